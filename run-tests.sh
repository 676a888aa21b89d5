#!/usr/bin/env bash
# The tests (see README.md). No arguments: the quick set, every test not marked `slow` (what a
# person runs after a change). --all: every test (what .ci/run runs). Any other arguments go to
# pytest as given, over every test (e.g. `-m slow`, or one file, slow tests included).
# Lab tests need root and iptables; they skip with a reason otherwise.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/bootstrap.sh
if [[ $# -eq 0 ]]; then
  exec .venv/bin/python -m pytest -q -rs -m "not slow"
fi
if [[ "$1" == "--all" ]]; then
  shift
  # the slowest tests listed at the end: CI's run is bounded (.ci/run), so what grows it shows
  exec .venv/bin/python -m pytest -q -rs --durations=30 "$@"
fi
exec .venv/bin/python -m pytest -q -rs "$@"
