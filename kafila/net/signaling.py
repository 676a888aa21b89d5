"""A member's TCP signaling connection to the rendezvous, and getting it back after it dropped.

The asyncio side of rendezvous.messages: `Signal` frames messages out and in, `expect` waits a
bounded time for the reply the rendezvous (or the host, through it) owes us, and `resume`
reconnects and proves we are still the same member (messages.Resume) while the ring keeps
serving (its edges do not go through signaling).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Callable

from backends.errors import Refused
from kafila.net.sock import DelayedWriter, delayed_writer
from rendezvous import messages as m
from rendezvous.errors import ProtocolError

log = logging.getLogger("kafila.net")

Address = tuple[str, int]
SIGNAL_TIMEOUT_S = 10.0  # a reply the rendezvous or host owes us
# signaling lost (the rendezvous restarted, or our line to it dropped): ask it to take us back,
# first after RESUME_RETRY_S, doubling to RESUME_RETRY_MAX_S, for RESUME_WINDOW_S in all
RESUME_RETRY_S = 0.25
RESUME_RETRY_MAX_S = 2.0
RESUME_WINDOW_S = 120.0
HOST_GONE = "the host's process is gone"
# the rendezvous will not take us back: the host was told we left (its watchdog dropped a member
# that froze past MEMBER_SILENT_S); such a member is out of the session, not cut off from it
DROPPED = "dropped from the session"


class Busy(Exception):
    """The rendezvous asked this joiner to come back in a moment (Member.join retries)."""


# a join the rendezvous could not take now, nothing spent: the joiner asks again (Member.join).
# "no-pake" (our PAKE came after its 3 s) is not retried: with it retried, two full-suite session
# tests hung forming (cause not found), so it ends the join as before
TRY_AGAIN_CODES = ("busy",)


class RendezvousRefused(Refused):
    """The rendezvous answered with an Error; `code` says which (e.g. "busy": try again)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Signal:
    """The TCP signaling connection: framed messages in, framed messages out."""

    def __init__(self, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter | DelayedWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = m.FrameReader()
        self.pending: collections.deque[m.Message] = collections.deque()

    @classmethod
    async def connect(cls, address: Address, send_delay_ms: float) -> Signal:
        """A new connection (delayed by send_delay_ms: the WAN emulation covers signaling too)."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), SIGNAL_TIMEOUT_S)
        return cls(reader, delayed_writer(writer, send_delay_ms))

    def send(self, message: m.Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(m.encode(message))

    async def next(self) -> m.Message:
        while not self.pending:
            data = await self.reader.read(64 * 1024)
            if not data:
                raise ConnectionError("the rendezvous closed the signaling connection")
            self.pending.extend(self.frames.feed(data))
        return self.pending.popleft()

    async def expect(self, *kinds: type, what: str | None = None) -> m.Message:
        """The next message, which must be one of kinds (an Error becomes Refused; none within
        SIGNAL_TIMEOUT_S, a Refused that says `what` did not come, e.g. "no answer from the host")."""
        while True:
            try:
                message = await asyncio.wait_for(self.next(), SIGNAL_TIMEOUT_S)
            except TimeoutError:
                extra = getattr(self.writer, "get_extra_info", None)
                peer = extra("peername") if extra is not None else None
                at = f" at {peer[0]}:{peer[1]}" if peer else ""
                wanted = what or f"no {' or '.join(k.__name__ for k in kinds)}"
                raise Refused(f"{wanted} came through the rendezvous{at} within {SIGNAL_TIMEOUT_S:g} s") from None
            if isinstance(message, m.Error):
                if message.code in TRY_AGAIN_CODES:
                    raise Busy()
                raise RendezvousRefused(message.code, f"rendezvous refused: {message.reason}")
            if isinstance(message, m.Heartbeat):
                continue
            if isinstance(message, kinds):
                return message
            raise Refused(f"rendezvous sent an unexpected {type(message).__name__}")


async def resume(address: Address, message: m.Resume, reason: str, *, name: str, send_delay_ms: float,
                 refused_means_host_gone: bool, closed: Callable[[], bool]) -> Signal | str:
    """Reconnect to the rendezvous and send `message` until it takes us back (the new Signal),
    or why not: asking again cannot help, RESUME_WINDOW_S passed, or (`refused_means_host_gone`:
    the rendezvous lived in the host's process) nothing listens there any more. The host comes
    back first; a member asked "which session?" before that asks again."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + RESUME_WINDOW_S, RESUME_RETRY_S
    while not closed():
        signal = None
        try:
            signal = await Signal.connect(address, send_delay_ms)
            signal.send(message)
            await signal.expect(m.Resumed, what="no answer to resuming")
        except RendezvousRefused as exc:
            assert signal is not None
            signal.writer.close()
            if exc.code == "left":
                return f"{DROPPED}: {reason}; {exc}"
            if exc.code != "unknown-nameplate":  # anything else will not change by asking again
                return f"{reason}; {exc}"
        except ConnectionRefusedError:
            if refused_means_host_gone:
                return f"{HOST_GONE} (its rendezvous, in its process, refuses connections)"
        except (OSError, TimeoutError, Refused, ProtocolError) as exc:
            if signal is not None:
                signal.writer.close()
            log.debug("%s: resume attempt failed: %s", name, exc)
        except asyncio.CancelledError:  # closing while we ask
            if signal is not None:
                signal.writer.close()
            raise
        else:
            return signal
        if loop.time() + pause > deadline:
            return f"{reason}; the rendezvous did not take us back within {RESUME_WINDOW_S:g} s"
        await asyncio.sleep(pause)
        pause = min(2 * pause, RESUME_RETRY_MAX_S)
    return reason


def local_candidates(bind_host: str, port: int, toward: Address) -> list[Address]:
    """This machine's address toward the rendezvous (and the bind address), with our port."""
    hosts = []
    if bind_host not in ("0.0.0.0", "::", ""):
        hosts.append(bind_host)
    else:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect(toward)  # no packet is sent: this only picks the route
            hosts.append(probe.getsockname()[0])
        except OSError:
            pass
        finally:
            probe.close()
    return [(h, port) for h in hosts]
