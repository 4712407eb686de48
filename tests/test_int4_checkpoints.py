"""int4 checkpoints (GPTQ 4-bit, AWQ, compressed-tensors pack-quantized int4) loaded with `quantize="int4"` run their
stored codes: each layer whose group size the kernels take is prepared from the checkpoint's codes, scales and zero
points (not decoded to bf16 and quantized again), exact to the checkpoint; the rest (group sizes the kernels do not
take, the layers kept in bf16) keep the decode path. Built in code from tiny float models with the release helpers of
test_quantized.py and test_compressed_tensors.py; the expected codes are unpacked here, by the formats' formulas."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import mtp
from conftest import tiny_model
from mtp.model import qmatmul
from mtp.model.linear import FastLinear, Int4Weight, _int4_pack, _native_int4
from mtp.model.packed import AWQ_ORDER
from test_compressed_tensors import release_ct, weights
from test_quantized import greedy_spec_equals_plain, release_int

WIDE = dict(hidden_size=64, intermediate_size=128)  # rows of several 32-wide groups
IDS = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))


def nibbles(words: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Code i along `dim` of int32 words packed 8 per word along `dim`, nibble index[i] of word i // 8."""
    expanded = words.repeat_interleave(8, dim)
    shift = (4 * index).reshape([-1 if d == dim else 1 for d in range(words.dim())])
    return (expanded >> shift) & 15


def stored_int4(stored: dict[str, torch.Tensor], base: str, method: str, group: int, zero_offset: int = 0,
                symmetric: bool = False) -> Int4Weight:
    """The checkpoint's own codes of module `base` as an Int4Weight ([N, K] codes, act order permuted into groups)."""
    perm = None
    if method in ("gptq", "awq"):
        qw, qz, scales = stored[base + ".qweight"], stored[base + ".qzeros"], stored[base + ".scales"].float()
        if method == "gptq":
            codes = nibbles(qw, torch.arange(qw.shape[0] * 8) % 8, 0)  # [K, N]
            zero = (nibbles(qz, torch.arange(qz.shape[1] * 8) % 8, 1) + zero_offset) & 15  # [G, N]
            if base + ".g_idx" in stored:
                perm = torch.argsort(stored[base + ".g_idx"].long(), stable=True)
        else:
            order = torch.tensor([AWQ_ORDER.index(o) for o in range(8)])
            codes = nibbles(qw, order.repeat(qw.shape[1]), 1)
            zero = nibbles(qz, order.repeat(qz.shape[1]), 1)
        codes, zero, scale = codes.t(), zero.t(), scales.t()
    else:
        wp, N = stored[base + ".weight_packed"], int(stored[base + ".weight_shape"][0])
        codes = nibbles(wp, torch.arange(wp.shape[1] * 8) % 8, 1)
        scale = stored[base + ".weight_scale"].float().reshape(N, -1)
        if symmetric:
            zero = torch.full(scale.shape, 8)
        else:
            zp = stored[base + ".weight_zero_point"]
            zero = nibbles(zp, torch.arange(zp.shape[0] * 8) % 8, 0)[:N]
        if base + ".weight_g_idx" in stored:
            perm = torch.argsort(stored[base + ".weight_g_idx"].long(), stable=True)
    if perm is not None and torch.equal(perm, torch.arange(perm.numel())):
        perm = None  # inputs already in their groups' order: the layer runs them as they come
    if perm is not None:
        codes = codes[:, perm]
    return Int4Weight(codes.to(torch.uint8).contiguous(), scale.contiguous(), zero.to(torch.uint8).contiguous(), group, perm)


def assert_runs_the_stored_codes(model, stored: dict, method: str, group: int, **kw) -> list[str]:
    """Every layer prepared from the checkpoint holds exactly the kernel operands of the stored codes. Returns them."""
    coded = [n for n, m in model.named_modules() if isinstance(m, FastLinear) and m.checkpoint_codes]
    for name in coded:
        layer = model.get_submodule(name)
        wq = stored_int4(stored, name, method, min(group, layer.in_features), **kw)  # a wider group: one per row
        want = _native_int4(wq) if layer._native else _int4_pack(wq)[:2]
        have = (layer._packed, layer._sz, layer._low) if layer._native else (layer._packed, layer._sz)
        assert all(torch.equal(a, b) for a, b in zip(have, want)), name
        assert (layer._perm is None) == (wq.perm is None) and (wq.perm is None or torch.equal(layer._perm, wq.perm)), name
    return coded


