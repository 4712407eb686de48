"""Lossless MTP speculative decoding: token equality, acceptance patterns, cache state, forward counts."""

import random
import statistics

import pytest
import torch

import mtp
from conftest import pattern_batch, scripted_drafts_patterns, tiny_model, trained_tiny_model
from mtp.decode.accept import accept_argmax, accept_rows
from mtp.decode.policy import DraftPolicy
from mtp.decode.sampling import RowSampling, SamplingParams


@pytest.fixture(scope="module")
def models():
    return {
        "sequential-hybrid": trained_tiny_model(depth=3),
        "sequential-attention": trained_tiny_model(depth=2, full_attention_interval=1, seed=1),
        "sequential-2-layers": trained_tiny_model(mtp_num_hidden_layers=2, seed=2),
        "parallel": trained_tiny_model(mtp_style="parallel", mtp_num_hidden_layers=3, seed=3),
        "untrained-vocab-4": tiny_model(vocab_size=4, seed=4),
    }


def prompts(vocab, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [pattern_batch(vocab, 1, int(torch.randint(1, 20, (1,), generator=g)), g)[0].tolist() for _ in range(n)]


@pytest.mark.parametrize("name", ["sequential-hybrid", "sequential-attention", "sequential-2-layers", "parallel",
                                  "untrained-vocab-4"])
def test_greedy_speculative_equals_plain_for_every_k(models, name):
    model = models[name]
    ks = [1, 2, 3] if name == "parallel" else [1, 2, 3, 4, 5, 6]
    for prompt in prompts(model.config.vocab_size, n=4):
        for max_new in (3, 25):
            want = mtp.generate(model, prompt, max_new_tokens=max_new).tokens
            for k in ks + ["auto"]:
                r = mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=k)
                assert r.tokens == want, (prompt, max_new, k)
                assert r.stats.backbone_forwards == len(r.stats.k_history)


@pytest.mark.parametrize("pattern", ["none", "some", "all", "mixed"])
def test_greedy_speculative_equals_plain_under_every_acceptance_pattern(models, monkeypatch, pattern):
    """Drafts scripted from the plain output force each acceptance pattern on any CPU (which patterns a quickly trained
    head happens to produce depends on the machine that trained it)."""
    seen = scripted_drafts_patterns(models["sequential-hybrid"], prompts(8)[0], monkeypatch, pattern)
    assert seen == ({"none", "some", "all"} if pattern == "mixed" else {pattern}), seen


@pytest.mark.parametrize("name", ["sequential-hybrid", "parallel"])
def test_reduced_vocabulary_drafting_stays_lossless(models, name):
    """Greedy output is the backbone's whatever the draft vocabulary (drafts outside it can only be missed)."""
    from mtp.decode.draft_vocab import DraftVocab

    model = models[name]
    for ids in ([0, 1, 2, 3], [2, 5], list(range(8))):
        vocab = DraftVocab(ids, model.config.vocab_size)
        for prompt in prompts(model.config.vocab_size, n=3, seed=5):
            want = mtp.generate(model, prompt, max_new_tokens=25).tokens
            for k in (1, 3, "auto"):
                r = mtp.generate(model, prompt, max_new_tokens=25, draft_tokens=k, draft_vocab=vocab)
                assert r.tokens == want, (ids, k)
    full = DraftVocab(list(range(8)), 8)  # the whole vocabulary drafts exactly what the full head does
    prompt = prompts(8, n=1, seed=6)[0]
    a = mtp.generate(model, prompt, max_new_tokens=25, draft_tokens=3)
    b = mtp.generate(model, prompt, max_new_tokens=25, draft_tokens=3, draft_vocab=full)
    assert a.stats.n_history == b.stats.n_history


