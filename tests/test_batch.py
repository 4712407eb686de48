"""Continuous batching with batched speculative decoding: every sequence's output is what it gets alone (greedy),
the sampled law is the target's (chi-square), rows join and leave between rounds, and k adapts to the batch."""

from __future__ import annotations

import math

import pytest
import torch

import mtp
import test_sampling_stats as stats
from conftest import pattern_batch, tiny_model, trained_tiny_model
from mtp.decode.decoder import COLD_ROUNDS, POOL_SLOTS, Decoder
from mtp.decode.policy import Acceptance, DraftPolicy, RoundTimes, solve
from mtp.decode.sampling import SamplingParams
from mtp.decode.session import Session


def run_batched(model, requests, draft_tokens, max_batch=4, arrive_every=3, cancel=(), eos=None):
    """requests: (prompt, max_new, SamplingParams, stop). Arrivals are staggered; returns the sessions in order. `eos`:
    the sessions' end tokens (None: the model's)."""
    dec = Decoder(model, max_batch=max_batch, max_len=model.context_length - 16, draft_tokens=draft_tokens)
    seqs, step = [], 0
    todo = list(requests)
    while todo or any(not s.finished for s in seqs) or dec.rows:
        if todo and step % arrive_every == 0:
            prompt, max_new, params, stop = todo.pop(0)
            seqs.append(dec.add(Session(model, prompt, max_new, params, eos, stop, model.tokenizer)))
        for i in cancel:
            if i < len(seqs) and len(seqs[i].session.new_tokens) >= 3:
                seqs[i].cancelled = True
        dec.step()
        step += 1
        assert step < 5000, "the batch does not finish"
        assert len(dec.rows) <= max_batch and all(r.decoding for r in dec.rows[:dec.decoding])
    return [s.session for s in seqs]


def greedy_requests(vocab, n, seed, max_prompt=150):
    g = torch.Generator().manual_seed(seed)
    return [(pattern_batch(vocab, 1, int(torch.randint(1, max_prompt, (1,), generator=g)), g)[0].tolist(),
             int(torch.randint(1, 40, (1,), generator=g)), SamplingParams(), None) for _ in range(n)]


@pytest.fixture(scope="module")
def models():
    fp32 = trained_tiny_model(steps=80, depth=2, max_position_embeddings=512)
    bf16 = trained_tiny_model(steps=80, depth=2, max_position_embeddings=512, seed=1).to(torch.bfloat16)
    bf16.prepare_for_inference()
    parallel = trained_tiny_model(steps=60, mtp_style="parallel", mtp_num_hidden_layers=3, seed=2,
                                  max_position_embeddings=512)
    return {"fp32": fp32, "bf16": bf16, "parallel": parallel}


@pytest.mark.parametrize("name", ["fp32", "bf16", "parallel"])
@pytest.mark.parametrize("draft_tokens", [None, 2, "auto"])
def test_batched_greedy_equals_solo_greedy(models, name, draft_tokens):
    model = models[name]
    requests = greedy_requests(8, 9, seed=3)
    sessions = run_batched(model, requests, draft_tokens)
    for (prompt, max_new, _, _), s in zip(requests, sessions):
        solo = mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=draft_tokens)
        assert s.new_tokens == solo.tokens and s.finish_reason == solo.finish_reason
        if draft_tokens is not None:
            assert s.stats.backbone_forwards == len(s.stats.k_history)


def test_rows_are_reused_after_cancellations_and_long_prompts(models):
    """A newcomer takes a freed row (its old state must not leak) and a prompt longer than a prefill chunk is read
    over several steps between rounds."""
    model = models["bf16"]
    requests = greedy_requests(8, 7, seed=4, max_prompt=400)
    sessions = run_batched(model, requests, 3, max_batch=2, arrive_every=1, cancel=(1, 3))
    for i, ((prompt, max_new, _, _), s) in enumerate(zip(requests, sessions)):
        solo = mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=3).tokens
        if i in (1, 3):
            assert solo[: len(s.new_tokens)] == s.new_tokens  # stopped early, correct so far
        else:
            assert s.new_tokens == solo


