"""Quantized drafts (`CausalLM.quantize_drafts`, `--draft-quantize`): the MTP layers and a copy of their head run
int8 / int4 while the backbone and its head stay bf16, so the output is the bf16 model's own - greedy bit for bit,
sampled in law - and only the drafts (and so the acceptance) can differ."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import mtp
import test_sampling_stats as stats
from conftest import MOE, tiny_model, trained_tiny_model
from mtp.bench.measure import Variant
from mtp.cli_common import draft_precision
from mtp.decode.decoder import Decoder
from mtp.decode.draft_vocab import DraftVocab
from mtp.decode.sampling import SamplingParams
from mtp.decode.session import Session
from mtp.model import qmatmul
from mtp.model.linear import FastLinear, int4_group_for, int4_supported

needs_kernels = pytest.mark.skipif(not qmatmul.available(), reason=f"qmatmul kernels unavailable: {qmatmul.reason()}")


def bf16(model, quantize: str | None = None):
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.prepare_for_inference(quantize)
    return m


@pytest.fixture(scope="module")
def trained():
    return trained_tiny_model(depth=3)


def kernels(module) -> dict[str, str]:
    return {n: m.kernel for n, m in module.named_modules() if isinstance(m, FastLinear)}


def expected(layer, bits: str) -> str:
    """`bits`, or int8 for an int4 layer the kernel cannot run (as `--quantize int4` does)."""
    group = int4_group_for(layer.in_features)
    fits = group is not None and int4_supported(layer.out_features, layer.in_features, group)
    return bits if bits == "int8" or fits else "int8"


@pytest.mark.parametrize("bits", ["int8", "int4"])
@pytest.mark.parametrize("moe", [False, True])
def test_only_the_drafts_are_quantized(trained, bits, moe):
    """The backbone's layers, head and logits do not move; every MTP projection, the input one too (only the drafts
    read it), but the routers (`keep_precision`), and each expert runs `bits`; the drafts read a quantized copy of the
    head that shares its weight."""
    model = bf16(tiny_model(seed=5, **MOE) if moe else trained)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ids)
        hidden = next(iter(model.mtp_hidden_states(ids, 1)))
        mtp_logits = model.mtp_head(hidden, 1)
    backbone = kernels(model.model)
    model.quantize_drafts(bits)
    assert model.draft_quantize == bits
    assert kernels(model.model) == backbone
    with torch.inference_mode():
        assert torch.equal(model(ids), logits)
        assert torch.equal(model.mtp_head(hidden, 1), mtp_logits)  # the head itself is the backbone's, unchanged
        drafted = model.draft_head(hidden, 1)
    mtp_kernels = kernels(model.mtp)
    kept = [n for n in mtp_kernels if any(f"mtp.{n}".endswith(s) for s in model.keep_precision)]
    assert bool(kept) == moe and "fc" in mtp_kernels  # an MoE layer's routers keep their precision, fc does not
    assert all(mtp_kernels.pop(n) not in ("int8", "int4") for n in kept)
    assert mtp_kernels and all(k == expected(model.mtp.get_submodule(n), bits) for n, k in mtp_kernels.items())
    assert bits in mtp_kernels.values()
    if moe:
        experts = [m for m in model.mtp.modules() if type(m).__name__ == "Experts"]
        assert experts and all(k.kernel == expected(k, bits) for e in experts for pair in e._kernels for k in pair)
    head = model.draft_head_module(1)
    assert head is not model.lm_head and head.weight is model.lm_head.weight and head.kernel == expected(head, bits)
    assert model.lm_head.kernel not in ("int8", "int4")
    assert not torch.equal(drafted, mtp_logits)  # the drafts really read the quantized copy
    # the same head in other precision: mostly the same argmax (1.0 and 0.94 here; a wrong head would agree ~1/64)
    assert (drafted.argmax(-1) == mtp_logits.argmax(-1)).float().mean() > 0.5


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_greedy_output_is_the_bf16_models_own(trained, bits):
    """Plain, k = 1..4 and auto on the quantized drafts give the bf16 model's plain tokens; and so does a batch of
    three sequences decoded together."""
    ref, model = bf16(trained), bf16(trained)
    model.quantize_drafts(bits)
    decodes_as(model, ref, seed=1)


def decodes_as(model, ref, seed: int) -> None:
    """Three prompts: plain, k = 1, 2, 4 and auto on `model`, and the three decoded together in one batch, give
    `ref`'s plain tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 8, (int(n),), generator=g).tolist() for n in (3, 7, 12)]
    want = [mtp.generate(ref, p, max_new_tokens=30).tokens for p in prompts]
    for p, w in zip(prompts, want):
        for k in (None, 1, 2, 4, "auto"):
            assert mtp.generate(model, p, max_new_tokens=30, draft_tokens=k).tokens == w, (p, k)
    dec = Decoder(model, 3, 48, 3)
    sessions = [Session(model, p, 30, SamplingParams(), None, None) for p in prompts]
    for s in sessions:
        dec.add(s)
    while not all(s.done for s in sessions):
        dec.step()
    assert [s.new_tokens for s in sessions] == want


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_a_reduced_draft_vocabulary_drafts_in_the_drafts_precision(trained, bits):
    """`--draft-vocab` beside quantized drafts: the reduced head runs the drafts' precision too (int8 where int4 cannot
    run its shape), and the output is still the bf16 model's."""
    ref, model = bf16(trained), bf16(trained)
    model.quantize_drafts(bits)
    vocab = DraftVocab([0, 1, 2, 3, 5], model.config.vocab_size)
    assert vocab.head(model, 1).kernel == "int8"  # (5 rows: the int4 kernel takes multiples of 16)
    g = torch.Generator().manual_seed(2)
    for n in (4, 9):
        prompt = torch.randint(0, 8, (n,), generator=g).tolist()
        want = mtp.generate(ref, prompt, max_new_tokens=30).tokens
        assert mtp.generate(model, prompt, max_new_tokens=30, draft_tokens=3, draft_vocab=vocab).tokens == want


