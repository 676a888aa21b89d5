"""Small helpers the drivers share: this machine's id and LAN address, the terminal question,
edges as /status shows them, task cancellation, and closing things on the way out.

Errors are narrowed here: `SEND_ERRORS` is what a control send may raise when its peer is gone
or signaling is down (kafila.net.Member.send), `CLOSE_ERRORS` what closing a connection, a node
or a listener that is already broken may raise. Anything else is a bug and is logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys

from backends.errors import KafilaError

log = logging.getLogger("kafila.session.control")

# a control message to a member that left, a channel gone, signaling down, a socket that broke
SEND_ERRORS = (KafilaError, ConnectionError, OSError, TimeoutError)
# closing what is already broken: its transport, a peer that reset, a wait that ran out
CLOSE_ERRORS = (ConnectionError, OSError, TimeoutError, RuntimeError, KafilaError)


async def close_quietly(what: str, awaitable) -> None:
    """Await a close on the way out: the errors of something already broken are expected (logged
    at debug); anything else is logged as a warning with its type, never raised past the exit."""
    try:
        await awaitable
    except CLOSE_ERRORS as exc:
        log.debug("closing %s: %r", what, exc)
    except Exception as exc:  # a bug in a close must not stop the rest from closing: say it
        log.warning("closing %s failed: %s: %s", what, type(exc).__name__, exc)


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended. asyncio.wait, not `await task` under
    suppress(CancelledError): that also swallowed a cancellation of the caller arriving then
    (a host told to leave went on to replan, and was killed at the grace deadline)."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: an error of a task we gave up on is not news


def machine_id() -> str:
    """A short hash naming this machine (its kernel's boot id: containers and network namespaces
    of one host share it, as they share its cores), so a head can tell members that share one."""
    import hashlib

    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw:
            return hashlib.sha256(f"kafila-machine|{raw}".encode()).hexdigest()[:16]
    import socket

    return hashlib.sha256(f"kafila-machine|{socket.gethostname()}".encode()).hexdigest()[:16]


def alone_on_machine(measure):
    """`measure()` while no other member of this machine computes or measures (the machine's
    CoreLock): probes and timings of one machine's members do not disturb each other."""
    from kafila.session.ring.cores import CoreLock

    lock = CoreLock(machine_id())
    try:
        with lock:
            return measure()
    finally:
        lock.close()


def lan_ip() -> str:
    """This machine's address on the route out (its LAN address behind a home router)."""
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        return s.getsockname()[0]
    return "127.0.0.1"


def stdin_is_terminal() -> bool:
    try:
        return sys.stdin.isatty()
    except (ValueError, OSError):
        return False


def reserve_stdout() -> None:
    """Keep standard output for the lines programs read (the host's code, --json-events) and send
    what native libraries print on file descriptor 1 (OpenVINO, its thread pools) to stderr, so
    no such print comes before a line or splits one. Python's sys.stdout keeps the real one."""
    sys.stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(private, "w", buffering=1, encoding="utf-8", errors="replace")


def punched_host(edge) -> list[str]:
    """[the IP the edge reached its peer at directly], or [] (relayed): a TCP lane tries it first."""
    direct = (getattr(edge, "stats", dict)() or {}).get("direct_address")
    return [direct.rpartition(":")[0]] if direct else []


def edge_stats(edge, lane=None) -> dict:
    """An edge's row for /status; with its ring_lane.Lane, what carries the ring's frames."""
    s = edge.stats()
    row = {k: s.get(k) for k in ("peer", "kind", "predicted", "rtt_ms", "bytes_sent", "bytes_received",
                                 "time_to_data_s", "time_to_direct_s")}  # fmt: skip
    return row | (lane.as_dict() if lane is not None else {})


__all__ = ["CLOSE_ERRORS", "SEND_ERRORS", "alone_on_machine", "cancel_and_wait", "close_quietly", "edge_stats", "lan_ip",
           "machine_id", "punched_host", "stdin_is_terminal"]  # fmt: skip
