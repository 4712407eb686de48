"""The acceptance rule of speculative decoding, for every row of a batch at once, on the device.

Row b drafted d_1..d_K (only the first limit[b] count) and the backbone verified [t, d_1..d_K]; position j of the
verify gives the target distribution p_j of the token after d_j (p_0: after t). Per row:
- greedy: accept drafts while they equal the target's argmax; at the first mismatch emit the target's argmax; if
  all match, the bonus token from the last position;
- seeded sampling (Gumbel-max coupling): the target's token at each position is argmax(log p_j + g_j) with noise g_j
  fixed by (seed, position), the draft was argmax(log q_j + g_j) with the same noise: accept while they are equal,
  then emit the target's token - an exact sample from p whatever was drafted;
- unseeded sampling (Leviathan et al. 2023): accept d with probability min(1, p(d)/q(d)); at the first rejection
  sample from norm(max(0, p - q)); if all are accepted, the bonus from p.
All three keep the output distribution exactly the target's (greedy: the tokens themselves).
"""

from __future__ import annotations

import torch

from ..model.argmax_kernel import argmax
from .sampling import RowSampling


def accepted_count(match: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """match [B, K] (draft j+1 accepted on its own) and the drafts each row may use, limit [B] -> accepted n [B]: the
    length of the leading run of matches within the limit."""
    K = match.shape[1]
    allowed = torch.arange(K, device=match.device) < limit[:, None]
    return (match & allowed).long().cumprod(dim=1).sum(dim=1)


def accept_argmax(drafts: torch.Tensor, limit: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows with no logit shaping: drafts [B, K], limit [B], verify logits [B, K+1, V] -> (n [B], next [B])."""
    target = argmax(logits)  # [B, K+1]
    n = accepted_count(drafts == target[:, :-1], limit)
    return n, target.gather(1, n[:, None])[:, 0]


def accept_rows(drafts: torch.Tensor, limit: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
                rs: RowSampling, noise: torch.Tensor | None, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy, seeded and unseeded rows mixed: drafts [B, K], limit [B], shaped target logits [B, K+1, V] and shaped
    draft logits [B, K, V] (`sampling.shape_logits`; None when every row is greedy), `noise` [B, K+1, V] Gumbel noise
    (seeded rows: the seed's noise of each position; unseeded rows: fresh noise for the residual or bonus sample) and
    `u` [B, K] uniforms for the unseeded ratio test -> (n [B], next [B])."""
    B, K = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    picked = target if noise is None else torch.where(rs.greedy[:, None, None], target, target + noise)
    token = argmax(picked)  # [B, K+1]: greedy rows' argmax, seeded rows' coupled sample
    match = drafts == token[:, :-1]
    if not rs.any_unseeded:
        n = accepted_count(match, limit)
        return n, token.gather(1, n[:, None])[:, 0]
    unseeded = rs.unseeded
    p = target.softmax(-1)  # [B, K+1, V]
    q = p[:, :0] if draft is None else draft.softmax(-1)  # [B, K, V] (K = 0: no drafts)
    pd = p[:, :K].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    ratio_ok = (qd > 0) & (u * qd < pd)  # u < p/q without dividing by a tiny q
    n = accepted_count(torch.where(unseeded[:, None], ratio_ok, match), limit)
    # the unseeded rows' next token: from the residual max(0, p - q) at a rejection, from p after all were accepted
    p_n = p[rows, n]  # [B, V]
    residual = (p[rows, n.clamp(max=K - 1)] - q[rows, n.clamp(max=K - 1)]).clamp_min(0.0) if K else p_n
    rejected = n < limit
    weight = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)  # p == q up to rounding: p itself is the law
    g = noise[rows, n]
    # after all were accepted (or with no drafts) the sample from p is the Gumbel-max one over the shaped logits, as a
    # seeded row's token is (so a plain step's sampled rows take one rule: round_kernel.greedy_round runs it in C)
    sampled = torch.where(rejected, (weight.log() + g).argmax(dim=-1), argmax(target[rows, n] + g))
    return n, torch.where(unseeded, sampled, token.gather(1, n[:, None])[:, 0])
