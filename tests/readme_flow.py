"""The README's LAN flow as a person runs it: `kafila host` with its defaults, `kafila join` with
the command the host printed, a question to a member's API. Used by tests/test_readme_lan.py
(one machine, with and without a terminal) and natlab_tests/test_lan_defaults.py (a veth LAN)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

JOIN_COMMAND = re.compile(r"kafila join (\S+) --rendezvous (\S+)")
API_LINE = re.compile(r"(\S+): serving; API at (http://\S+)/v1")
SERVING_TIMEOUT_S = 420.0  # measure, index, plan, fetch weights, compile, ring (a loaded 2-core CI)
QUESTION = "What is the capital of France?"


class Output:
    """Everything a stream printed so far, read by a thread (a pipe or a pty's master side)."""

    def __init__(self, read=None, snapshot=None) -> None:
        """`read()` returns the next chunk (b"" at the end); or `snapshot()` returns the text so far
        (a stream somebody else already reads, such as a natlab Proc's stderr tail)."""
        self._text = ""
        self._read = read
        self._snapshot = snapshot
        self._lock = threading.Lock()
        if read is not None:
            threading.Thread(target=self._pump, daemon=True).start()

    @property
    def text(self) -> str:
        return self._snapshot() if self._snapshot is not None else self._text

    def _pump(self) -> None:
        while True:
            try:
                chunk = self._read()
            except OSError:  # a pty's master raises EIO once the child side is closed
                return
            if not chunk:
                return
            with self._lock:
                self._text += chunk.decode("utf-8", "replace") if isinstance(chunk, bytes) else chunk

    def wait_for(self, pattern: str | re.Pattern, timeout_s: float, what: str, others=()) -> re.Match:
        """The first match of pattern; AssertionError with every output's tail after timeout_s."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = rx.search(_plain(self.text))
            if found:
                return found
            time.sleep(0.2)
        tails = "\n".join(f"--- output {i}:\n{_plain(o.text)[-1500:]}" for i, o in enumerate([self, *others]))
        raise AssertionError(f"{what}: not seen within {timeout_s:.0f} s\n{tails}")


def _plain(text: str) -> str:
    """Terminal output without its escape sequences and carriage returns."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r", "", text)


def ask(api: str, timeout_s: float = 300.0) -> dict:
    """A chat completion from `api` (http://host:port) for the model it serves."""
    with urllib.request.urlopen(f"{api}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    req = urllib.request.Request(f"{api}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.load(r)
