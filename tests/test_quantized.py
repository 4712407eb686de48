"""Quantized checkpoints (model/quantized.py): FP8 releases in their published layout (float8 weights + scales per
block, per channel or per tensor; `quantization_config` with `weight_block_size` and `modules_to_not_convert`), for
every family and both expert layouts, MTP layers quantized or excluded. Built in code from a tiny float model: the
reference is the stored codes dequantized by hand; plus logits near the float source, greedy speculative == plain on
the loaded model, and every bad-input rule."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp
from conftest import scripted_drafts_patterns, tiny_model
from mtp.config import ConfigError
from mtp.io import CheckpointError
from mtp.model import config_from_dict
from test_families import MAIN, tiny
from test_moe import MOE_CFG, write

# Tensors releases keep in float: embeddings and heads, routers, the DeltaNet conv, anything 1-D.
KEEP = re.compile(r"embed_tokens|lm_head|shared_head\.head|(mlp\.gate|shared_expert_gate)\.weight$|conv1d")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantizable(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not KEEP.search(name)


def expand(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """The scale of every element of a weight of `shape` (by hand: each tile's value repeated over the tile)."""
    *lead, N, K = shape
    if block is None:
        return scale.float().reshape(*lead, N, 1).expand(shape) if scale.numel() > 1 else scale.float().expand(shape)
    return scale.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :N, :K]


def quantize_fp8(w: torch.Tensor, block, per: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (float8_e4m3fn codes, float32 scale_inv): amax / 448 per tile, per row or per tensor."""
    w = w.float()
    *lead, N, K = w.shape
    if per == "tensor":
        s = (w.abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(1)
    elif per == "channel":
        s = (w.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [..., N, 1]
    else:
        b0, b1 = block
        n0, n1 = -(-N // b0), -(-K // b1)
        padded = torch.zeros(*lead, n0 * b0, n1 * b1)
        padded[..., :N, :K] = w
        tiles = padded.reshape(*lead, n0, b0, n1, b1).abs().amax((-3, -1))
        s = (tiles / FP8_MAX).clamp_min(1e-12)
    q = (w / expand(s, w.shape, block if per == "block" else None)).to(torch.float8_e4m3fn)
    return q, s


def release_fp8(path, block=(16, 24), per: str = "block", exclude: list[str] | None = None,
                skip=lambda name: False) -> dict[str, torch.Tensor]:
    """Turn the float checkpoint at `path` into an FP8 release in place (every file): each quantizable tensor
    becomes float8 + `<name>_scale_inv`, config.json gets the quantization_config. Returns the by-hand reference:
    checkpoint name -> what the tensor should load as (bf16), for every tensor."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block) if per == "block" else None,
                                  "modules_to_not_convert": exclude or []}
    (path / "config.json").write_text(json.dumps(cfg))
    reference = {}
    for f in sorted(path.glob("*.safetensors")):
        state = load_file(f)
        out = {}
        for name, t in state.items():
            if quantizable(name, t) and not skip(name):
                q, s = quantize_fp8(t, block, per)
                scale_name = name + "_scale_inv"
                out[name], out[scale_name] = q, s
                reference[name] = (q.float() * expand(s, q.shape, block if per == "block" else None)).to(torch.bfloat16)
            else:
                out[name] = reference[name] = t
        save_file(out, f)
    return reference


def assert_loads_as(model, reference: dict[str, torch.Tensor]) -> None:
    state = model.checkpoint_state()
    assert set(state) <= set(reference), set(state) - set(reference)
    for name, t in state.items():
        want = reference[name]
        assert t.dtype == (torch.float32 if model.keeps_fp32(name) else torch.bfloat16), name
        assert torch.equal(t, want.to(t.dtype)), name


def close_logits(a, b, ids) -> float:
    """max |a - b| over the logits, relative to the largest |b|. (The sources are initialised with std 0.02: the
    tests' usual std 0.2 makes a tiny model so peaked that fp8's 3-bit mantissa moves its logits by ~70%.)"""
    with torch.no_grad():
        la, lb = a(ids).float(), b(ids).float()
    return float((la - lb).abs().max() / lb.abs().max())


def greedy_spec_equals_plain(model, monkeypatch, vocab: int) -> None:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (7,), generator=g).tolist()
    want = mtp.generate(model, prompt, max_new_tokens=16).tokens
    for k in (1, 3):
        assert mtp.generate(model, prompt, max_new_tokens=16, draft_tokens=k).tokens == want, k
    seen = set().union(*(scripted_drafts_patterns(model, prompt, monkeypatch, p, max_new=16, ks=(3,))
                         for p in ("none", "all", "mixed")))
    assert seen == {"none", "some", "all"}


