"""Speculative sampling keeps the target distribution exactly: chi-square tests against the backbone's
exact joint distribution of the first three tokens, and the same test catches a wrong acceptance rule."""

import itertools
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import mtp
import mtp.decode.accept as accept
from conftest import tiny_model
from mtp.decode.decoder import Decoder
from mtp.decode.draft_vocab import DraftVocab
from mtp.decode.sampling import SamplingParams, apply_repetition_penalty, probs_from_logits
from mtp.decode.session import Session

PROMPT = [1, 3, 0, 2, 2]
N = 1500


@pytest.fixture(scope="module")
def model():
    # vocab 4 and a random MTP head: q differs from p, drafts are accepted often but not always
    return tiny_model(vocab_size=4, seed=11, std=0.15)


@torch.no_grad()
def exact_joint(model, params: SamplingParams, prompt: list[int] = PROMPT) -> dict[tuple, float]:
    """P(t1, t2, t3) computed from full backbone forwards with the same logits processing."""
    out = {}
    for seq in itertools.product(range(4), repeat=3):
        prob, ctx = 1.0, list(prompt)
        for t in seq:
            logits = model(torch.tensor([ctx]))[0, -1]
            if params.repetition_penalty != 1.0:
                logits = apply_repetition_penalty(logits[None], torch.tensor([ctx]), params.repetition_penalty)[0]
            prob *= float(probs_from_logits(logits, params)[t])
            ctx.append(t)
        out[seq] = prob
    return out


def sample_first_three(model, params: SamplingParams, k, draft_vocab=None, seeded: bool = True, compile: bool = False,
                       rows: int = 50, seed_base: int | None = None, prompt: list[int] = PROMPT) -> dict[tuple, int]:
    """N generations of 3 tokens from PROMPT, `rows` at a time through one decoder (rows of a batch are sampled
    independently: tests/test_batch.py): counts of their first three tokens. Seeded runs sample by the Gumbel-max
    coupling (one seed per generation), unseeded ones by Leviathan's rule (from torch's global RNG, seeded here so
    the test itself is reproducible)."""
    kk = k if isinstance(k, int) else 9
    torch.manual_seed(1234 + kk)
    base = 10_000 * kk if seed_base is None else seed_base
    dec = Decoder(model, rows, len(prompt) + 8, k, draft_vocab, compile=compile)
    sessions = [Session(model, prompt, 3, replace(params, seed=base + i if seeded else None), None, None) for i in range(N)]
    for s in sessions:
        dec.add(s)
    while not all(s.done for s in sessions):
        dec.step()
    counts: dict[tuple, int] = {}
    for s in sessions:
        key = tuple(s.new_tokens[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi2_of_counts(model, params: SamplingParams, counts: dict[tuple, int], prompt: list[int] = PROMPT) -> float:
    """p-value of the counts of the first three tokens against the backbone's exact joint law."""
    n = sum(counts.values())
    exact = exact_joint(model, params, prompt)
    assert sum(counts.get(c, 0) for c, p in exact.items() if p == 0) == 0  # never a token the target forbids
    cells = sorted((p, counts.get(c, 0)) for c, p in exact.items() if p > 0)
    # merge the rarest cells so every expected count is >= 5
    obs, exp, acc_p, acc_o = [], [], 0.0, 0
    for p, o in cells:
        acc_p, acc_o = acc_p + p, acc_o + o
        if acc_p * n >= 5:
            exp.append(acc_p * n)
            obs.append(acc_o)
            acc_p, acc_o = 0.0, 0
    exp[-1] += acc_p * n
    obs[-1] += acc_o
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def chi2_pvalue(model, params: SamplingParams, k, draft_vocab=None, seeded: bool = True, compile: bool = False) -> float:
    return chi2_of_counts(model, params, sample_first_three(model, params, k, draft_vocab, seeded, compile))


# temperature 1 with k = 2, seeded and unseeded, is tests/test_batch.py's chi-square (through staggered arrivals)
@pytest.mark.parametrize("params, k, seeded", [
    (SamplingParams(temperature=0.7, top_k=3), 3, False),
    (SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.3), 2, False),
    (SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.3), 3, True),
])
def test_speculative_sampling_matches_the_target_distribution(model, params, k, seeded):
    assert chi2_pvalue(model, params, k, seeded=seeded) > 1e-3


