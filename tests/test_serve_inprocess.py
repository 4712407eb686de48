"""The app in process (no server, httpx's ASGI transport): the plain chat fallback when the model has no
chat template, and a generation that fails mid-way (500 / an in-band error event, the slot freed)."""

from __future__ import annotations

import asyncio

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
    assert out["choices"][0]["message"]["content"] == ref.text.removesuffix("<|endoftext|>")
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
            assert r.json()["choices"][0]["text"] == want.text.removesuffix("<|endoftext|>")
        assert mtp.generate(model, ids, max_new_tokens=16, repetition_penalty=0.3).tokens != \
            mtp.generate(model, ids, max_new_tokens=16).tokens
    finally:
        eng.shutdown()
