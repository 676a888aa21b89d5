"""Many users of one session, as separate processes on 127.0.0.1 with the default model.

Isolation, on OpenVINO and on MLX, with batched decode rows on and off: 8 greedy requests typed at once at m1, m2, m3 in turn each get exactly the answer they
get alone; a request whose client hangs up mid-answer frees its KV slot on every stage (each
member's /status shows its own stage live) and the next request is served. Admission: with one
slot and a queue of one, the requests beyond them are answered 429 with Retry-After and an
OpenAI error body, and the two admitted finish with their solo answers."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from tests.default_model import needs_default_model
from tests.mlx_chain import needs_mlx
from tests.test_session_e2e import PROMPTS as E2E_PROMPTS

pytestmark = [pytest.mark.session, pytest.mark.model, pytest.mark.slow, needs_default_model]

MAX_NEW = 24
PROMPTS = E2E_PROMPTS  # the end-to-end test's eight


def status(api: str) -> dict:
    with urllib.request.urlopen(api + "/status", timeout=10) as r:
        return json.loads(r.read())


def chat(api: str, prompt: str, max_new: int = MAX_NEW) -> tuple[int, dict, dict]:
    """(HTTP status, headers, body) of one greedy chat completion."""
    body = {"model": status(api)["session"]["model"], "temperature": 0, "max_tokens": max_new,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    req = urllib.request.Request(api + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def answer(api: str, prompt: str) -> tuple[str, int]:
    code, _, body = chat(api, prompt)
    assert code == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def at_once(calls: list) -> list:
    """Run every call in its own thread, all started together; their results in order."""
    out: list = [None] * len(calls)

    def one(i, fn, *args):
        out[i] = fn(*args)

    threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return out


def own_stage(session, name: str) -> dict:
    return status(session.api(name))["load"]["stages"][name]


def wait_for(what: str, check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module", params=[
    "openvino-batch-rows-on", "openvino-batch-rows-off",
    pytest.param("mlx-batch-rows-on", marks=needs_mlx), pytest.param("mlx-batch-rows-off", marks=needs_mlx),
])  # fmt: skip
def session(request, tmp_path_factory):
    from kafila.tooling.launch import LocalSession

    backend = request.param.split("-")[0]
    # --concurrency auto (LocalSession's default, as kafila host's): context 512 makes a slot small
    s = LocalSession(members=3, context=512, precision="f32", cache_root=str(tmp_path_factory.mktemp("caches")),
                     log_dir=str(tmp_path_factory.mktemp("logs")), batch_rows=request.param.endswith("on"),
                     backend=backend)  # fmt: skip
    s.start(timeout_s=300)
    yield s
    codes = s.stop()
    assert all(c in (0, -9) for c in codes.values()), codes


def test_slots_come_from_memory(session):
    from kafila.session.ring.slots import AUTO_MAX_SLOTS

    st = status(session.api("m2"))
    # a 135M model at context 512 takes tens of MB a slot: any machine that runs the tests holds the cap
    assert st["session"]["concurrency"] == AUTO_MAX_SLOTS
    head = st["plan"]["head"]
    load = status(session.api(head))["load"]
    assert (load["slots"], load["active"], load["queued"]) == (AUTO_MAX_SLOTS, 0, 0)


def test_eight_concurrent_requests_from_three_members_get_their_solo_answers(session):
    asks = [(session.names[i % 3], p) for i, p in enumerate(PROMPTS)]
    solo = [answer(session.api(name), prompt) for name, prompt in asks]
    head = status(session.api("m1"))["plan"]["head"]
    seen = {"active": 0, "tok_s": 0.0, "rows": 0, "fitted": False}
    done = threading.Event()

    def watch():  # what the head's /status shows while they run
        while not done.is_set():
            load = status(session.api(head))["load"]
            seen["active"] = max(seen["active"], load["active"])
            rates = [r["tok_s"] for r in load["requests"] if r["tok_s"]]
            seen["tok_s"] = max([seen["tok_s"], *rates])
            seen["rows"] = max([seen["rows"], *(s["batch_rows"] or 0 for s in load["stages"].values())])
            seen["fitted"] |= bool(load["batching"] and "c_ms" in load["batching"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        together = at_once([(answer, session.api(name), prompt) for name, prompt in asks])
    finally:
        done.set()
        watcher.join(10)
    for (name, prompt), alone, got in zip(asks, solo, together):
        assert got == alone, (name, prompt)
    assert seen["active"] >= 2 and seen["tok_s"] > 0, seen  # they ran side by side, and it showed
    # batched decode rows: several requests' steps in one forward (and never when off)
    assert (seen["rows"] > 1) == session.batch_rows, seen
    assert seen["fitted"] == session.batch_rows, seen  # and the head's fit of a batch's cost showed
    for name in session.names:  # no slot left behind on any stage (a stage frees its slot when the
        # request's end reaches it, just after the client has the last token: a moment's grace)
        deadline = time.monotonic() + 10
        while own_stage(session, name)["active"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert own_stage(session, name)["active"] == 0, name


def test_a_client_that_hangs_up_frees_its_slot_on_every_stage(session):
    api = session.api("m2")
    u = urlsplit(api)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": status(api)["session"]["model"], "temperature": 0, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}  # fmt: skip
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    pieces = 0
    while pieces < 3:  # mid-answer: a few pieces in
        line = resp.readline()
        assert line, "the stream ended early"
        pieces += line.startswith(b"data:") and b'"content"' in line
    for name in session.names:  # the request holds one slot on every stage
        wait_for(f"{name} shows the request's slot", lambda n=name: own_stage(session, n)["active"] == 1)
    head = status(session.api("m1"))["plan"]["head"]
    assert [r["origin"] for r in status(session.api(head))["load"]["requests"]] == ["m2"]
    conn.sock.close()  # the client hangs up
    conn.close()
    for name in session.names:
        wait_for(f"{name} freed the slot", lambda n=name: own_stage(session, n)["active"] == 0)
    load = status(session.api(head))["load"]
    assert (load["active"], load["queued"], load["requests"]) == (0, 0, [])
    code, _, body = chat(session.api("m3"), PROMPTS[0])  # the next one is served
    assert code == 200 and body["usage"]["completion_tokens"] >= 1
    # asked before in this session (prompt caching, the default): all but its last token were in a
    # parked slot's KV, and the eight answers above came from such slots the second time, alike
    usage = body["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage


def test_more_requests_than_the_queue_holds_get_429_and_the_admitted_finish(tmp_path):
    from kafila.tooling.launch import LocalSession

    # prompt caching off: the admitted answers are compared with the same prompts asked again at
    # serving precision, where a prompt read partly from the cache may part at a near-tie
    s = LocalSession(members=3, context=256, concurrency=1, max_queued=1, cache_root=str(tmp_path / "cache"),
                     log_dir=str(tmp_path), prompt_cache=False)  # fmt: skip
    s.start(timeout_s=300)
    try:
        asks = [(s.names[i % 3], PROMPTS[i]) for i in range(5)]
        got = at_once([(chat, s.api(name), prompt) for name, prompt in asks])
        ok = [i for i, (code, _, _) in enumerate(got) if code == 200]
        refused = [i for i, (code, _, _) in enumerate(got) if code == 429]
        assert len(ok) == 2 and len(refused) == 3, [(c, b) for c, _, b in got]
        for i in refused:
            _, headers, body = got[i]
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
            assert "waiting" in body["error"]["message"]
        for i in ok:  # nothing lost for the admitted: their answers are their solo ones
            _, _, body = got[i]
            alone = answer(s.api(asks[i][0]), asks[i][1])
            assert (body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]) == alone
        head = status(s.api("m1"))["plan"]["head"]
        load = status(s.api(head))["load"]
        assert (load["slots"], load["max_queued"], load["active"], load["queued"]) == (1, 1, 0, 0)
    finally:
        codes = s.stop()
    assert all(c in (0, -9) for c in codes.values()), codes
