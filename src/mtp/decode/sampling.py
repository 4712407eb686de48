"""Turning logits into a distribution: repetition penalty, temperature, top-k, top-p (one place, so that
the target p and the draft q of speculative sampling are shaped exactly alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL/HF rule on logits [..., V] for the token ids in `seen` [..., N]: divide positive logits by
    `penalty`, multiply negative ones."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(-1, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(-1, seen, picked)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] (penalty already applied) -> probabilities [..., V] (fp32) after temperature,
    top-k and top-p. Greedy params give a one-hot distribution on the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (cum - sorted_logits.softmax(-1)) >= params.top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from probabilities [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
