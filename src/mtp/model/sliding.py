"""Sliding-window causal attention with optional attention sinks (MiMo-V2-Flash's sliding-window layers).

A query at position p sees the keys at positions p - window + 1 .. p. A sink is a learned logit per query head that
joins the softmax as one more key and contributes no value (it only takes probability mass away from the keys):
    out = sum_j softmax([s_1 .. s_n, sink])_j v_j,   s_j = q . k_j * scale
It is computed as SDPA over the keys plus one key of zeros (score 0) whose additive bias is the sink logit, and a
value of zeros. Keys and values live in the position-addressed `KVCache` (all positions kept, so rolling a
speculative round back is only not advancing; the window only masks).

The decode path follows the rules of `attention.attend_decode`: a query's result depends on its position and the
keys it sees only, never on the batch, the width T or the cache length S (eagerly, one SDPA per query row over exactly
its window; compiled, a masked reduction over all S slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import KVCache, Positions


def attend_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, pos: Positions,
                  scale: float, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, A, T, D] at positions pos.start.. (or pos.index [B, T], a decode forward) over k/v [B, Hk, T, D/Dv];
    with a cache, k/v are stored there first and the queries also see the earlier positions inside their window.
    sinks [A] or None. Returns [B, A, T, Dv]. A prefill builds an additive bias [A, T, keys] (the sink differs per
    head): a prompt read in chunks (`decode/prefill.py`) keeps it at T x (T + window); one forward over a whole
    long sequence (training) holds T x T per head, as transformers' eager attention does."""
    if pos.decoding:
        cache.write_at(k, v, pos.index)
        if pos.starts is not None and not torch.compiler.is_compiling():
            return torch.cat([window_rows(q[b : b + 1], cache.k[b : b + 1], cache.v[b : b + 1], s, scale, window, sinks)
                              for b, s in enumerate(pos.starts)])
        return window_masked(q, cache.k, cache.v, pos.index, scale, window, sinks)
    start = lo = 0
    if cache is not None:
        start = pos.start
        k, v = cache.write(k, v, start)
        lo = max(0, start - window + 1)  # the first key any of these queries sees: a chunk reads T + window keys at most
        k, v = k[:, :, lo:], v[:, :, lo:]
    T, S = q.shape[2], k.shape[2]
    qpos = torch.arange(T, device=q.device)[:, None] + start
    kpos = torch.arange(S, device=q.device)[None, :] + lo
    return sdpa_sinks(q, k, v, (kpos <= qpos) & (kpos > qpos - window), scale, sinks)


def sdpa_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
               sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, A, T, D] over k/v [B, Hk, S, D/Dv] where allowed [T, S] (bool), plus the sink of each head
    (sinks [A], or None): [B, A, T, Dv]."""
    B, A, T, _ = q.shape
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    gqa = A != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    k = torch.cat([k, k.new_zeros(B, k.shape[1], 1, k.shape[3])], dim=2)
    v = torch.cat([v, v.new_zeros(B, v.shape[1], 1, v.shape[3])], dim=2)
    bias = torch.cat([bias.expand(A, T, -1), sinks.to(q.dtype)[:, None, None].expand(A, T, 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None], scale=scale, enable_gqa=gqa)


def window_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, window: int,
                sinks: torch.Tensor | None) -> torch.Tensor:
    """Query row t of q [1, A, T, D] (position start + t) over exactly its window of k/v [1, Hk, >=start+T, D], one
    row at a time: what a plain decoding step at that position computes. Returns [1, A, T, Dv]."""
    rows = []
    for t in range(q.shape[2]):
        p = start + t
        lo = max(0, p - window + 1)
        allowed = torch.ones(1, p + 1 - lo, dtype=torch.bool, device=q.device)
        rows.append(sdpa_sinks(q[:, :, t : t + 1], k[:, :, lo : p + 1], v[:, :, lo : p + 1], allowed, scale, sinks))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)


def window_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, scale: float, window: int,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, A, T, D] at positions index [B, T] over all keys k/v [B, Hk, S, D] with those outside each query's window
    masked, the sink as one more score; fp32 reductions written as sums (no matmul, whose blocking may depend on the
    sizes), as `attention.attend_masked`. Returns [B, A, T, Dv] in q's dtype."""
    B, A, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = A // Hk  # query head a reads kv head a // G
    qf = q.float().reshape(B, Hk, G * T, D)
    scores = (qf[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * scale  # [B, Hk, G*T, S]
    keys = torch.arange(S, device=q.device)
    at = index[:, None, :, None]
    allowed = (keys <= at) & (keys > at - window)  # [B, 1, T, S]
    scores = scores.reshape(B, Hk, G, T, S).masked_fill(~allowed[:, :, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, Hk, G, 1, 1).expand(B, Hk, G, T, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = (probs.reshape(B, Hk, G * T, S)[..., None] * v.float()[:, :, None, :, :]).sum(-2)  # [B, Hk, G*T, Dv]
    return out.reshape(B, A, T, -1).to(q.dtype)
