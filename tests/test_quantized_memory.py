"""int8 / int4 memory (issue 19): fused projections are built from their parts' codes (bit for bit what quantizing the
concatenated weight gives, and what the parts give concatenated), on the qmatmul kernels and on torch's fallback
kernels; `load_model(release=True)` (what the inference commands load) keeps only the codes, decodes the same
tokens, and refuses what would need the float weights it let go."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import mtp
from conftest import MOE, tiny_model
from mtp.check import all_zero
from mtp.model import qmatmul, rtn
from mtp.model.linear import FastLinear, FusedProjections, ReleasedWeightError

KERNELS = ["native", "fallback"]


def kernels(monkeypatch, which: str) -> None:
    if which == "fallback":
        monkeypatch.setattr(qmatmul, "available", lambda: False)
    elif not qmatmul.available():
        pytest.skip(f"the qmatmul kernels do not run here: {qmatmul.reason()}")


def fusions(model) -> list[tuple[str, FusedProjections]]:
    return [(n, m.__dict__["_fused"]) for n, m in model.named_modules() if m.__dict__.get("_fused") is not None]


def bf16_model(**overrides):
    return tiny_model(std=0.05, **overrides).to(torch.bfloat16)


def nan_scale_is_named_alike(path, scale: str, **load) -> None:
    """With a NaN written into the checkpoint's tensor `scale`, a released load (`load_model(path, release=True,
    **load)`) names it in the warning the unreleased load gives, and refuses it under strict."""
    from safetensors.torch import load_file, save_file

    from mtp.model.checkpoint import NonFiniteWeightsWarning

    tensors = load_file(path / "model.safetensors")
    tensors[scale] = tensors[scale].clone()
    tensors[scale][0, 0] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(NonFiniteWeightsWarning) as unreleased:
        mtp.load_model(path, **load)
    message = str(unreleased[0].message)
    assert "down_proj" in message and "values)" in message
    with pytest.warns(NonFiniteWeightsWarning) as got:
        mtp.load_model(path, release=True, **load)
    assert str(got[0].message) == message
    with pytest.raises(mtp.CheckpointError, match="NaN or Inf in tensor"):
        mtp.load_model(path, release=True, strict=True, **load)


def check_fusions(model, kernel: str, native: bool, views: bool) -> set[str]:
    """Each fusion of `model` runs `kernel` and holds no float copy; its output == its parts' outputs concatenated == a
    layer prepared from the concatenated float weight, bit for bit; with `views` every part runs on a view of the fused
    codes. -> the kinds of module fused."""
    found = fusions(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, fused in found:
            assert fused.fused.weight.is_meta and fused.fused.kernel == kernel  # no float copy
            assert fused.fused._native == native
            x = torch.randn(5, fused.fused.in_features, generator=g).to(torch.bfloat16)
            assert torch.equal(torch.cat(fused(x), -1), torch.cat([p.run(x) for p in fused.parts], -1)), name
            old = nn.Linear(fused.fused.in_features, sum(fused.sizes), bias=False)
            old.weight = nn.Parameter(torch.cat([p.weight.detach() for p in fused.parts]), requires_grad=False)
            assert torch.equal(torch.cat(fused(x), -1), FastLinear.wrap(old, kernel).run(x)), name
            storage = fused.fused._packed.untyped_storage().data_ptr()
            assert all(p._packed.untyped_storage().data_ptr() == storage for p in fused.parts) == views, name
    return {n.rsplit(".", 1)[-1] for n, _ in found}


@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_fused_codes_are_the_parts_concatenated(quantize, which, monkeypatch):
    """Each fusion's output == its parts' outputs concatenated == a layer prepared from the concatenated float weight
    (the fusion before issue 19), bit for bit; on the row-major kernels the parts run on views of the fused codes."""
    kernels(monkeypatch, which)
    model = bf16_model()
    model.prepare_for_inference(quantize)
    # (torch's int4 packing is not by row: there each part keeps its own)
    kinds = check_fusions(model, quantize, which == "native", quantize == "int8" or which == "native")
    assert kinds >= {"self_attn", "mlp"} | ({"linear_attn"} if quantize == "int8" else set())


@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_released_model_holds_codes_and_decodes_the_same(tmp_path, quantize, which, monkeypatch):
    """release=True: every quantized layer's weight is a meta placeholder (float bytes left: the embedding, the norms
    and the layers kept in bf16), and greedy plain and speculative decoding give the tokens of the unreleased load."""
    kernels(monkeypatch, which)
    mtp.save_model(bf16_model(), tmp_path / "m")
    kept = mtp.load_model(tmp_path / "m", quantize=quantize)
    released = mtp.load_model(tmp_path / "m", quantize=quantize, release=True)
    for name, m in released.named_modules():
        if isinstance(m, FastLinear) and m.kernel == quantize:
            assert m.released == (name != "lm_head") and m.weight.is_meta == m.released, name
    float_bytes = sum(p.numel() * p.element_size() for p in released.parameters() if not p.is_meta)
    small = sum(p.numel() * p.element_size() for n, p in released.named_parameters()
                if p.dim() < 2 or "embed_tokens" in n or n.startswith("mtp.fc") or "conv1d" in n)
    assert float_bytes == small
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    plain = mtp.generate(kept, prompt, max_new_tokens=24, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=24, draft_tokens=0).tokens == plain
    assert mtp.generate(released, prompt, max_new_tokens=24, draft_tokens=2).tokens == plain


def test_released_moe_experts(tmp_path):
    """Routed experts let go of their stacked float weights too, and decode as before."""
    mtp.save_model(bf16_model(**MOE), tmp_path / "m")
    kept = mtp.load_model(tmp_path / "m", quantize="int4")
    released = mtp.load_model(tmp_path / "m", quantize="int4", release=True)
    experts = [m for m in released.modules() if type(m).__name__ == "Experts"]
    assert experts and all(m.gate_up_proj.is_meta and m.down_proj.is_meta for m in experts)
    prompt = [7, 2, 9, 4, 4, 1, 8]
    plain = mtp.generate(kept, prompt, max_new_tokens=16, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=16, draft_tokens=2).tokens == plain


def test_released_layers_refuse_what_needs_their_weights(tmp_path):
    """Grad enabled, an in-place change, a new weight, re-preparing or asking for the int4 codes again: a clear
    ReleasedWeightError, never a result computed from stale codes."""
    src = bf16_model()
    mtp.save_model(src, tmp_path / "m")
    model = mtp.load_model(tmp_path / "m", quantize="int4", release=True)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ReleasedWeightError, match="holds only its quantized codes"):
        model(ids)  # training forward: grad is on
    layer = model.model.layers[0].mlp.down_proj
    with pytest.raises(ReleasedWeightError):
        layer.int4_weight()
    with pytest.raises(ReleasedWeightError):
        layer.prepare("int4")
    with torch.no_grad():
        model(ids)  # still fine
        layer.weight.zero_()  # an in-place change of the placeholder
        with pytest.raises(ReleasedWeightError, match="after its weight changed"):
            model(ids)
    model = mtp.load_model(tmp_path / "m", quantize="int8", release=True)
    model.load_state_dict(src.state_dict(), assign=True)  # new float weights: the codes are stale
    with torch.no_grad(), pytest.raises(ReleasedWeightError):
        model(ids)
    with pytest.raises(ValueError, match="cannot save tensor 'model.layers.0"):
        mtp.save_model(mtp.load_model(tmp_path / "m", quantize="int4", release=True), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unreleased_quantized_load_keeps_exact_float_weights(tmp_path):
    """Without release the loader only drops the file pages of what it quantized: the float weights read back
    unchanged (a training forward, on F.linear, equals the plain bf16 load's)."""
    mtp.save_model(bf16_model(), tmp_path / "m")
    ref = mtp.load_model(tmp_path / "m")
    model = mtp.load_model(tmp_path / "m", quantize="int4")
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    ids = torch.tensor([[5, 4, 3, 2, 1]])
    assert torch.equal(model(ids), ref(ids))


def test_check_probes_released_layers_through_their_codes(tmp_path):
    """`mtp check --quantize` loads released: a zeroed MTP is still seen as zeroed, a trained one not."""
    src = bf16_model()
    mtp.save_model(src, tmp_path / "m")
    assert not all_zero(mtp.load_model(tmp_path / "m", quantize="int4", release=True).mtp)
    with torch.no_grad():
        for p in src.mtp.parameters():
            p.zero_()
    mtp.save_model(src, tmp_path / "z")
    assert all_zero(mtp.load_model(tmp_path / "z", quantize="int4", release=True).mtp)


@pytest.mark.skipif(os.environ.get("MTP_TEST_COMPILE") != "1", reason="compiles a graph: set MTP_TEST_COMPILE=1 to run")
def test_compiled_call_of_a_released_layer():
    """A compiled graph calls the prepared kernel without the (meta) weight as an input."""
    layer = FastLinear.wrap(nn.Linear(64, 32, bias=False).to(torch.bfloat16), "int4")
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = layer(x)
        layer.release()
        assert torch.equal(torch.compile(lambda t: layer(t))(x), want)


def test_bf16_native_fusions_view_their_parts_and_loads_drop_the_mapped_weights(tmp_path, monkeypatch):
    """bf16 layers on qmatmul's product (what they run where oneDNN cannot pack bf16: forced here): each fusion's
    output is its parts' outputs concatenated and a layer prepared from the concatenated weight's, bit for bit, the
    parts viewing the fused copy (no second one); a bf16 load then drops each packed weight's memory-mapped pages (a
    copy of the file: the model would otherwise hold the weights twice) and decodes the same tokens."""
    kernels(monkeypatch, "native")
    monkeypatch.setenv("MTP_BF16", "native")
    model = bf16_model()
    model.prepare_for_inference()
    assert check_fusions(model, "bf16-native", True, True) >= {"self_attn", "mlp", "linear_attn"}
    mtp.save_model(model, tmp_path / "m")
    from mtp.io.safetensors_mmap import SafetensorsFile

    dropped: list[str] = []
    real = SafetensorsFile.release
    monkeypatch.setattr(SafetensorsFile, "release", lambda self, key: (dropped.append(key), real(self, key))[1])
    loaded = mtp.load_model(tmp_path / "m")
    packed = [n for n, m in loaded.named_modules() if isinstance(m, FastLinear) and m.kernel == "bf16-native"]
    assert packed and {f"{n}.weight" for n in packed if n != "lm_head"} <= set(dropped)
    prompt = [1, 2, 3, 4, 5]
    assert (mtp.generate(loaded, prompt, max_new_tokens=12, draft_tokens=2).tokens
            == mtp.generate(model, prompt, max_new_tokens=12).tokens)


def test_released_bf16_layers_hold_their_packed_copies_and_decode_the_same(tmp_path, monkeypatch):
    """release=True on a bf16 load (what the inference commands load: a checkpoint decoded at load, FP8 or GPTQ,
    would otherwise hold each weight twice): every layer on qmatmul's bf16 product but the output heads keeps only its
    packed copy, packed straight from the file's pages (never loaded as a weight, its NaN / Inf counted as it is
    moved: a NaN is named as the unreleased load names it, and refused under strict); `restore` unpacks exactly the
    weight it let go; greedy plain and speculative decoding, and int4 drafts quantized from the restored MTP weights,
    give the unreleased load's tokens and drafts; a training forward or a save refuses clearly."""
    from mtp.model import checkpoint

    kernels(monkeypatch, "native")
    monkeypatch.setenv("MTP_BF16", "native")
    mtp.save_model(bf16_model(), tmp_path / "m")
    kept = mtp.load_model(tmp_path / "m")
    straight = []
    pack = checkpoint._StoredPack.packed_bf16
    monkeypatch.setattr(checkpoint._StoredPack, "packed_bf16", lambda self, out=None: straight.append(self.key) or pack(self, out))
    released = mtp.load_model(tmp_path / "m", release=True)
    packed = {n: m for n, m in released.named_modules() if isinstance(m, FastLinear) and m.kernel == "bf16-native"}
    heads = {"lm_head"} | {n for n, m in packed.items() if any(m is h for h in released._output_heads())}
    assert packed and all(m.released == (n not in heads) and m.weight.is_meta == m.released for n, m in packed.items())
    assert len(straight) == len(set(straight)) == sum(m.released for m in packed.values())
    for n in ("model.layers.0.mlp.down_proj", "model.layers.0.linear_attn.in_proj_qkv"):
        layer = released.get_submodule(n)
        layer.restore()
        assert torch.equal(layer.weight.view(torch.int16), kept.get_submodule(n).weight.detach().view(torch.int16)), n
        layer.release()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    plain = mtp.generate(kept, prompt, max_new_tokens=24, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=24, draft_tokens=0).tokens == plain
    assert mtp.generate(released, prompt, max_new_tokens=24, draft_tokens=2).tokens == plain
    kept.quantize_drafts("int4")
    released.quantize_drafts("int4")
    for (n, a), (_, b) in zip(kept.mtp.named_modules(), released.mtp.named_modules()):
        if isinstance(a, FastLinear) and a.kernel is not None:
            assert b.kernel == a.kernel and torch.equal(a._packed, b._packed), n
            assert b.released or any(b is h for h in released._output_heads()), n
    a = mtp.generate(kept, prompt, max_new_tokens=24, draft_tokens=3)
    b = mtp.generate(released, prompt, max_new_tokens=24, draft_tokens=3)
    assert a.tokens == b.tokens == plain
    assert (a.stats.drafted, a.stats.accepted, a.stats.backbone_forwards) == (b.stats.drafted, b.stats.accepted,
                                                                                b.stats.backbone_forwards)
    with pytest.raises(ReleasedWeightError, match="holds only its packed copy"):
        released(torch.tensor([[1, 2, 3]]))  # training forward: grad is on
    with pytest.raises(ValueError, match="cannot save tensor"):
        mtp.save_model(released, tmp_path / "out")
    from safetensors.torch import load_file, save_file

    from mtp.model.checkpoint import NonFiniteWeightsWarning

    tensors, key = load_file(tmp_path / "m" / "model.safetensors"), "model.layers.0.mlp.down_proj.weight"
    tensors[key][0, 0], tensors[key][1, 1] = float("nan"), float("inf")
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(NonFiniteWeightsWarning) as unreleased:
        mtp.load_model(tmp_path / "m")
    assert f"'{key}' (2 values)" in str(unreleased[0].message)
    with pytest.warns(NonFiniteWeightsWarning) as got:
        mtp.load_model(tmp_path / "m", release=True)
    assert str(got[0].message) == str(unreleased[0].message)
    with pytest.raises(mtp.CheckpointError, match="NaN or Inf in tensor"):
        mtp.load_model(tmp_path / "m", release=True, strict=True)


def test_a_released_fp8_load_decodes_straight_into_the_packed_copies(tmp_path, monkeypatch):
    """release=True on an FP8 release (what the inference commands load): the layers on qmatmul's bf16 product get
    their packed copies decoded from the codes (`DecodedTensor.packed_bf16`), never as [out, in] weights; each fusion
    runs the one buffer its parts were packed into (no concatenated copy); the packed copies, `restore`, and greedy
    plain and speculative tokens are the unreleased load's."""
    from mtp.model import dequant
    from test_quantized import release_fp8

    kernels(monkeypatch, "native")
    if not dequant.LIBRARY.available():
        pytest.skip(f"dequant.c unavailable: {dequant.LIBRARY.reason()}")
    monkeypatch.setenv("MTP_BF16", "native")
    mtp.save_model(bf16_model(), tmp_path / "m")
    release_fp8(tmp_path / "m")
    kept = mtp.load_model(tmp_path / "m")
    decoded = []
    whole = dequant.scaled_counted
    monkeypatch.setattr(dequant, "scaled_counted", lambda *a: decoded.append(a[0].shape) or whole(*a))
    released = mtp.load_model(tmp_path / "m", release=True)
    assert decoded == []  # every FP8 weight of this model is a linear layer's on the bf16 product
    packed = {n: m for n, m in released.named_modules() if isinstance(m, FastLinear) and m.kernel == "bf16-native"}
    heads = {n for n, m in packed.items() if any(m is h for h in released._output_heads())}
    assert len(packed) > len(heads) and all(m.released == (n not in heads) for n, m in packed.items())
    for n, m in packed.items():
        assert torch.equal(m._packed.view(torch.int16), kept.get_submodule(n)._packed.view(torch.int16)), n
    theirs = dict(fusions(kept))
    assert fusions(released) and {n for n, _ in fusions(released)} == set(theirs)
    for n, f in fusions(released):
        assert f.fused._packed.data_ptr() == f.parts[0]._packed.data_ptr(), n
        assert torch.equal(f.fused._packed.view(torch.int16), theirs[n].fused._packed.view(torch.int16)), n
    layer = released.get_submodule("model.layers.0.mlp.down_proj")
    layer.restore()
    assert torch.equal(layer.weight.view(torch.int16), kept.get_submodule("model.layers.0.mlp.down_proj").weight.view(torch.int16))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    plain = mtp.generate(kept, prompt, max_new_tokens=24, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=24, draft_tokens=0).tokens == plain
    assert mtp.generate(released, prompt, max_new_tokens=24, draft_tokens=2).tokens == plain


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_released_fp8_load_quantizes_each_weight_from_one_scratch(tmp_path, monkeypatch, quantize):
    """release=True with `quantize` on an FP8 release: each quantized layer's weight is decoded as the layer is
    quantized, every one into the same scratch (`DecodedTensor.tensor_into`), never all held as [out, in] weights; the
    codes, scales and tokens are the unreleased load's; int8 and int4 fusions run the buffers their parts were
    quantized into; a NaN scale is named as the unreleased load names it, or refused under strict."""

    from mtp.model import dequant
    from mtp.model.quantized import DecodedTensor
    from test_quantized import release_fp8

    kernels(monkeypatch, "native")
    if not dequant.LIBRARY.available():
        pytest.skip(f"dequant.c unavailable: {dequant.LIBRARY.reason()}")
    mtp.save_model(bf16_model(), tmp_path / "m")
    release_fp8(tmp_path / "m")
    kept = mtp.load_model(tmp_path / "m", quantize=quantize)
    into, written = [], set()
    whole = DecodedTensor.tensor_into
    monkeypatch.setattr(DecodedTensor, "tensor_into", lambda self, out: into.append(out.data_ptr()) or whole(self, out))
    quantizer = "quantize_int8_packed" if quantize == "int8" else "quantize_int4_packed"
    fast = getattr(rtn, quantizer)

    def spy(*a, **kw):  # where the quantizer wrote each layer's codes
        out = fast(*a, **kw)
        if out is not None:
            written.add(out[0].data_ptr())
        return out

    monkeypatch.setattr(rtn, quantizer, spy)
    released = mtp.load_model(tmp_path / "m", quantize=quantize, release=True)
    quantized = {n: m for n, m in released.named_modules() if isinstance(m, FastLinear) and m.kernel in ("int8", "int4")}
    planned = {n for n, m in quantized.items() if not any(m is h for h in released._output_heads())}
    assert planned and len(into) == len(planned) and len(set(into)) == 1  # (every FP8 weight here: a linear layer's)
    for n, m in quantized.items():
        assert m.released == (n in planned), n
        theirs = kept.get_submodule(n)
        assert m.kernel == theirs.kernel and torch.equal(m._packed, theirs._packed), n
        for attr in ("_scale", "_sz", "_low"):
            if hasattr(theirs, attr):
                assert torch.equal(getattr(m, attr), getattr(theirs, attr)), (n, attr)
    assert fusions(released) and fusions(kept)
    for n, f in fusions(released):  # the codes as quantized: no concatenated copy
        assert f.fused._packed.data_ptr() in written, n
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    plain = mtp.generate(kept, prompt, max_new_tokens=16, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=16, draft_tokens=0).tokens == plain
    assert mtp.generate(released, prompt, max_new_tokens=16, draft_tokens=2).tokens == plain
    nan_scale_is_named_alike(tmp_path / "m", "model.layers.0.mlp.down_proj.weight_scale_inv", quantize=quantize)


@pytest.mark.parametrize("fp8, quantize", [(False, "int4"), (True, "int8"), (True, "int4")])
def test_a_released_moe_load_quantizes_its_experts_one_at_a_time(tmp_path, monkeypatch, fp8, quantize):
    """release=True with `quantize` on an MoE checkpoint stored per expert (bf16, or an FP8 release): the routed
    experts' [E, ...] weights are never built; each expert is copied or decoded into a scratch the load shares only as
    it is quantized (`checkpoint._expert_sources`); the experts' codes and the tokens are the unreleased load's; an
    expert's NaN scale is named as the unreleased load names it, or refused under strict."""
    from mtp.model import checkpoint
    from mtp.model.moe import Experts, Stack
    from test_moe import moe_model, write
    from test_quantized import release_fp8

    kernels(monkeypatch, "native")
    write(moe_model().to(torch.bfloat16), tmp_path / "m", "per_expert", "per_expert")
    if fp8:
        release_fp8(tmp_path / "m")
    kept = mtp.load_model(tmp_path / "m", quantize=quantize)
    stacked = []
    whole = checkpoint.materialize
    monkeypatch.setattr(checkpoint, "materialize",
                        lambda files, src, *a: (isinstance(src, Stack) and stacked.append(src)) or whole(files, src, *a))
    released = mtp.load_model(tmp_path / "m", quantize=quantize, release=True)
    assert stacked == []  # no [E, ...] expert weight was built
    experts = [(n, a, released.get_submodule(n)) for n, a in kept.named_modules() if isinstance(a, Experts)]
    assert len(experts) == 5  # 4 layers and the MTP's
    for n, a, b in experts:
        assert b.gate_up_proj.is_meta and b.down_proj.is_meta, n
        for (ga, da), (gb, db) in zip(a._kernels, b._kernels):
            assert gb.kernel == ga.kernel and torch.equal(ga._packed, gb._packed) and torch.equal(da._packed, db._packed), n
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = mtp.generate(kept, prompt, max_new_tokens=12, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=12, draft_tokens=2).tokens == plain
    monkeypatch.setattr(checkpoint, "materialize", whole)
    if fp8:
        nan_scale_is_named_alike(tmp_path / "m", "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv",
                                 quantize=quantize)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_released_gptq_or_awq_load_decodes_each_weight_as_it_packs_it(tmp_path, monkeypatch, method):
    """release=True on a 4-bit release decoded to bf16 (`--quantize none`): each layer's weight is decoded by the
    format's decoder as the layer is packed, one at a time (never the whole model's [out, in] weights at once); the
    packed copies and tokens are the unreleased load's, and a NaN scale is named with the count the unreleased load
    gives (read from the packed copy), or refused under strict."""
    from safetensors.torch import load_file

    from mtp.model.quantized import DecodedTensor
    from test_quantized import release_int

    kernels(monkeypatch, "native")
    monkeypatch.setenv("MTP_BF16", "native")
    mtp.save_model(bf16_model(), tmp_path / "m")
    release_int(tmp_path / "m", method, 4, 16)
    kept = mtp.load_model(tmp_path / "m")
    calls = []
    whole = DecodedTensor.packed_bf16
    monkeypatch.setattr(DecodedTensor, "packed_bf16", lambda self, out=None: calls.append(1) or whole(self, out))
    released = mtp.load_model(tmp_path / "m", release=True)
    qweights = [k for k in load_file(tmp_path / "m" / "model.safetensors") if k.endswith(".qweight")]
    assert qweights and len(calls) == len(qweights)  # every quantized weight (all are linear layers' here)
    packed = {n: m for n, m in released.named_modules() if isinstance(m, FastLinear) and m.kernel == "bf16-native"}
    assert sum(m.released for m in packed.values()) >= len(qweights)
    for n, m in packed.items():
        assert torch.equal(m._packed.view(torch.int16), kept.get_submodule(n)._packed.view(torch.int16)), n
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    plain = mtp.generate(kept, prompt, max_new_tokens=16, draft_tokens=0).tokens
    assert mtp.generate(released, prompt, max_new_tokens=16, draft_tokens=2).tokens == plain
    nan_scale_is_named_alike(tmp_path / "m", "model.layers.0.mlp.down_proj.scales")
