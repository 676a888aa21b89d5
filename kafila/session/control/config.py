"""A session's configuration as each command builds it (argument parsing stays in the CLI), and
the context a session serves."""

from __future__ import annotations

import os
from dataclasses import dataclass

from backends import DEFAULT_KQUANT
from backends.errors import BadInput
from kafila.session.ring.slots import DEFAULT_MAX_QUEUED

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kafila", "models")


@dataclass(frozen=True)
class SessionConfig:
    name: str
    rendezvous: tuple[str, int] | None  # None: the host starts an embedded one
    backend: str = "openvino"
    precision: str = "serving"
    kquant: str = DEFAULT_KQUANT  # the host's --kquant (a member takes the session's)
    api: tuple[str, int] | None = ("127.0.0.1", 8740)  # None: no HTTP API
    api_tries: int = 1  # >1: the next ports up are tried when api's port is taken (the default)
    bind_host: str = "0.0.0.0"
    send_delay_ms: float = 0.0
    cache_dir: str = DEFAULT_CACHE_DIR
    local_model: str | None = None  # a member's own copy of the model (used when the digest matches)
    draft_path: str | None = None  # a draft model this member runs when it is the head (--speculate draft)
    # the host's
    model_path: str | None = None
    expect: int = 0  # session size, host included (0: plan on Enter)
    context: int | None = None  # None: 2048, or the model's own context if shorter (session_context)
    concurrency: int | None = None  # requests served at once; None: as many as memory holds (slots.py)
    max_queued: int = DEFAULT_MAX_QUEUED  # requests that may wait for a slot (one more: 429)
    batch_rows: bool = True  # kafila host --batch-rows: ready decode steps travel as one micro-batch
    dipsd: bool = True  # kafila host --dipsd: the head's live DiP-SD optimiser (session/ring/speculation/dipsd_live.py)
    prompt_cache: bool = True  # kafila host --prompt-cache: finished requests' KV kept (session/ring/prefix.py)
    speculate: str = "off"  # the head's drafter (speculate.SPECULATE_MODES), sent in the session
    policy: str = "kafila"
    code_file: str | None = None
    auto_replan: bool = False  # a machine that joins a serving session is planned in at once
    code_words: int = 3  # words in the session code (4 for a long-lived session)
    embedded_listen: tuple[str, int] = ("0.0.0.0", 7473)
    json_events: bool = False  # print one JSON line per lifecycle event on stdout (scripts)
    # "auto": weights over the bulk lane (TCP, kafila.session.weights.bulk) when the peer is reachable,
    # else the QUIC stream; "quic": never offer or take the TCP lane
    weights_lane: str = "auto"
    # the same for ring frames (kafila.session.weights.ring_lane): "auto" over TCP where the successor is
    # reachable, "quic": this member neither offers nor takes a TCP lane on its ring edges
    ring_lane: str = "auto"


def session_context(requested: int | None, model_context: int, model_name: str) -> tuple[int, str | None]:
    """The context a session asks of the planner and a one-line note: `requested` (--context)
    when given, else the model's own (the plan then caps it by the members' memory:
    pricing.choose_context). An explicit value outside 2..the model's context is BadInput."""
    if requested is None:
        return model_context, None
    if requested < 2 or requested > model_context:
        raise BadInput(f"--context {requested}: choose 2..{model_context} for {model_name} (its own context), "
                       "or leave --context out")  # fmt: skip
    return requested, None


__all__ = ["DEFAULT_CACHE_DIR", "SessionConfig", "session_context"]
