"""The one-call decode forward (model/step.py, step.c): its outputs, caches and per-layer steps equal the per-layer
eager forward's bit for bit (int8, int4 and bf16 on qmatmul's product, one row and many, a plain step and a verify
block), decoding through it is
the eager decoding (greedy speculative == plain, batched == solo), and whatever it cannot run takes the per-layer path:
other kernels, hooks, changed weights, bad input."""

from __future__ import annotations

import contextlib

import pytest
import torch

import mtp
import test_batch
from conftest import tiny_model, trained_tiny_model
from mtp.decode import round_kernel
from mtp.model import act, qmatmul, step
from mtp.model.base import CausalLM
from mtp.model.cache import DeltaSteps
from mtp.model.linear import prompt_products, renew_prepared
from mtp.model.rowwise import rowwise

pytestmark = pytest.mark.skipif(not step.LIBRARY.available() or not act.LIBRARY.available(),
                                reason="the C kernels are not available here")


def quantized(kind: str, seed: int = 0, **overrides):
    """A tiny bf16 model prepared for `kind`: "int8", "int4", or "bf16" with every bf16 layer on qmatmul's product
    ("bf16-native": what bf16 layers run where oneDNN cannot pack bf16 weights; here on any CPU), optionally
    "+drafts-int8|int4" (`quantize_drafts`)."""
    model = tiny_model(seed, **overrides).to(torch.bfloat16)
    kind, _, drafts = kind.partition("+drafts-")  # "bf16+drafts-int4": bf16, the drafts int4 (`quantize_drafts`)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MTP_BF16", "native" if kind == "bf16" else "torch")
        model.prepare_for_inference(None if kind == "bf16" else kind)
        if drafts:
            model.quantize_drafts(drafts)
    return model


def filled_cache(model, B: int, seed: int):
    """A decode cache of B rows with random states, conv inputs and keys/values (as if rows had decoded a while)."""
    cache = model.new_cache(B, 64)
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        for t in (layer.ssm, layer.conv) if hasattr(layer, "ssm") else (layer.k, layer.v):
            t.copy_(torch.randn(t.shape, generator=g))
    return cache