# ---------------------------------------------------------------------- loading, every family and layout
@pytest.mark.parametrize("block", [(16, 24), (128, 128)])
def test_qwen35_fp8_blocks_load_exactly_and_decode_losslessly(tmp_path, block, monkeypatch):
    src = tiny_model(std=0.02, mtp_num_hidden_layers=1).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_fp8(tmp_path, block)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "mtp.fc.weight_scale_inv" in names and "model.layers.1.self_attn.q_proj.weight_scale_inv" in names
    model = mtp.load_model(tmp_path)
    assert model.dtype == torch.bfloat16 and model.has_mtp
    assert_loads_as(model, reference)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    assert close_logits(model, src, ids) < 0.1
    greedy_spec_equals_plain(model, monkeypatch, 64)


@pytest.mark.parametrize("backbone, mtp_layout", [("per_expert", "fused"), ("fused", "per_expert")])
def test_qwen35_moe_fp8_in_both_expert_layouts(tmp_path, backbone, mtp_layout, monkeypatch):
    src = tiny_model(std=0.02, **MOE_CFG).to(torch.bfloat16)
    write(src, tmp_path, backbone, mtp_layout)
    reference = release_fp8(tmp_path, (16, 16))
    names = set(load_file(tmp_path / "model.safetensors"))
    fused = "model.layers.0.mlp.experts.gate_up_proj" if backbone == "fused" else "mtp.layers.0.mlp.experts.gate_up_proj"
    assert fused + "_scale_inv" in names and any(n.endswith("experts.3.up_proj.weight_scale_inv") for n in names)
    model = mtp.load_model(tmp_path)
    assert_loads_as(model, reference)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    assert close_logits(model, src, ids) < 0.1
    greedy_spec_equals_plain(model, monkeypatch, 64)


@pytest.mark.parametrize("name", MAIN)
def test_nextn_families_fp8_with_the_mtp_layer_excluded(tmp_path, name, monkeypatch):
    """DeepSeek-V3 / GLM-4.5 / MiMo: the backbone in fp8, the MTP layer left in bf16 and named in
    modules_to_not_convert (how most releases ship it) - it loads as stored."""
    src = tiny(name, std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    L = src.config.num_hidden_layers
    mtp_prefix = f"model.layers.{L}" if name != "mimo" else "model.mtp_layers"
    reference = release_fp8(tmp_path, (16, 16), exclude=["lm_head", mtp_prefix],
                            skip=lambda n: n.startswith(mtp_prefix + "."))
    stored = load_file(tmp_path / "model.safetensors")
    assert any(n.startswith(mtp_prefix + ".") and t.dtype == torch.bfloat16 and t.dim() == 2 for n, t in stored.items())
    model = mtp.load_model(tmp_path)
    assert model.has_mtp
    assert_loads_as(model, reference)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    assert close_logits(model, src, ids) < 0.1
    greedy_spec_equals_plain(model, monkeypatch, 64)


def test_deepseek_v3_fp8_with_a_quantized_mtp_layer(tmp_path):
    """DeepSeek-V3 ships its MTP layer in fp8 like the rest: it loads (decoded) and drafts."""
    src = tiny("deepseek_v3", std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_fp8(tmp_path, (16, 16))
    assert "model.layers.3.eh_proj.weight_scale_inv" in load_file(tmp_path / "model.safetensors")
    model = mtp.load_model(tmp_path)
    assert_loads_as(model, reference)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.mtp_logits(ids, 1)[0].float(), src.mtp_logits(ids, 1)[0].float(), atol=0.5, rtol=0.2)


@pytest.mark.parametrize("per", ["channel", "tensor"])
def test_per_channel_and_per_tensor_scales(tmp_path, per):
    src = tiny_model().to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_fp8(tmp_path, per=per)
    model = mtp.load_model(tmp_path)
    assert_loads_as(model, reference)


def test_fp32_load_decodes_without_a_bf16_rounding(tmp_path):
    src = tiny_model().to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    release_fp8(tmp_path, (16, 16))
    model = mtp.load_model(tmp_path, dtype="float32")
    stored = load_file(tmp_path / "model.safetensors")
    q, s = stored["model.layers.0.mlp.up_proj.weight"], stored["model.layers.0.mlp.up_proj.weight_scale_inv"]
    torch.testing.assert_close(model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                               q.float() * expand(s, q.shape, (16, 16)), atol=0, rtol=0)


def test_saving_a_loaded_fp8_model_writes_a_float_checkpoint(tmp_path):
    src = tiny_model().to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "fp8")
    reference = release_fp8(tmp_path / "fp8", (16, 16))
    mtp.save_model(mtp.load_model(tmp_path / "fp8"), tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert not any(n.endswith("_scale_inv") for n in stored)
    assert_loads_as(mtp.load_model(tmp_path / "out"), reference)


# ---------------------------------------------------------------------- bad input: one line naming tensor and rule
def fp8_checkpoint(tmp_path, **kw):
    mtp.save_model(tiny_model().to(torch.bfloat16), tmp_path)
    release_fp8(tmp_path, (16, 16), **kw)
    return tmp_path


def edit_tensors(path, fn):
    f = path / "model.safetensors"
    state = load_file(f)
    fn(state)
    save_file(state, f)


W = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop(W + "_scale_inv"), f"tensor '{W}' is float8_e4m3fn but has no scale '{W}_scale_inv'"),
    (lambda s: s.update({W + "_scale_inv": torch.ones(3, 3)}),
     rf"scale '{W}_scale_inv' has shape \[3, 3\] but weight '{W}' \[64, 32\] needs \[4, 2\] \(one per 16x16 block"),
    (lambda s: s.update({W: s[W].to(torch.bfloat16)}), f"tensor '{W}' has a scale '{W}_scale_inv' but is bfloat16"),
    (lambda s: s.update({"model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1)}),
     "scale 'model.layers.0.mlp.extra.weight_scale_inv' has no tensor 'model.layers.0.mlp.extra.weight'"),
    (lambda s: s.update({W + "_scale_inv": s[W + "_scale_inv"].to(torch.int32)}), f"scale '{W}_scale_inv' is int32"),
])
def test_bad_fp8_tensors_are_named(tmp_path, edit, message):
    path = fp8_checkpoint(tmp_path)
    edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=message):
        mtp.load_model(path)


