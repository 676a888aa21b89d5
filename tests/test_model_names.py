"""Model names people use: the id, the alias (smollm2-135m) and the file name all work, on the
OpenAI routes and the Ollama ones; an unknown name is a 404 that lists what is served.
Scripted engine, real sockets, no model (tests/test_page.py checks the same on a real session)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kafila.api._names import ModelNames, names_for
from tests.api_fixtures import ScriptedEngine, tokenizer  # noqa: F401 (fixture)
from tests.test_api_http import serve

STEM = "SmolLM2-135M-Instruct.Q4_1"
FILE = STEM + ".gguf"
ALIAS = "smollm2-135m"
MSGS = [{"role": "user", "content": "Say something."}]


def test_names_of_a_session_model_and_of_an_alias():
    aliases = {ALIAS: SimpleNamespace(filename=FILE)}
    session = names_for(STEM, aliases)  # a session names its model by the file's stem
    assert session == ModelNames(STEM, (ALIAS, FILE))
    served = names_for(ALIAS, aliases)  # `kafila serve --model smollm2-135m`
    assert served == ModelNames(ALIAS, (STEM, FILE))
    for names in (session, served):
        assert all(names.accepts(n) for n in (STEM, FILE, ALIAS, ALIAS + ":latest", STEM + ":latest"))
        assert not any(names.accepts(n) for n in ("smollm2", "gpt-4o", ALIAS + ":7b", "", STEM.lower()))
    other = names_for("tiny-llama.Q8_0", aliases)  # a file no alias points at
    assert other == ModelNames("tiny-llama.Q8_0", ("tiny-llama.Q8_0.gguf",))
    assert names_for("", aliases) == ModelNames("", ())  # a member before the session formed


def test_the_real_alias_table_names_the_default_model():
    assert names_for(STEM).aliases[0] == ALIAS  # kafila.models.ALIASES


def test_alias_and_file_name_work_on_v1_and_api(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, model_name=STEM)
    want = tokenizer.decode(ScriptedEngine.answer(
        tokenizer.encode(tokenizer.render_chat(MSGS, add_generation_prompt=True)), 5))  # fmt: skip

    async def test(server, http):
        async with http.get("/v1/models") as r:
            body = await r.json()
        assert [m["id"] for m in body["data"]] == [STEM]
        assert body["data"][0]["aliases"] == [ALIAS, FILE]
        async with http.get("/api/tags") as r:
            assert [m["name"] for m in (await r.json())["models"]] == [STEM]
        for name in (STEM, ALIAS, FILE):
            async with http.get(f"/v1/models/{name}") as r:
                assert r.status == 200 and (await r.json())["id"] == STEM
            req = {"model": name, "messages": MSGS, "max_tokens": 5}
            async with http.post("/v1/chat/completions", json=req) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
            assert body["model"] == name and body["choices"][0]["message"]["content"] == want
            async with http.post("/v1/completions", json={"model": name, "prompt": "Once", "max_tokens": 2}) as r:
                assert r.status == 200
            for tagged in (name, name + ":latest"):
                req = {"model": tagged, "messages": MSGS, "stream": False, "options": {"num_predict": 5}}
                async with http.post("/api/chat", json=req) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["message"]["content"] == want
            req = {"model": name, "prompt": "Say something.", "stream": False, "options": {"num_predict": 5}}
            async with http.post("/api/generate", json=req) as r:
                assert r.status == 200 and (await r.json())["response"] == want

    serve(engine, test)


def test_an_unknown_name_is_a_404_listing_what_is_served(tokenizer):  # noqa: F811
    async def test(server, http):
        for path, body in (
            ("/v1/chat/completions", {"model": "llama3", "messages": MSGS}),
            ("/v1/completions", {"model": "llama3", "prompt": "Once"}),
        ):
            async with http.post(path, json=body) as r:
                assert r.status == 404
                err = (await r.json())["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model"
            assert all(repr(n) in err["message"] for n in (STEM, ALIAS, FILE)), err
        async with http.get("/v1/models/llama3") as r:
            assert r.status == 404
        for path, body in (
            ("/api/chat", {"model": "llama3", "messages": MSGS}),
            ("/api/generate", {"model": "llama3:8b", "prompt": "Once"}),
            ("/api/show", {"model": "llama3"}),
        ):
            async with http.post(path, json=body) as r:
                assert r.status == 404
                err = await r.json()
            assert set(err) == {"error"}  # Ollama's shape
            assert "not served here" in err["error"] and all(n in err["error"] for n in (STEM, ALIAS, FILE))

    serve(ScriptedEngine(tokenizer, model_name=STEM), test)


@pytest.mark.parametrize("name", [ALIAS, STEM])
def test_a_server_started_with_either_name_accepts_the_other(tokenizer, name):  # noqa: F811
    async def test(server, http):
        for asked in (ALIAS, STEM, FILE):
            req = {"model": asked, "messages": MSGS, "max_tokens": 2}
            async with http.post("/v1/chat/completions", json=req) as r:
                assert r.status == 200, (name, asked)

    serve(ScriptedEngine(tokenizer, model_name=name), test)