def test_a_seed_fixes_the_sample_whatever_k(model):
    """Seeded sampling (Gumbel-max, noise fixed per position) gives the same tokens for plain decoding and every k."""
    for seed in range(5):
        kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=seed)
        want = mtp.generate(model, PROMPT, **kw).tokens
        for k in (1, 2, 4, "auto"):
            assert mtp.generate(model, PROMPT, draft_tokens=k, **kw).tokens == want, (seed, k)


def test_reduced_vocabulary_drafting_keeps_the_target_distribution(model):
    """Drafts over 2 of the 4 tokens: q is the MTP's law restricted to them, and the output law is still p's."""
    vocab = DraftVocab([1, 2], model.config.vocab_size)
    assert chi2_pvalue(model, SamplingParams(temperature=1.0), 2, vocab, seeded=False) > 1e-3


def test_the_test_detects_a_wrong_acceptance_rule(model, monkeypatch):
    """Resampling from p on rejection, instead of from norm(max(0, p - q)), skews the law: the chi-square test sees it."""
    real = accept.accept_rows

    def without_residual(drafts, limit, target, draft, rs, noise, u):
        n, nxt = real(drafts, limit, target, draft, rs, noise, u)
        rows = torch.arange(n.shape[0])
        resampled = (target[rows, n].log_softmax(-1) + noise[rows, n]).argmax(-1)  # wrong: from p itself
        return n, torch.where(n < limit, resampled, nxt)

    monkeypatch.setattr(accept, "accept_rows", without_residual)
    assert chi2_pvalue(model, SamplingParams(temperature=1.0), 2, seeded=False) < 1e-3


# (top-k 2: at top-k 3 this model has a near tie after (1, 1) that its forward and its decode programs round apart)
@pytest.mark.parametrize("params, k", [(SamplingParams(temperature=1.0), 2), (SamplingParams(temperature=0.7, top_k=2), 3),
                                       (SamplingParams(temperature=0.7, repetition_penalty=4.0), 2),
                                       (SamplingParams(temperature=1.0, top_p=0.7), 3)])
def test_the_one_call_round_keeps_the_target_distribution(params, k, monkeypatch):
    """On an int8 model whose rounds run as one C call (round_kernel.greedy_round: the drafts' rule and Leviathan et
    al.'s acceptance in C, step.c `unseeded_row`), unseeded speculative sampling still draws the target's joint law,
    with top-p (model/top_p.c) and with a repetition penalty (over the prompt, the tokens emitted and the drafts before
    each position: a prompt of two of the four tokens, so the others' penalty depends on what was drafted)."""
    from mtp.decode import round_kernel
    from mtp.model import step
    from test_step import quantized

    if not (round_kernel.LIBRARY.available() and step.LIBRARY.available()):
        pytest.skip("the one-call round's C kernels are not available here")
    model = quantized("int8", seed=11, vocab_size=4, std=0.15)
    real, calls = round_kernel.greedy_round, []

    def counted(*args, **kw):
        done = real(*args, **kw)
        calls.append(done is not None and args[2] > 0)
        return done

    monkeypatch.setattr(round_kernel, "greedy_round", counted)
    prompt = [1, 3, 1, 3, 3] if params.repetition_penalty != 1.0 else PROMPT
    counts = sample_first_three(model, params, k, seeded=False, prompt=prompt)
    assert sum(calls) > 0.9 * len(calls)  # (the rounds with drafts ran as one call)
    assert chi2_of_counts(model, params, counts, prompt) > 1e-3
