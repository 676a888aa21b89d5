"""A fake link for tests that drive stream protocols without sockets (as aioquic's tests do)."""

from __future__ import annotations

import asyncio
from collections import deque


class Pipe:
    """One direction of an in-memory stream: a StreamReader fed by a writer-like object."""

    def __init__(self, fail_after=None, delay_s: float = 0.0):
        self.reader = asyncio.StreamReader()
        self.fail_after = fail_after
        self.writes = 0
        self.delay_s = delay_s  # a hop's one-way latency: each write arrives this much later, in order
        self._late: deque = deque()
        self._closed = False

    def write(self, data):
        self.writes += 1
        if self.fail_after is not None and self.writes > self.fail_after:
            self.reader.feed_eof()  # the edge dropped
            raise ConnectionResetError("edge lost")
        if not self.delay_s:
            self.reader.feed_data(data)
            return
        self._late.append(bytes(data))
        # each timer feeds the oldest write still held: in order whichever timer fires first
        asyncio.get_running_loop().call_later(self.delay_s, self._arrive)

    def _arrive(self):
        data = self._late.popleft()
        if not self._closed:
            self.reader.feed_data(data)

    async def drain(self):
        await asyncio.sleep(0)

    def close(self):
        self._closed = True
        if not self.reader.at_eof():
            self.reader.feed_eof()