def test_greedy_and_sampled_requests_mix_in_one_batch(models):
    model = models["fp32"]
    greedy = greedy_requests(8, 4, seed=5)
    sampled = [(p, n, SamplingParams(temperature=0.9, top_k=5, seed=i), None) for i, (p, n, _, _) in enumerate(greedy)]
    mixed = [r for pair in zip(greedy, sampled) for r in pair]
    sessions = run_batched(model, mixed, "auto", max_batch=8, arrive_every=1)
    for (prompt, max_new, params, _), s in zip(mixed, sessions):
        # greedy: the solo output; seeded sampling: the solo sample too (Gumbel-max noise fixed per position)
        solo = mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens="auto", temperature=params.temperature,
                            top_k=params.top_k, seed=params.seed)
        assert s.new_tokens == solo.tokens


@pytest.mark.parametrize("seeded", [True, False])
def test_batched_sampling_keeps_the_target_distribution(seeded):
    """Chi-square of the first three sampled tokens against the exact joint law, sampled through batches of 12
    concurrent requests with k = 2 (seeded: Gumbel-max per request; unseeded: Leviathan's rule)."""
    model = tiny_model(vocab_size=4, seed=11, std=0.15)
    params = SamplingParams(temperature=1.0)
    counts: dict[tuple, int] = {}
    torch.manual_seed(7)
    for start in range(0, stats.N, 12):
        reqs = [(stats.PROMPT, 4, SamplingParams(temperature=1.0, seed=20_000 + start + i if seeded else None), None)
                for i in range(12)]
        for s in run_batched(model, reqs, 2, max_batch=12, arrive_every=1):
            key = tuple(s.new_tokens[:3])
            counts[key] = counts.get(key, 0) + 1
    assert stats.chi2_of_counts(model, params, counts) > 1e-3


def test_batch_policy_drafts_less_as_the_batch_grows():
    """Verify cost per token rising with the batch (as on a CPU once the batch is compute-bound) drives k down,
    to 0 where extra verified tokens stop paying; a flat cost keeps it up."""
    def settle(cost, batch):
        pol = DraftPolicy.from_arg("auto", 8)
        for r in range(200):
            k = pol.next_k(batch)
            pol.update(batch, k, [(k, k if r % 4 else 0)] * batch, cost(batch, k))
        return pol.k_last

    steep = lambda b, k: 0.005 + 0.004 * b * (k + 1)  # noqa: E731 - compute-bound: every verified token costs
    flat = lambda b, k: 0.02 + 0.0001 * b * (k + 1)  # noqa: E731 - memory-bound: extra rows nearly free
    assert settle(flat, 8) >= 3
    assert settle(steep, 16) == 0 < settle(steep, 1)
    assert DraftPolicy.from_arg(None, 8).next_k(4) == 0 and DraftPolicy.from_arg(3, 8).next_k(4) == 3


def test_batch_policy_finds_a_best_k_away_from_its_neighbours():
    """Round times that step where the bf16 tiles take another 16 rows (8 rows: k = 1 verifies 16, k = 2 and 3 verify
    24 and 32; measured on code-small, AMX Xeon): tokens per second peak at k = 1 with k = 3 a second peak the
    probes of k +- 1 left only slowly (the two peaks nearly tie); an unmeasured k near the best is tried once and then
    wins within a few rounds."""
    ms = {0: 3.1, 1: 4.8, 2: 7.6, 3: 9.6, 4: 12.0, 5: 14.3, 6: 16.5}  # rounds of 8 rows, milliseconds
    g = torch.Generator().manual_seed(0)
    pol = DraftPolicy.from_arg("auto", 8)
    for b in range(1, 8):  # the batch filled up, as in a server, where drafting was cheap (memory-bound small batches)
        for _ in range(20):
            k = pol.next_k(b)
            pol.update(b, k, [(k, k)] * b, (2.9 + 0.1 * b * k) / 1000)
    picks = []
    for _ in range(30):
        k = pol.next_k(8)
        accepted = [int((torch.rand(k, generator=g) < 0.85).int().cumprod(0).sum()) if k else 0 for _ in range(8)]
        pol.update(8, k, [(k, n) for n in accepted], ms[k] / 1000)
        picks.append(k)
    assert max(set(picks), key=picks.count) == 1  # (measuring k +- 1 only: mostly k = 3 in these rounds)