RELEASES = {
    "gptq asym g32": (lambda p: release_int(p, "gptq", 4, 32, False, False, "gptq"), "gptq", 32, dict(zero_offset=1)),
    "gptq sym act order g32": (lambda p: release_int(p, "gptq", 4, 32, True, True, "gptq"), "gptq", 32,
                               dict(zero_offset=1)),
    "gptq_v2 g64": (lambda p: release_int(p, "gptq", 4, 64, False, False, "gptq_v2"), "gptq", 64, {}),
    "awq g32": (lambda p: release_int(p, "awq", 4, 32), "awq", 32, {}),
    "ct asym g32": (lambda p: release_ct(p, weights(4, symmetric=False, group=32)), "ct", 32, {}),
    "ct sym act order g32": (lambda p: release_ct(p, weights(4, group=32, actorder="group")), "ct", 32,
                             dict(symmetric=True)),
}


@pytest.mark.parametrize("release", list(RELEASES))
def test_int4_releases_run_their_own_codes(tmp_path, release, monkeypatch):
    make, method, group, kw = RELEASES[release]
    src = tiny_model(std=0.02, **WIDE).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    make(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    model = mtp.load_model(tmp_path, quantize="int4", release=True)
    coded = assert_runs_the_stored_codes(model, stored, method, group, **kw)
    # every int4 layer of the backbone the checkpoint quantized (the 4-output in_proj_a / b run int8; the MTP's fc
    # and the head keep bf16)
    quantized = {n for n in (k.rsplit(".", 1)[0] for k in stored if k.endswith((".qweight", ".weight_packed")))}
    int4 = {n for n, m in model.named_modules() if isinstance(m, FastLinear) and m.kernel == "int4"}
    assert set(coded) == quantized & int4 and len(coded) >= 20, sorted(quantized & int4 - set(coded))
    assert all(model.get_submodule(n).weight.is_meta for n in coded)  # never decoded
    # logits near the checkpoint's decode run in bf16 (the int4 kernel quantizes its activations to int8)
    decoded = mtp.load_model(tmp_path)
    with torch.no_grad():
        a, b = model(IDS).float(), decoded(IDS).float()
    assert float((a - b).abs().max() / b.abs().max()) < 0.1
    greedy_spec_equals_plain(model, monkeypatch, 64)


def test_the_codes_dequantize_to_the_checkpoints_decode(tmp_path):
    """`DecodedTensor.int4()` is exact: its dequantized weight is the format decoder's, bit for bit in fp32."""
    from mtp.io.files import TensorIndex
    from mtp.model.families import config_from_json
    from mtp.model.quantized import decoded_index

    src = tiny_model(std=0.02, **WIDE).to(torch.bfloat16)
    for name, (make, *_) in RELEASES.items():
        path = tmp_path / name.replace(" ", "_")
        mtp.save_model(src, path)
        make(path)
        with TensorIndex(path) as raw:
            files = decoded_index(raw, config_from_json(path / "config.json"), path)
            n = 0
            for key in files.decoded:
                entry = files[key][0]
                if entry.int4_codes is None:
                    continue
                stored = {role: raw.tensor(k) for role, k in entry.parts.items()}
                assert torch.equal(entry.int4().dequantize(torch.float32), entry.decode(stored, torch.float32)), (name, key)
                n += 1
            assert n >= 20, name


@pytest.mark.parametrize("native", [True, False])
def test_fusions_and_both_kernels(tmp_path, native, monkeypatch):
    """Without act order the q|k|v, gate|up, DeltaNet input fusions are built from the checkpoint's codes; with it
    (a permutation per layer) each layer runs alone; on torch's int4 kernel as on qmatmul's."""
    if not native:
        monkeypatch.setattr(qmatmul, "available", lambda: False)
    elif not qmatmul.available():
        pytest.skip("the qmatmul kernels are not available here")
    src = tiny_model(std=0.02, **WIDE).to(torch.bfloat16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for act_order in (False, True):
        path = tmp_path / str(act_order)
        mtp.save_model(src, path)
        release_int(path, "gptq", 4, 32, False, act_order, "gptq")
        model = mtp.load_model(path, quantize="int4", release=True)
        assert_runs_the_stored_codes(model, load_file(path / "model.safetensors"), "gptq", 32, zero_offset=1)
        fused = [n for n, m in model.named_modules() if "_fused" in m.__dict__]
        assert (len(fused) == 0) == act_order, fused
        kept = mtp.load_model(path, quantize="int4")  # not released: the decoded weights kept beside the codes
        layer = kept.model.layers[0].mlp.down_proj
        assert layer.checkpoint_codes and not layer.weight.is_meta
        with pytest.raises(ValueError, match="int4 checkpoint's own codes"):
            layer.int4_weight()
        want = mtp.generate(kept, prompt, max_new_tokens=12).tokens
        assert mtp.generate(model, prompt, max_new_tokens=12).tokens == want
        assert mtp.generate(model, prompt, max_new_tokens=12, draft_tokens=3).tokens == want


def test_group_sizes_the_kernels_do_not_take_are_decoded_and_quantized_again(tmp_path):
    """Groups of 16 (the kernels' smallest is 32): every layer decoded and quantized as before, exactly the layers a
    bf16 copy of the decoded weights would give."""
    src = tiny_model(std=0.02, **WIDE).to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "q")
    release_int(tmp_path / "q", "gptq", 4, 16, False, False, "gptq")
    model = mtp.load_model(tmp_path / "q", quantize="int4", release=True)
    assert not any(isinstance(m, FastLinear) and m.checkpoint_codes for m in model.modules())
    mtp.save_model(mtp.load_model(tmp_path / "q"), tmp_path / "bf16")  # the decode, as a float checkpoint
    again = mtp.load_model(tmp_path / "bf16", quantize="int4", release=True)
    for (name, a), (_, b) in zip(model.named_modules(), again.named_modules()):
        if isinstance(a, FastLinear) and a.kernel in ("int8", "int4"):
            assert torch.equal(a._packed, b._packed), name


@pytest.mark.parametrize("release", ["gptq asym g32", "awq g32", "ct asym g32"])
def test_the_inference_commands_run_an_int4_release_as_int4_by_default(tmp_path, release):
    """`--quantize` left out: an int4 release loads as `--quantize int4` (its own codes, never decoded); `none` decodes
    it; an 8-bit release, an FP8 one and a float checkpoint load as stored; an explicit choice stands."""
    import argparse

    from mtp.cli_common import add_model_args, load_from_args, resolve_quantize
    from test_quantized import release_fp8

    make, *_ = RELEASES[release]
    mtp.save_model(tiny_model(std=0.02, **WIDE).to(torch.bfloat16), tmp_path / "int4")
    make(tmp_path / "int4")
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--model", str(tmp_path / "int4"), "--threads", "1"])
    model = load_from_args(args)
    assert args.quantize == "int4"
    coded = [m for m in model.modules() if isinstance(m, FastLinear) and m.checkpoint_codes]
    assert len(coded) >= 20 and all(m.weight.is_meta for m in coded)
    none = p.parse_args(["--model", str(tmp_path / "int4"), "--quantize", "none"])
    resolve_quantize(none)
    assert none.quantize is None
    mtp.save_model(tiny_model(std=0.02, **WIDE).to(torch.bfloat16), tmp_path / "float")
    mtp.save_model(tiny_model(std=0.02, **WIDE).to(torch.bfloat16), tmp_path / "int8")
    release_int(tmp_path / "int8", "gptq", 8, 32, False, False, "gptq")
    mtp.save_model(tiny_model(std=0.02, **WIDE).to(torch.bfloat16), tmp_path / "fp8")
    release_fp8(tmp_path / "fp8")
    for name, argv, want in [("float", [], None), ("int8", [], None), ("fp8", [], None),
                             ("int4", ["--quantize", "int8"], "int8"), ("float", ["--quantize", "int4"], "int4")]:
        a = p.parse_args(["--model", str(tmp_path / name), *argv])
        resolve_quantize(a)
        assert a.quantize == want, (name, argv)
