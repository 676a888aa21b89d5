"""Frames over an asyncio stream pair (an edge's QUIC stream): the thin I/O side of frames.py."""

from __future__ import annotations

import asyncio

from kafila.session.wire.frames import (
    PREFIX,
    Frame,
    FrameError,
    Limits,
    build_frame,
    encode,
    parse_header,
    parse_prefix,
)


class StreamClosed(Exception):
    """The peer closed the stream (or the edge went away)."""


async def read_frame(reader, limits: Limits | None) -> Frame:
    """One validated frame; FrameError on a bad one, StreamClosed at the end of the stream."""
    try:
        hlen, plen = parse_prefix(await reader.readexactly(PREFIX.size))
        header = parse_header(await reader.readexactly(hlen), plen, limits)
        payload = await reader.readexactly(plen) if plen else b""
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("stream ended inside a frame") from None
        raise StreamClosed() from None
    except (ConnectionError, OSError) as exc:
        raise StreamClosed(str(exc)) from None
    return build_frame(header, payload)


class FrameWriter:
    """Writes frames in order; `send` returns once the transport has taken them (drain).

    A frame over a bound (`limits.frame_bytes` for activations) raises EncodeError before
    anything is written: the stream stays whole."""

    def __init__(self, writer, limits: Limits | None = None) -> None:
        self.writer = writer
        self.limits = limits
        self.bytes_sent = 0
        self._lock = asyncio.Lock()

    async def send(self, *frames: Frame) -> None:
        data = b"".join(encode(f, self.limits) for f in frames)
        async with self._lock:
            try:
                self.writer.write(data)
                await self.writer.drain()
            except (ConnectionError, OSError, RuntimeError) as exc:
                raise StreamClosed(str(exc)) from None
            self.bytes_sent += len(data)

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # already closed with its connection: nothing left to release
            pass
