"""Bounded logs and fd budgets for the listeners a stranger can reach (the rendezvous, the API).

A flood of bad input must not become a flood of log lines: `BoundedLog` writes one line per
cause per interval, with the count of the ones it stood for, and a traceback only when the log
is at DEBUG (`--debug`). It is also a stand-in for a `logging.Logger` where a library logs each
bad request itself (aiohttp's request handler takes a `logger`). `quiet_accept_errors` routes
asyncio's "socket.accept() out of system resource" (and its kin) through one.

`fd_share` sizes connection caps from the process's fd limit (RLIMIT_NOFILE), so the listeners
together never take the descriptors that accept(), files and sockets of the session need.
"""

from __future__ import annotations

import asyncio
import logging
import resource

INTERVAL_S = 60.0  # one line per cause and interval
FD_RESERVE = 256  # descriptors kept for everything but listeners' connections (files, QUIC, threads)
MIN_CONNECTIONS = 16


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def fd_share(fraction: float) -> int:
    """Connections a listener may hold: `fraction` of the fds above FD_RESERVE (at least 16)."""
    return max(MIN_CONNECTIONS, int((fd_limit() - FD_RESERVE) * fraction))


class BoundedLog:
    """One line per cause per INTERVAL_S, counted; tracebacks only at DEBUG."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S, clock=None) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._next: dict[str, float] = {}  # cause -> when it may be written again
        self._held: dict[str, int] = {}  # cause -> occurrences not written since its last line
        self.seen = 0  # every occurrence, written or not

    def note(self, cause: str, text: str, exc: BaseException | None = None, level: int = logging.WARNING) -> None:
        self.seen += 1
        now = self._clock()
        if now < self._next.get(cause, 0.0):
            self._held[cause] = self._held.get(cause, 0) + 1
            return
        if len(self._next) > 256:  # causes are few; a flood of distinct ones must not grow this
            self._next.clear()
        self._next[cause] = now + self.interval_s
        held = self._held.pop(cause, 0)
        more = f" (and {held} more like it in the last {self.interval_s:g} s)" if held else ""
        debug = self.logger.isEnabledFor(logging.DEBUG)
        detail = f": {type(exc).__name__}: {' '.join(str(exc).split())[:200]}" if exc is not None else ""  # one line
        self.logger.log(level, "%s%s%s", text, detail, more, exc_info=exc if debug and exc is not None else None)

    # what aiohttp's request handler calls (logger.exception on a bad request, debug, warning)
    def exception(self, msg: str, *args, exc_info: BaseException | None = None, **_) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        cause = type(exc).__name__ if exc is not None else msg
        self.note(cause, msg % args if args else msg, exc)

    def error(self, msg: str, *args, **kw) -> None:
        self.exception(msg, *args, **kw)

    def warning(self, msg: str, *args, **kw) -> None:
        self.exception(msg, *args, **kw)

    def info(self, msg: str, *args, **_) -> None:
        self.logger.info(msg, *args)

    def debug(self, msg: str, *args, **kw) -> None:
        self.logger.debug(msg, *args, **kw)

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging.Logger's name
        return self.logger.isEnabledFor(level)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, log: BoundedLog) -> None:
    """asyncio's accept loop reports each failed accept() (EMFILE and kin) to the loop's exception
    handler, with a traceback each time: through `log` instead. Other reports go where they went."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiet_accept", False):
        return  # installed already (the rendezvous and the API share the host's loop)

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept()"):
            exc = context.get("exception")
            log.note(f"accept:{type(exc).__name__}", f"a listener could not accept a connection ({message}; "
                     f"fd limit {fd_limit()})", exc if isinstance(exc, BaseException) else None)  # fmt: skip
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiet_accept = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)