def test_one_backbone_forward_per_verify_step(models):
    model = models["sequential-hybrid"]
    calls = []
    handle = model.model.norm.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))  # once per backbone forward
    try:
        r = mtp.generate(model, prompts(8)[0], max_new_tokens=30, draft_tokens=4)
    finally:
        handle.remove()
    assert len(calls) == 1 + r.stats.backbone_forwards  # prefill + one forward per verify
    # each verifies [last token, 4 drafts] at once: the width is the policy's k, also in the last rounds where fewer
    # drafts can be used (their slots are masked), so a compiled round has one graph per k; none usable: a plain step
    assert calls[1:] == [5 if k else 1 for k in r.stats.k_history]
    assert r.stats.k_history[0] == 4  # the stats count the drafts a round could use
    assert r.stats.mean_accepted_length == (r.stats.new_tokens - 1) / r.stats.backbone_forwards


@pytest.fixture(scope="module")
def bf16_model(models):
    import copy

    model = copy.deepcopy(models["sequential-hybrid"]).to(torch.bfloat16)
    model.prepare_for_inference()  # row-invariant kernels: a verify row equals its plain step bit for bit
    return model


@pytest.mark.parametrize("n_keep", [0, 1, 2, 4])
@torch.no_grad()
def test_cache_after_keep_equals_plain_decoding(bf16_model, n_keep):
    """A decode forward of 4 tokens then keep_at(n) leaves the cache as n plain steps would (n = 0: untouched), bit
    for bit in bf16 (fp32 matmuls are not row-invariant: tests/test_precision.py)."""
    model = bf16_model
    prompt = torch.tensor([prompts(8)[1] + [1, 2, 3]])
    P = prompt.shape[1]
    block = torch.tensor([[5, 1, 7, 2]])  # [last token, 3 drafts]; keep n_keep of the 4 positions
    model.prepare_decode(64)
    spec = model.new_cache(1, 64)
    model(prompt, spec)
    hidden, steps = model.decode(block, spec, model.decode_positions(torch.arange(P, P + 4)[None], [P]))
    spec.keep_at(steps, torch.tensor([n_keep]))
    plain = model.new_cache(1, 64)
    model(prompt, plain)
    for i in range(n_keep):
        h, st = model.decode(block[:, i : i + 1], plain, model.decode_positions(torch.tensor([[P + i]]), [P + i]))
        plain.keep_at(st, torch.tensor([1]))
        assert torch.equal(h[0, 0], hidden[0, i])  # each verified position exactly as its plain step
    for a, b in zip(spec.layers, plain.layers):
        if hasattr(a, "ssm"):
            assert torch.equal(a.conv, b.conv) and torch.equal(a.ssm, b.ssm)
        else:
            assert torch.equal(a.k[:, :, : P + n_keep], b.k[:, :, : P + n_keep])
            assert torch.equal(a.v[:, :, : P + n_keep], b.v[:, :, : P + n_keep])


def test_accept_greedy_patterns():
    V = 10
    target = torch.tensor([[4, 2, 3, 9], [1, 2, 5, 9], [1, 2, 3, 9], [1, 2, 3, 9]])  # the backbone's argmax per position
    logits = torch.nn.functional.one_hot(target, V).float()
    drafts = torch.tensor([[1, 2, 3]] * 4)
    n, nxt = accept_argmax(drafts, torch.tensor([3, 3, 3, 1]), logits)
    assert n.tolist() == [0, 2, 3, 1]  # none, some (correction at the first mismatch), all (+ bonus), capped by limit
    assert nxt.tolist() == [4, 5, 9, 2]
    n, nxt = accept_argmax(drafts[:, :0], torch.tensor([0] * 4), logits[:, :1])
    assert n.tolist() == [0] * 4 and nxt.tolist() == [4, 1, 1, 1]  # no drafts: a plain step


