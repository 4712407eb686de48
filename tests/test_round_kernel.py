"""The end of a greedy round as one C call (decode/round_kernel.py) leaves the round state exactly as the tensor form
in decode/round.py (`accept_and_keep`) does: tokens, counts, positions, last tokens, the MTP's slots and pending
positions, for K = 0 (a plain step: the pending position appended) and K > 0, rows at their limit, inactive rows,
and every draft accepted or none."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from mtp.decode import round as round_mod
from mtp.decode import round_kernel
from mtp.decode.round import PENDING, RoundState, accept_and_keep

pytestmark = pytest.mark.skipif(not round_kernel.LIBRARY.available(), reason="the C kernels are not available here")


def state(model, B: int, seed: int) -> RoundState:
    g = torch.Generator().manual_seed(seed)
    st = RoundState.allocate(model, B, 64, True, False)
    st.pos.copy_(torch.randint(0, 30, (B,), generator=g))
    st.last.copy_(torch.randint(0, 64, (B,), generator=g))
    st.mtp_pos.copy_(torch.randint(0, 20, (B,), generator=g))
    st.pend_n.copy_(torch.randint(1, PENDING + 1, (B,), generator=g))
    st.pend_next.copy_(torch.randint(0, 64, st.pend_next.shape, generator=g))
    st.pend_h.copy_(torch.randn(st.pend_h.shape, generator=g))
    return st


@pytest.mark.parametrize("K", [0, 1, 3, 8])
@pytest.mark.parametrize("with_mtp,rule", [(True, None), (False, None), (True, "seeded"), (True, "unseeded"),
                                           (False, "unseeded"), (True, "penalty"), (True, "seeded penalty")])
def test_the_c_accept_leaves_the_state_the_tensor_form_leaves(K, with_mtp, rule, monkeypatch):
    """... and so does a sampling rule's round (greedy, seeded and unseeded rows mixed): the rule decides n and the next
    token, the C call emits and keeps them; with a repetition penalty it also marks the emitted tokens seen."""
    from mtp.decode.sampling import RowSampling, SamplingParams, gumbel

    model = tiny_model(0).to(torch.bfloat16)
    B, V = 6, model.config.vocab_size
    g = torch.Generator().manual_seed(K)
    target = torch.randint(0, V, (B, K + 1), generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    for b, n in enumerate([0, 1, K, K // 2, K, 2]):  # rows whose drafts match the target's first n
        drafts[b, : min(n, K)] = target[b, : min(n, K)]
    limit = torch.tensor([K, K, max(K - 1, 0), K, K, 1])
    active = torch.tensor([True, True, True, False, True, True])
    logits = torch.nn.functional.one_hot(target, V).to(torch.bfloat16)  # its argmax is the target
    hidden = torch.randn(B, K + 1, model.config.hidden_size, generator=g).to(torch.bfloat16)
    rs = draft_logits = noise = u = seen = None
    if rule is not None:  # peaked distributions: sampled rows mostly accept what matches the target
        logits = (8 * logits.float() + torch.randn(B, K + 1, V, generator=g)).to(torch.bfloat16)
        r = 1.3 if "penalty" in rule else 1.0
        sampled = SamplingParams(0.7 if rule != "penalty" else 0.0, seed=5 if "seeded" in rule else None,
                                 repetition_penalty=r)
        rs = RowSampling.build([sampled if b % 3 else SamplingParams() for b in range(B)], V, "cpu")
        if r != 1.0:
            seen = torch.rand(B, V, generator=g) < 0.3
        draft_logits = 8 * torch.nn.functional.one_hot(drafts, V).float() + torch.randn(B, K, V, generator=g)
        noise = gumbel(torch.rand(B, K + 1, V, generator=g))
        u = torch.rand(B, K, generator=g)
    results = []
    for c in (True, False):
        st = state(model, B, seed=K + 10)
        st.seen = None if seen is None else seen.clone()
        if not with_mtp:
            st.mtp_cache = st.mtp_pos = st.pend_h = st.pend_next = st.pend_n = None
        with monkeypatch.context() as m:
            if not c:
                m.setattr(round_mod.round_kernel, "usable", lambda *a: False)
            else:
                assert round_kernel.usable(st, drafts, hidden)
            tokens = accept_and_keep(st, [], hidden, logits, drafts, limit, active, rs, draft_logits, noise, u)
        results.append((tokens, st))
    (ta, sa), (tb, sb) = results
    assert torch.equal(ta, tb)
    for name in ("pos", "last", "mtp_pos", "pend_h", "pend_next", "pend_n", "seen"):
        a, b = getattr(sa, name), getattr(sb, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert ta[:, K + 1].tolist()[3] == 0  # the inactive row accepted nothing


def round_state(model, B: int, seed: int) -> RoundState:
    """A round state of B rows as if they had decoded a while: random caches, positions, last tokens, MTP slots and
    1..4 pending positions per row."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    st = RoundState.allocate(model, B, 64, True, False)
    for t in st.tensors():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g))
    st.pos.copy_(torch.randint(0, 30, (B,), generator=g))
    st.last.copy_(torch.randint(0, V, (B,), generator=g))
    st.pend_next.copy_(torch.randint(0, V, st.pend_next.shape, generator=g))
    st.pend_n.copy_(torch.randint(1, 5, (B,), generator=g))
    st.mtp_pos.copy_(torch.randint(0, 20, (B,), generator=g))
    return st


