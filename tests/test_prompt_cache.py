"""The prompt cache (decode/prompt_cache.py): a prompt read again, whole or as the prefix of a longer one, resumes
from a snapshot and decodes exactly as a cold read does (greedy and seeded sampling, with and without MTP); the
cache keeps its byte budget, least recently used out; the server reports the cached tokens."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

import mtp
from conftest import pattern_batch, trained_tiny_model
from mtp.decode.decoder import Decoder
from mtp.decode.prefill import PREFILL_CHUNK
from mtp.decode.prompt_cache import PromptCache
from mtp.decode.sampling import SamplingParams
from mtp.decode.session import Session


@pytest.fixture(scope="module")
def models():
    bf16 = trained_tiny_model(steps=60, depth=2, max_position_embeddings=1024, seed=1).to(torch.bfloat16)
    bf16.prepare_for_inference()
    parallel = trained_tiny_model(steps=40, mtp_style="parallel", mtp_num_hidden_layers=2, seed=2,
                                  max_position_embeddings=1024)
    return {"bf16": bf16, "parallel": parallel}


def requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """A prompt over a chunk boundary, then: it extended (resumes at the boundary), itself (whole), its first chunk
    (a prompt of exactly one chunk), a 1-token prompt twice, the first prompt sampled with a seed twice."""
    g = torch.Generator().manual_seed(5)
    a = pattern_batch(vocab, 1, PREFILL_CHUNK + 44, g)[0].tolist()
    tail = pattern_batch(vocab, 1, 30, g)[0].tolist()
    greedy, seeded = SamplingParams(), SamplingParams(temperature=1.0, seed=7)
    return [(a, greedy), (a + tail, greedy), (a, greedy), (a[:PREFILL_CHUNK], greedy), (a[:PREFILL_CHUNK], greedy),
            (a[:1], greedy), (a[:1], greedy), (a + tail, seeded), (a + tail, seeded)]


def decode_one_by_one(model, reqs, draft_tokens, cache: PromptCache | None) -> list[Session]:
    dec = Decoder(model, max_batch=2, max_len=PREFILL_CHUNK * 2 + 64, draft_tokens=draft_tokens, prompt_cache=cache)
    out = []
    for prompt, params in reqs:
        for t in dec.state.tensors():  # what the last request left in the rows (a restore must not rely on it)
            if t.is_floating_point():
                t.normal_()
        seq = dec.add(Session(model, prompt, 24, params, [], None, None))
        while not seq.finished:
            dec.step()
        out.append(seq.session)
    return out


@pytest.mark.parametrize("name", ["bf16", "parallel"])
@pytest.mark.parametrize("draft_tokens", [None, 2])
def test_prompts_from_the_cache_decode_as_cold_reads(models, name, draft_tokens):
    model = models[name]
    reqs = requests(model.config.vocab_size)
    cold = decode_one_by_one(model, reqs, draft_tokens, None)
    cache = PromptCache(1 << 30)
    warm = decode_one_by_one(model, reqs, draft_tokens, cache)
    for c, w in zip(cold, warm):
        assert w.new_tokens == c.new_tokens
        assert c.stats.prompt_cached == 0
    P = PREFILL_CHUNK + 44
    assert [w.stats.prompt_cached for w in warm] == [0, PREFILL_CHUNK, P, PREFILL_CHUNK, PREFILL_CHUNK, 0, 1,
                                                     P + 30, P + 30]
    # drafting from a restored row goes on as from a cold one (the MTP's entries came with the snapshot)
    if draft_tokens:
        assert warm[2].stats.accepted == cold[2].stats.accepted


def test_a_cached_prompt_in_a_batch_decodes_as_alone(models):
    """Rows that resume from the cache while others decode: each output is the cold solo one."""
    model = models["bf16"]
    reqs = requests(model.config.vocab_size)
    solo = [mtp.generate(model, p, max_new_tokens=24, draft_tokens=3, eos_token_ids=[], **vars(params)).tokens
            for p, params in reqs]
    dec = Decoder(model, max_batch=3, max_len=PREFILL_CHUNK * 2 + 64, draft_tokens=3,
                  prompt_cache=PromptCache(1 << 30))
    seqs = [dec.add(Session(model, p, 24, params, [], None, None)) for p, params in reqs]
    for _ in range(2000):
        if all(s.finished for s in seqs):
            break
        dec.step()
    assert [s.session.new_tokens for s in seqs] == solo
    assert sum(s.session.stats.prompt_cached for s in seqs) > 0


def test_the_cache_keeps_its_budget_least_recently_used_out(models):
    model = models["bf16"]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [pattern_batch(vocab, 1, 20, g)[0].tolist() for _ in range(4)]
    probe = PromptCache(1 << 30)
    decode_one_by_one(model, [(prompts[0], SamplingParams())], 3, probe)
    one = probe.nbytes  # a 20-token prompt keeps one snapshot
    assert len(probe.entries) == 1 and one > 0
    cache = PromptCache(2 * one + one // 2)  # room for two
    sessions = decode_one_by_one(model, [(prompts[0], SamplingParams()), (prompts[1], SamplingParams()),
                                         (prompts[0], SamplingParams()),  # a hit: prompt 0 is now the most recent
                                         (prompts[2], SamplingParams()),  # evicts prompt 1, the least recent
                                         (prompts[0], SamplingParams()), (prompts[1], SamplingParams())], 3, cache)
    assert [s.stats.prompt_cached for s in sessions] == [0, 0, 20, 0, 20, 0]
    assert cache.nbytes <= cache.max_bytes and len(cache.entries) == 2
    tiny = PromptCache(one - 1)  # too small for any snapshot: nothing kept, nothing breaks
    sessions = decode_one_by_one(model, [(prompts[3], SamplingParams())] * 2, 3, tiny)
    assert [s.stats.prompt_cached for s in sessions] == [0, 0] and tiny.nbytes == 0
    with pytest.raises(ValueError, match="budget"):
        PromptCache(-1)
    with pytest.raises(ValueError, match="another model"):  # (its states would not fit this model's rows)
        mtp.generate(models["parallel"], prompts[0], max_new_tokens=2, prompt_cache=cache)


def test_generate_takes_a_prompt_cache_across_calls(models):
    """A conversation's next turn (the last prompt + the answer + a new message) resumes from the last prompt's last
    whole chunk; the same prompt again reads nothing."""
    model = models["bf16"]
    (first, _), (longer, _) = requests(model.config.vocab_size)[:2]
    cache = mtp.PromptCache(64 << 20)
    for prompt, cached in ((first, 0), (first, len(first)), (longer, PREFILL_CHUNK)):
        r = mtp.generate(model, prompt, max_new_tokens=16, draft_tokens=3, prompt_cache=cache)
        assert r.tokens == mtp.generate(model, prompt, max_new_tokens=16, draft_tokens=3).tokens
        assert r.stats.prompt_cached == cached


def test_the_server_reports_cached_prompt_tokens(tmp_path):
    from mtp.serve.app import create_app
    from mtp.serve.engine import Engine
    from serve_support import build_model_dir

    model = mtp.load_model(build_model_dir(tmp_path / "m", chat_template=False))
    engine = Engine(model, draft_tokens=None, max_concurrency=2, prompt_cache_bytes=64 << 20)
    off = Engine(model, draft_tokens=None, max_concurrency=2)
    try:
        body = {"model": "m", "prompt": "def fibonacci(n): return n if n < 2 else", "max_tokens": 8, "temperature": 0}

        async def go(app) -> list[dict]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                out = [(await c.post("/v1/completions", json=body)).json() for _ in range(2)]
                metrics = (await c.get("/metrics")).text
            return out + [metrics]

        first, second, metrics = asyncio.run(go(create_app(engine, "m")))
        n = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n
        assert f"mtp:prefix_cache_hits_total {float(n)}" in metrics
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        plain = asyncio.run(go(create_app(off, "m")))[:2]
        assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in plain] == [0, 0]
        assert plain[1]["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        engine.shutdown()
        off.shutdown()


def test_the_server_keeps_the_cache_within_half_the_memory_available(monkeypatch, caplog):
    from mtp.serve import engine as serve_engine

    monkeypatch.setattr(serve_engine, "available_memory", lambda device: 100 << 20)
    with caplog.at_level("WARNING", logger="mtp.serve"):
        assert serve_engine.prompt_cache_budget(1 << 30, "cpu") == 50 << 20
    assert "half the memory available" in caplog.text
    assert serve_engine.prompt_cache_budget(10 << 20, "cpu") == 10 << 20
    monkeypatch.setattr(serve_engine, "available_memory", lambda device: None)  # (no bound known: as asked)
    assert serve_engine.prompt_cache_budget(1 << 30, "cpu") == 1 << 30