def test_accept_sampling_hand_made_distributions():
    """Leviathan's rule on hand-made p and q (one unseeded sampled row per case)."""
    torch.manual_seed(0)
    rs = RowSampling.build([SamplingParams(temperature=1.0)], 3, "cpu")
    log = lambda p: torch.tensor(p).log()  # noqa: E731 - shaped logits whose softmax is p

    def run(drafts, p, q, n=1):
        out = []
        for _ in range(n):
            noise = -(-torch.rand(1, len(p), 3).log()).log()
            res = accept_rows(torch.tensor([drafts]), torch.tensor([len(drafts)]), log(p)[None], log(q)[None], rs,
                              noise, torch.rand(1, len(drafts)))
            out.append((int(res[0]), int(res[1])))
        return out

    p = [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert run([0], p, [[1.0, 0.0, 0.0]]) == [(0, 1)]  # p(x)=0: always rejected, residual is p
    assert run([1], p, [[0.0, 1.0, 0.0]]) == [(1, 2)]  # p=q: always accepted + bonus
    outcomes = run([1], [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]], n=4000)
    accepted = sum(n for n, _ in outcomes) / len(outcomes)
    assert 0.45 < accepted < 0.55  # min(1, 0.5/1)
    assert all(tok == 0 for n, tok in outcomes)  # rejected -> residual max(0, p-q) = token 0; accepted -> bonus 0


def settle(verify_cost, accept_every=3, rounds=300) -> int:
    """Run the auto policy for one sequence against a made-up round cost; returns where k settles."""
    pol = DraftPolicy.from_arg("auto", 8)
    for r in range(rounds):
        k = pol.next_k(1)
        pol.update(1, k, [(k, k if r % accept_every else 0)], 0.0005 * k + verify_cost(k + 1))
    return pol.k_last


def test_auto_policy_follows_the_verify_cost():
    """An MoE-like verify (each extra token +80% of a plain step) makes auto stop drafting at modest acceptance;
    the same acceptance with a flat verify cost makes it draft deep."""
    assert settle(lambda q: 0.01 * (1 + 0.8 * (q - 1))) == 0
    assert settle(lambda q: 0.01 * (1 + 0.02 * (q - 1))) >= 4


def test_auto_policy_is_not_thrown_by_rounds_the_machine_slowed():
    """Every 5th drafting round slowed 6x by interference (another process, a page fault) leaves auto drafting deep
    where drafts pay (a mean over the rounds chose k = 0 here); a lasting change of cost is still followed."""
    pol = DraftPolicy.from_arg("auto", 8)
    for r in range(300):
        k = pol.next_k(1)
        cost = 0.01 + 0.001 * k
        pol.update(1, k, [(k, k if r % 4 else 0)], cost * (6 if k and r % 5 == 0 else 1))
    assert pol.k_last >= 3
    for r in range(300):  # from now on every drafting round costs 6x: drafting stops
        k = pol.next_k(1)
        pol.update(1, k, [(k, k if r % 4 else 0)], (0.01 + 0.001 * k) * (6 if k else 1))
    assert pol.k_last == 0


def test_auto_policy_stays_in_bounds_and_follows_acceptance():
    pol = DraftPolicy.from_arg("auto", 8)
    for _ in range(50):
        k = pol.next_k(1)
        assert 0 <= k <= pol.k_max
        pol.update(1, k, [(k, k)], 0.01 + 0.002 * k)  # everything accepted, cheap drafts
    assert pol.k_last >= 5
    for _ in range(200):
        k = pol.next_k(1)
        pol.update(1, k, [(k, 0)], 0.01 + 0.002 * k)  # nothing accepted
    assert pol.k_last == 0  # drafting turned off
    with pytest.raises(ValueError, match="draft_tokens"):
        DraftPolicy.from_arg(9, 8)