def one_round(model, st: RoundState, K: int, limits: list[int], D: int, vocab, whole: bool, sampling=None):
    """One greedy round on `st`: as one C call (`greedy_round`, which must run) or as round.py's steps. `sampling`:
    (RowSampling, draft noise, target noise) of a round whose rule is greedy over picked tokens."""
    B = st.pos.shape[0]
    starts, width = st.pos.tolist(), max(st.pend_n.tolist())
    head = None if vocab is None else vocab.head(model, 1)
    rs, d_noise, t_noise, u = sampling if sampling is not None else (None,) * 4
    with torch.inference_mode():
        if whole:
            done = round_kernel.greedy_round(model, st, K, limits, D, starts, width, None if head is None else (head, vocab.ids),
                                             sampling)
            assert done is not None
            return done[0]
        drafts, q = torch.zeros(B, 0, dtype=torch.long), None
        if K:
            drafts, q = round_mod.draft(model, st, K, rs, d_noise, vocab, width, (st.mtp_pos.tolist(), st.pend_n.tolist()))
        active = torch.tensor([b < D for b in range(B)])
        return round_mod.verify(model, st, drafts, torch.tensor(limits), active, rs, q, t_noise, u, starts).tolist()


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("B,D,K,reduced,rule", [
    (1, 1, 0, False, None), (1, 1, 3, False, None), (4, 3, 0, False, None), (4, 3, 2, False, None),
    (2, 2, 1, False, None), (3, 3, 4, True, None), (3, 3, 3, False, "seeded"), (4, 3, 2, True, "seeded top_k"),
    (1, 1, 0, False, "seeded"), (4, 3, 0, False, "unseeded top_k"), (2, 2, 0, False, "unseeded"),
    (3, 3, 3, False, "unseeded"), (4, 3, 2, True, "unseeded top_k"), (2, 2, 4, False, "unseeded"),
    (4, 3, 3, False, "penalty"), (1, 1, 0, False, "penalty"), (3, 3, 2, True, "penalty"), (3, 3, 3, False, "seeded penalty"),
    (4, 3, 3, False, "unseeded penalty top_k"), (2, 2, 0, False, "seeded penalty"), (3, 3, 3, False, "seeded top_p"),
    (4, 3, 2, True, "unseeded top_p top_k penalty"), (2, 2, 0, False, "unseeded top_p")])
