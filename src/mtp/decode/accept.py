"""The acceptance rule of speculative decoding (one small function per mode).

Greedy: accept drafts while they equal the target's argmax; at the first mismatch emit the target's
argmax; if all k match, emit the bonus token from the last position.
Sampling (Leviathan et al. 2023): accept draft x with probability min(1, p(x)/q(x)); on rejection
sample from norm(max(0, p - q)); if all are accepted, sample the bonus from p at the last position.
Both keep the output distribution exactly that of the target model.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], target: list[int]) -> tuple[int, int]:
    """drafts [k], target argmax per verified position [k+1] -> (accepted count n, next token)."""
    n = 0
    for d, t in zip(drafts, target):
        if d != t:
            break
        n += 1
    return n, target[n]


def accept_sampling(drafts: list[int], p: torch.Tensor, q: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[int, int]:
    """drafts [k], target probs p [k+1, V], draft probs q [k, V] (drafts were sampled from q)
    -> (accepted count n, next token)."""
    k = len(drafts)
    u = torch.rand(k, generator=generator, device=p.device) if k else None
    for j, x in enumerate(drafts):
        px, qx = float(p[j, x]), float(q[j, x])
        if qx > 0 and float(u[j]) * qx < px:  # u < p/q without dividing by a tiny q
            continue
        residual = (p[j] - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: the residual is empty, p itself is the right law
            residual, total = p[j], 1.0
        return j, int(torch.multinomial(residual / total, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))
