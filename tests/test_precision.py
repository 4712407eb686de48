"""Reduced precision on CPU: bf16 (oneDNN-packed) and int8 weight-only linear layers stay lossless for greedy
speculative decoding (each verified row computed exactly as a plain step), and fall back when they must."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mtp
from conftest import pattern_batch, trained_tiny_model
from mtp.model.linear import FastLinear

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped():
    return {q: mtp.load_model(ROOT / "models" / "code-small", dtype="bfloat16", quantize=q) for q in (None, "int8")}


@pytest.mark.parametrize("quantize", [None, "int8"])
@torch.no_grad()
def test_prepared_layers_are_row_invariant(shipped, quantize):
    """Every prepared linear of the shipped model gives row i of a 1..6-row input exactly as a 1-row input."""
    model = shipped[quantize]
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, FastLinear)]
    assert layers and all(m.kernel == ("bf16" if quantize is None or n.endswith("mtp.fc") else "int8") for n, m in layers)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, m in layers:
            x = torch.randn(6, m.in_features, generator=g).to(torch.bfloat16)
            single = torch.cat([m(x[i : i + 1]) for i in range(6)])
            for rows in range(2, 7):
                assert torch.equal(m(x[:rows]), single[:rows]), (name, rows)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_greedy_speculative_equals_plain_on_the_shipped_model(shipped, quantize):
    model = shipped[quantize]
    prompts = [json.loads(line)["text"] for line in (ROOT / "src/mtp/assets/bench_prompts.jsonl").read_text().splitlines()]
    for text in prompts[:3]:
        ids = model.tokenizer.encode(text)[-300:]
        want = mtp.generate(model, ids, max_new_tokens=64, eos_token_ids=[]).tokens
        for k in (2, 3, "auto"):
            assert mtp.generate(model, ids, max_new_tokens=64, draft_tokens=k, eos_token_ids=[]).tokens == want, k


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_greedy_speculative_equals_plain_on_random_models(quantize):
    for seed, kw in ((0, {}), (1, dict(full_attention_interval=1)), (2, dict(mtp_num_hidden_layers=2))):
        model = trained_tiny_model(steps=60, seed=seed, depth=2, **kw).to(torch.bfloat16)
        model.prepare_for_inference(quantize)
        g = torch.Generator().manual_seed(seed)
        for _ in range(3):
            prompt = pattern_batch(8, 1, 12, g)[0].tolist()
            want = mtp.generate(model, prompt, max_new_tokens=30).tokens
            for k in (1, 3, 5, "auto"):
                assert mtp.generate(model, prompt, max_new_tokens=30, draft_tokens=k).tokens == want, (seed, k)


def test_prepared_layers_step_aside_for_training_and_changed_weights():
    model = trained_tiny_model(steps=5).to(torch.bfloat16)
    model.prepare_for_inference("int8")
    lin = model.model.layers[0].mlp.up_proj
    assert isinstance(lin, FastLinear) and lin.kernel == "int8"
    x = torch.randn(3, lin.in_features, dtype=torch.bfloat16)
    exact = torch.nn.functional.linear(x, lin.weight)
    with torch.no_grad():
        quantized = lin(x)
    assert not torch.equal(quantized, exact) and torch.allclose(quantized.float(), exact.float(), atol=0.05, rtol=0.05)
    assert torch.equal(lin(x), exact)  # with grad enabled (training): the parameter itself
    with torch.no_grad():
        lin.weight.add_(1.0)  # weights changed since preparing: the stale copy must not be used
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
    assert "model.layers.0.mlp.up_proj.weight" in model.state_dict()  # names and state dict unchanged


def test_int8_needs_a_bf16_model():
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        trained_tiny_model(steps=1).prepare_for_inference("int8")