def test_the_whole_round_in_one_call_leaves_what_its_steps_leave(kind, B, D, K, reduced, rule):
    """`greedy_round` (draft chain, verify forward, head, argmax, accept and keep in one C call) == round.py's draft and
    verify step by step: the same tokens and, bit for bit, every tensor of the round state (caches, MTP caches, positions,
    pending positions), for a plain step every row keeps (states in place), a plain step with a row that keeps nothing,
    rounds with drafts and rows at their limit, and over a reduced draft vocabulary. Sampled rows (at temperature 0.7,
    some with a top-k, beside greedy ones), seeded or unseeded: the same tokens from the same noise and uniforms (the
    unseeded rule's softmax rounds apart from torch's; these inputs sit nowhere near a tie). A repetition penalty (greedy
    rows with one, and sampled ones) over the tokens seen and the drafts before each position: the same drafts, tokens
    and state, the emitted tokens marked seen. Top-p: the target's cut in C (model/top_p.c), which the steps'
    `shape_logits` runs too."""
    from mtp.decode.draft_vocab import DraftVocab
    from mtp.decode.sampling import RowSampling, SamplingParams, gumbel
    from test_step import quantized

    model = quantized(kind, mtp_num_hidden_layers=2 if reduced else 1)
    model.prepare_decode(64)
    V = model.config.vocab_size
    vocab = DraftVocab(torch.arange(1, V, 3), V) if reduced else None
    limits = [K, max(K - 1, 0), K, 1][:B] if B > 1 else [K]
    sampling = seen = None
    if rule is not None:
        r = 3.0 if "penalty" in rule else 1.0
        sampled = SamplingParams(0.0 if rule == "penalty" else 0.7, top_k=5 if "top_k" in rule else None,
                                 top_p=0.6 if "top_p" in rule else None, seed=None if "unseeded" in rule else 1,
                                 repetition_penalty=r)
        rs = RowSampling.build([SamplingParams() if b == 1 else sampled for b in range(B)], V, "cpu")
        if r != 1.0:
            seen = torch.rand(B, V, generator=torch.Generator().manual_seed(4)) < 0.3
        g = torch.Generator().manual_seed(3)
        t_noise = gumbel(torch.rand(B, K + 1, V, generator=g))
        d_noise = gumbel(torch.rand(B, K, V, generator=g)) if "unseeded" in rule else t_noise[:, :K].contiguous()
        sampling = (rs, d_noise, t_noise, torch.rand(B, K, generator=g))
        if rule == "penalty":  # (greedy rows only: no noise, as the decoder draws none)
            sampling = (rs, None, None, None)
    results = []
    for whole in (True, False, True):  # (the second whole round reuses the first one's bound program)
        st = round_state(model, B, seed=B + K)
        st.seen = None if seen is None else seen.clone()
        tokens = one_round(model, st, K, limits, D, vocab, whole, sampling)
        results.append((tokens, [t.clone() for t in st.tensors()]))
    (ta, sa), (tb, sb), (tc, sc) = results
    assert ta == tb == tc and len(ta) == B and all(len(row) == K + 2 for row in ta)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(sa, sb, sc))
    assert all(row[K + 1] == 0 for row in ta[D:])  # a row not decoding accepted nothing


def test_the_whole_round_follows_changed_weights_and_hands_over_what_it_cannot_run():
    """A weight changed in place: the next decoder's state binds its rounds anew (its result is the steps' with the new
    weight); a hook on the head (even after the round was bound) and a model whose layers the programs cannot run take
    the steps; bad state raises before anything is written."""
    from test_step import quantized

    model = quantized("int8")
    model.prepare_decode(64)
    st = round_state(model, 2, seed=0)
    one_round(model, st, 2, [2, 2], 2, None, True)
    handle = model.lm_head.register_forward_hook(lambda *args: None)
    with torch.inference_mode():
        assert round_kernel.greedy_round(model, st, 2, [2, 2], 2, st.pos.tolist(), 2) is None
    handle.remove()
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    a, b = round_state(model, 2, seed=1), round_state(model, 2, seed=1)
    assert one_round(model, a, 2, [2, 2], 2, None, True) == one_round(model, b, 2, [2, 2], 2, None, False)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))

    handle = model.lm_head.register_forward_hook(lambda *args: None)
    with torch.inference_mode():
        assert round_kernel.greedy_round(model, round_state(model, 2, 2), 2, [2, 2], 2, [0, 0], 2) is None
    handle.remove()
    fp32 = tiny_model(0)
    fp32.prepare_for_inference()
    fp32.prepare_decode(64)
    with torch.inference_mode():
        assert round_kernel.greedy_round(fp32, round_state(fp32, 1, 0), 2, [2], 1, [0], 2) is None

    st = round_state(model, 1, 4)
    st.pend_next[0, 0] = model.config.vocab_size  # a pending token outside the vocabulary
    before = [t.clone() for t in st.tensors()]
    with torch.inference_mode(), pytest.raises(IndexError, match="vocabulary"):
        round_kernel.greedy_round(model, st, 2, [2], 1, st.pos.tolist(), 4)
    assert all(torch.equal(x, y) for x, y in zip(before, st.tensors()))
    with torch.inference_mode(), pytest.raises(ValueError, match="past the cache"):
        round_kernel.greedy_round(model, st, 2, [2], 1, [63], 4)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("rule", ["penalty", "seeded penalty top_k", "seeded", "unseeded penalty", "seeded top_p",
                                  "seeded top_p top_k penalty", "unseeded top_p"])