def both(model, B: int, T: int, commit: bool, seed: int = 0):
    """The same decode forward through the program and through the layers, from identical caches ->
    ((hidden, steps, cache) program, (hidden, steps, cache) eager)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    starts = [5 + 3 * b for b in range(B)]
    index = torch.tensor(starts)[:, None] + torch.arange(T)
    model.prepare_decode(64)
    out = []
    for run in (step.decode, CausalLM.decode):
        cache = filled_cache(model, B, seed)
        pos = model.decode_positions(index, starts)
        pos.commit = commit
        with torch.inference_mode():
            done = run(model, ids, cache, pos)
        assert done is not None, step.verdict(model)
        out.append((*done, cache))
    return out


def assert_same(a, b) -> None:
    (ha, sa, ca), (hb, sb, cb) = a, b
    assert torch.equal(ha, hb)
    for la, lb in zip(ca.layers, cb.layers):
        for name in ("ssm", "conv") if hasattr(la, "ssm") else ("k", "v"):
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
    for x, y in zip(sa, sb):
        assert type(x) is type(y)
        if isinstance(x, DeltaSteps):
            assert torch.equal(x.window, y.window) and torch.equal(x.updates, y.updates)


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("B,T,commit", [(1, 1, True), (1, 1, False), (1, 4, False), (2, 1, True), (3, 4, False)])
def test_program_equals_the_layer_by_layer_forward(kind, B, T, commit):
    """(int4 on the tiny shape: the DeltaNet's b/a projections are too narrow for it, so its input projections run
    unfused, int4 and int8 side by side - the program's other input path)"""
    model = quantized(kind)
    assert_same(*both(model, B, T, commit))
    if commit:  # a kept step updated its caches in place and kept no steps
        assert all(s is None for s in both(model, B, T, commit)[0][1])


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
def test_a_prompt_read_in_one_call_is_its_tokens_decoded_one_by_one(kind):
    """`step.prefill` outside `prompt_products` (the decode kernels, attention included): its hidden states and every
    cache entry equal the prompt's tokens decoded one at a time, bit for bit, in two chunks too (the second through
    `hidden`, which takes it); the cache advances by each chunk."""
    model = quantized(kind)
    ids = torch.randint(0, model.config.vocab_size, (1, 45), generator=torch.Generator().manual_seed(3))
    one_call, plain = model.new_cache(1, 64), model.new_cache(1, 64)
    model.prepare_decode(64)
    with torch.inference_mode():
        first = step.prefill(model, ids[:, :37], one_call)  # (two blocks of 16 tokens and a tail)
        assert first is not None and one_call.pos == 37
        read = torch.cat([first, model.hidden(ids[:, 37:], one_call)], dim=1)
        steps = []
        for t in range(ids.shape[1]):
            pos = model.decode_positions(torch.tensor([[t]]), [t])
            pos.commit = True
            steps.append(CausalLM.decode(model, ids[:, t : t + 1], plain, pos)[0])
    assert one_call.pos == 45
    assert_same((read, [], one_call), (torch.cat(steps, dim=1), [], plain))


@pytest.mark.skipif(not qmatmul.wide_available(), reason="no prompt products on the bf16 tiles in this build")
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_prompt_read_in_one_call_multiplies_as_the_layers_do(kind):
    """Within `prompt_products` the one-call prefill's int8/int4 products of 64 rows or more run on the bf16 tiles, as
    the layers' do (other bits than the integer kernels'). The two prefills differ in attention only (the layers'
    is SDPA's, the program's `attend_prompt`), so what comes before the first attention's output - the first DeltaNet
    layer's state and conv inputs, the first attention layer's keys and values - equals the layers' prefill bit for
    bit, and not the integer kernels'; the hidden states after it are as close as bf16 rounding leaves them."""
    model = quantized(kind)  # layers: DeltaNet, attention, DeltaNet, attention
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(4))
    out = {}
    for name, run, prompt in (("program", step.prefill, True), ("layers", CausalLM.hidden, True),
                              ("integer", step.prefill, False)):
        cache = model.new_cache(1, 96)
        with torch.inference_mode(), (prompt_products() if prompt else contextlib.nullcontext()):
            hidden = run(model, ids, cache).float()
        delta, attention = cache.layers[:2]
        out[name] = (delta.ssm, delta.conv, attention.k, attention.v, hidden)
    assert all(torch.equal(a, b) for a, b in zip(out["program"][:4], out["layers"][:4]))
    assert not torch.equal(out["program"][0], out["integer"][0])
    hidden, want = out["program"][4], out["layers"][4]
    assert (hidden - want).norm() <= 0.03 * want.norm()  # (this peaked model: 1.2% measured, bf16 and int8/int4)


def test_program_follows_changed_weights_and_hands_over_what_it_cannot_run():
    model = quantized("int8")
    first = step.program(model)
    assert first is not None and step.program(model) is first
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.add_(0.25)  # in place: the program must see it (it points there)
        model.model.layers[0].linear_attn.A_log.add_(0.1)  # copied to fp32 by the program: rebuilt
    assert step.program(model) is not first
    assert_same(*both(model, 1, 4, False))
    # a fused projection's weight changed in place: its codes are stale, so the layers run until it is fused again
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    assert step.program(model) is None and step.verdict(model) is None
    renew_prepared(model)
    assert step.program(model) is not None
    assert_same(*both(model, 2, 4, False))
    # a hook on any backbone module: the layers run, so the hook does
    calls = []
    handle = model.model.layers[2].mlp.register_forward_hook(lambda *a: calls.append(1))
    assert step.program(model).hooked()
    with torch.inference_mode():
        pos = model.decode_positions(torch.tensor([[3]]), [3])
        hidden, _ = model.decode(torch.tensor([[1]]), model.new_cache(1, 64), pos)
    assert calls == [1]
    handle.remove()
    assert not step.program(model).hooked()


def test_models_the_program_cannot_run_keep_the_layers(monkeypatch):
    monkeypatch.setenv("MTP_BF16", "torch")  # bf16 layers on oneDNN (or torch's product): not qmatmul's
    bf16 = tiny_model(0).to(torch.bfloat16)
    bf16.prepare_for_inference()  # oneDNN bf16 projections: not qmatmul's
    assert step.program(bf16) is None and "int8/int4" in step.verdict(bf16)
    moe = tiny_model(0, num_experts=4).to(torch.bfloat16)
    moe.prepare_for_inference("int8")
    assert step.program(moe) is None and "SwiGLU" in step.verdict(moe)
    prepared_again = quantized("int8")
    assert step.program(prepared_again) is not None
    prepared_again.prepare_for_inference()  # back to bf16 kernels: the verdict is made again
    assert step.program(prepared_again) is None


