"""Reduced precision on CPU: bf16 (oneDNN-packed) and int8 weight-only linear layers stay lossless for greedy
speculative decoding (each verified row computed exactly as a plain step), and fall back when they must."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mtp
from conftest import pattern_batch, trained_tiny_model
from mtp.model import qmatmul
from mtp.model.linear import FastLinear, bf16_kernel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped():
    return {q: mtp.load_model(ROOT / "models" / "code-small", dtype="bfloat16", quantize=q) for q in (None, "int8", "int4")}


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@torch.no_grad()
def test_prepared_layers_are_row_invariant(shipped, quantize):
    """Every prepared linear of the shipped model gives row i of a 1..6-row input exactly as a 1-row input."""
    model = shipped[quantize]
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, FastLinear)]
    bf16 = {bf16_kernel()}  # oneDNN's, or ours where oneDNN cannot pack bf16 weights
    want = {None: bf16, "int8": {"int8"}, "int4": {"int4", "int8"}}[quantize]  # int8 where int4 cannot run the shape
    kept = {None: bf16}.get(quantize, {"bf16-native"} if qmatmul.available() else {"bf16"})  # keep_precision
    assert layers and all(m.kernel in (kept if n.endswith("mtp.fc") else want) for n, m in layers)
    if quantize == "int4":
        assert sum(m.kernel == "int4" for _, m in layers) > len(layers) // 2
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, m in layers:
            x = torch.randn(6, m.in_features, generator=g).to(torch.bfloat16)
            single = torch.cat([m(x[i : i + 1]) for i in range(6)])
            for rows in range(2, 7):
                assert torch.equal(m(x[:rows]), single[:rows]), (name, rows)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_greedy_speculative_equals_plain_on_the_shipped_model(shipped, quantize):
    model = shipped[quantize]
    prompts = [json.loads(line)["text"] for line in (ROOT / "src/mtp/assets/bench_prompts.jsonl").read_text().splitlines()]
    for text in prompts[:3]:
        ids = model.tokenizer.encode(text)[-300:]
        want = mtp.generate(model, ids, max_new_tokens=64, eos_token_ids=[]).tokens
        for k in (2, 3, "auto"):
            assert mtp.generate(model, ids, max_new_tokens=64, draft_tokens=k, eos_token_ids=[]).tokens == want, k


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
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


@torch.no_grad()
def test_int4_kernel_matches_its_dequantized_weight_and_is_row_invariant():
    """`Int4Weight` codes run by the int4 kernel here (qmatmul's, else torch's): the product of the dequantized weight
    (up to bf16 output rounding and, in qmatmul, int8 activations in blocks of up to 128), and row i of a 1..64-row
    input exactly as a 1-row input (lossless speculative decoding needs it)."""
    from mtp.model.linear import Int4Weight

    g = torch.Generator().manual_seed(0)
    for out_f, in_f in ((64, 32), (48, 256), (32, 512)):  # groups of 32, 128, and 128 split from a 512-wide layer
        lin = FastLinear(in_f, out_f, bias=True).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        lin.prepare("int4")
        wq = lin.int4_weight()
        assert wq.codes.max() <= 15 and (wq.dequantize() - lin.weight.float()).abs().max() <= wq.scale.max() * 0.5 + 1e-6
        x = torch.randn(64, in_f, generator=g).to(torch.bfloat16)
        want = x.float() @ wq.dequantize().t() + lin.bias.float()
        torch.testing.assert_close(lin(x).float(), want, atol=0.04, rtol=0.02)
        single = torch.cat([lin(x[i : i + 1]) for i in range(64)])
        for rows in (2, 3, 4, 7, 16, 33, 64):
            assert torch.equal(lin(x[:rows]), single[:rows]), (out_f, in_f, rows)
    assert Int4Weight.quantize(torch.zeros(16, 32), 32).dequantize().abs().max() == 0


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
def test_int4_moe_experts_run_int4_and_decode_losslessly(family, monkeypatch):
    from conftest import scripted_drafts_patterns, tiny_model
    from mtp.model.moe import Experts
    from test_families import tiny

    if family == "deepseek_v3":
        model = tiny("deepseek_v3", std=0.02, moe_intermediate_size=32).to(torch.bfloat16)
    else:
        model = tiny_model(std=0.02, num_experts=8, moe_intermediate_size=32).to(torch.bfloat16)
    model.config.eos_token_id = None  # decode the whole length (the tiny model's first token may be its eos)
    model.prepare_for_inference("int4")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(all(a.kernel == "int4" and b.kernel == "int4" for a, b in m._kernels) for m in experts)
    prompt = [3, 9, 1, 40, 22, 7]
    want = mtp.generate(model, prompt, max_new_tokens=20).tokens
    for k in (1, 3):
        assert mtp.generate(model, prompt, max_new_tokens=20, draft_tokens=k).tokens == want, k
    seen = set().union(*(scripted_drafts_patterns(model, prompt, monkeypatch, p, max_new=20, ks=(3,))
                         for p in ("none", "all", "mixed")))
    assert seen == {"none", "some", "all"}


def test_prepared_layers_compile_whole_and_are_renewed_after_in_place_changes():
    """A fused projection (q|k|v as one matmul) traces into one graph (fullgraph: a graph break raises), and a
    compiled decoder renews prepared copies whose weights changed in place (a graph cannot check them)."""
    from mtp.model.linear import project, renew_prepared

    model = trained_tiny_model(steps=2).to(torch.bfloat16)
    model.prepare_for_inference()
    attn = next(m for m in model.modules() if m.__dict__.get("_fused") is not None)
    names = attn.fused_projections
    x = torch.randn(3, getattr(attn, names[0]).in_features, dtype=torch.bfloat16)
    step = torch.compile(lambda x: project(attn, x, *names), fullgraph=True, backend="eager")
    with torch.no_grad():
        # against the eager fused form (fused vs separate layers may round apart on another CPU's kernels)
        for got, want in zip(step(x), project(attn, x, *names), strict=True):
            assert torch.equal(got, want)
        assert renew_prepared(model) == 0
        getattr(attn, names[0]).weight.mul_(2.0)
        # the layer and its fusion (a fusion of qmatmul's bf16 weights prepares its parts again itself: one count)
        assert renew_prepared(model) >= 1
        assert attn.__dict__["_fused"].fresh() and all(p.weight._version == p._version
                                                       for p in attn.__dict__["_fused"].parts)
        for got, want in zip(step(x), project(attn, x, *names), strict=True):  # the graph reads the renewed weights
            assert torch.equal(got, want)
