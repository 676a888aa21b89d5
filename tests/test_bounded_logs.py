"""Issue 38 item 4 in process: bad HTTP requests and accept errors add a bounded number of log
lines (one per cause a minute, with a count, no traceback without --debug); the rendezvous makes
room from silent connections at its fd-derived cap. The CLI-level checks are in
tests/test_harden_process.py."""

from __future__ import annotations

import asyncio
import errno
import logging

from kafila.api import start_api
from rendezvous import Rendezvous
from rendezvous import messages as m
from rendezvous.quiet import BoundedLog, fd_limit, fd_share, quiet_accept_errors
from tests.api_fixtures import ScriptedEngine, tokenizer  # noqa: F401 (fixture)

BAD_REQUESTS = [
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # a URL over 8 KB
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",  # a header over 8 KB
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n",
]


async def _send(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(200), 5)
    finally:
        writer.close()


def test_500_malformed_requests_add_a_few_lines_and_no_traceback(tokenizer, caplog) -> None:  # noqa: F811
    async def main():
        server = await start_api(ScriptedEngine(tokenizer), "127.0.0.1", 0)
        try:
            answers = []
            for i in range(0, 500, 25):
                answers += await asyncio.gather(*(_send(server.port, BAD_REQUESTS[(i + k) % 3]) for k in range(25)))
            return answers, server.quiet.seen
        finally:
            await server.close()

    with caplog.at_level(logging.WARNING):
        answers, seen = asyncio.run(main())
    assert all(a.split(b" ")[1].startswith(b"4") for a in answers), {a[:40] for a in answers}
    assert seen >= 500  # every one was noted, and refused...
    lines = [r for r in caplog.records if r.name.startswith(("kafila", "aiohttp"))]
    assert 1 <= len(lines) <= 3, [r.getMessage()[:120] for r in lines]  # ...in one line per cause
    assert not any(r.exc_info for r in lines)


def test_a_bounded_log_counts_what_it_held_back(caplog) -> None:
    clock = [0.0]
    quiet = BoundedLog(logging.getLogger("kafila.test"), interval_s=60.0, clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="kafila.test"):
        for _ in range(1000):
            quiet.note("cause-a", "a happened", ValueError("x"))
        quiet.note("cause-b", "b happened")
        clock[0] = 61.0
        quiet.note("cause-a", "a happened", ValueError("x"))
    texts = [r.getMessage() for r in caplog.records]
    assert texts == ["a happened: ValueError: x", "b happened",
                     "a happened: ValueError: x (and 999 more like it in the last 60 s)"], texts
    assert not any(r.exc_info for r in caplog.records)
    with caplog.at_level(logging.DEBUG, logger="kafila.test"):  # --debug: the traceback too
        clock[0] = 200.0
        quiet.note("cause-a", "a happened", ValueError("x"))
    assert caplog.records[-1].exc_info


def test_accept_errors_are_one_line_a_minute(caplog) -> None:
    """What asyncio's accept loop reports when the fd table is full (EMFILE), 1000 times."""
    async def main():
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop, BoundedLog(logging.getLogger("kafila.test")))
        for _ in range(1000):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
        loop.call_exception_handler({"message": "something else"})  # still reported as before

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    texts = [r.getMessage() for r in caplog.records]
    assert len(texts) == 2 and "could not accept" in texts[0] and "something else" in texts[1], texts


def test_connection_caps_follow_the_fd_limit() -> None:
    assert fd_share(0.5) + fd_share(0.25) < fd_limit()
    assert fd_share(0.5) >= 16


def test_the_rendezvous_evicts_silent_connections_at_its_cap(caplog) -> None:
    async def main():
        rv = await Rendezvous.start("127.0.0.1", 0)
        rv.max_connections = 20
        try:
            port = rv.address[1]
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(200)]
            for _, w in idle[::2]:  # half of them dribble half a frame: still in no session
                w.write(b"\x00\x00")
            await asyncio.sleep(0.3)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a host, after the flood
            writer.write(m.encode(m.Open()))
            frames = m.FrameReader()
            opened = frames.feed(await asyncio.wait_for(reader.read(4096), 5))
            for _, w in idle:
                w.close()
            writer.close()
            return opened, rv.evicted, len(rv._writers)
        finally:
            await rv.close()

    with caplog.at_level(logging.INFO):
        opened, evicted, open_at_end = asyncio.run(main())
    assert isinstance(opened[0], m.Opened) and evicted >= 180 and open_at_end <= 20
    lines = [r for r in caplog.records if "signaling connections" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