def test_auto_policy_drafts_by_how_the_last_round_ended():
    """Where drafts are accepted far more often after a fully accepted round than after a rejection (as on the shipped
    model), `auto` drafts deep after a full round and little after a rejection; acceptance pooled over both would give
    both the same k."""
    from mtp.decode.policy import AFTER_FULL, AFTER_REJECTION

    pol = DraftPolicy.from_arg("auto", 8)
    rng = random.Random(0)
    ks: dict[int, list[int]] = {AFTER_FULL: [], AFTER_REJECTION: []}
    for r in range(600):
        state = pol.states[0] if pol.states else AFTER_REJECTION
        k = pol.next_k(1)
        n = 0
        while n < k and rng.random() < (0.95 if state == AFTER_FULL else 0.5):
            n += 1
        pol.update(1, k, [(k, n)], 0.01 + 0.001 * k)
        if r >= 300:
            ks[state].append(k)
    assert pol.states == [AFTER_FULL if n == k else AFTER_REJECTION]
    deep, shallow = (statistics.median(ks[s]) for s in (AFTER_FULL, AFTER_REJECTION))
    assert len(ks[AFTER_FULL]) > 20 and len(ks[AFTER_REJECTION]) > 20
    assert deep >= 6 and shallow <= 3


def test_auto_commits_a_lone_row_to_its_k_by_state_up_to_the_next_probe():
    """`run` and `by_state` (the rounds a lone row may chain, and its k after a rejection and after a fully accepted
    round): up to the next probe, 1 on a probe or a measuring round and for a batch; `by_state` deep after a full round
    and shallow after a rejection where acceptance differs so. Rounds chained (each at its state's k) and counted with
    `advance` keep the probes where they fall without a chain. A caller that does not chain gets run 1."""
    from mtp.decode.policy import AFTER_FULL

    def policy(apart: bool) -> DraftPolicy:
        pol = DraftPolicy.from_arg("auto", 8)
        for r in range(120):  # cheap drafts; acceptance the same in both states (or far higher after a full round)
            k = pol.next_k(1, chain=True)
            full = bool(pol.states) and pol.states[0] == AFTER_FULL
            n = k if r % 5 else 0
            if apart and not full:
                n = min(n, 1)
            pol.update(1, k, [(k, n)], 0.01 + 0.001 * k)
        return pol

    pol = policy(apart=False)
    probes, runs, n0 = [], [], pol.n
    for _ in range(64):
        k = pol.next_k(1, chain=True)
        if pol.probed is not None or k != pol.k_last:
            probes.append(pol.n)
            assert pol.run == 1
        else:
            runs.append(pol.run)
            every = pol.probe_every << pol.rounds.settled
            nxt = next(m for m in range(pol.n + 1, pol.n + every + 1)
                       if (m % every == 0 and k < pol.k_max) or (m % every == every // 2 and k > 0))
            assert pol.run == nxt - pol.n and pol.by_state[pol.states[0]] == k
        pol.update(1, k, [(k, k)], 0.01 + 0.001 * k)
    assert probes and max(runs) > 1
    chained = policy(apart=False)
    seen = []
    while chained.n < n0 + 64:  # the same rounds, chained as the decoder chains them
        k = chained.next_k(1, chain=True)
        if chained.probed is not None or k != chained.k_last:
            seen.append(chained.n)
        for _ in range(chained.run):
            chained.update(1, k, [(k, k)], 0.01 + 0.001 * k)
        chained.advance(chained.run - 1)
    assert [n for n in seen if n <= n0 + 64] == probes
    apart = policy(apart=True)
    deeper = 0
    for _ in range(16):
        k = apart.next_k(1, chain=True)
        deeper += apart.by_state[1] > apart.by_state[0]
        apart.update(1, k, [(k, k)], 0.01 + 0.001 * k)
    assert deeper >= 12
    pol.next_k(2, chain=True)
    assert pol.run == 1  # a batch: one round at a time
    k = pol.next_k(1)
    assert pol.run == 1 and pol.probed is None and k == pol.k_last  # (not asked to chain)


def test_a_new_generation_starts_from_the_acceptance_the_last_one_saw(models):
    """Round costs where drafting pays only at high acceptance (a plain round 3.1 ms, k = 3 7.7 ms: the shipped bf16
    model's on an AVX2 EPYC): a fresh policy whose first draft is rejected falls to k = 0 under the prior, while one
    starting from a previous generation's counts (90% accepted) keeps drafting; decoders of one model share them."""
    from mtp.decode.decoder import Decoder
    from mtp.decode.policy import Acceptance, RoundTimes

    rounds = RoundTimes()
    for k, ms in enumerate((3.1, 5.2, 5.9, 7.7)):
        rounds.record((1, k), ms / 1e3)
    seen = Acceptance()
    for r in range(60):
        seen.record([(3, 3 if r % 10 else 0)], [r % 2])
    ks = []
    for counts in (Acceptance(), seen):
        pol = DraftPolicy.from_arg("auto", 8, rounds, counts)
        pol.update(1, 3, [(3, 0)], 7.7e-3)  # the first draft rejected
        ks.append(pol.next_k(1))
    assert ks[0] == 0 and ks[1] >= 2
    model = models["sequential-hybrid"]
    one, two = (Decoder(model, 1, 64, "auto").policy for _ in range(2))
    assert one.counts is two.counts and Decoder(model, 1, 64, 3).policy.k_fixed == 3


def test_auto_rests_the_mtp_where_drafting_has_not_paid(models):
    """Once QUIET_MAX probes in a row have found k = 0 best, `auto` generations of one sequence run plain - no MTP
    state, no prompt read by the MTP - all but every REST_PROBE-th, which drafts again to measure; a batch decoder
    keeps its MTP; the tokens are plain decoding's throughout."""
    from mtp.decode.decoder import Decoder
    from mtp.decode.policy import QUIET_MAX, REST_PROBE

    model = models["sequential-hybrid"]
    prompt = [3, 1, 4, 1, 5]
    want = mtp.generate(model, prompt, max_new_tokens=12).tokens
    assert mtp.generate(model, prompt, max_new_tokens=12, draft_tokens="auto").tokens == want
    first = Decoder(model, 1, 64, "auto")  # (its round times are the ones every generation of one sequence shares)
    assert first.use_mtp  # (quiet below QUIET_MAX: nothing rests)
    rounds = first.policy.rounds
    for k in range(0, 7):  # rounds with drafts 100x a plain one's: k = 0 best throughout
        for _ in range(16):
            rounds.record((1, k), 1e-3 if k == 0 else 0.1)
    rounds.quiet, rounds.rested = QUIET_MAX, 0
    drafted = []
    for _ in range(2 * REST_PROBE):
        r = mtp.generate(model, prompt, max_new_tokens=12, draft_tokens="auto")
        assert r.tokens == want
        drafted.append(r.stats.draft_tokens_max > 0)
    assert drafted == [(i + 1) % REST_PROBE == 0 for i in range(2 * REST_PROBE)]
    assert Decoder(model, 4, 64, "auto").use_mtp  # a batch decoder keeps its MTP
    for _ in range(16):  # drafting pays again: the next probing generation drafts, and then none rests
        rounds.record((1, 3), 0.5 * rounds.estimates[(1, 0)])
    while not (r := mtp.generate(model, prompt, max_new_tokens=12, draft_tokens="auto")).stats.draft_tokens_max:
        assert r.tokens == want
    assert r.tokens == want and rounds.quiet < QUIET_MAX
    assert Decoder(model, 1, 64, "auto").use_mtp and rounds.rested == 0


@pytest.mark.parametrize("stop_kind", ["eos", "length"])
def test_stops_are_exact_under_speculation(models, stop_kind):
    model = models["sequential-hybrid"]
    for prompt in prompts(8, n=6, seed=3):
        full = mtp.generate(model, prompt, max_new_tokens=40).tokens
        if stop_kind == "eos":
            eos = full[len(full) // 2]
            want = full[: full.index(eos) + 1]
            for k in (2, 4, "auto"):
                r = mtp.generate(model, prompt, max_new_tokens=40, eos_token_ids=[eos], draft_tokens=k)
                assert r.tokens == want and r.finish_reason == "eos"
        else:
            for n in (1, 2, 5, 13):
                r = mtp.generate(model, prompt, max_new_tokens=n, draft_tokens=6)
                assert r.tokens == full[:n] and r.finish_reason == "length"
                if n == 1:  # the prompt's forward gave the one token: no round after it
                    assert r.stats.backbone_forwards == 0


def test_context_limit_is_never_overrun():
    model = trained_tiny_model(steps=30, max_position_embeddings=40)
    prompt = list(range(8)) * 4  # 32 tokens
    r = mtp.generate(model, prompt, max_new_tokens=100, draft_tokens=6)
    assert len(prompt) + len(r.tokens) == 40 and r.finish_reason == "length"
    assert r.tokens == mtp.generate(model, prompt, max_new_tokens=100).tokens
    with pytest.raises(ValueError, match="does not fit the context"):
        mtp.generate(model, list(range(8)) * 5, max_new_tokens=1, draft_tokens=2)


def test_streaming_yields_the_same_tokens(models):
    model = models["sequential-hybrid"]
    prompt = prompts(8)[2]
    s = mtp.stream(model, prompt, max_new_tokens=30, draft_tokens=3)
    chunks = list(s)
    assert sum(chunks, []) == s.result.tokens == mtp.generate(model, prompt, max_new_tokens=30).tokens
    assert max(len(c) for c in chunks) > 1  # several tokens per step at least once


def test_verify_keeps_every_state_and_matches_plain_steps_bit_for_bit():
    """A verify block computes each position exactly as a 1-token plain step does (same arithmetic), and keeps the
    state after every position."""
    from mtp.model.deltanet import l2norm, recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    B, H, T, K, V = 2, 3, 9, 16, 8
    q = l2norm(torch.randn(B, H, T, K, generator=g)) * K**-0.5
    k = l2norm(torch.randn(B, H, T, K, generator=g))
    v, S0 = torch.randn(B, H, T, V, generator=g), torch.randn(B, H, K, V, generator=g)
    decay, beta = -torch.rand(B, H, T, generator=g), torch.rand(B, H, T, generator=g)
    o, final, states = recurrent_gated_delta_rule(q, k, v, decay, beta, S0, keep_states=True)
    assert torch.equal(states[:, :, -1], final)
    S = S0
    for t in range(T):
        o_t, S, _ = recurrent_gated_delta_rule(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                               decay[:, :, t : t + 1], beta[:, :, t : t + 1], S)
        assert torch.equal(states[:, :, t], S) and torch.equal(o[:, :, t], o_t[:, :, 0])


@torch.no_grad()
def test_first_draft_equals_the_teacher_forced_mtp_prediction(models, monkeypatch):
    """The catch-up forward is exactly depth 1 of `mtp_logits`: no stale chain slot leaks into it."""
    import mtp.decode.round as rnd

    model = models["sequential-hybrid"]
    seen = []
    real = rnd.draft

    def recording(model_, st, K, *a, **kw):
        drafts, qs = real(model_, st, K, *a, **kw)
        seen.append((int(st.pos[0]) - 1, int(drafts[0, 0])))  # draft 1 comes from the last consumed position
        return drafts, qs

    monkeypatch.setattr(rnd, "draft", recording)
    for k in (2, 4):
        seen.clear()
        prompt = prompts(8)[3]
        r = mtp.generate(model, prompt, max_new_tokens=40, draft_tokens=k)
        full = torch.tensor([prompt + r.tokens])
        teacher = model.mtp_logits(full, 1)[0][0].argmax(-1)  # position i predicts token i+2
        assert len(seen) == sum(1 for kk in r.stats.k_history if kk)  # one first draft per round that drafts
        for pos, draft in seen:
            assert draft == int(teacher[pos]), (k, pos)