def test_bad_token_ids_and_positions_raise_before_anything_is_written():
    model = quantized("int8")
    model.prepare_decode(64)
    cache = filled_cache(model, 1, 0)
    before = [t.clone() for layer in cache.layers for t in ((layer.ssm, layer.conv) if hasattr(layer, "ssm")
                                                            else (layer.k, layer.v))]
    with torch.inference_mode():
        for ids, starts in ((torch.tensor([[model.config.vocab_size]]), [3]), (torch.tensor([[-1]]), [3])):
            with pytest.raises(IndexError, match="vocabulary"):
                step.decode(model, ids, cache, model.decode_positions(torch.tensor([starts]), starts))
        with pytest.raises(ValueError, match="past the cache"):
            step.decode(model, torch.tensor([[1]]), cache, model.decode_positions(torch.tensor([[63]]), [64]))
        cache.pos = 3  # a prompt's read (`step.prefill`, through `hidden`): the same errors, and an empty one reads nothing
        with pytest.raises(IndexError, match="vocabulary"):
            model.hidden(torch.tensor([[1, model.config.vocab_size]]), cache)
        with pytest.raises(ValueError, match="cannot add 62"):
            model.hidden(torch.ones(1, 62, dtype=torch.long), cache)
        assert model.hidden(torch.ones(1, 0, dtype=torch.long), cache).shape == (1, 0, model.config.hidden_size)
        assert cache.pos == 3
    after = [t for layer in cache.layers for t in ((layer.ssm, layer.conv) if hasattr(layer, "ssm")
                                                   else (layer.k, layer.v))]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.fixture(scope="module", params=["int8", "bf16"])
def trained(request):
    model = trained_tiny_model(steps=80, depth=3, max_position_embeddings=512).to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MTP_BF16", "native")  # (bf16: every layer on qmatmul's product, which the program runs)
        model.prepare_for_inference(None if request.param == "bf16" else request.param)
    return model


def test_decoding_through_the_program_is_the_layer_by_layer_decoding(trained, monkeypatch):
    """Greedy speculative through the program == plain through the layers (and the program did run), for every k;
    batched == solo through it."""
    calls = {"program": 0}
    real = step.decode

    def counted(*args):
        done = real(*args)
        calls["program"] += done is not None
        return done

    prompts = [r[0] for r in test_batch.greedy_requests(8, 3, seed=4, max_prompt=40)]
    with monkeypatch.context() as m:
        m.setattr(step, "decode", lambda *args: None)
        m.setattr(round_kernel, "greedy_round", lambda *args: None)  # (the whole round as one call runs the programs)
        m.setattr(round_kernel, "greedy_rounds", lambda *args: None)  # (and so do rounds chained in one call)
        want = [mtp.generate(trained, p, max_new_tokens=30).tokens for p in prompts]
    monkeypatch.setattr(step, "decode", counted)
    for whole in (False, True):  # the programs called round by round, and the whole round as one call
        with monkeypatch.context() as m:
            if not whole:
                m.setattr(round_kernel, "greedy_round", lambda *args: None)
                m.setattr(round_kernel, "greedy_rounds", lambda *args: None)
            for p, w in zip(prompts, want):
                for k in (None, 1, 3, "auto"):
                    assert mtp.generate(trained, p, max_new_tokens=30, draft_tokens=k).tokens == w, (p, k)
    assert calls["program"] > 0 and trained.__dict__["_step"]["verify"] is not None
    requests = test_batch.greedy_requests(8, 6, seed=5)
    sessions = test_batch.run_batched(trained, requests, 2)
    for (prompt, max_new, _, _), s in zip(requests, sessions):
        assert s.new_tokens == mtp.generate(trained, prompt, max_new_tokens=max_new).tokens