def test_the_one_call_verify_picks_every_position_as_the_shaped_target(kind, rule):
    """Every verify position's pick in the one call (not only those a round emits, which with a random model's drafts
    are mostly the first) is round.py's: the argmax of the logits the call computed, shaped by `shape_logits` with the
    penalty over the tokens seen and the drafts before that position (`seen_before`), plus the row's noise. Unseeded
    rows take accept.py's rule over those shaped logits and the chain's q, with uniforms near 0 (drafts are accepted
    unless the penalised p all but excludes them) and a penalty below 1 with nothing seen before: the drafts alone are
    boosted, so the tokens after a draft depend on its mark."""
    from mtp.decode import accept
    from mtp.decode.round import seen_before
    from mtp.decode.sampling import RowSampling, SamplingParams, gumbel, shape_logits
    from test_step import quantized

    model = quantized(kind)
    model.prepare_decode(64)
    B, K, V = 3, 4, model.config.vocab_size
    r = 1.0 if "penalty" not in rule else 0.3 if "unseeded" in rule else 3.0
    sampled = SamplingParams(0.0 if rule == "penalty" else 0.7, top_k=5 if "top_k" in rule else None,
                             top_p=0.5 if "top_p" in rule else None, seed=None if "unseeded" in rule else 1,
                             repetition_penalty=r)
    rs = RowSampling.build([SamplingParams() if b == 1 else sampled for b in range(B)], V, "cpu")
    g = torch.Generator().manual_seed(5)
    t_noise = gumbel(torch.rand(B, K + 1, V, generator=g))
    d_noise = gumbel(torch.rand(B, K, V, generator=g)) if "unseeded" in rule else t_noise[:, :K].contiguous()
    u = torch.full((B, K), 1e-4)
    sampling = (rs, None, None, None) if rule == "penalty" else (rs, d_noise, t_noise, u)
    st = round_state(model, B, seed=9)
    if r != 1.0:
        st.seen = torch.rand(B, V, generator=g) < (0.3 if r > 1 else 0.0)
    seen = None if st.seen is None else st.seen.clone()
    one_round(model, st, K, [K] * B, B, None, True, sampling)
    prog = st.__dict__["greedy_plans"][(K, False, None)].program
    logits = prog.logits.view(B, K + 1, V)
    x = shape_logits(logits, rs, seen_before(seen, prog.drafts))
    if rs.use_top_p:  # (the cut left some tokens, and cut some)
        kept = (x > float("-inf")).sum(-1)[~rs.greedy]
        assert kept.min() >= 1 and kept.max() < (V if not rs.use_top_k else 5)
    want = torch.where(rs.greedy[:, None, None], x, x + t_noise).argmax(-1)
    if rs.any_unseeded:  # an unseeded row's target: its accepted drafts, then its next token (the rest unread)
        n, nxt = accept.accept_rows(prog.drafts, torch.full((B,), K), x, st.__dict__["sample_q"], rs, t_noise, u)
        for b in rs.unseeded.nonzero()[:, 0].tolist():
            want[b, : n[b]], want[b, n[b]] = prog.drafts[b, : n[b]], nxt[b]
            want[b, n[b] + 1:] = prog.target[b, n[b] + 1:]
        if r != 1.0:  # (every unseeded row accepted a draft: the positions after it, and their marks, count)
            assert n[rs.unseeded].min() > 0
    assert torch.equal(prog.target, want)


