"""Tooling around sessions, not the session protocol: the local multi-process launcher
(`kafila demo`, tests, benchmarks) and the cgroup CPU throttle that makes a slower device."""
