"""What both drivers (participant.Participant, host.HostParticipant) do the same way: run a
lifecycle until it ends or SIGINT/SIGTERM, turn net events into lifecycle events, and carry out
the actions that need no decision of their own (say, record, degrade, end, send)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from backends.errors import KafilaError
from kafila.net.signaling import DROPPED
from kafila.session.control import lifecycle
from kafila.session.control import messages as control
from kafila.session.control.config import SessionConfig
from kafila.session.control.system import reserve_stdout

log = logging.getLogger("kafila.session.control")
# how a member hears it was removed: the host's plain refusal (joining.py), or the rendezvous
# refusing to take it back after its watchdog dropped it (signaling.DROPPED)
DROPPED_PREFIXES = ("removed: ", DROPPED)


class Driver:
    """What the host's and a member's drivers share (host.HostParticipant, participant.Participant):
    their stage's configuration, network and /status, and `run`."""

    stage: Any  # a stage.Stage, set by the driver's constructor

    @property
    def cfg(self) -> SessionConfig:
        return self.stage.cfg

    @property
    def net(self):
        return self.stage.net

    def status(self) -> dict:
        return self.stage.status()

    def run(self) -> int:
        return run(self)


def run(driver) -> int:
    """`driver.lifecycle()` in a fresh event loop, its stage's API up first; 0 when stopped."""
    reserve_stdout()  # the code and --json-events lines are the only things on stdout
    return asyncio.run(_main(driver))


async def _main(driver) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stage = driver.stage
    await stage.start_api()
    life = asyncio.create_task(driver.lifecycle(), name="lifecycle")
    stopper = asyncio.create_task(stop.wait(), name="stop")
    try:
        done, _ = await asyncio.wait({life, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if life in done:
            return life.result() or 0
        stage.say(f"{stage.cfg.name}: leaving the session")
        driver.leaving = True  # nothing new starts (a replan), whatever the lifecycle is in
        life.cancel()
        await asyncio.wait({life})
        if not life.cancelled() and isinstance(life.exception(), KafilaError):
            log.info("the lifecycle ended while leaving: %s", life.exception())
        elif not life.cancelled() and life.exception() is not None:
            raise life.exception()
        return 0
    finally:
        stopper.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await driver.close()


def core_event(ev):
    """A net event as the lifecycle core's event (None for what the core does not use). A body
    that is no control message becomes Malformed: the host drops its sender, a member that
    cannot read its plan leaves."""
    from kafila.net import MemberJoined, MemberLeft, Message

    if isinstance(ev, MemberLeft):
        reason = str(ev.reason)
        return lifecycle.MemberLeft(ev.name, reason, dropped=reason.startswith(DROPPED_PREFIXES))
    if isinstance(ev, MemberJoined):
        return lifecycle.MemberJoined(ev.info.name)
    if isinstance(ev, Message):
        try:
            return lifecycle.Received(ev.sender, control.decode(ev.body))
        except control.ControlError as exc:
            log.warning("a control message from %s is not one: %s", ev.sender, exc)
            kind = ev.body.get("t") if isinstance(ev.body, dict) else None
            return lifecycle.Malformed(ev.sender, str(exc)[:300], kind[:32] if isinstance(kind, str) else None)
    return None


def act(stage, action) -> bool:
    """Carry out an action that needs no waiting; False when it is not one of these."""
    if isinstance(action, lifecycle.Say):
        stage.say(action.text)
    elif isinstance(action, lifecycle.Record):
        stage.event(action.kind, **dict(action.fields))
    elif isinstance(action, lifecycle.DegradeNode):
        if stage.node is not None:
            stage.node.degrade(action.reason)
    elif isinstance(action, lifecycle.EndEngine):
        stage.end_engine(action.reason)
    else:
        return False
    return True


async def send(stage, action) -> bool:
    """Carry out a Send or SendAll; False when it is neither. A member's Ready that cannot go is
    an error (raised): the host would wait for it; anything else that cannot go is logged."""
    if isinstance(action, lifecycle.Send):
        if isinstance(action.msg, control.Ready):
            await stage.net.send(action.to, control.encode(action.msg))
        else:
            await stage.tell(action.to, action.msg)
    elif isinstance(action, lifecycle.SendAll):
        await stage.broadcast(action.msg)
    else:
        return False
    return True


__all__ = ["DROPPED_PREFIXES", "act", "core_event", "run", "send"]