def test_batch_policy_spends_few_rounds_away_from_its_best():
    """Once its probes keep confirming the best k they come less often: over 2,000 rounds of 8 rows with the round
    times above (a round after k = 0 pays the MTP's catch-up), `auto` makes >= 0.97 of the best fixed k's tokens per
    millisecond (probing k +- 1 every 8 rounds: 0.93)."""
    ms = {0: 3.1, 1: 4.8, 2: 7.6, 3: 9.6, 4: 12.0, 5: 14.3, 6: 16.5}
    acc = [0.85, 0.89, 0.92, 0.9, 0.88, 0.87]
    g = torch.Generator().manual_seed(0)
    pol = DraftPolicy.from_arg("auto", 8)
    tokens = elapsed = 0.0
    last = 1
    for r in range(2500):
        k = pol.next_k(8)
        rows = []
        for _ in range(8):
            n = 0
            while n < k and float(torch.rand(1, generator=g)) < acc[n]:
                n += 1
            rows.append((k, n))
        t = ms[k] + (1.5 if last == 0 and k > 0 else 0.0)
        pol.update(8, k, rows, t / 1000)
        last = k
        if r >= 500:
            tokens, elapsed = tokens + sum(n + 1 for _, n in rows), elapsed + t
    best = max(8 * (1 + sum(math.prod(acc[:j]) for j in range(1, k + 1))) / t for k, t in ms.items())
    assert tokens / elapsed >= 0.97 * best


def test_rounds_without_drafts_skip_the_mtp_and_it_catches_up_later(models, monkeypatch):
    """A round with k = 0 runs no MTP forward (auto turns drafting off at large batches to save that cost); the MTP
    reads the positions it skipped in the next drafting round: each first draft's logits equal the MTP's computed
    over the whole sequence at once (teacher forced), and the outputs stay the solo outputs."""
    model = models["fp32"]
    requests = greedy_requests(8, 6, seed=5)
    calls, first_drafts, decoding = {"n": 0}, [], []
    real_step, real_round, real_head = type(model).mtp_step, Decoder._round, type(model).mtp_head

    def counting(self, *a, **kw):
        calls["n"] += 1
        return real_step(self, *a, **kw)

    def round_(self, D, cold=False):  # remember whose rows the round drafts for
        decoding[:] = [list(s.session.tokens) for s in self.rows[:D]]
        try:
            return real_round(self, D, cold)
        finally:
            decoding.clear()

    def head(self, h, d):  # the first draft of every decoding row
        logits = real_head(self, h, d)
        if d == 1 and h.dim() == 2:  # in a round (not the teacher-forced reference below)
            first_drafts.extend((tokens, logits[b].detach().clone()) for b, tokens in enumerate(decoding))
        return logits

    monkeypatch.setattr(type(model), "mtp_step", counting)
    monkeypatch.setattr(Decoder, "_round", round_)
    monkeypatch.setattr(type(model), "mtp_head", head)
    n_calls = {}
    for pattern in ([2], [0, 0, 0, 2]):
        it = iter(pattern * 10_000)
        monkeypatch.setattr(DraftPolicy, "next_k", lambda self, batch, cold=False, bucket=None, chain=False, it=it: next(it))
        calls["n"], first_drafts[:] = 0, []
        sessions = run_batched(model, requests, "auto")
        for (prompt, max_new, _, _), s in zip(requests, sessions):
            assert s.new_tokens == mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=None).tokens
        assert len(first_drafts) > 10
        with torch.no_grad():
            for tokens, logits in first_drafts:  # the MTP at the last consumed position predicts the next token
                want = model.mtp_logits(torch.tensor([tokens]), 1)[0][0, len(tokens) - 2]
                torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        n_calls[pattern[0]] = calls["n"]
    assert n_calls[0] < n_calls[2] / 2                  # the k = 0 rounds ran no MTP step


def test_batch_policy_carries_costs_over_to_unseen_batch_sizes():
    """Costs measured at small batches predict a batch size never seen (a linear fit in B and B*k): with a
    compute-bound cost, a large batch starts at k = 0 instead of drafting until it has measured itself."""
    pol = DraftPolicy.from_arg("auto", 8)
    steep = lambda b, k: 0.005 + 0.004 * b * (k + 1)  # noqa: E731
    for b in (1, 2):
        for k in (0, 1, 2):
            pol.update(b, k, [(k, k)] * b, steep(b, k))          # every draft accepted so far
    assert pol.next_k(1) >= 1                                    # one sequence: drafting pays
    assert pol.next_k(16) == 0                                   # 16: the fit says verifying extra tokens does not
    fit = pol.fit()
    assert fit is not None and pol.round_time(16, 2, fit) == pytest.approx(steep(16, 2), rel=1e-6)


