"""Chat without a chat template (in process, no server): the documented plain fallback
`role: content` lines + `assistant:` is what the model sees."""

from __future__ import annotations

import asyncio

import httpx

import mtp
from mtp.serve.app import create_app
from mtp.serve.engine import Engine
from serve_support import build_model_dir


def test_chat_without_template_uses_the_plain_fallback(tmp_path):
    model = mtp.load_model(build_model_dir(tmp_path / "plain", chat_template=False))
    assert model.tokenizer.chat_template is None
    engine = Engine(model, draft_tokens=None, max_concurrency=2)
    app = create_app(engine, "plain")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    ids = model.tokenizer.encode("system: be brief\nuser: Hello\nassistant:")
    ref = model.generate(ids, max_new_tokens=12)

    async def ask() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.post("/v1/chat/completions", json={"model": "plain", "messages": messages, "max_tokens": 12,
                                                           "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

    try:
        out = asyncio.run(ask())
    finally:
        engine.shutdown()
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == ref.text.removesuffix("<|endoftext|>")
    assert engine.active == 0 and engine.served == 1