def test_quantized_tensor_in_an_excluded_module_is_refused(tmp_path):
    path = fp8_checkpoint(tmp_path, exclude=["lm_head", "model.layers.*.mlp"])
    rule = r"excluded by quantization_config.modules_to_not_convert pattern 'model.layers.\*.mlp'"
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.(\w+).weight' is quantized .* module "
                                              r"'model.layers.0.mlp.\1' is " + rule):
        mtp.load_model(path)


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path):
    path = fp8_checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor '.*' is float8_e4m3fn but .*config.json has no 'quantization_config'"):
        mtp.load_model(path)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"}, r"'quantization_config.quant_method' is 'bitsandbytes' \(not supported yet"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"'quantization_config.bits' is 3; gptq supports 2, 4, 8"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"'quantization_config.bits' is 8; awq supports 4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"'quantization_config.group_size' must be a positive integer or -1"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'quantization_config.checkpoint_format'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"'quantization_config.version' is 'gemv'"),
    ({"quant_method": "my-own"}, r"'quantization_config.quant_method' is 'my-own'; supported: 'fp8'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "'quantization_config.weight_block_size' must be two positive"),
    ({"quant_method": "fp8", "fmt": "e2m1"}, "'quantization_config.fmt' is 'e2m1'"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "'quantization_config.scale_fmt' is 'ue8m0'"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "'quantization_config.modules_to_not_convert' must be a list"),
    ("fp8", "'quantization_config' must be an object"),
])
def test_bad_quantization_configs_name_the_key(tmp_path, qc, message):
    cfg = {**tiny_model().config.to_hf_dict(), "quantization_config": qc}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cfg)
    mtp.save_model(tiny_model(), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        mtp.load_model(tmp_path)


# ---------------------------------------------------------------------- GPTQ and AWQ
def loop_pack_gptq_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's packer as published, word by word: word r holds inputs r*per .. r*per+per-1, input j at bits*j."""
    per = 32 // bits
    out = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int64)
    for r in range(out.shape[0]):
        for j in range(per):
            out[r] |= codes[r * per + j].long() << (bits * j)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def loop_pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packer as published: nibble i of word c holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    out = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for c in range(out.shape[1]):
        for i in range(8):
            out[:, c] |= codes[:, c * 8 + order[i]].long() << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def int_quantize(w: torch.Tensor, bits: int, group: int | None, sym: bool, g_idx: torch.Tensor):
    """RTN per group (groups given by g_idx over the inputs) of w [N, K] -> codes [K, N], zeros [G, N], scales [G, N]."""
    N, K = w.shape
    G = int(g_idx.max()) + 1
    top = 2**bits - 1
    codes = torch.zeros(K, N, dtype=torch.int32)
    zeros = torch.zeros(G, N, dtype=torch.int32)
    scales = torch.zeros(G, N)
    for gi in range(G):
        cols = (g_idx == gi).nonzero().flatten()
        x = w[:, cols].float()
        if sym:
            s = (x.abs().amax(1) / (2 ** (bits - 1) - 1)).clamp_min(1e-8)
            z = torch.full((N,), 2 ** (bits - 1), dtype=torch.int32)
        else:
            lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
            s = ((hi - lo) / top).clamp_min(1e-8)
            z = (-lo / s).round().clamp(0, top).to(torch.int32)
        s = s.to(torch.float16).float()  # stored in fp16
        codes[cols] = (x / s[:, None] + z[:, None]).round().clamp(0, top).to(torch.int32).t()
        zeros[gi], scales[gi] = z, s
    return codes, zeros, scales


