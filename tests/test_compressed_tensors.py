"""compressed-tensors checkpoints (config/compressed_tensors.py, model/compressed_tensors.py): pack-quantized int4 /
int8 (group, channel, tensor; symmetric and asymmetric; act-order g_idx), int-quantized / naive-quantized int8 and
float-quantized fp8 (channel, tensor, block), built in code from tiny float models with a by-hand packer written from
the format's description. The reference is the stored codes dequantized by hand (exact equality), and, where the
`compressed-tensors` package is installed, its own compressor and decompressor; plus greedy speculative == plain on
the loaded models (Qwen3.5, Qwen3.5-MoE per expert, DeepSeek-V3; MTP ignored = bf16, or quantized) and every
bad-input rule."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp
from conftest import tiny_model
from mtp.config import ConfigError
from mtp.io import CheckpointError
from mtp.model import compressed_tensors, config_from_dict, dequant, qmatmul
from mtp.model.linear import FastLinear
from test_families import tiny
from test_moe import MOE_CFG, write
from test_quantized import KEEP, assert_loads_as, close_logits, edit_tensors, greedy_spec_equals_plain

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def weights(bits: int = 4, kind: str = "int", symmetric: bool = True, strategy: str = "group", group: int | None = 8,
            block=None, actorder=None) -> dict:
    """A scheme's `weights` object as llm-compressor writes it."""
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy,
            "group_size": group if strategy == "group" else None, "block_structure": block, "dynamic": False,
            "actorder": actorder, "observer": "minmax", "observer_kwargs": {}}


