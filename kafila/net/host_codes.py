"""The host's session code over time: a fresh one after a wrong guess (paced, bounded) or when the
host asks, so a stranger's guess never closes the session to joins for good.

Each code has its own nameplate at the rendezvous (messages.Reopen / Reopened: the session keeps
its first nameplate as its id, so members' resume proofs hold) and its own admission, which
answers one guess. The owner (kafila.net.member.Member) sends what `send` is given and hands the
new code to admission (HostSession.reopen).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from backends.errors import Refused
from kafila.net.code import make_code
from rendezvous import messages as m

log = logging.getLogger("kafila.net")

# After a wrong guess the host opens a fresh code by itself, after a pause and at most this many
# times a session (each code answers one guess: 50 wrong guesses at 3 words are a 1-in-335,000
# chance in all); then only the host's command (new_code) opens another.
AUTO_REOPEN_DELAY_S = 2.0
AUTO_REOPENS_MAX = 50
REOPEN_TIMEOUT_S = 10.0  # the rendezvous's Reopened


class HostCodes:
    def __init__(self, nameplate: int, words: int, send: Callable[[m.Message], None]) -> None:
        self.words = words
        self.nameplate = nameplate  # the current code's (joins use it)
        self.code = make_code(nameplate, words=words)
        self.void = False  # a wrong guess was tried at the current code: it admits nobody now
        self.auto_reopens = 0
        self.on_new_code: Callable[[str], None] | None = None  # prints it, writes --code-file
        self._send = send
        self._changed = asyncio.Event()

    def wrong_guess(self, name: str) -> None:
        """Admission closed the current code: close its nameplate; a fresh code after a pause."""
        self._send(m.CloseNameplate())
        self.void = True
        self.auto_reopens += 1
        more = self.auto_reopens <= AUTO_REOPENS_MAX
        log.warning("%s: someone tried a wrong code; it admits nobody now%s", name,
                    ", a new code follows" if more else "; `POST /admin/new-code` opens another")  # fmt: skip
        if more:
            asyncio.get_running_loop().call_later(AUTO_REOPEN_DELAY_S, self._reopen_if_void)

    def _reopen_if_void(self) -> None:
        if self.void:
            self._send(m.Reopen())

    def resumed(self, session_nameplate: int) -> None:
        """Signaling is back after a rendezvous restart: re-claim the current code's nameplate."""
        if self.nameplate != session_nameplate:
            self._send(m.Reopen(self.nameplate))

    def reopened(self, nameplate: int) -> str | None:
        """The rendezvous's Reopened: the fresh code, or None when nothing changed (a re-claim)."""
        if nameplate == self.nameplate and not self.void:
            return None
        self.code = make_code(nameplate, words=self.words)
        self.nameplate, self.void = nameplate, False
        self._changed.set()
        if self.on_new_code is not None:
            self.on_new_code(self.code)
        return self.code

    async def renew(self) -> str:
        """Close the current code and open a fresh one (the host asked); the new code."""
        self._changed.clear()
        self._send(m.Reopen())
        try:
            await asyncio.wait_for(self._changed.wait(), REOPEN_TIMEOUT_S)
        except TimeoutError:
            raise Refused(f"the rendezvous gave no new nameplate within {REOPEN_TIMEOUT_S:g} s") from None
        return self.code
