"""Turning logits into a distribution: repetition penalty, temperature, top-k, top-p (one place). The target p of
speculative sampling takes all of them; the MTP's draft q all but top-p (`RowSampling.for_drafts`: any q keeps the
output exact, and this one the C draft chain computes with comparisons alone).

`SamplingParams` are one request's; `RowSampling` holds a batch's as tensors for the decode round, which shapes
logits on the device (`shape_logits`) for every row at once, greedy and sampled rows mixed. `probs_from_logits`
is the same rule for one distribution, the reference the tests hold the round to."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..model import top_p_kernel


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


@dataclass
class RowSampling:
    """The sampling parameters of a batch's rows as tensors [B] on the device, built on the host when the rows change.
    The flags say what the decode round computes at all (a graph is compiled per combination)."""

    greedy: torch.Tensor  # bool: argmax (after the repetition penalty)
    seeded: torch.Tensor  # bool: a sampled row with a seed (Gumbel-max with noise fixed per position)
    temperature: torch.Tensor  # fp32, 1 for greedy rows
    top_k: torch.Tensor  # long, V where a row has none
    top_p: torch.Tensor  # fp32, 1 where a row has none
    penalty: torch.Tensor  # fp32, 1 where a row has none
    unseeded: torch.Tensor  # bool: a sampled row without a seed (Leviathan et al.'s acceptance rule)
    use_penalty: bool = False
    use_top_k: bool = False
    use_top_p: bool = False
    any_sampled: bool = False
    any_unseeded: bool = False

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device: torch.device | str) -> RowSampling:
        greedy = [p.greedy for p in params]
        seeded = [not p.greedy and p.seed is not None for p in params]
        unseeded = [not g and not s for g, s in zip(greedy, seeded)]
        top_k = [vocab if p.greedy or p.top_k is None else min(p.top_k, vocab) for p in params]
        top_p = [1.0 if p.greedy or p.top_p is None else p.top_p for p in params]
        penalty = [p.repetition_penalty for p in params]

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=device)

        return cls(t(greedy, torch.bool), t(seeded, torch.bool),
                   t([1.0 if p.greedy else p.temperature for p in params], torch.float32), t(top_k, torch.long),
                   t(top_p, torch.float32), t(penalty, torch.float32), t(unseeded, torch.bool),
                   use_penalty=any(r != 1.0 for r in penalty), use_top_k=any(k < vocab for k in top_k),
                   use_top_p=any(p < 1.0 for p in top_p), any_sampled=not all(greedy), any_unseeded=any(unseeded))

    def for_drafts(self) -> RowSampling:
        """The rule the MTP drafts by (decode/round.py `draft`): the rows' repetition penalty, temperatures and top-k,
        no top-p."""
        return replace(self, use_top_p=False)

    @property
    def key(self) -> tuple[bool, ...]:
        """What the shaping computes (one compiled graph per key)."""
        return self.use_penalty, self.use_top_k, self.use_top_p, self.any_sampled, self.any_unseeded


def shape_logits(logits: torch.Tensor, rs: RowSampling, seen: torch.Tensor | None) -> torch.Tensor:
    """Logits [B, T, V] -> shaped logits [B, T, V] fp32: the repetition penalty over `seen` [B, T, V] (bool: the
    tokens before each position), then for sampled rows temperature, top-k and top-p (-inf outside). The argmax of a
    greedy row's result is its greedy token; softmax of a sampled row's result is its distribution, and its argmax
    after adding Gumbel noise is an exact sample (no softmax needed). Ties and cut-offs follow `probs_from_logits`."""
    x = logits.float()
    if rs.use_penalty and seen is not None:
        r = rs.penalty[:, None, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if not rs.any_sampled:
        return x
    sampled = ~rs.greedy[:, None, None]
    y = x / rs.temperature[:, None, None]
    native = rs.use_top_p and top_p_kernel.usable(y)  # (on the CPU the cut is top_p.c's: the one-call round's bits)
    if rs.use_top_k or (rs.use_top_p and not native):
        ranked, order = torch.sort(y, dim=-1, descending=True)
        drop = torch.zeros_like(y, dtype=torch.bool)
        if rs.use_top_k:
            kth = ranked.gather(-1, (rs.top_k - 1)[:, None, None].expand(*y.shape[:2], 1))
            drop = y < kth
            ranked = ranked.masked_fill(ranked < kth, float("-inf"))  # top-p then sees what top-k kept
        if rs.use_top_p and not native:
            probs = ranked.softmax(-1)
            # drop a token when the mass before it already reaches top_p (the first token always stays)
            cut = (probs.cumsum(-1) - probs) >= rs.top_p[:, None, None]
            drop = drop | cut.scatter(-1, order, cut)
        y = y.masked_fill(drop, float("-inf"))
    if native:
        top_p_kernel.cut(y, rs.top_p[:, None])
    return torch.where(sampled, y, x)


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from uniforms in (0, 1]: argmax(log p + noise) is an exact sample from p."""
    return -(-uniform.clamp_min(1e-30).log()).log()