@pytest.mark.parametrize("N", [1024, 64, 13])
def test_the_gates_are_row_invariant_and_round_as_torch_does(N):
    """act.c's SwiGLU product and attention gate: each row alone is its row of a batch, and the values are torch's
    form within two bf16 steps (its exp and ours may differ in a float's last bit, which can move each of the two
    roundings by a step, on any CPU's vector width)."""
    g = torch.Generator().manual_seed(N)
    gate, up = (torch.randn(7, N, generator=g).mul(4).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        for ours, theirs in ((act.silu_mul(gate, up), rowwise(torch.nn.functional.silu, gate) * up),
                             (act.sigmoid_mul(up, gate), up * rowwise(torch.sigmoid, gate))):
            steps = theirs.float().abs().clamp(min=1e-30) * 2**-6
            assert ((ours.float() - theirs.float()).abs() <= steps).all()
        for r in range(7):
            assert torch.equal(act.silu_mul(gate[r : r + 1], up[r : r + 1]), act.silu_mul(gate, up)[r : r + 1])
            assert torch.equal(act.sigmoid_mul(up[r : r + 1], gate[r : r + 1]), act.sigmoid_mul(up, gate)[r : r + 1])


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 3), (2, 2)])
def test_the_mtp_layer_program_equals_its_layer(kind, B, T, monkeypatch):
    """A draft step's MTP layer and norm (after its bf16 input projection) through the program == through the layer,
    keys/values written alike."""
    model = quantized(kind)
    g = torch.Generator().manual_seed(B * 10 + T)
    hidden = torch.randn(B, T, model.config.hidden_size, generator=g).to(torch.bfloat16)
    nxt = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    starts = [4 + 2 * b for b in range(B)]
    model.prepare_decode(64)
    out = []
    for use in (True, False):
        caches = model.new_mtp_cache(B, 64)
        for c in caches:
            for t in (c.k, c.v):
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(7)))
        with monkeypatch.context() as m:
            if not use:
                m.setattr(step, "mtp_layer", lambda *a: None)
            with torch.inference_mode():
                pos = model.decode_positions(torch.tensor(starts)[:, None] + torch.arange(T), starts)
                out.append((model.mtp_step(1, hidden, nxt, pos, caches), caches))
    assert step.program(model.mtp, 0) is not None
    (ha, ca), (hb, cb) = out
    assert torch.equal(ha, hb)
    assert all(torch.equal(x.k, y.k) and torch.equal(x.v, y.v) for x, y in zip(ca, cb))


def test_decoders_on_two_threads_share_one_program(trained):
    """The program's layer table is copied per call (ctypes lets go of the GIL inside it, and a call fills in its own
    caches): two generations of one model on two threads give what each gives alone. (With one shared table this
    crashed the process within 60 generations here.)"""
    import threading

    prompts = [r[0] for r in test_batch.greedy_requests(8, 2, seed=6, max_prompt=30)]
    alone = [mtp.generate(trained, p, max_new_tokens=60).tokens for p in prompts]
    wrong = []

    def run(i):
        for _ in range(30):
            if mtp.generate(trained, prompts[i], max_new_tokens=60).tokens != alone[i]:
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_a_released_model_keeps_its_fusions_and_its_program():
    """Releasing the float weights (an inference-only load) swaps in placeholders: the fusions must stay fresh, or
    the layers run unfused and the program never runs. The tiny model's weights were changed in place by its init
    (versions above 0), as a random model built in code or a model trained before `prepare_for_inference` has them."""
    model = tiny_model(0).to(torch.bfloat16)
    assert model.model.layers[0].mlp.up_proj.weight._version > 0
    model.prepare_for_inference("int8", release=True)
    fusions = [m.__dict__["_fused"] for m in model.modules() if "_fused" in m.__dict__]
    assert fusions and all(f.fresh() for f in fusions)
    assert step.program(model) is not None


def draft_state(model, B: int, seed: int):
    """A round state of B rows with random pending positions (1..4 per row), MTP slots and MTP caches."""
    from mtp.decode.round import PENDING, RoundState

    g = torch.Generator().manual_seed(seed)
    st = RoundState.allocate(model, B, 64, True, False)
    st.pend_h.copy_(torch.randn(st.pend_h.shape, generator=g))
    st.pend_next.copy_(torch.randint(0, model.config.vocab_size, (B, PENDING), generator=g))
    st.pend_n.copy_(torch.randint(1, 5, (B,), generator=g))
    st.mtp_pos.copy_(torch.randint(0, 20, (B,), generator=g))
    for c in st.mtp_cache:
        for t in (c.k, c.v):
            t.copy_(torch.randn(t.shape, generator=g))
    return st


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16", "bf16+drafts-int4", "int8+drafts-int4", "int4+drafts-int4"])
@pytest.mark.parametrize("B,K,layers,reduced,rule", [
    (1, 1, 1, False, None), (1, 3, 1, False, None), (3, 4, 1, False, None), (2, 3, 2, False, None),
    (1, 3, 1, True, None), (3, 4, 2, True, None), (1, 3, 1, False, "seeded"), (3, 4, 2, False, "seeded"),
    (3, 3, 1, False, "unseeded"), (3, 4, 2, True, "unseeded"), (2, 3, 1, False, "top_k"), (3, 3, 1, False, "top_k unseeded"),
    (3, 4, 1, True, "top_k unseeded"), (2, 3, 1, True, "wide top_k unseeded"), (2, 3, 1, False, "penalty"),
    (3, 4, 1, True, "penalty"), (3, 3, 1, False, "seeded penalty"), (3, 4, 2, False, "top_k unseeded penalty")])