@pytest.mark.parametrize("D", [2, 1])
def test_rounds_of_every_width_share_one_scratch_and_stay_exact(D):
    """Rounds of changing width on one state (as `auto` picks them): the bound rounds share one scratch buffer, grown
    for the widest (dropping the rounds bound to the old one), and every round leaves what its steps leave."""
    from test_step import quantized

    model = quantized("bf16")
    model.prepare_decode(64)
    whole, steps = round_state(model, 2, seed=7), round_state(model, 2, seed=7)
    for K in (1, 3, 0, 2, 3, 0, 1):
        limits = [K, K]
        assert one_round(model, whole, K, limits, D, None, True) == one_round(model, steps, K, limits, D, None, False)
        assert all(torch.equal(x, y) for x, y in zip(whole.tensors(), steps.tensors())), K
    scratch = whole.__dict__["greedy_scratch"]
    assert set(whole.__dict__["greedy_plans"]) >= {(3, False, None), (1, False, None)}  # (built on the grown buffer)
    for plan in whole.__dict__["greedy_plans"].values():
        steps, window = plan.program.held[:2]
        scratch_tensors = [x for st in steps if st is not None for x in (st.window, st.updates)]
        scratch_tensors += [] if window is None else [window]
        assert scratch_tensors and all(t.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr()
                                       for t in scratch_tensors)


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("draft_tokens", [None, 1, 3, "auto"])
def test_rounds_chained_in_one_call_decode_what_single_rounds_do(kind, draft_tokens, monkeypatch):
    """`generate` runs a lone greedy sequence's rounds back to back in one C call (`greedy_rounds`, `Decoder(chain=16)`):
    the same tokens as one round a call (chain = 1), and at a fixed k the same rounds (drafts offered and accepted,
    token kinds); stopped by the length limit, and by an EOS token in mid-round (the tokens after it dropped, the
    finish reason "eos"). `auto` learns from every chained round (its probes fall where they fall unchained)."""
    import importlib

    import mtp
    from test_step import quantized

    gen = importlib.import_module("mtp.decode.generate")
    model = quantized(kind)
    prompt = [5, 9, 2, 31, 7]

    def decode(chain: int, eos: list[int], max_new: int):
        decoder = gen.Decoder
        monkeypatch.setattr(gen, "Decoder", lambda *a, **kw: decoder(*a, **{**kw, "chain": chain}))
        calls = []
        rounds = round_kernel.greedy_rounds
        monkeypatch.setattr(round_kernel, "greedy_rounds", lambda *a, **kw: calls.append(1) or rounds(*a, **kw))
        r = mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=draft_tokens, eos_token_ids=eos)
        monkeypatch.setattr(gen, "Decoder", decoder)
        return r, len(calls)

    if draft_tokens == "auto":  # a policy that has seen every draft accepted and cheap drafts (this model's are not):
        # deep in both states, so its rounds chain between probes from the first rounds after the prompt's
        from mtp.decode.decoder import Decoder

        policy = Decoder(model, 1, 128, "auto").policy  # (its counts and times are every later decoder's)
        for k in range(policy.k_max + 1):
            policy.rounds.record((1, k), (1 + 0.02 * k) * 1e-3)
        for r in range(60):
            policy.counts.record([(policy.k_max, policy.k_max)], [r % 2])
    (free, n_free), (one, n_one) = decode(16, [], 57), decode(1, [], 57)
    assert free.tokens == one.tokens and len(free.tokens) == 57 and free.finish_reason == "length"
    assert n_free > 0 and n_one == 0  # (chain 1: never called)
    eos = free.tokens[40]  # an EOS token emitted in mid-generation (in mid-round where drafts are accepted)
    (a, _), (b, _) = decode(16, [eos], 57), decode(1, [eos], 57)
    assert a.tokens == b.tokens == free.tokens[: free.tokens.index(eos) + 1] and a.finish_reason == b.finish_reason == "eos"
    if draft_tokens != "auto":
        for x, y in ((free, one), (a, b)):
            assert x.stats.k_history == y.stats.k_history and x.stats.n_history == y.stats.n_history
            assert x.kinds == y.kinds and x.stats.backbone_forwards == y.stats.backbone_forwards


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_chained_rounds_switch_width_by_state_as_single_rounds_would(kind):
    """`greedy_rounds` with a width per state (after a rejection 1, after a fully accepted round 3; a fixed k: one
    width) == `greedy_round` called once a round with the width of the state the last round left: the same rounds,
    tokens and, bit for bit, the round state; a stop token ends the chain after its round. (From this state the rounds
    switch both ways here, one accepting its draft and the next drafting 3; the equalities hold whichever way.)"""
    from test_step import quantized

    model = quantized(kind)
    model.prepare_decode(64)
    for ks, full in (((1, 3), True), ((1, 3), False), ((2, 2), False)):
        chained, single = round_state(model, 1, seed=12), round_state(model, 1, seed=12)
        with torch.inference_mode():
            got = round_kernel.greedy_rounds(model, chained, ks, full, 40, chained.pos.item(), rounds=12)
        assert got is not None
        rounds, seconds, _ = got
        assert len(rounds) == len(seconds) and all(t > 0 for t in seconds)
        want, state = [], full
        while sum(n + 1 for _, (*_, n) in want) + ks[state] + 1 <= 40 and len(want) < 12:
            K = ks[state]
            out = one_round(model, single, K, [K], 1, None, True)[0]
            want.append((K, out))
            state = out[K + 1] == K
        assert rounds == want and ks[full] == rounds[0][0]
        assert all(torch.equal(x, y) for x, y in zip(chained.tensors(), single.tensors()))
    stop = rounds[2][1][0]  # the third round's first token: the chain stops after the first round that emits it
    again = round_state(model, 1, seed=12)
    with torch.inference_mode():
        cut = round_kernel.greedy_rounds(model, again, ks, full, 40, again.pos.item(), stop=[stop], rounds=12)[0]
    first = next(i for i, (K, out) in enumerate(rounds) if stop in out[: out[K + 1] + 1])
    assert cut == rounds[: first + 1]


