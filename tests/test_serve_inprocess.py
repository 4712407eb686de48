"""The app in process (no server, httpx's ASGI transport): the plain chat fallback when the model has no
chat template, a generation that fails mid-way (500 / an in-band error event, the slot freed), and the drain at
shutdown (requests run on through the grace period, then end with an OpenAI error)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import mtp
from mtp.serve.app import create_app
from mtp.serve.engine import Engine
from serve_support import build_model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = mtp.load_model(build_model_dir(tmp_path_factory.mktemp("inproc") / "plain", chat_template=False))
    eng = Engine(model, draft_tokens=None, max_concurrency=2)
    yield eng
    eng.shutdown()


def post(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_chat_without_template_uses_the_plain_fallback(engine):
    model = engine.model
    assert model.tokenizer.chat_template is None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    ids = model.tokenizer.encode("system: be brief\nuser: Hello\nassistant:")
    ref = mtp.generate(model, ids, max_new_tokens=12)
    r = post(create_app(engine, "plain"), "/v1/chat/completions",
             {"model": "plain", "messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == ref.text
    assert engine.active == 0


def test_a_generation_that_fails_midway_is_reported_and_frees_its_slot(engine, monkeypatch):
    from mtp.decode.decoder import Decoder as BatchDecoder

    real_step = BatchDecoder.step

    def failing_step(self):
        if any(s.decoding and s.session.new_tokens for s in self.rows):  # after the first token
            raise RuntimeError("simulated failure")
        return real_step(self)

    app = create_app(engine, "plain")
    body = {"model": "plain", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    monkeypatch.setattr(BatchDecoder, "step", failing_step)
    r = post(app, "/v1/completions", body)
    assert r.status_code == 500 and "simulated failure" in r.json()["error"]["message"]
    r = post(app, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert "simulated failure" in events[-2] and events[-1] == "[DONE]"
    assert engine.active == 0
    monkeypatch.undo()
    assert post(app, "/v1/completions", body).json()["usage"]["completion_tokens"] == 5


def test_a_drain_lets_requests_finish_then_stops_the_rest_with_errors(engine):
    app = create_app(engine, "plain")
    server = app.state.server
    body = {"model": "plain", "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def started(task):
        while engine.active == 0:
            assert not task.done(), task.result().text
            await asyncio.sleep(0.01)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            await started(first)
            server.begin_drain(3600)  # a grace period longer than the request needs
            assert not first.done()
            health = await c.get("/health")
            finished = await first
            cut = [asyncio.create_task(c.post("/v1/completions", json={**body, "max_tokens": 3000, "stream": s}))
                   for s in (False, True)]
            for task in cut:
                await started(task)
            while engine.active < 2:
                await asyncio.sleep(0.01)
            server.abort_in_flight(3600)  # what the drain does once the grace period is over
            whole, stream = [await task for task in cut]
            late = await c.post("/v1/completions", json=body)
            return health, finished, whole, stream, late

    health, finished, whole, stream, late = asyncio.run(go())
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 200
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "server_shutdown"
    events = [line.removeprefix("data: ") for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutdown"
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    assert engine.active == 0 and not engine.live


def test_fields_a_request_leaves_out_come_from_generation_config(tmp_path):
    folder = build_model_dir(tmp_path / "defaults", chat_template=False)
    (folder / "generation_config.json").write_text('{"do_sample": false, "repetition_penalty": 0.3}')
    model = mtp.load_model(folder)
    eng = Engine(model, draft_tokens=None, max_concurrency=2)
    try:
        app = create_app(eng, "defaults")
        ids = model.tokenizer.encode("def add(a, b):")
        for body, rp in (({}, 0.3), ({"repetition_penalty": 1.0}, 1.0)):
            r = post(app, "/v1/completions", {"model": "defaults", "prompt": "def add(a, b):", "max_tokens": 16,
                                              "temperature": 0, **body})
            assert r.status_code == 200, r.text
            want = mtp.generate(model, ids, max_new_tokens=16, repetition_penalty=rp)
            assert r.json()["choices"][0]["text"] == want.text
        assert mtp.generate(model, ids, max_new_tokens=16, repetition_penalty=0.3).tokens != \
            mtp.generate(model, ids, max_new_tokens=16).tokens
    finally:
        eng.shutdown()