def test_policy_fit_is_the_least_squares_fit():
    """The fit over (B, k) is the least-squares one (solved in Python floats, `policy.solve`), and none where the
    points do not pin it down."""
    g = torch.Generator().manual_seed(4)
    pol = DraftPolicy.from_arg("auto", 8)
    for b in (1, 2, 4, 8):
        for k in (0, 1, 3, 5):
            pol.rounds.record((b, k), 1e-3 * (1 + 0.3 * b + 0.2 * b * k) * (1 + 0.05 * float(torch.rand(1, generator=g))))
    x = torch.tensor([[1.0, b, b * k] for b, k in pol.times], dtype=torch.float64)
    y = torch.tensor([[t] for t in pol.times.values()], dtype=torch.float64)
    want = torch.linalg.lstsq(x, y, driver="gelsd").solution[:, 0].tolist()
    assert pol.fit() == pytest.approx(want, rel=1e-9)
    two = DraftPolicy.from_arg("auto", 8)  # two points: three unknowns
    two.rounds.record((1, 2), 1e-3)
    two.rounds.record((2, 1), 2e-3)
    assert two.fit() is None
    assert solve([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]) is None and solve([[2.0, 1.0, 5.0], [1.0, 3.0, 10.0]]) == pytest.approx([1, 3])


def test_rounds_after_a_prompt_chunk_teach_the_policy_nothing(models):
    """The rounds of the COLD_ROUNDS steps from a prompt chunk on run slower whatever their k: the policy learns no
    round time from them, and measures k = 0 at a new batch size (the baseline every k is compared with) in the first
    round after them, not in the one right after the newcomer's last chunk (which had made k = 0 look 1.4-2x its
    cost in a server). Their acceptance is still counted."""
    model = models["bf16"]
    g = torch.Generator().manual_seed(9)
    dec = Decoder(model, max_batch=2, max_len=model.context_length - 16, draft_tokens="auto")
    dec.policy.rounds, dec.policy.counts = RoundTimes(), Acceptance()  # (not what earlier tests measured)
    ks, colds = [], []
    real_next_k = dec.policy.next_k

    def next_k(batch, cold=False, bucket=None, chain=False):
        colds.append(cold)
        ks.append(real_next_k(batch, cold, bucket, chain))
        return ks[-1]

    dec.policy.next_k = next_k
    for _ in range(2):
        dec.add(Session(model, pattern_batch(8, 1, 30, g)[0].tolist(), 40, SamplingParams(), [], None, model.tokenizer))
    for _ in range(1 + COLD_ROUNDS):  # step 1 reads the first prompt, step 2 the second: 1 + COLD_ROUNDS cold rounds
        dec.step()
    assert colds == [True] * (1 + COLD_ROUNDS) and 0 not in ks
    assert not dec.policy.times and sum(sum(c.offered) for c in dec.policy.counts.by_state) > 0  # no time learned; acceptance counted
    for _ in range(3):
        dec.step()
    assert colds[1 + COLD_ROUNDS:] == [False] * 3 and ks[1 + COLD_ROUNDS] == 0  # k = 0 measured at B = 2 once warm
    assert (2, 0) in dec.policy.times and all(b == 2 for b, _ in dec.policy.times)


def test_a_row_reading_its_prompt_keeps_its_keys_through_rounds(models, monkeypatch):
    """A newcomer reads its prompt one chunk per step while the other rows decode. With 3 rows decoding an eager round
    computes those 3 alone (a compiled one its bucket of 4, the reader inside as a row that keeps nothing). The rounds
    must not write over the keys it has read."""
    model = models["bf16"]
    g = torch.Generator().manual_seed(5)
    dec = Decoder(model, max_batch=4, max_len=model.context_length - 16, draft_tokens=2)
    for _ in range(3):
        dec.add(Session(model, pattern_batch(8, 1, 20, g)[0].tolist(), 60, SamplingParams(), [], None, model.tokenizer))
    for _ in range(3):
        dec.step()
    prompt = pattern_batch(8, 1, 300, g)[0].tolist()
    reader = dec.add(Session(model, prompt, 20, SamplingParams(), [], None, model.tokenizer))
    rows, view = [], Decoder._view
    monkeypatch.setattr(Decoder, "_view", lambda self, B: rows.append(B) or view(self, B))
    dec.step()  # its first chunk
    monkeypatch.undo()
    assert dec.decoding == 3 and not reader.decoding and rows == [3]  # (the rows the round computed: the 3 decoding)
    attn = [layer for layer in dec.state.cache.layers if hasattr(layer, "k")]
    read = dec.state.cache.rows[3]
    before = [(layer.k[3, :, :read].clone(), layer.v[3, :, :read].clone()) for layer in attn]
    dec.step()  # its second chunk, then a round of 4 decoding rows
    assert all(torch.equal(k, layer.k[3, :, :read]) and torch.equal(v, layer.v[3, :, :read])
               for (k, v), layer in zip(before, attn))
    while dec.rows or dec.waiting:
        dec.step()
    assert reader.session.new_tokens == mtp.generate(model, prompt, max_new_tokens=20, draft_tokens=2,
                                                     eos_token_ids=[]).tokens