def test_a_chained_round_that_fails_raises_what_a_single_one_does():
    """Bad state in a chain (a pending token outside the vocabulary, read by the first round's draft chain): the same
    IndexError `greedy_round` raises, whichever of the two widths' plans ran it."""
    from test_step import quantized

    model = quantized("int8")
    model.prepare_decode(64)
    for ks, full in (((1, 3), True), ((1, 3), False), ((2, 2), False)):
        st = round_state(model, 1, seed=4)
        st.pend_next[0, 0] = model.config.vocab_size
        with torch.inference_mode(), pytest.raises(IndexError, match="vocabulary"):
            round_kernel.greedy_rounds(model, st, ks, full, 40, st.pos.item())


def test_autos_cold_rounds_chain_and_teach_no_times(monkeypatch):
    """A lone greedy sequence under `auto`: the COLD_ROUNDS rounds after its prompt (decoder.py: slower whatever their
    k) run as one chained call, not one call each, and none of their times reaches the policy; the output is plain
    decoding's."""
    import mtp
    from mtp.decode import decoder as dec
    from test_step import quantized

    model = quantized("int8")
    prompt = [5, 9, 2, 31, 7]
    want = mtp.generate(model, prompt, max_new_tokens=80, eos_token_ids=[]).tokens
    policy = dec.Decoder(model, 1, 128, "auto").policy  # (its counts and times are every later decoder's)
    for k in range(policy.k_max + 1):  # measured already: no round of this generation has to measure one
        for _ in range(16):
            policy.rounds.record((1, k), (1 + 0.02 * k) * 1e-3)
    calls, learned = [], []
    rounds, update = round_kernel.greedy_rounds, dec.DraftPolicy.update
    monkeypatch.setattr(round_kernel, "greedy_rounds", lambda *a, **kw: calls.append(a[-1]) or rounds(*a, **kw))
    monkeypatch.setattr(dec.DraftPolicy, "update", lambda self, b, k, rows, s, bucket=None:
                        learned.append(s) or update(self, b, k, rows, s, bucket))
    r = mtp.generate(model, prompt, max_new_tokens=80, draft_tokens="auto", eos_token_ids=[])
    assert r.tokens == want
    assert calls and calls[0] == dec.COLD_ROUNDS  # the first call: the cold rounds, chained
    assert learned[: dec.COLD_ROUNDS] == [None] * dec.COLD_ROUNDS and any(s is not None for s in learned[dec.COLD_ROUNDS:])