def release_int(path, method: str, bits: int = 4, group: int | None = 16, sym: bool = False, act_order: bool = False,
                fmt: str = "gptq") -> dict[str, torch.Tensor]:
    """Turn the float checkpoint at `path` into a GPTQ or AWQ release (2-D linear weights; the MTP's fc too).
    Returns the by-hand reference as `release_fp8` does."""
    cfg = json.loads((path / "config.json").read_text())
    qc = {"quant_method": method, "bits": bits, "group_size": group or -1}
    qc.update({"sym": sym, "desc_act": act_order, "checkpoint_format": fmt} if method == "gptq" else
              {"version": "gemm", "zero_point": True})
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    reference = {}
    for f in sorted(path.glob("*.safetensors")):
        out = {}
        for name, t in load_file(f).items():
            per = 32 // (bits if method == "gptq" else 4)
            if t.dim() != 2 or KEEP.search(name) or not name.endswith(".weight") or t.shape[0] % per or t.shape[1] % per:
                # (packing needs whole words: narrow layers such as the DeltaNet's in_proj_a stay float, as releases keep them)
                out[name] = reference[name] = t
                continue
            N, K = t.shape
            w = t.float()
            g = torch.arange(K) // (group or K)
            if act_order:
                g = g[torch.randperm(K, generator=gen)]
            codes, zeros, scales = int_quantize(w, bits, group, sym, g)
            base = name[: -len(".weight")]
            reference[name] = ((codes.float() - zeros[g].float()) * scales[g]).t().to(torch.bfloat16)
            if method == "gptq":
                out[base + ".qweight"] = loop_pack_gptq_rows(codes, bits)
                stored = (zeros - (1 if fmt == "gptq" else 0)) & (2**bits - 1)
                out[base + ".qzeros"] = loop_pack_gptq_rows(stored.t().contiguous(), bits).t().contiguous()
                if act_order:
                    out[base + ".g_idx"] = g.to(torch.int32)
            else:
                out[base + ".qweight"] = loop_pack_awq(codes)
                out[base + ".qzeros"] = loop_pack_awq(zeros)
            out[base + ".scales"] = scales.to(torch.float16)
        save_file(out, f)
    return reference


