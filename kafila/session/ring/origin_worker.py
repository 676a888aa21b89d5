"""The origin's draft model (--speculate origin with kafila join --draft), apart from the ring node.

It drafts the requests typed at this member on a thread of its own while the ring works, so the
stage's worker thread and the asyncio loop never wait on it; it holds this machine's core lock
for its own compute (cores.py), like a stage does."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kafila.session.ring.cores import core_lock
from kafila.session.ring.speculation.origin import OriginDrafts

log = logging.getLogger("kafila.session.ring.node")  # its messages stay the ring node's


class OriginWorker:
    """One member's draft model: its thread, the event that wakes it, its hold of the machine's
    cores and its measured cost a token (`us_per_token`, a moving average)."""

    def __init__(self, name: str, drafter, drafts: OriginDrafts, machines: dict[str, str] | None,
                 on_draft: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """`drafts`: the node's OriginDrafts (what to draft, where drafts go); `on_draft(req_id)`:
        called after a request's draft grew (the head hands it to its scheduler)."""
        self.name = name
        self.drafter = drafter
        self.drafts = drafts
        self.on_draft = on_draft
        self.wake = asyncio.Event()
        self.cores = core_lock(name, machines)
        self.us_per_token = 0.0
        self._thread: ThreadPoolExecutor | None = None

    def start(self) -> asyncio.Task:
        """The drafting thread and the loop that feeds it (the node cancels the task on close)."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"draft-{self.name}")
        return asyncio.create_task(self._loop(), name=f"ring-draft-{self.name}")

    def release(self, req_id: str) -> None:
        self.drafter.release(req_id)  # freed on the drafting thread

    async def close(self) -> None:
        """After the loop's task ended: the draft model closes on its own thread."""
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self.drafter.close)
            self._thread.shutdown(wait=True)
        self.cores.close()

    async def _loop(self) -> None:
        """Draft what `OriginDrafts.wanted` asks for, a chunk a job, while the ring works; a
        failing draft model drops its request's drafting (never the request)."""
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            self.wake.clear()
            for req_id, history, kept, n in self.drafts.wanted():
                try:
                    new, us = await loop.run_in_executor(self._thread, self._draft, req_id, history + kept, n)
                except Exception as exc:
                    log.warning("the draft model failed on %s (%s: %s): the head drafts its n-grams for it",
                                req_id, type(exc).__name__, exc)  # fmt: skip
                    self.drafts.end(req_id)
                    continue
                if new and self.drafts.put(req_id, len(history), kept + new):
                    old = self.us_per_token
                    self.us_per_token = us if old == 0 else 0.8 * old + 0.2 * us
                    if self.on_draft is not None:
                        self.on_draft(req_id)
            if self.drafts.wanted():
                self.wake.set()  # drafts still short: the next chunk

    def _draft(self, req_id: str, tokens: tuple[int, ...], n: int) -> tuple[tuple[int, ...], float]:
        """On the drafting thread: `n` greedy drafts after `tokens`, and the µs each took."""
        with self.cores:
            t0 = time.perf_counter()
            drafts = self.drafter.propose(req_id, tokens, n)
            return drafts, (time.perf_counter() - t0) * 1e6 / max(1, len(drafts))
