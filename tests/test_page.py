"""The session page at GET / and the tools people already use, against the member's API.

Fast (scripted engine, real sockets): the page and its files are served with a same-origin-only
Content-Security-Policy; a foreign Host or Origin is refused on the page, its files, /status and
every API route (DNS rebinding, cross-site requests), in each route family's error shape.

Slow (a real 3-member session on 127.0.0.1, one for the module): headless Chromium (Debian's
`chromium` + `chromium-driver`, driven by selenium) opens a member's page: the ring shows three
members and their edge kinds, the table shows predicted and measured stage ms, a prompt typed
into the chat box streams the API's answer; a screenshot is saved under the test's tmp dir; the
browser requested nothing outside the member. On the same session, the `ollama` client at a
member that is not the head lists the model and streams an answer token-identical to the
OpenAI endpoint's, and the alias and the file name work on both APIs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest

from kafila.api._guard import refusal
from tests.api_fixtures import ScriptedEngine, tokenizer  # noqa: F401 (fixture)
from tests.default_model import needs_default_model
from tests.test_api_http import serve

MSGS = [{"role": "user", "content": "Say something."}]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ALIAS, FILE = "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"

# --- fast: the page's files and the Host/Origin guard ---------------------------------------------


def test_the_page_and_its_files_are_served_same_origin_only(tokenizer):  # noqa: F811
    async def test(server, http):
        async with http.get("/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            csp = r.headers["Content-Security-Policy"]
            html = await r.text()
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        refs = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert refs and all(ref.startswith("/static/") for ref in refs), refs
        for ref, kind in (("/static/page.js", "text/javascript"), ("/static/page.css", "text/css"),
                          ("/static/icon.svg", "image/svg+xml")):  # fmt: skip
            async with http.get(ref) as r:
                assert r.status == 200 and r.content_type == kind
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                body = await r.text()
            assert "http://" not in body.replace("http://www.w3.org/2000/svg", "")
            assert "https://" not in body
        for missing in ("/static/../_server.py", "/static/index.html", "/static/nope.js"):
            async with http.get(missing) as r:
                assert r.status == 404

    serve(ScriptedEngine(tokenizer), test)


def test_guard_rules():
    assert refusal("127.0.0.1:8740", None) is None
    assert refusal("[::1]:8740", None) is None and refusal("localhost", None) is None
    assert refusal("192.168.1.20:8740", None) is None  # an IP literal: no name to rebind
    assert refusal("app.localhost:8740", None) is None
    assert refusal(None, None) is None  # HTTP/1.0 without Host: not a browser
    assert refusal("laptop.local:8740", None, ("laptop", "laptop.local")) is None
    assert "DNS rebinding" in refusal("evil.example:8740", None)
    assert refusal("laptop.local:8740", None) is not None  # not this machine's name
    assert refusal("127.0.0.1:8740", "http://127.0.0.1:8740") is None  # the member's own page
    assert refusal("127.0.0.1:8740", "http://localhost:3000") is None  # a local front-end
    assert refusal("127.0.0.1:8740", "http://[::1]:3000") is None
    for origin in ("http://evil.example", "https://127.0.0.1.evil.example", "null", "file://",
                   "http://127.0.0.1:8740.evil.example"):  # fmt: skip
        assert "refused" in refusal("127.0.0.1:8740", origin), origin


ROUTES = [  # (method, path, body): the page, its files and every API route
    ("GET", "/", None), ("GET", "/static/page.js", None), ("GET", "/status", None),
    ("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"model": "scripted", "messages": MSGS}),
    ("POST", "/v1/completions", {"model": "scripted", "prompt": "hi"}), ("GET", "/api/tags", None),
    ("GET", "/api/version", None), ("POST", "/api/chat", {"model": "scripted", "messages": MSGS}),
    ("POST", "/api/generate", {"model": "scripted", "prompt": "hi"}),
]  # fmt: skip


@pytest.mark.parametrize("headers", [
    {"Host": "evil.example"}, {"Host": "attacker.example:8740"},
    {"Origin": "http://evil.example"}, {"Origin": "null"},
    {"Host": "evil.example", "Origin": "http://evil.example"},
], ids=["host", "host-port", "origin", "origin-null", "both"])  # fmt: skip
def test_a_foreign_host_or_origin_is_refused_everywhere(tokenizer, headers):  # noqa: F811
    engine = ScriptedEngine(tokenizer)

    async def test(server, http):
        for method, path, body in ROUTES:
            async with http.request(method, path, json=body, headers=headers) as r:
                assert r.status == 403, (path, headers)
                err = await r.json()
            if path.startswith("/api/"):
                assert set(err) == {"error"}
                assert "refused" in err["error"] or "rebinding" in err["error"]
            else:
                assert err["error"]["code"] == "forbidden", err
        assert not engine.requests  # nothing reached the model

    serve(engine, test)


def test_same_origin_local_origins_and_plain_clients_pass(tokenizer):  # noqa: F811
    async def test(server, http):
        own = f"http://127.0.0.1:{server.port}"
        for headers in ({}, {"Origin": own}, {"Origin": "http://localhost:5173"},
                        {"Host": f"localhost:{server.port}", "Origin": f"http://localhost:{server.port}"}):  # fmt: skip
            for method, path, body in ROUTES:
                async with http.request(method, path, json=body, headers=headers) as r:
                    assert r.status == 200, (path, headers, await r.text())

    serve(ScriptedEngine(tokenizer), test)


# --- slow: a real session, a real browser, the ollama client --------------------------------------

PROMPT = "Name three colors."
MAX_NEW = 24


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from kafila.tooling.launch import LocalSession

    # prompt caching off: answers are compared with one stage's at serving precision (as in
    # tests/test_session_e2e.py: a prompt read partly from the cache may part at a near-tie)
    s = LocalSession(members=3, context=256, concurrency=2, prompt_cache=False,
                     cache_root=str(tmp_path_factory.mktemp("caches")),
                     log_dir=str(tmp_path_factory.mktemp("logs")))  # fmt: skip
    s.start(timeout_s=300)
    yield s
    s.stop()


def get(api, path, headers=None):
    req = urllib.request.Request(api + path, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def post(api, path, body, headers=None):
    req = urllib.request.Request(api + path, json.dumps(body).encode(),
                                 {"content-type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def openai_answer(api, model, prompt=PROMPT):
    code, body = post(api, "/v1/chat/completions", {
        "model": model, "temperature": 0, "max_tokens": MAX_NEW,
        "messages": [{"role": "user", "content": prompt}]})  # fmt: skip
    assert code == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def not_head(session):
    head = get(session.api("m1"), "/status")["plan"]["head"]
    return next(n for n in session.names if n != head)


def chromium(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,1600",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def wait_for(driver, what, check, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = driver.execute_script(check)
        if got:
            return got
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.25)


@pytest.mark.timeout(600)
@pytest.mark.session
@pytest.mark.model
@pytest.mark.slow
@needs_default_model
def test_the_page_in_a_real_browser_during_a_session(session, tmp_path):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromedriver are not installed: apt-get install chromium chromium-driver")
    member = not_head(session)
    api = session.api(member)
    model = get(api, "/v1/models")["data"][0]["id"]
    want = openai_answer(api, model)[0]  # also gives the head its first stage measurements
    driver = chromium(tmp_path)
    try:
        driver.get(api + "/")
        ring = wait_for(driver, "three members and three edges", """
            const m = [...document.querySelectorAll('#ring g.member')].map(g => g.dataset.name);
            const e = [...document.querySelectorAll('#ring g.edge')].map(g => g.dataset.kind);
            return m.length === 3 && e.length === 3 && e.every(k => k === 'direct' || k === 'relay')
                   && document.querySelectorAll('#ring g.member.head').length === 1 ? {m, e} : null;""")
        plan = get(api, "/status")["plan"]
        assert ring["m"] == plan["ring"]  # drawn in plan order
        assert set(ring["e"]) <= {"direct", "relay"}
        # the NAT classes come with the host's next status message (every few seconds)
        labels = wait_for(driver, "the NAT classes at both ends of an edge", """
            const t = [...document.querySelectorAll('#ring g.edge text')].map(t => t.textContent);
            return t.some(s => s.includes('→') && !s.includes('?')) ? t : null;""", timeout_s=30)
        assert any(re.match(r"(direct|relay) · [\d.]+ ms", t) for t in labels), labels
        assert any("→" in t and "?" not in t for t in labels), labels  # NAT classes at both ends
        rows = wait_for(driver, "predicted and measured stage ms for every member", """
            const rows = [...document.querySelectorAll('#members tbody tr')].map(tr => ({
                name: tr.dataset.name, predicted: tr.querySelector('td.predicted').textContent,
                measured: tr.querySelector('td.measured').textContent}));
            return rows.length === 3 && rows.every(r => /^\\d/.test(r.predicted) && /^\\d/.test(r.measured))
                   ? rows : null;""", timeout_s=30)  # fmt: skip
        assert [r["name"] for r in rows] == plan["ring"]
        for r in rows:
            assert float(r["predicted"]) == pytest.approx(plan["stage_ms"][r["name"]], abs=0.006)
            assert float(r["measured"]) > 0

        driver.find_element("id", "max-tokens").send_keys(str(MAX_NEW))
        driver.find_element("id", "prompt").send_keys(PROMPT)
        driver.find_element("id", "send").click()
        got = wait_for(driver, "the streamed answer", """
            const m = document.querySelector('#log .msg.assistant[data-done="true"]');
            return m ? {text: m.querySelector('.text').textContent, chunks: +m.dataset.chunks,
                        error: m.classList.contains('error')} : null;""", timeout_s=120)  # fmt: skip
        assert not got["error"], got
        assert got["text"] == want
        assert got["chunks"] > 1  # it streamed, piece by piece

        shot = tmp_path / "kafila-page.png"
        driver.save_screenshot(str(shot))
        print(f"screenshot: {shot}")
        assert shot.stat().st_size > 10_000
        driver.set_window_size(390, 844)  # a phone's width: nothing wider than the screen
        time.sleep(0.5)
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 1, overflow
        phone = tmp_path / "kafila-page-phone.png"
        driver.save_screenshot(str(phone))
        print(f"screenshot (phone width): {phone}")

        page_urls, web_urls = set(), set()  # requested by the page; any http(s) at all
        for entry in driver.get_log("performance"):
            msg = json.loads(entry["message"])["message"]
            if msg["method"] == "Network.requestWillBeSent":
                url = msg["params"]["request"]["url"]
                if msg["params"].get("documentURL", "").startswith(api + "/"):
                    page_urls.add(url)
                if url.startswith(("http:", "https:", "ws:", "wss:")):
                    web_urls.add(url)
        assert {api + "/", api + "/static/page.js", api + "/status", api + "/v1/chat/completions"} <= page_urls
        outside = {u for u in page_urls | web_urls if not u.startswith(api + "/") and not u.startswith("data:")}
        assert not outside, f"the page requested addresses outside the member: {outside}"
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors

        # the load, on the head's page (its queue is live there): every stage, then a request being served
        head = plan["head"]
        driver.get(session.api(head) + "/")
        stages = wait_for(driver, "a row per stage with its forwards", """
            const rows = [...document.querySelectorAll('#load-stages tbody tr')].map(tr => ({
                name: tr.dataset.name, steps: tr.querySelector('td.steps').textContent}));
            return rows.length === 3 && rows.every(r => /^\\d+$/.test(r.steps) && +r.steps > 0) ? rows : null;""",
                          timeout_s=30)  # fmt: skip
        assert [r["name"] for r in stages] == plan["ring"]
        assert driver.find_element("id", "load-slots").text.startswith("slots: ")
        answer: list = []
        long = threading.Thread(target=lambda: answer.append(post(session.api(head), "/v1/chat/completions", {
            "model": model, "temperature": 0, "max_tokens": 200,
            "messages": [{"role": "user", "content": "Write a long story about a cat who learns to fly."}]})))  # fmt: skip
        long.start()
        try:
            row = wait_for(driver, "the request being served, with its origin and tokens", """
                const tr = document.querySelector('#load-requests tbody tr');
                return tr ? {origin: tr.querySelector('td.origin').textContent,
                             state: tr.querySelector('td.state').textContent,
                             tokens: tr.querySelector('td.tokens').textContent} : null;""", timeout_s=30)  # fmt: skip
        finally:
            long.join(timeout=120)
            print("the long answer:", answer)
        assert row["origin"] == head and row["state"] in ("prefill", "decode"), row
        assert row["tokens"].endswith(" / 200"), row
    finally:
        driver.quit()


@pytest.mark.session
@pytest.mark.model
@pytest.mark.slow
@needs_default_model
def test_ollama_client_streams_from_a_member_that_is_not_the_head(session):
    import ollama

    member = not_head(session)
    api = session.api(member)
    client = ollama.Client(host=api, timeout=120)
    listed = [m.model for m in client.list().models]
    model = get(api, "/v1/models")["data"][0]["id"]
    assert listed == [model]
    want_text, want_tokens = openai_answer(api, model)
    chunks = list(client.chat(model=ALIAS, messages=[{"role": "user", "content": PROMPT}], stream=True,
                              options={"temperature": 0, "num_predict": MAX_NEW}))  # fmt: skip
    pieces = [c.message.content for c in chunks if not c.done]
    assert len([p for p in pieces if p]) > 1  # it streamed
    assert "".join(pieces) == want_text
    assert chunks[-1].done and chunks[-1].eval_count == want_tokens  # the same tokens, counted
    assert chunks[-1].model == ALIAS


@pytest.mark.session
@pytest.mark.model
@pytest.mark.slow
@needs_default_model
def test_alias_and_file_name_on_a_real_session(session):
    api = session.api("m3")
    model = get(api, "/v1/models")["data"][0]
    assert model["id"] == "SmolLM2-135M-Instruct.Q4_1" and model["aliases"] == [ALIAS, FILE]
    want = openai_answer(api, model["id"], "What is 12 times 12?")
    assert openai_answer(api, ALIAS, "What is 12 times 12?") == want
    assert openai_answer(api, FILE, "What is 12 times 12?") == want
    code, body = post(api, "/api/generate", {"model": FILE, "prompt": "What is 12 times 12?", "stream": False,
                                             "options": {"num_predict": MAX_NEW}})  # fmt: skip
    assert code == 200 and body["response"] == want[0] and body["eval_count"] == want[1]
    code, body = post(api, "/v1/chat/completions", {"model": "smollm2", "messages": MSGS})
    assert code == 404 and ALIAS in body["error"]["message"] and FILE in body["error"]["message"]
    code, body = post(api, "/api/chat", {"model": "smollm2", "messages": MSGS})
    assert code == 404 and ALIAS in body["error"]
    # the guard holds on a real member too
    code, body = post(api, "/api/chat", {"model": ALIAS, "messages": MSGS}, {"Origin": "http://evil.example"})
    assert code == 403 and "refused" in body["error"]



# --- `kafila status`: the same picture in a terminal ----------------------------------------------

STATUS = {  # a GET /status body as a member of a 3-member session answers it (trimmed)
    "session": {"name": "m2", "host": "m1", "state": "serving", "degraded": None, "model": "SmolLM2-135M-Instruct.Q4_1",
                "backend": "openvino", "context": 256, "concurrency": 2, "uptime_s": 36.9},
    "members": {n: {"name": n, "nat": nat, "rtt_ms": 1.0, "bandwidth_gbps": 3.8, "memory_gb": 22.8,
                    "overhead_us": 450.0, "backend": "openvino", "state": "joined"}
                for n, nat in (("m1", "permissive"), ("m2", "symmetric"), ("m3", "permissive"))},
    "plan": {"feasible": True, "tier": "full", "policy": "kafila", "head": "m3", "ring": ["m3", "m1", "m2"],
             "blocks": {"m3": 4, "m1": 8, "m2": 18}, "stage_ms": {"m3": 11.04, "m1": 10.88, "m2": 10.82},
             "bottleneck_ms": 11.04, "edges": [{"from": "m3", "to": "m1", "kind": "direct", "ms": 30.0},
                                               {"from": "m1", "to": "m2", "kind": "relay", "ms": 18.6},
                                               {"from": "m2", "to": "m3", "kind": "direct", "ms": 11.4}]},
    "stages": {"m3": {"blocks": 4, "predicted_ms": 11.04, "compute_ms": 12.5},
               "m1": {"blocks": 8, "predicted_ms": 10.88, "compute_ms": 19.25},
               "m2": {"blocks": 18, "predicted_ms": 10.82, "compute_ms": None}},
    "edges": [{"from": "m3", "to": "m1", "kind": "direct", "rtt_ms": 1.757},
              {"from": "m1", "to": "m2", "kind": "relay", "rtt_ms": 0.752}],
    "tok_s": 9.5, "step_ms": 80.1, "network_ms": 3.2,
    "weights": {"received_bytes": 40_266_911, "tensor_bytes": 39_896_064, "seconds": 20.4, "source": "host"},
    "memory": {"rss_bytes": 232_726_528, "planned_bytes": 46_973_952}, "requests": None,
    "api": {"url": "http://127.0.0.1:43179", "inflight_requests": 1},
}  # fmt: skip


def _printed(status: dict) -> str:
    from rich.console import Console

    from kafila.commands.status import render

    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render(status))
    return console.export_text()


def test_status_render_shows_members_edges_plan_and_bottleneck():
    from kafila.commands.status import predicted_tok_s

    out = _printed(STATUS)
    lines = out.splitlines()
    rows = [ln for ln in lines if ln.lstrip("│ ").startswith(("m1", "m2", "m3"))]
    assert [r.lstrip("│ ").split()[0] for r in rows[:3]] == ["m3", "m1", "m2"]  # ring order
    assert "m3 (head)" in out and "m2 (here)" in out
    assert "11.04 ◀" in out and "19.25 ◀" in out  # predicted and measured bottlenecks marked
    assert "m1 → m2" in out and "relay" in out and "permissive / symmetric" in out
    tps = predicted_tok_s(STATUS["plan"])
    assert tps == pytest.approx(1000 / (11.04 + 10.88 + 10.82 + 30.0 + 18.6 + 11.4))
    assert f"predicted {tps:.1f} tok/s, bottleneck m3 (11.04 ms)" in out
    assert "measured 9.5 tok/s" in out and "40.3 of 39.9 MB from host" in out
    degraded = dict(STATUS, session=dict(STATUS["session"], state="degraded", degraded="m3 is gone"))
    assert "degraded: m3 is gone" in _printed(degraded)
    assert "one process" in _printed({"model": "smollm2-135m", "ready": True, "mode": "local"})


def test_status_command_against_a_member_and_a_missing_one(tokenizer):  # noqa: F811
    import subprocess
    import sys

    async def test(server, http):
        import asyncio

        def run(*args):
            return subprocess.run([sys.executable, "-m", "kafila", "status", *args], capture_output=True,
                                  text=True, timeout=60, check=False)  # fmt: skip

        r = await asyncio.to_thread(run, "--api", f"127.0.0.1:{server.port}", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["model"] == "scripted"
        r = await asyncio.to_thread(run, "--api", f"127.0.0.1:{server.port}")
        assert r.returncode == 0 and "scripted" in r.stdout, r.stderr

    serve(ScriptedEngine(tokenizer), test)
    from kafila.tooling.launch import free_port

    r = subprocess.run([sys.executable, "-m", "kafila", "status", "--api", f"127.0.0.1:{free_port()}"],
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 3 and "cannot reach a Kafila API" in r.stderr and "--api" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, no traceback


@pytest.mark.session
@pytest.mark.model
@pytest.mark.slow
@needs_default_model
def test_kafila_status_prints_the_session_from_any_member(session):
    import subprocess
    import sys

    plan = get(session.api("m1"), "/status")["plan"]
    api = session.api(not_head(session)).removeprefix("http://")
    r = subprocess.run([sys.executable, "-m", "kafila", "status", "--api", api], capture_output=True,
                       text=True, timeout=60, check=False, env=dict(os.environ, COLUMNS="160"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"{plan['head']} (head)" in out and "serving" in out
    for a, b in zip(plan["ring"], plan["ring"][1:] + plan["ring"][:1]):
        assert f"{a} → {b}" in out
    assert "predicted" in out and "tok/s, bottleneck " in out
