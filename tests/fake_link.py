"""A fake link for tests that drive stream protocols without sockets (as aioquic's tests do)."""

from __future__ import annotations

import asyncio


class Pipe:
    """One direction of an in-memory stream: a StreamReader fed by a writer-like object."""

    def __init__(self, fail_after=None):
        self.reader = asyncio.StreamReader()
        self.fail_after = fail_after
        self.writes = 0

    def write(self, data):
        self.writes += 1
        if self.fail_after is not None and self.writes > self.fail_after:
            self.reader.feed_eof()  # the edge dropped
            raise ConnectionResetError("edge lost")
        self.reader.feed_data(data)

    async def drain(self):
        await asyncio.sleep(0)

    def close(self):
        if not self.reader.at_eof():
            self.reader.feed_eof()