def test_the_draft_chain_in_one_call_equals_the_round_step_by_step(kind, B, K, layers, reduced, rule, monkeypatch):
    """round.draft's chain as one C call (`step.draft`) == the same chain step by step in Python: the same drafts and
    the same MTP keys/values, for rows at different MTP positions with different pending counts, with two MTP layers
    taken in turn, and over a reduced draft vocabulary (its head rows a bf16 layer, drafts mapped back to the full
    vocabulary). With a sampling rule (rows sampled at temperature 0.7 beside greedy ones): the same drafts from the
    same noise, and for the unseeded rule the same draft logits q; top-k too (the drafts' rule: temperature and
    top-k), over the full or a reduced vocabulary, with a top-k past the reduced one's size. A repetition penalty
    (greedy rows with one: a rule with no noise; sampled rows with one) counts the tokens seen and the drafts before
    (the target's penalty), so its drafts are not the argmax ones."""
    from mtp.decode.draft_vocab import DraftVocab
    from mtp.decode.round import draft
    from mtp.decode.sampling import RowSampling, SamplingParams, gumbel

    model = quantized(kind, mtp_num_hidden_layers=layers)
    model.prepare_decode(64)
    V = model.config.vocab_size
    vocab = DraftVocab(torch.arange(1, V, 3), V) if reduced else None  # every third token
    calls = []  # the chains the C call ran (it returns None where it would hand over)
    real = type(model).mtp_draft

    def counted(*args):
        done = real(*args)
        calls.append(done is not None)
        return done

    monkeypatch.setattr(type(model), "mtp_draft", counted)
    rs = noise = seen = None
    penalty = 3.0 if rule is not None and "penalty" in rule else 1.0
    if rule == "penalty":  # (one row with none)
        rs = RowSampling.build([SamplingParams(repetition_penalty=penalty if b != 1 else 1.0) for b in range(B)], V, "cpu")
    elif rule is not None:
        top_k = None if "top_k" not in rule else V - 1 if "wide" in rule else 5
        sampled = SamplingParams(0.7, top_k=top_k, repetition_penalty=penalty, seed=None if "unseeded" in rule else 3)
        rs = RowSampling.build([sampled if b != 1 else SamplingParams(repetition_penalty=penalty) for b in range(B)], V,
                               "cpu")
        noise = gumbel(torch.rand(B, K, V, generator=torch.Generator().manual_seed(7)))
    if penalty != 1.0:  # the tokens the argmax chain drafts, and a random third of the others
        st = draft_state(model, B, seed=B + K)
        with torch.inference_mode():
            argmax_drafts = draft(model, st, K, None, None, vocab, width=max(st.pend_n.tolist()),
                                  host=(st.mtp_pos.tolist(), st.pend_n.tolist()))[0]
        seen = torch.rand(B, V, generator=torch.Generator().manual_seed(8)) < 0.3
        seen.scatter_(1, argmax_drafts, True)
        calls.clear()
    out = []
    for one_call in (True, False):
        st = draft_state(model, B, seed=B + K)
        st.seen = seen
        host = (st.mtp_pos.tolist(), st.pend_n.tolist())
        with monkeypatch.context() as m:
            if not one_call:
                m.setattr(type(model), "mtp_draft", lambda *a: None)
            with torch.inference_mode():
                drafts, shaped = draft(model, st, K, rs, noise, vocab, width=max(host[1]), host=host)
        assert (shaped is None) == (rule is None or "unseeded" not in rule)
        out.append((drafts, shaped, st.mtp_cache))
    assert isinstance(model.__dict__["_step"]["draft"], step.Program) and calls == [True]
    (da, qa, ca), (db, qb, cb) = out
    assert da.shape == (B, K) and torch.equal(da, db)
    assert qa is None or torch.equal(qa, qb)
    if rule == "penalty":  # the penalty moved the first draft of the rows with one off the argmax
        assert all(da[b, 0] != argmax_drafts[b, 0] for b in range(B) if b != 1)
    if reduced:
        assert torch.isin(da, vocab.ids).all()
    assert all(torch.equal(x.k, y.k) and torch.equal(x.v, y.v) for x, y in zip(ca, cb))