def test_rows_that_joined_apart_catch_up_together(models, monkeypatch):
    """After runs of rounds without drafts, the MTP reads the skipped positions of every decoding row in one forward
    (not only of the row whose buffer is full), so rows that joined at different times share each catch-up instead of
    calling for one nearly every round; the first drafts after it are still the teacher-forced MTP's, and the outputs
    the solo outputs."""
    import mtp.decode.round as rnd

    model = models["fp32"]
    requests = greedy_requests(8, 6, seed=6)
    catch_ups, after, first_drafts, decoding = [], [], [], []
    real_catch_up, real_round, real_head = rnd.catch_up, Decoder._round, type(model).mtp_head

    def catch_up(model_, st, rows_mask, starts=None):
        catch_ups.append(rows_mask.tolist())
        return real_catch_up(model_, st, rows_mask, starts)

    def round_(self, D, cold=False):
        n = len(catch_ups)
        decoding[:] = [list(s.session.tokens) for s in self.rows[:D]]
        try:
            out = real_round(self, D, cold)
        finally:
            decoding.clear()
        if len(catch_ups) > n:  # every decoding row read what it had pending but one, then this round added one
            after.append([self.pend_n[b] for b in range(D)])
        return out

    def head(self, h, d):
        logits = real_head(self, h, d)
        if d == 1 and h.dim() == 2:
            first_drafts.extend((tokens, logits[b].detach().clone()) for b, tokens in enumerate(decoding))
        return logits

    monkeypatch.setattr(rnd, "catch_up", catch_up)
    monkeypatch.setattr(Decoder, "_round", round_)
    monkeypatch.setattr(type(model), "mtp_head", head)
    it = iter(([0] * 11 + [2]) * 10_000)
    monkeypatch.setattr(DraftPolicy, "next_k", lambda self, batch, cold=False, bucket=None, chain=False: next(it))
    sessions = run_batched(model, requests, "auto", max_batch=4, arrive_every=3, eos=[])  # (every row runs its length)
    rounds = sum(s.stats.backbone_forwards for s in sessions)
    for (prompt, max_new, _, _), s in zip(requests, sessions):
        assert s.new_tokens == mtp.generate(model, prompt, max_new_tokens=max_new, eos_token_ids=[]).tokens
    assert catch_ups and all(max(pend) <= 2 for pend in after)
    assert len(catch_ups) * 8 <= rounds  # rounds counted per row: one catch-up per ~8 rounds of the batch, not per row
    assert len(first_drafts) > 5
    with torch.no_grad():
        for tokens, logits in first_drafts:
            want = model.mtp_logits(torch.tensor([tokens]), 1)[0][0, len(tokens) - 2]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_a_batch_size_not_measured_yet_starts_with_a_plain_round():
    """Costs measured at one batch size only cannot say how drafting scales with rows: a batch size not seen yet first
    runs a plain round (its baseline; the fit over B and B*k then has two sizes) instead of borrowing the seen size's
    costs scaled by B, which kept their ratio and drafted at every size while a batch filled up."""
    pol = DraftPolicy.from_arg("auto", 8)
    flat = lambda b, k: 0.01 * b + 0.001 * b * k  # noqa: E731 - drafting pays at every size
    for k in (0, 1, 2, 3, 0, 1, 2, 3):
        pol.update(1, k, [(k, k)], flat(1, k))
    assert pol.next_k(1) >= 2
    assert pol.next_k(5) == 0  # 5 rows, never measured: the baseline first
    pol.update(5, 0, [(0, 0)] * 5, flat(5, 0))
    assert pol.next_k(5) >= 2  # then the fit says drafting pays there too


