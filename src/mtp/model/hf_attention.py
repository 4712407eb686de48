"""Our attention inside transformers' own decoder layers: the function `hf_causal.py` registers with transformers'
attention registry (`AttentionInterface`, the name `ATTENTION`), so a transformers model runs its own projections,
norms and RoPE and hands the rotated q/k/v here, where they meet OUR position-addressed KV cache (`KVCache`) and our
decode rules (model/attention.py: a query's result does not depend on the batch, the width of the forward or the
cache length). transformers' own cache is never used (its forward is called with `use_cache=False`), and no mask is
built (the registry has no mask function under this name, so `masking_utils` skips it): causality and sliding
windows are applied here from the positions.

The layer finds its cache by `module.layer_idx` in the `mtp_attention` keyword argument that our forward passes
through transformers' `**kwargs` (`AttentionState`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import attend
from .cache import KVCache, Positions

ATTENTION = "mtp"  # the name under transformers' AttentionInterface (and `attn_implementation`)


@dataclass
class AttentionState:
    """What one of our forwards gives every attention call: the KV caches by layer index (a list for the backbone, a
    {layer_idx: cache} mapping for an MTP layer, None without a cache: training) and the tokens' positions."""

    caches: Sequence[KVCache] | Mapping[int, KVCache] | None
    pos: Positions


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                      dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, mtp_attention: AttentionState | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, A, T, D], k/v [B, Hk, T, D] (RoPE applied) -> ([B, T, A, D],
    no weights). `attention_mask` is ignored: positions decide what each query sees."""
    if mtp_attention is None:
        raise RuntimeError(f"attention implementation {ATTENTION!r} is mtp's: call the model through mtp (model.hidden / "
                           "model.decode), not transformers' forward")
    if softcap is not None:
        raise RuntimeError("attention logit soft-capping is not supported (hf_causal refuses such configs)")
    state = mtp_attention
    cache = None if state.caches is None else state.caches[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if sliding_window is None:
        out = attend(query, key, value, cache, state.pos, scale)
    else:
        out = attend_window(query, key, value, cache, state.pos, scale, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def attend_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, pos: Positions,
                  scale: float, window: int) -> torch.Tensor:
    """`attention.attend` with a sliding window: the query at position p sees the keys at positions p-window+1..p
    (transformers' `sliding_window`). q [B, A, T, D], k/v [B, Hk, T, D] -> [B, A, T, Dv]."""
    gqa = q.shape[1] != k.shape[1]
    if pos.decoding:
        cache.write_at(k, v, pos.index)
        if pos.starts is not None and not torch.compiler.is_compiling():  # row by row over exactly the keys seen
            rows = []
            for b, s in enumerate(pos.starts):
                cols = []
                for t in range(q.shape[2]):
                    p = s + t
                    lo = max(0, p - window + 1)
                    cols.append(F.scaled_dot_product_attention(q[b : b + 1, :, t : t + 1], cache.k[b : b + 1, :, lo : p + 1],
                                                               cache.v[b : b + 1, :, lo : p + 1], scale=scale, enable_gqa=gqa))
                rows.append(torch.cat(cols, dim=2))
            return torch.cat(rows)
        keys = torch.arange(cache.k.shape[2], device=q.device)
        allowed = (keys <= pos.index[:, None, :, None]) & (keys > pos.index[:, None, :, None] - window)  # [B, 1, T, S]
        return F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    start, T = pos.start, q.shape[2]
    if cache is not None:
        k, v = cache.write(k, v, start)
    keys = torch.arange(k.shape[2], device=q.device)[None, :]
    qpos = torch.arange(T, device=q.device)[:, None] + start
    allowed = (keys <= qpos) & (keys > qpos - window)  # [T, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