def test_unpack_int8_inverts_the_kernels_packing():
    codes = torch.randint(-128, 128, (21, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(qmatmul.unpack_int8(qmatmul.pack_int8(codes), 21), codes)


@needs_kernels  # (the kernels' names and codes are qmatmul's)
@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("vocab", [None, 64])
def test_int4_drafts_for_an_int8_model(trained, release, vocab):
    """An int8 model (`--quantize int8`, its float weights released or not) drafting int4: the MTP's int8 layers are
    requantized to int4 in place - from their codes once the float weight is gone, the same codes as quantizing
    that decode - and its int8 head gets an int4 copy; the backbone, its head and every output stay the int8
    model's, greedy bit for bit (plain, k = 1..4, auto, a batch of three)."""
    source = trained if vocab is None else tiny_model(seed=7, vocab_size=vocab)  # (8 head rows: no int4; 64: int4)
    ref, model = bf16(source, "int8"), bf16(source)
    model.prepare_for_inference("int8", release=release)
    before = kernels(model.mtp)
    q = model.mtp.get_submodule(next(n for n, k in before.items() if k == "int8"))
    decoded = q.int8_decoded()
    weight = decoded.to(torch.bfloat16) if release else q.weight.detach().clone()  # (in the model's dtype)
    if not release:  # (the decode is the weight to within half a step of its row's scale)
        step = q.weight.float().abs().amax(1, keepdim=True) / 127
        assert ((decoded - q.weight.float()).abs() <= step / 2 + 1e-3 * step).all()
    model.quantize_drafts("int4")
    assert model.draft_quantize == "int4"
    assert kernels(model.model) == kernels(ref.model) and model.lm_head.kernel == "int8"
    after = kernels(model.mtp)
    assert before["fc"] == "bf16-native" and after.pop("fc") == expected(model.mtp.fc, "int4")  # (kept bf16 in the model)
    assert {n: k for n, k in after.items() if before[n] != "int8"} == {n: k for n, k in before.items() if k != "int8" and n != "fc"}
    assert all(after[n] == expected(model.mtp.get_submodule(n), "int4") for n, k in before.items() if k == "int8")
    assert q.kernel == "int4" and q.released == release
    fusions = [m.__dict__["_fused"] for m in model.mtp.modules() if "_fused" in m.__dict__]
    assert fusions and all(f.fused.kernel == p.kernel == "int4" and f.fresh() for f in fusions for p in f.parts)
    want = FastLinear.wrap(torch.nn.Linear(q.in_features, q.out_features, bias=False), "int8")
    with torch.no_grad():
        want.weight.copy_(weight)
    want.prepare("int4")
    x = torch.randn(3, q.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(q(x), want(x))  # the same int4 codes as quantizing the float weight / the codes' decode
    head = model.draft_head_module(1)
    if vocab is None:
        assert head is model.lm_head
    else:
        assert head is not model.lm_head and head.kernel == "int4" and head.weight is model.lm_head.weight
    decodes_as(model, ref, seed=4)


@needs_kernels  # (the kernels' names and codes are qmatmul's)
def test_int4_drafts_for_an_int4_model(trained):
    """An int4 model drafting int4 (`--draft-quantize auto`): only the MTP's input projection, which the model keeps
    bf16, changes (to int4, in the one-call draft chain too); every other layer and head stays, and the output is the
    int4 model's, greedy bit for bit (plain, k = 1..4, auto, a batch of three)."""
    ref, model = bf16(trained, "int4"), bf16(trained, "int4")
    before = kernels(model)
    model.quantize_drafts("int4")
    after = kernels(model)
    assert before["mtp.fc"] == "bf16-native" and after.pop("mtp.fc") == expected(model.mtp.fc, "int4")
    assert after == {n: k for n, k in before.items() if n != "mtp.fc"}
    assert model.draft_head_module(1) is model.lm_head or model.draft_head_module(1).kernel == model.lm_head.kernel
    decodes_as(model, ref, seed=6)


@needs_kernels  # (the kernels' names and codes are qmatmul's)
@pytest.mark.parametrize("release", [False, True])
def test_int4_drafts_for_an_int8_moe_model(release):
    """An int8 MoE model drafting int4: the MTP's routed experts are requantized to int4 (the backbone's stay int8),
    and the greedy output is the int8 model's, plain and speculative."""
    ref, model = bf16(tiny_model(seed=5, **MOE), "int8"), bf16(tiny_model(seed=5, **MOE))
    model.prepare_for_inference("int8", release=release)
    experts = lambda module: [k for m in module.modules() if type(m).__name__ == "Experts"  # noqa: E731
                              for pair in m._kernels for k in pair]
    assert experts(model.mtp) and {k.kernel for k in experts(model.mtp)} == {"int8"}
    model.quantize_drafts("int4")
    assert all(k.kernel == expected(k, "int4") for k in experts(model.mtp)) and "int4" in {k.kernel for k in experts(model.mtp)}
    assert {k.kernel for k in experts(model.model)} == {"int8"}
    g = torch.Generator().manual_seed(6)
    for n in (3, 9):
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        want = mtp.generate(ref, prompt, max_new_tokens=24).tokens
        for k in (None, 2, "auto"):
            assert mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k).tokens == want, (n, k)


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_a_quantized_models_reduced_draft_head_runs_its_heads_precision(bits):
    """An int8 / int4 model drafting in its own precision (no `quantize_drafts`): the reduced draft head takes the
    head's kernel (it ran bf16, reading 2-4x a row's bytes), its logits are the full head's at its ids bit for bit
    (the kernels quantize and multiply each row on its own), and the output is the model's."""
    ref, model = bf16(tiny_model(seed=7, vocab_size=256), bits), bf16(tiny_model(seed=7, vocab_size=256), bits)
    vocab = DraftVocab(torch.arange(0, 256, 4), 256)
    head = vocab.head(model, 1)
    assert head.kernel == bits == model.lm_head.kernel and model.draft_quantize is None
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(head(x), model.mtp_head(x, 1)[:, vocab.ids])
    prompt = [1, 2, 3, 4, 5]
    want = mtp.generate(ref, prompt, max_new_tokens=24).tokens
    assert mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=3, draft_vocab=vocab).tokens == want


def test_sampling_keeps_the_target_distribution():
    """Unseeded speculative sampling over int8 drafts (q the quantized MTP's law) still draws the bf16 backbone's
    joint law of the first three tokens (chi-square against the exact one)."""
    model = bf16(tiny_model(vocab_size=4, seed=11, std=0.15))
    model.quantize_drafts("int8")
    params = SamplingParams(temperature=1.0)
    counts = stats.sample_first_three(model, params, 2, seeded=False)
    assert stats.chi2_of_counts(model, params, counts) > 1e-3


def test_the_quantized_head_copy_is_renewed_with_the_model(trained):
    """A weight changed in place (training, healing): `renew_prepared` (what a compiled decoder calls as it starts,
    compiled graphs trusting prepared weights) prepares the drafts' head copy again too, not only the model's layers."""
    model = bf16(trained)
    model.quantize_drafts("int8")
    copy_ = model.draft_head_module(1)
    h = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # (the same parameter the copy holds)
    assert copy_._version != copy_.weight._version
    assert model.renew_prepared() >= 2  # the model's head and the copy
    assert copy_._version == copy_.weight._version
    fresh = FastLinear.wrap(torch.nn.Linear(h.shape[1], model.config.vocab_size, bias=False), "int8")
    with torch.no_grad():
        fresh.weight.copy_(model.lm_head.weight)
        fresh.prepare("int8")
        assert torch.equal(copy_(h), fresh(h))


def test_refused_where_it_cannot_run(trained):
    with pytest.raises(ValueError, match="bfloat16 model on the CPU"):
        copy.deepcopy(trained).quantize_drafts("int8")  # fp32
    with pytest.raises(ValueError, match="one of int8, int4"):
        bf16(trained).quantize_drafts("int2")
    model = bf16(trained)
    model.quantize_drafts("int8")
    with pytest.raises(ValueError, match="already quantized"):
        model.quantize_drafts("int4")
    no_mtp = bf16(trained)
    no_mtp.mtp = None
    with pytest.raises(ValueError, match="no MTP module"):
        no_mtp.quantize_drafts("int8")


def test_auto_quantizes_the_drafts_of_a_bf16_int8_or_int4_model(trained):
    """--draft-quantize auto: int4 for a bf16, int8 or int4 model on qmatmul's kernels (an int4 model's input
    projection, kept bf16, then runs int4), nothing for an fp32 model; the explicit choices are taken as they are."""
    assert draft_precision("auto", bf16(trained)) == ("int4" if qmatmul.available() else None)
    assert draft_precision("auto", trained) is None
    assert draft_precision("auto", bf16(trained, "int8")) == ("int4" if qmatmul.available() else None)
    assert draft_precision("auto", bf16(trained, "int4")) == ("int4" if qmatmul.available() else None)
    assert draft_precision("none", bf16(trained)) is None
    assert draft_precision("int4", trained) == "int4" and draft_precision("int8", trained) == "int8"


def test_bench_variants_name_the_drafts_precision():
    v = Variant.parse("bf16+draft-int4")
    assert (v.dtype, v.quantize, v.draft_quantize) == ("bfloat16", None, "int4")
    assert Variant.parse("int8+vocab64").draft_quantize is None  # (then the command line's)
    assert Variant.parse("int8").draft_vocab is None and Variant.parse("int8+vocab-full").draft_vocab == 0  # (None: the
    assert Variant.parse("bf16+vocab64").draft_vocab == 64  # command line's --draft-vocab; 0: the full vocabulary)
    with pytest.raises(ValueError, match="vocab-full"):
        Variant.parse("bf16+vocab0")
    assert Variant.parse("bf16+draft-none").model_key != Variant.parse("bf16+draft-int8").model_key
    with pytest.raises(ValueError, match="draft-none"):
        Variant.parse("bf16+draft-int3")


def test_int4_drafts_of_an_int8_model_on_torchs_kernels():
    """`--quantize int8 --draft-quantize int4` where torch's weight-only kernels run (MTP_QMATMUL=0, or no C compiler):
    the requantized MTP layers hold no Int4Weights, so their projections run unfused (it raised "fusing int4 layers for
    torch's kernel needs their Int4Weights"); speculative output equals plain."""
    def run(k: str) -> list[int]:
        cmd = [sys.executable, "-m", "mtp.cli", "generate", "--quantize", "int8", "--draft-quantize", "int4",
               "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--repetition-penalty", "1", "--draft-tokens",
               k, "--threads", "1", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, MTP_QMATMUL="0"))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["tokens"]

    assert run("3") == run("0")