def with_zero_points_at_zero(model):
    """Make the first row of every linear weight non-negative: its groups' asymmetric zero points are then 0, the case
    GPTQ v1 (stored zero - 1) wraps to 2^bits - 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith("proj.weight"):
                p[0].abs_()
    return model


@pytest.mark.parametrize("bits, group, sym, act_order, fmt", [
    (4, 16, False, False, "gptq"), (4, 16, True, True, "gptq"), (8, 32, False, True, "gptq_v2"), (4, None, False, False, "gptq"),
    (2, 16, True, False, "gptq"), (8, 16, False, False, "gptq"),
])
def test_gptq_loads_exactly_as_its_codes_dequantized(tmp_path, bits, group, sym, act_order, fmt, monkeypatch):
    src = with_zero_points_at_zero(tiny_model(std=0.02).to(torch.bfloat16))
    mtp.save_model(src, tmp_path)
    reference = release_int(tmp_path, "gptq", bits, group, sym, act_order, fmt)
    assert "mtp.fc.qweight" in load_file(tmp_path / "model.safetensors")
    model = mtp.load_model(tmp_path)
    assert_loads_as(model, reference)
    if bits >= 4:
        ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
        assert close_logits(model, src, ids) < (0.02 if bits == 8 else 0.25)
    if (bits, act_order) == (4, True):
        greedy_spec_equals_plain(model, monkeypatch, 64)
    if bits in (4, 8) and not act_order:
        # released (what the commands load): the words decoded straight into the packing, or into the scratch a
        # quantizing load quantizes from (dequant.words_bf16), give the tokens of the load that keeps its weights
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        for quantize in (None, "int8"):
            kept = mtp.load_model(tmp_path, quantize=quantize)
            released = mtp.load_model(tmp_path, quantize=quantize, release=True)
            want = mtp.generate(kept, prompt, max_new_tokens=12, eos_token_ids=[]).tokens
            for k in (None, 2):
                assert mtp.generate(released, prompt, max_new_tokens=12, draft_tokens=k, eos_token_ids=[]).tokens == want


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
def test_gptq_and_awq_in_moe_families_per_expert(tmp_path, family, monkeypatch):
    if family == "deepseek_v3":
        src = tiny("deepseek_v3", std=0.02).to(torch.bfloat16)
        mtp.save_model(src, tmp_path / "g")
    else:
        src = tiny_model(std=0.02, **MOE_CFG).to(torch.bfloat16)
        write(src, tmp_path / "g", "per_expert", "per_expert")
    ref = release_int(tmp_path / "g", "gptq", 4, 16, False, True)
    assert any(n.endswith("experts.3.down_proj.qweight") for n in load_file(tmp_path / "g" / "model.safetensors"))
    model = mtp.load_model(tmp_path / "g")
    assert_loads_as(model, ref)
    greedy_spec_equals_plain(model, monkeypatch, 64)
    mtp.save_model(src, tmp_path / "a")
    ref = release_int(tmp_path / "a", "awq", 4, 16)
    assert_loads_as(mtp.load_model(tmp_path / "a"), ref)
    # released and quantizing (what `--quantize int8` loads): each expert's words decoded into the load's scratch
    # (dequant.words_bf16) give the kept load's tokens
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = mtp.generate(mtp.load_model(tmp_path / "a", quantize="int8"), prompt, max_new_tokens=12, eos_token_ids=[]).tokens
    released = mtp.load_model(tmp_path / "a", quantize="int8", release=True)
    for k in (None, 2):
        assert mtp.generate(released, prompt, max_new_tokens=12, draft_tokens=k, eos_token_ids=[]).tokens == want, k


def test_awq_qwen35_loads_exactly(tmp_path):
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_int(tmp_path, "awq", 4, 16)
    model = mtp.load_model(tmp_path)
    assert_loads_as(model, reference)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    assert close_logits(model, src, ids) < 0.25


def test_packers_match_the_published_loops():
    from mtp.model.packed import awq_pack, pack_rows, unpack_cols, unpack_rows

    g = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        codes = torch.randint(0, 2**bits, (64, 24), generator=g, dtype=torch.int32)
        assert torch.equal(pack_rows(codes, bits), loop_pack_gptq_rows(codes, bits))
        assert torch.equal(unpack_rows(loop_pack_gptq_rows(codes, bits), bits), codes)
    codes = torch.randint(0, 16, (8, 32), generator=g, dtype=torch.int32)
    assert torch.equal(awq_pack(codes), loop_pack_awq(codes))
    assert unpack_cols(loop_pack_awq(codes), 4).shape == (8, 32)


G = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop(G + ".scales"), f"tensor '{G}.qweight' has no '{G}.scales'"),
    (lambda s: s.update({G + ".scales": s[G + ".scales"][:1]}), rf"tensor '{G}.scales' has shape \[1, 64\] but '{G}.qweight'"),
    (lambda s: s.update({G + ".g_idx": torch.full((32,), 9, dtype=torch.int32)}), f"tensor '{G}.g_idx' holds group 9, outside 0..1"),
    (lambda s: s.update({G + ".weight": torch.zeros(64, 32)}), f"module '{G}' holds both a float '{G}.weight' and a quantized"),
    (lambda s: s.update({"model.layers.0.mlp.extra.scales": torch.ones(1, 4)}),
     "tensor 'model.layers.0.mlp.extra.scales' has no 'model.layers.0.mlp.extra.qweight'"),
    (lambda s: s.update({G + ".qweight": s[G + ".qweight"].float()}), f"tensor '{G}.qweight' is float32"),
])
def test_bad_gptq_tensors_are_named(tmp_path, edit, message):
    mtp.save_model(tiny_model().to(torch.bfloat16), tmp_path)
    release_int(tmp_path, "gptq", 4, 16)
    edit_tensors(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        mtp.load_model(tmp_path)