def loop_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """By hand, word by word: unsigned codes [R, C] -> int32 [R, ceil(C * bits / 32)], code c of a row in word
    c // (32 / bits) at bit (c % (32 / bits)) * bits; the last word zero-padded."""
    per = 32 // bits
    R, C = codes.shape
    out = torch.zeros(R, -(-C // per), dtype=torch.int64)
    for c in range(C):
        out[:, c // per] |= codes[:, c].long() << (bits * (c % per))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def scale_index(N: int, K: int, w: dict, g_idx: torch.Tensor | None):
    """(rows, cols) index tensors [N, K] giving each weight element's scale in the strategy's scale tensor."""
    n = torch.arange(N)[:, None].expand(N, K)
    k = torch.arange(K)[None, :].expand(N, K)
    if w["strategy"] == "tensor":
        return torch.zeros_like(n), torch.zeros_like(k)
    if w["strategy"] == "channel":
        return n, torch.zeros_like(k)
    if w["strategy"] == "group":
        return n, (g_idx[None, :].expand(N, K) if g_idx is not None else k // w["group_size"])
    b0, b1 = w["block_structure"]
    return n // b0, k // b1


def rtn(t: torch.Tensor, w: dict, scale_dtype, g_idx=None):
    """Round to nearest under scheme `w`: t [N, K] -> (codes q (signed int8, or float8), scale, zero point or None,
    the by-hand dequantized reference in fp32)."""
    N, K = t.shape
    x = t.float()
    rows, cols = scale_index(N, K, w, g_idx)
    shape = (int(rows.max()) + 1, int(cols.max()) + 1)
    flat = rows * shape[1] + cols  # each element's scale slot
    lo = torch.zeros(shape).view(-1).scatter_reduce(0, flat.reshape(-1), x.reshape(-1), "amin").view(shape)
    hi = torch.zeros(shape).view(-1).scatter_reduce(0, flat.reshape(-1), x.reshape(-1), "amax").view(shape)
    if w["type"] == "float":
        s = (torch.maximum(-lo, hi) / FP8_MAX).clamp_min(1e-8).to(scale_dtype).float()
        q = (x / s[rows, cols]).to(torch.float8_e4m3fn)
        return q, s.to(scale_dtype).reshape(-1 if w["strategy"] == "tensor" else shape), None, q.float() * s[rows, cols]
    qmin, qmax = -(2 ** (w["num_bits"] - 1)), 2 ** (w["num_bits"] - 1) - 1
    if w["symmetric"]:
        s, z = (torch.maximum(-lo, hi) / qmax).clamp_min(1e-8), None
    else:
        s = ((hi - lo) / (qmax - qmin)).clamp_min(1e-8)
    s = s.to(scale_dtype).float()
    if not w["symmetric"]:
        z = (qmin - lo / s).round().clamp(qmin, qmax)
    zz = 0 if z is None else z[rows, cols]
    q = (x / s[rows, cols] + zz).round().clamp(qmin, qmax)
    stored = (lambda t: t.reshape(1)) if w["strategy"] == "tensor" else (lambda t: t)  # a per-tensor scale is [1]
    return (q.to(torch.int8), stored(s.to(scale_dtype)), None if z is None else stored(z.to(torch.int8)),
            (q - zz) * s[rows, cols])


def release_ct(path, w: dict, fmt: str = "pack-quantized", ignore=("lm_head",), scale_dtype=torch.bfloat16,
               quantize=lambda name: True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Turn the float checkpoint at `path` into a compressed-tensors release in place: every 2-D linear weight whose
    inputs the scheme's groups divide (and that `quantize` accepts) is stored as `fmt` stores it; config.json gets the
    quantization_config (one group targeting "Linear"; `ignore` as given). Returns the by-hand reference (checkpoint
    name -> what it loads as, bf16)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "version": "0.20.1",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None,
                                      "output_activations": None, "format": fmt}},
        "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "global_compression_ratio": None}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    bits = w["num_bits"]
    reference = {}
    for f in sorted(path.glob("*.safetensors")):
        out = {}
        for name, t in load_file(f).items():
            base = name.removesuffix(".weight")
            K = t.shape[-1]
            if (t.dim() != 2 or KEEP.search(name) or not name.endswith(".weight") or not quantize(name)
                    or (w["group_size"] and K % w["group_size"])):
                out[name] = reference[name] = t
                continue
            g_idx = None
            if w["actorder"] == "group":
                g_idx = (torch.arange(K) // w["group_size"])[torch.randperm(K, generator=gen)]
            q, s, z, ref = rtn(t, w, scale_dtype, g_idx)
            reference[name] = ref.to(torch.bfloat16)
            out[base + ".weight_scale"] = s
            if fmt == "pack-quantized":
                out[base + ".weight_packed"] = loop_pack(q.to(torch.int32) + 2 ** (bits - 1), bits)
                out[base + ".weight_shape"] = torch.tensor(list(t.shape))
                if z is not None:
                    out[base + ".weight_zero_point"] = (
                        loop_pack(z.to(torch.int32).t() + 2 ** (bits - 1), bits).t().contiguous()
                        if w["strategy"] in ("group", "channel") else z)
            else:
                out[base + ".weight"] = q
                if z is not None:
                    out[base + ".weight_zero_point"] = z
            if g_idx is not None:
                out[base + ".weight_g_idx"] = g_idx.to(torch.int32)
        save_file(out, f)
    return reference


IDS = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
MTP_IGNORED = ("lm_head", r"re:mtp\..*")


# ---------------------------------------------------------------------- pack-quantized
@pytest.mark.parametrize("w, scale_dtype", [
    (weights(4, symmetric=False), torch.bfloat16),  # W4A16 asymmetric, groups (the GPTQ / AWQ-like release)
    (weights(4), torch.float32),  # W4A16 symmetric
    (weights(8, strategy="channel"), torch.bfloat16),  # W8A16
    (weights(4, symmetric=False, strategy="channel"), torch.float16),
    (weights(4, symmetric=False, strategy="tensor"), torch.float32),
    (weights(4, actorder="group"), torch.bfloat16),  # GPTQ act order: weight_g_idx
])
def test_pack_quantized_loads_exactly_with_the_mtp_in_bf16(tmp_path, w, scale_dtype, monkeypatch):
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_ct(tmp_path, w, ignore=MTP_IGNORED, scale_dtype=scale_dtype, quantize=lambda n: not n.startswith("mtp."))
    stored = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.up_proj.weight_packed" in stored and "mtp.fc.weight" in stored
    assert ("model.layers.0.linear_attn.in_proj_a.weight_zero_point" in stored) == (not w["symmetric"])  # 4 outputs: a padded word
    model = mtp.load_model(tmp_path)
    assert model.has_mtp
    assert_loads_as(model, reference)
    assert model.state_dict()["model.layers.0.mlp.up_proj.weight"].is_contiguous()
    assert close_logits(model, src, IDS) < (0.02 if w["num_bits"] == 8 else 0.3)
    greedy_spec_equals_plain(model, monkeypatch, 64)
    # released (what the inference commands load): group and channel scales without act order decode the stored words
    # straight into the packed copies (dequant.words_bf16; the torch decoder only for widths it does not take, such
    # as the DeltaNet's 4-output in_proj_a): the same packed weights
    decoded = []
    whole = compressed_tensors.dequantize
    monkeypatch.setattr(compressed_tensors, "dequantize", lambda q, *a, **k: decoded.append(q.shape) or whole(q, *a, **k))
    released = mtp.load_model(tmp_path, release=True)
    packed = [n for n, m in released.named_modules() if isinstance(m, FastLinear) and m.kernel == "bf16-native"]
    for n in packed:
        assert torch.equal(released.get_submodule(n)._packed.view(torch.int16),
                           model.get_submodule(n)._packed.view(torch.int16)), n
    in_place = w["strategy"] in ("group", "channel") and not w.get("actorder") and dequant.LIBRARY.available()
    assert (len(decoded) < len(packed) // 2) == (in_place and qmatmul.available()), (len(decoded), len(packed))


@pytest.mark.parametrize("fmt, w", [
    ("int-quantized", weights(8, strategy="channel")),  # W8A8 int (activations stay bf16 here)
    ("naive-quantized", weights(8, symmetric=False, strategy="group")),
    ("float-quantized", weights(8, "float", strategy="channel")),  # FP8_DYNAMIC
    ("float-quantized", weights(8, "float", strategy="tensor")),  # FP8 static
    ("float-quantized", weights(8, "float", strategy="block", block=[16, 16])),  # FP8_BLOCK
])
def test_int8_and_fp8_formats_load_exactly(tmp_path, fmt, w, monkeypatch):
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_ct(tmp_path, w, fmt)  # the MTP layer quantized like the rest
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["mtp.fc.weight"].dtype == (torch.float8_e4m3fn if w["type"] == "float" else torch.int8)
    if w["type"] == "float":  # static activation scales are dropped: activations stay bf16
        edit_tensors(tmp_path, lambda s: s.update({"model.layers.0.mlp.up_proj.input_scale": torch.ones(1)}))
    model = mtp.load_model(tmp_path)
    assert_loads_as(model, reference)
    assert close_logits(model, src, IDS) < 0.1
    greedy_spec_equals_plain(model, monkeypatch, 64)
    # released (what the inference commands load; one scale per tensor, row or tile: decoded straight into the
    # packed copies, with no [out, in] weight between): the same packed weights
    decoded = []
    whole = compressed_tensors.dequantize
    monkeypatch.setattr(compressed_tensors, "dequantize", lambda q, *a, **k: decoded.append(q.shape) or whole(q, *a, **k))
    released = mtp.load_model(tmp_path, release=True)
    assert (decoded == []) == (fmt != "naive-quantized" and qmatmul.available() and dequant.LIBRARY.available())
    for n, m in released.named_modules():
        if isinstance(m, FastLinear) and m.kernel == "bf16-native":
            assert torch.equal(m._packed.view(torch.int16), model.get_submodule(n)._packed.view(torch.int16)), n


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
def test_moe_families_per_expert(tmp_path, family, monkeypatch):
    if family == "deepseek_v3":
        src = tiny("deepseek_v3", std=0.02).to(torch.bfloat16)
        mtp.save_model(src, tmp_path / "a")
        ignore = ("lm_head", r"re:model\.layers\.3\..*")  # the MTP layer (layer num_hidden_layers) in bf16
        keep = lambda n: not n.startswith("model.layers.3.")
    else:
        src = tiny_model(std=0.02, **MOE_CFG).to(torch.bfloat16)
        write(src, tmp_path / "a", "per_expert", "per_expert")
        ignore, keep = MTP_IGNORED, lambda n: not n.startswith("mtp.")
    ref = release_ct(tmp_path / "a", weights(4, symmetric=False), ignore=ignore, quantize=keep)
    assert any(n.endswith("experts.3.down_proj.weight_packed") for n in load_file(tmp_path / "a" / "model.safetensors"))
    model = mtp.load_model(tmp_path / "a")
    assert_loads_as(model, ref)
    greedy_spec_equals_plain(model, monkeypatch, 64)
    if family == "deepseek_v3":  # DeepSeek-style: everything fp8 blocks, the MTP layer too
        mtp.save_model(src, tmp_path / "b")
        ref = release_ct(tmp_path / "b", weights(8, "float", strategy="block", block=[16, 16]), "float-quantized")
        assert "model.layers.3.eh_proj.weight_scale" in load_file(tmp_path / "b" / "model.safetensors")
        assert_loads_as(mtp.load_model(tmp_path / "b"), ref)


def test_pack_quantized_run_by_the_int4_kernel_speculative_equals_plain(tmp_path, monkeypatch):
    """A pack-quantized checkpoint loaded and re-run by the int4 kernel (`quantize="int4"`), MTP quantized too."""
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    release_ct(tmp_path, weights(4, symmetric=False))
    model = mtp.load_model(tmp_path, quantize="int4")
    greedy_spec_equals_plain(model, monkeypatch, 64)
    # inference-only (what the commands load): the decoded float weights let go, the same tokens
    released = mtp.load_model(tmp_path, quantize="int4", release=True)
    assert released.model.layers[0].mlp.down_proj.weight.is_meta
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert (mtp.generate(released, prompt, max_new_tokens=16, draft_tokens=2).tokens
            == mtp.generate(model, prompt, max_new_tokens=16, draft_tokens=0).tokens)


@pytest.mark.parametrize("fmt, w", [
    ("int-quantized", weights(8, strategy="channel")),  # W8A8 (activations stay bf16 here)
    ("pack-quantized", weights(8, strategy="channel")),  # W8A16
    ("int-quantized", weights(8, strategy="tensor")),
])
def test_an_int8_release_runs_its_own_codes(tmp_path, fmt, w, monkeypatch):
    """A symmetric int8 release with one scale per row (or tensor) with `quantize="int8"` (the commands' default for
    it): every quantized linear layer but the output heads runs the stored codes and scales on the int8 kernel, as
    stored (its dequantized weight is the decoded one exactly), never decoded or quantized again; released, those
    weights are never loaded; logits close to the reference, greedy speculative == plain, and the same tokens as the
    unreleased load. An int4 load of it runs the codes where the int4 kernel cannot take the shape."""
    from mtp.cli_common import resolve_quantize
    from mtp.config.quantization import parse_quantization
    from mtp.model import linear

    if not qmatmul.available():
        pytest.skip(f"the qmatmul kernels do not run here: {qmatmul.reason()}")
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_ct(tmp_path, w, fmt)  # the MTP layer quantized like the rest
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert parse_quantization(qc).int8 and not parse_quantization(qc).int4
    args = argparse.Namespace(model=str(tmp_path), revision=None, quantize=None)
    resolve_quantize(args)
    assert args.quantize == "int8"
    quantized = []
    whole = linear.FastLinear._set_int8_from
    monkeypatch.setattr(linear.FastLinear, "_set_int8_from", lambda self, *a: quantized.append(self) or whole(self, *a))
    model = mtp.load_model(tmp_path, quantize="int8")
    heads = {id(h) for h in model._output_heads()}
    coded = {n: m for n, m in model.named_modules() if isinstance(m, FastLinear) and m.checkpoint_codes}
    stored = {k.removesuffix(".weight_scale") for k in load_file(tmp_path / "model.safetensors") if k.endswith("_scale")}
    keep = model.precise_layers()  # (kept bf16: the MTP's input projection)
    assert set(coded) == {n for n in stored if id(model.get_submodule(n)) not in heads and not n.endswith(keep)}
    assert quantized and all(id(m) in heads for m in quantized)  # quantized from a float weight: the heads only
    for n, m in coded.items():
        assert m.kernel == "int8" and torch.equal(m.int8_decoded(torch.bfloat16), reference[n + ".weight"]), n
    assert close_logits(model, src, IDS) < 0.1
    greedy_spec_equals_plain(model, monkeypatch, 64)
    released = mtp.load_model(tmp_path, quantize="int8", release=True)
    assert all(released.get_submodule(n).weight.is_meta and released.get_submodule(n).checkpoint_codes for n in coded)
    fusions = [m.__dict__["_fused"] for m in released.modules() if m.__dict__.get("_fused") is not None]
    assert fusions and all(f.fused.kernel == "int8" for f in fusions)  # each runs the one buffer its parts' codes
    assert all(f.fused._packed.data_ptr() == f.parts[0]._packed.data_ptr() for f in fusions)  # were moved into
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = mtp.generate(model, prompt, max_new_tokens=16, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=16, draft_tokens=2).tokens == plain
    # int4 of it: the int8 codes where the int4 kernel cannot run the shape (DeltaNet's in_proj_a / b)
    as4 = mtp.load_model(tmp_path, quantize="int4", release=True)
    int8 = {n for n, m in as4.named_modules() if isinstance(m, FastLinear) and m.kernel == "int8" and id(m) not in
            {id(h) for h in as4._output_heads()}}
    assert int8 & set(coded) and all(as4.get_submodule(n).checkpoint_codes for n in int8 & set(coded))


# ---------------------------------------------------------------------- the compressed-tensors package as reference
@pytest.mark.parametrize("w, fmt", [
    (weights(4, symmetric=False), "pack-quantized"), (weights(4), "pack-quantized"),
    (weights(8, strategy="channel"), "pack-quantized"), (weights(4, symmetric=False, strategy="channel"), "pack-quantized"),
    (weights(8, "float", strategy="block", block=[16, 16]), "float-quantized"),
    (weights(8, symmetric=False, strategy="group"), "naive-quantized"),
])
def test_the_compressed_tensors_package_packs_and_decodes_alike(w, fmt):
    """Its packer packs our codes into exactly the words our by-hand packer writes, its compressor writes tensors of
    the names, dtypes and shapes we read, and its decompressor gives exactly the weight our loader decodes (bf16)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationScheme

    from mtp.config.compressed_tensors import parse_compressed_tensors
    from mtp.model.compressed_tensors import dequantize, unpack

    scheme = parse_compressed_tensors({"format": fmt, "config_groups": {"g": {"targets": ["Linear"], "weights": w}}}).schemes[0]
    theirs = QuantizationScheme(targets=["Linear"], weights=w, format=fmt)
    comp = BaseCompressor.get_value_from_registry(fmt)
    t = torch.randn(36, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # 36 rows: a padded zero-point word
    q, s, z, _ = rtn(t, w, torch.bfloat16)
    bits = w["num_bits"]
    ours = {"weight_scale": s}
    if fmt == "pack-quantized":
        ours |= {"weight_packed": loop_pack(q.to(torch.int32) + 2 ** (bits - 1), bits), "weight_shape": torch.tensor([36, 48])}
        assert torch.equal(pack_to_int32(q, bits), ours["weight_packed"])
        if z is not None:
            ours["weight_zero_point"] = loop_pack(z.to(torch.int32).t() + 2 ** (bits - 1), bits).t().contiguous()
            assert torch.equal(pack_to_int32(z, bits, packed_dim=0), ours["weight_zero_point"])
        codes = unpack(ours["weight_packed"], bits, 48)
        zero = None if z is None else unpack(ours["weight_zero_point"].t().contiguous(), bits, 36).t()
    else:
        ours["weight"] = q
        if z is not None:
            ours["weight_zero_point"] = z
        codes, zero = q, z
    compressed = comp.compress({"weight": t, "weight_scale": s} | ({} if z is None else {"weight_zero_point": z}), theirs)
    assert {k: (v.dtype, v.shape) for k, v in compressed.items()} == {k: (v.dtype, v.shape) for k, v in ours.items()}
    want = comp.decompress(ours, theirs)["weight"].to(torch.bfloat16)
    assert torch.equal(dequantize(codes, s, zero, scheme, torch.bfloat16), want)
    assert ct.__version__


# ---------------------------------------------------------------------- bad input: one line naming tensor and rule
def ct_checkpoint(path, w=None, fmt="pack-quantized", **kw):
    mtp.save_model(tiny_model().to(torch.bfloat16), path)
    release_ct(path, w or weights(4, symmetric=False), fmt, **kw)
    return path


U = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop(U + ".weight_scale"), f"module '{U}' has no tensor '{U}.weight_scale'"),
    (lambda s: s.pop(U + ".weight_zero_point"), f"module '{U}' has no tensor '{U}.weight_zero_point'"),
    (lambda s: s.pop(U + ".weight_shape"), f"module '{U}' has no tensor '{U}.weight_shape'"),
    (lambda s: s.update({U + ".weight_scale": torch.ones(64, 3)}),
     rf"tensor '{U}.weight_scale' has shape \[64, 3\] but weight \[64, 32\] under config group 'group_0' .* needs \[64, 4\]"),
    (lambda s: s.update({U + ".weight_shape": torch.tensor([64, 40])}),
     rf"tensor '{U}.weight_packed' has shape \[64, 4\] but weight_shape \[64, 40\] at 4 bits packs to \[64, 5\]"),
    (lambda s: s.update({U + ".weight_zero_point": torch.zeros(64, 4, dtype=torch.int32)}),
     rf"tensor '{U}.weight_zero_point' is int32 \[64, 4\] but .* needs int32 \[8, 4\] \(packed along the outputs\)"),
    (lambda s: s.update({U + ".weight": torch.zeros(64, 32)}), f"module '{U}' holds both '{U}.weight' and '{U}.weight_packed'"),
    (lambda s: s.update({U + ".weight_scale": s[U + ".weight_scale"].to(torch.int32)}), f"tensor '{U}.weight_scale' is int32"),
    (lambda s: s.update({U + ".weight_g_idx": torch.zeros(32, dtype=torch.int32)}),
     f"tensor '{U}.weight_g_idx' gives group 0 32 inputs; every group has group_size 8"),
])
def test_bad_pack_quantized_tensors_are_named(tmp_path, edit, message):
    path = ct_checkpoint(tmp_path)
    edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=message):
        mtp.load_model(path)


def test_bad_int8_and_fp8_tensors_are_named(tmp_path):
    path = ct_checkpoint(tmp_path / "a", weights(8, "float", strategy="channel"), "float-quantized")
    edit_tensors(path, lambda s: s.update({U + ".weight": s[U + ".weight"].to(torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=rf"tensor '{U}.weight' is bfloat16 \[64, 32\]; .* stores float8_e4m3fn"):
        mtp.load_model(path)
    path = ct_checkpoint(tmp_path / "b", weights(8, strategy="channel"), "int-quantized")
    edit_tensors(path, lambda s: s.update({U + ".weight_zero_point": torch.zeros(64, 1, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=f"tensor '{U}.weight_zero_point' is a zero point but .* is symmetric"):
        mtp.load_model(path)


def test_a_quantized_tensor_in_an_ignored_module_is_refused(tmp_path):
    path = ct_checkpoint(tmp_path, ignore=["lm_head", r"re:.*\.mlp\.up_proj$"])
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.\d.mlp.up_proj.weight_\w+' is quantized but module "
                                              r"'model.layers.\d.mlp.up_proj' is in quantization_config.ignore "
                                              + re.escape(r"('re:.*\.mlp\.up_proj$')")):
        mtp.load_model(path)


def test_a_quantized_tensor_no_group_targets_is_refused(tmp_path):
    path = ct_checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = [r"re:.*self_attn.*"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"no quantization_config.config_groups target matches module 'model.layers"):
        mtp.load_model(path)


def test_the_most_specific_target_picks_the_scheme(tmp_path):
    """An exact name beats a regex, which beats "Linear" (compressed-tensors' order): one module in 8-bit channels,
    the rest in 4-bit groups."""
    from mtp.config.compressed_tensors import parse_compressed_tensors

    ct = parse_compressed_tensors({"format": "pack-quantized", "config_groups": {
        "a": {"targets": ["Linear"], "weights": weights(4)},
        "b": {"targets": [r"re:.*mlp.*"], "weights": weights(8, strategy="channel")},
        "c": {"targets": [U], "weights": weights(4, symmetric=False, strategy="channel")}}, "ignore": ["re:.*gate$"]})
    assert [ct.scheme_for(m).name for m in (U, "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj")] == ["c", "b", "a"]
    assert ct.ignored_by("model.layers.0.mlp.gate") == "re:.*gate$" and ct.ignored_by(U) is None


GROUP = {"targets": ["Linear"], "weights": weights(4)}


@pytest.mark.parametrize("qc, message", [
    ({"format": "nvfp4-pack-quantized", "config_groups": {"g": GROUP}}, r"'quantization_config.format' is 'nvfp4-pack-quantized'"),
    ({"format": "pack-quantized", "config_groups": {"g": {**GROUP, "weights": weights(3)}}},
     r"'quantization_config.config_groups.g.weights.num_bits' is 3; int weights support 4, 8"),
    ({"format": "pack-quantized", "config_groups": {"g": {**GROUP, "weights": weights(8, "float")}}},
     r"'quantization_config.config_groups.g.weights.type' is 'float' but the format is 'pack-quantized'"),
    ({"format": "pack-quantized", "config_groups": {"g": {**GROUP, "weights": weights(4, strategy="token")}}},
     r"'quantization_config.config_groups.g.weights.strategy' is 'token'"),
    ({"format": "pack-quantized", "config_groups": {"W4A16": ["Linear"]}},
     r"'quantization_config.config_groups.W4A16' must be a scheme"),
    ({"format": "pack-quantized", "config_groups": {"g": GROUP}, "transform_config": {"config_groups": {"r": {}}}},
     r"'quantization_config.transform_config' is set"),
    ({"format": "pack-quantized", "config_groups": {"g": GROUP}, "ignore": "lm_head"}, r"'quantization_config.ignore' must be a list"),
])
def test_bad_compressed_tensors_configs_name_the_key(qc, message):
    cfg = {**tiny_model().config.to_hf_dict(), "quantization_config": {"quant_method": "compressed-tensors", **qc}}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cfg)
