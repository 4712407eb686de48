"""Tiny models built in code: every test runs on 2 CPU cores in seconds."""

from __future__ import annotations

import os

import pytest
import torch

from mtp import Qwen35Config, Qwen35ForCausalLM
from mtp.config import Qwen35MoeConfig
from mtp.model import init_weights_
from mtp.model.qwen3_5 import Qwen35MoeForCausalLM

# Tiny models: one intra-op thread is fastest (and the suite must not thrash a shared 2-core machine).
torch.set_num_threads(1)
# `auto` starts from nothing in every test (and in the processes tests start): measurements an earlier run kept
# (`decode/policy_store.py`) would make its choices depend on what ran before; tests/test_policy_store.py turns it on.
os.environ["MTP_AUTO_STORE"] = "0"


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def tiny_config(**overrides) -> Qwen35Config:
    """A tiny Qwen3.5 config; with any MoE key (see MOE) a Qwen3.5-MoE config."""
    base = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=512,
        tie_word_embeddings=True, mtp_num_hidden_layers=1, rope_theta=10000.0, partial_rotary_factor=0.5,
    )
    base.update(overrides)
    if any(k in base for k in MOE):
        return Qwen35MoeConfig(**{**MOE, **base})
    return Qwen35Config(**base)


def tiny_model(seed: int = 0, std: float = 0.2, **overrides) -> Qwen35ForCausalLM:
    """A random tiny model (Qwen3.5, or Qwen3.5-MoE with MoE keys); a large init std makes its outputs peaked
    (and sensitive to bugs)."""
    config = tiny_config(**overrides)
    model = (Qwen35MoeForCausalLM if isinstance(config, Qwen35MoeConfig) else Qwen35ForCausalLM)(config)
    init_weights_(model, std=std, seed=seed)
    # Randomise the norms too so that a missing (1 + w) or a swapped norm shows up in parity tests.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "pre_fc_norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture
def make_tiny():
    return tiny_model


class Killed(Exception):
    """Stands for the process being killed right after a training step (see `kill_after_step`)."""


def kill_after_step(monkeypatch, step: int) -> None:
    """Make `mtp.train.trainer.train` stop as a kill would, right after optimizer step `step` (before that step's
    evaluation or checkpoint): its `train_step` raises Killed once it has run that step."""
    from mtp.train import trainer

    real = trainer.train_step

    def step_then_die(run):
        result = real(run)
        if run.step == step:
            raise Killed(f"killed after step {step}")
        return result

    monkeypatch.setattr(trainer, "train_step", step_then_die)


def pattern_batch(vocab: int, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Sequences that repeat a random motif (period 2..5) with 10% noise: learnable, so a quickly
    trained MTP head agrees with the backbone often but not always (every acceptance pattern occurs)."""
    rows = []
    for _ in range(batch):
        period = int(torch.randint(2, 6, (1,), generator=gen))
        motif = torch.randint(0, vocab, (period,), generator=gen)
        seq = motif.repeat(length // period + 1)[:length].clone()
        noise = torch.rand(length, generator=gen) < 0.1
        seq[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
        rows.append(seq)
    return torch.stack(rows)


def trained_tiny_model(steps: int = 100, seed: int = 0, depth: int | None = None, **overrides) -> Qwen35ForCausalLM:
    """A tiny model whose backbone and MTP module were trained together (main + MTP cross-entropy) on
    `pattern_batch` data for a few seconds."""
    overrides.setdefault("vocab_size", 8)
    model = tiny_model(seed=seed, std=0.02, **overrides).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    depth = depth or model.config.mtp_num_hidden_layers
    for _ in range(steps):
        ids = pattern_batch(model.config.vocab_size, 8, 32, gen)
        h = model.hidden(ids)
        loss = torch.nn.functional.cross_entropy(model.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        for d, hd in enumerate(model.mtp_hidden_states(ids, depth, hidden=h), start=1):
            logits = model.mtp_head(hd[:, :-1], d)
            loss = loss + torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, d + 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def scripted_drafts_patterns(model, prompt: list[int], monkeypatch, pattern: str = "mixed", max_new: int = 30,
                             ks=(1, 3, 5)) -> set[str]:
    """Decode greedily with drafts scripted from the plain output - always right ("all"), always wrong ("none"), right
    only first ("some"), or alternating in runs of three ("mixed") - and assert the output equals plain decoding for
    each k. Returns the acceptance patterns of the rounds that drafted 2 or more tokens. This forces every pattern
    whatever the machine (which patterns a quickly trained head produces depends on the CPU that trained it)."""
    import mtp
    import mtp.decode.round as rnd
    from mtp.decode import round_kernel

    want = mtp.generate(model, prompt, max_new_tokens=max_new).tokens
    real = rnd.draft

    def scripted(model_, st, K, *a, **kw):
        drafts, q = real(model_, st, K, *a, **kw)  # the MTP still runs (its caches stay as they would be)
        drafts = drafts.clone()
        for j in range(1, K + 1):
            at = int(st.pos[0]) + j - len(prompt)  # index in the new tokens of the token draft j proposes
            right = want[at] if at < len(want) else 0
            good = {"none": False, "all": True, "some": j == 1, "mixed": (at // 3) % 2 == 0}[pattern]
            drafts[0, j - 1] = right if good else (right + 1) % model.config.vocab_size
        return drafts, q

    seen: set[str] = set()
    with monkeypatch.context() as m:
        m.setattr(rnd, "draft", scripted)
        m.setattr(round_kernel, "greedy_round", lambda *a, **kw: None)  # (its draft chain is C's own)
        m.setattr(round_kernel, "greedy_rounds", lambda *a, **kw: None)  # (so are the chained rounds')
        for k in ks:
            r = mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=k)
            assert r.tokens == want, (pattern, k)
            seen |= {"none" if n == 0 else "all" if n == kk else "some"
                     for kk, n in zip(r.stats.k_history, r.stats.n_history) if kk > 1}
    return seen


@torch.no_grad()
def assert_greedy_agrees(model, prompt: list[int], ours: list[int], reference: list[int], tie: float = 1e-4) -> None:
    """Two greedy continuations of `prompt` by implementations that round differently (ours vs transformers, eager
    vs compiled) must be equal - except that they may part at a near-tie: where they first differ, the two tokens'
    logits (a full fp32 forward of `model` over the common prefix) must lie within `tie` of each other. Exact equality
    everywhere would test the machine's floating-point kernels (it failed on one CPU kind at a 1e-6 margin)."""
    n = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
    if n is None:
        assert len(ours) == len(reference), (len(ours), len(reference))
        return
    logits = model(torch.tensor([list(prompt) + list(ours[:n])], device=model.device))[0, -1].float()
    gap = abs(float(logits[ours[n]] - logits[reference[n]]))
    assert gap <= tie, f"greedy outputs part at new token {n} ({ours[n]} vs {reference[n]}) with a logit gap of {gap:.3g}"