def test_round_times_are_kept_by_the_rows_a_round_computes():
    """A compiled round of 5 to 8 decoding rows runs the bucket of 8 (`decoder.bucket`) and costs what 8 rows cost: its
    round times are kept and read by the rows computed (`bucket=`), so a round of 5 reads what rounds of 8 measured - no
    baseline round of its own, and the rate weighs the bucket's time by the 5 rows' tokens - and records its time
    there. (An eager round computes the 5 alone and keys its times by 5.)"""
    pol = DraftPolicy.from_arg("auto", 8)
    for k in range(7):
        pol.update(8, k, [], (2.0 + 0.5 * k) * 1e-3, bucket=8)  # (a round of 8 rows: 2 ms, 0.5 ms a draft)
    for c in pol.counts.by_state:  # acceptance ~0.5 at every position, whatever the last round
        c.offered, c.accepted = [100.0] * 6, [50.0] * 6
    assert pol.next_k(5, bucket=8) == 1  # 5 x 1.5 tokens / 2.5 ms beats 5 / 2.0 and 5 x 1.75 / 3.0
    pol.update(5, 1, [(1, 1)] * 5, 2.5e-3, bucket=8)
    assert set(pol.times) == {(8, k) for k in range(7)}
    assert DraftPolicy.from_arg("auto", 8, pol.rounds, pol.counts).next_k(5) == 0  # (keyed by 5: never measured)


def test_compiled_cuda_runner_marks_the_round_state_static(monkeypatch):
    """CUDA graphs skip a graph that writes an ordinary input: a compiled runner on CUDA marks every tensor of the
    round's state (backbone and MTP caches, positions, pending buffers, seen tokens) as living at a fixed address
    (decode/compiled.py, `static_state`; docs/decisions.md, the first GPU check), and leaves them alone on CPU or with
    MTP_CUDA_STATIC=0. Checked on CPU: marking is a tensor attribute, and torch.compile compiles nothing until called."""
    from mtp.decode.compiled import Runner, _tensors
    from mtp.decode.round import RoundState

    model = tiny_model(mtp_num_hidden_layers=2)

    def marked(device: str, env: str | None) -> tuple[int, int]:
        if env is None:
            monkeypatch.delenv("MTP_CUDA_STATIC", raising=False)
        else:
            monkeypatch.setenv("MTP_CUDA_STATIC", env)
        st = RoundState.allocate(model, 2, 64, mtp=True, penalty=True)
        runner = Runner(True, torch.device(device))
        runner.static_state(st)
        tensors = list(_tensors(st))
        return sum(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in tensors), len(tensors)

    n, total = marked("cuda", None)
    # every layer's cache (k/v or conv/ssm), each MTP layer's k/v, and pos, last, mtp_pos, pend_h/next/n, seen
    layers = model.config.num_hidden_layers
    assert total == 2 * layers + 2 * 2 + 7
    assert n == total
    assert marked("cuda", "0")[0] == 0
    assert marked("cpu", None)[0] == 0


def test_a_reused_state_keeps_its_bound_round_programs(monkeypatch):
    """The one-call round's programs are bound to the state view they ran on (`round_kernel.greedy_round`): a pooled
    state carries its views, so the next generation of the same shape binds nothing again (a view new with each
    decoder bound each width again in its first round: ~0.3-0.6 ms, which `auto` took for the cost of a probe's k and
    stayed at k = 2 where k = 3-4 was faster, docs/decisions.md); and the tokens are the same."""
    from mtp.decode import round_kernel

    if not round_kernel.LIBRARY.available():
        pytest.skip("the C kernels are not available here")
    model = trained_tiny_model(depth=2).to(torch.bfloat16)
    model.prepare_for_inference("int8")
    built, real = [], round_kernel._plan
    monkeypatch.setattr(round_kernel, "_plan", lambda *a: built.append(a[2]) or real(*a))
    prompt = [1, 2, 3, 1, 2, 3, 4]
    first = [mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k).tokens for k in (2, 3)]
    assert {2, 3} <= set(built)
    n = len(built)
    again = [mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k).tokens for k in (2, 3)]
    assert again == first and len(built) == n