def test_the_draft_chain_hands_over_what_it_cannot_run_and_refuses_bad_state(monkeypatch):
    """A hook on the MTP and a bf16 model on oneDNN (or torch's product) take the step-by-step chain; a pending
    count outside 1..width or a pending token outside the vocabulary raises before anything is written."""
    model = quantized("int8")
    model.prepare_decode(64)
    st = draft_state(model, 2, seed=1)
    args = lambda st, w: (3, st.pend_h, st.pend_next, st.pend_n, st.mtp_pos, st.mtp_cache, w,  # noqa: E731
                          (st.mtp_pos.tolist(), st.pend_n.tolist()))
    with torch.inference_mode():
        assert model.mtp_draft(*args(st, 4)) is not None
        handle = model.mtp.fc.register_forward_hook(lambda *a: None)
        assert model.mtp_draft(*args(st, 4)) is None
        handle.remove()
        before = [c.k.clone() for c in st.mtp_cache]
        st.pend_n[0] = 5
        with pytest.raises(ValueError):
            model.mtp_draft(*args(st, 4))
        st.pend_n[0] = 1
        st.pend_next[1, 0] = model.config.vocab_size
        with pytest.raises(IndexError):
            model.mtp_draft(*args(st, 4))
        assert all(torch.equal(b, c.k) for b, c in zip(before, st.mtp_cache))
    monkeypatch.setenv("MTP_BF16", "torch")
    bf16 = tiny_model(0).to(torch.bfloat16)
    bf16.prepare_for_inference(None)
    bf16.prepare_decode(64)
    with torch.inference_mode():
        assert bf16.mtp_draft(*args(draft_state(bf16, 2, seed=1), 4)) is None
        assert "not an int8/int4" in step.verdict(bf16, "draft")  # its MTP layer runs on oneDNN


def test_keeping_every_layer_in_one_call_equals_keeping_each():
    """Cache.keep_at after a verify forward (one C call for its Gated DeltaNet layers) == each layer's
    DeltaState.keep_at, for rows keeping 0, some and all of the block."""
    model = quantized("int8")
    (_, steps, cache), (_, _, other) = both(model, 3, 4, False, seed=3)
    n = torch.tensor([0, 2, 4])
    with torch.inference_mode():
        cache.keep_at(steps, n)
        for state, st in zip(other.layers, steps):
            if st is not None:
                state.keep_at(st, n)
    for a, b in zip(cache.layers, other.layers):
        for name in ("ssm", "conv") if hasattr(a, "ssm") else ("k", "v"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("B,layers", [(1, 1), (3, 2)])
def test_the_catch_up_in_one_call_equals_it_step_by_step(kind, B, layers, monkeypatch):
    """round.catch_up through the draft chain with no drafts (`step.draft` with K = 0: depth 1 reads the pending
    positions) == the MTP step it runs otherwise: the same MTP keys/values and round state, rows with full and
    partly full pending buffers."""
    from mtp.decode.round import PENDING, catch_up

    model = quantized(kind, mtp_num_hidden_layers=layers)
    model.prepare_decode(64)
    calls = []
    real = type(model).mtp_draft

    def counted(self, K, *args):
        done = real(self, K, *args)
        calls.append((K, done is not None))
        return done

    monkeypatch.setattr(type(model), "mtp_draft", counted)
    out = []
    for one_call in (True, False):
        st = draft_state(model, B, seed=B + layers)
        st.pend_n[0] = PENDING  # a full buffer (the others: 1..4 pending)
        mask = torch.ones(B, dtype=torch.bool)
        with monkeypatch.context() as m:
            if not one_call:
                m.setattr(type(model), "mtp_draft", lambda *a: None)
            with torch.inference_mode():
                catch_up(model, st, mask, st.mtp_pos.tolist())
        out.append(st)
    assert calls == [(0, True)]
    a, b = out
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