def test_decoders_share_a_free_state_and_decode_alike(monkeypatch):
    """A decoder takes a free decode state of the model's (the same tensors: captured CUDA graphs replay at the
    addresses they recorded, and the eager round's C programs stay bound to them, docs/decisions.md) and hands it back
    when collected; two live decoders never share one; an eager state longer than POOL_SLOTS positions is not kept; a
    model cast to another dtype gets a new one. A reused state decodes as a new one: each row is reset as it is taken,
    and a padding row's positions and pending MTP inputs start from zero whatever the last decoder left there."""
    import gc

    model = trained_tiny_model(depth=2, max_position_embeddings=8192)
    for compile in (True, False):
        first = Decoder(model, 1, 64, 2, compile=compile)
        state = first.state
        assert Decoder(model, 1, 64, 2, compile=compile).state is not state  # (alive while `first` is)
        del first
        gc.collect()
        assert Decoder(model, 1, 64, 2, compile=compile).state is state  # (collected at once: the state is free again)
    long = Decoder(model, 1, POOL_SLOTS + 64, 2)
    kept = long.state
    del long
    gc.collect()
    assert all(kept is not s for free in model.__dict__["_free_states"].values() for s in free)

    requests = greedy_requests(model.config.vocab_size, 3, seed=4, max_prompt=30)
    want = [mtp.generate(model, p, max_new_tokens=n, draft_tokens=2).tokens for p, n, _, _ in requests]
    dec = Decoder(model, 4, 80, 2)
    state = dec.state
    with torch.inference_mode():  # what a last decoder may leave: positions and pending counts past a new one's reads
        for t in (state.pos, state.mtp_pos, state.pend_n):
            t.fill_(7)
    del dec
    gc.collect()
    dec = Decoder(model, 4, 80, 2)
    assert dec.state is state
    steps, real_step = [], type(model).mtp_step  # (the rounds' tensor path, which indexes every row's pending inputs)
    monkeypatch.setattr(type(model), "mtp_step", lambda self, *a, **kw: steps.append(1) or real_step(self, *a, **kw))
    seqs = [dec.add(Session(model, p, n, SamplingParams(), None, None)) for p, n, _, _ in requests]
    while not all(s.finished for s in seqs):  # (3 rows decoding: the eager rounds compute those 3)
        dec.step()
    assert [s.session.new_tokens for s in seqs] == want and steps
    monkeypatch.undo()
    cast = model.to(torch.bfloat16)
    assert Decoder(cast, 2, 64, 2).state.pend_h.dtype == torch.bfloat16
    model.to(torch.float32)

    prompts = ([1, 2, 3, 1, 2], [4, 5, 6, 7], [7, 1, 7, 1, 7, 1])
    want = [mtp.generate(model, p, max_new_tokens=20, draft_tokens=2).tokens for p in prompts]
    dec = Decoder(model, 1, 64, 2)
    lender = Decoder(model, 1, 64, 2, compile=True)  # the pool's state (used above, freed, taken again)
    dec.state = lender.state
    for p, w in zip(prompts, want):
        seq = dec.add(Session(model, p, 20, SamplingParams(), None, None, model.tokenizer))
        while not seq.finished:
            dec.step()
        dec.step()  # (frees the row)
        assert seq.session.result().tokens == w


def test_policy_states_follow_their_rows():
    """Each decoding row's state (its last round fully accepted, or cut by a rejection) moves with its sequence when
    the decoder fills a finished row's place, and a newcomer starts as after a rejection; a row that drafted nothing
    keeps its state."""
    from mtp.decode.policy import AFTER_FULL, AFTER_REJECTION

    pol = DraftPolicy.from_arg("auto", 8)
    pol.update(3, 3, [(3, 3), (3, 1), (3, 3)], 1e-3)
    assert pol.states == [AFTER_FULL, AFTER_REJECTION, AFTER_FULL]
    # the round's rows all started as after a rejection (none had drafted before): counted there
    assert not pol.counts.by_state[AFTER_FULL].offered and pol.counts.by_state[AFTER_REJECTION].offered == [3, 3, 2]
    pol.update(3, 0, [(0, 0)] * 3, 1e-3)
    assert pol.states == [AFTER_FULL, AFTER_REJECTION, AFTER_FULL]
    pol.move_row(2, 1)  # row 1 finished: the last decoding row takes its place
    pol.reset_row(2)  # and a newcomer the freed row
    assert pol.states == [AFTER_FULL, AFTER_FULL, AFTER_REJECTION]
