"""Gated full attention of Qwen3.5: query+gate projection, per-head q/k norm, partial RoPE, GQA, sigmoid gate."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from . import act, attention_kernel
from .cache import KVCache, Positions
from .linear import project
from .norm import RMSNorm
from .rope import apply_rope
from .rowwise import rowwise


class GatedAttention(nn.Module):
    fused_projections = ("q_proj", "k_proj", "v_proj")  # one matmul at inference (`linear.project`)

    def __init__(self, config: Qwen35Config):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, pos: Positions, cache: KVCache | None = None) -> tuple[torch.Tensor, None]:
        """x [B, T, H] at positions pos.start.. -> ([B, T, H], None); writes K/V into `cache` at those positions.
        (Nothing to snapshot for a verify: entries are addressed by position.)"""
        B, T, _ = x.shape
        D = self.head_dim
        # Per head the projection holds [query (D), gate (D)].
        q, k, v = project(self, x, "q_proj", "k_proj", "v_proj")
        q, gate = q.reshape(B, T, self.num_heads, 2 * D).chunk(2, dim=-1)
        gate = gate.reshape(B, T, self.num_heads * D)
        q = apply_rope(self.q_norm(q).transpose(1, 2), pos.cos, pos.sin)  # [B, A, T, D]
        out = attend(q, *self.keys_values(k, v, pos), cache, pos, D**-0.5)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * D)
        # inference on a CPU: one C call, the same roundings
        out = act.sigmoid_mul(out, gate) if act.usable(out, gate) else out * rowwise(torch.sigmoid, gate)
        return self.o_proj(out), None

    def keys_values(self, k: torch.Tensor, v: torch.Tensor, pos: Positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection's keys and values [B, T, Hk*D] -> normalised, rotated keys and values [B, Hk, T, D]."""
        B, T, _ = k.shape
        k = self.k_norm(k.reshape(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(k, pos.cos, pos.sin), v.reshape(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def fill(self, x: torch.Tensor, pos: Positions, cache: KVCache) -> None:
        """`forward`'s keys and values of x [B, T, H] at positions pos.start.. written into `cache`, and nothing else: no
        query attends (an MTP layer reading a prompt only needs what later drafts attend to). The key and value
        projections alone (a fused layer's parts run on views of its codes, each output its own row's product: the same
        bits; the query and gate columns were 3/4 of the fused product: 0.18 -> 0.06 ms of a ~0.8 ms read of 218
        positions, int4) and `keys_values`, so the same entries as `forward`."""
        cache.write(*self.keys_values(self.k_proj(x), self.v_proj(x), pos), pos.start)

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return KVCache.allocate(batch, self.num_kv_heads, max_len, self.head_dim, self.head_dim, dtype, device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, pos: Positions,
           scale: float) -> torch.Tensor:
    """Causal (grouped-query) attention of q [B, A, T, D] over k/v [B, Hk, T, D] at positions pos.start.. (a decode
    forward: `attend_decode`); with a cache, k/v are stored there first and q attends to every earlier position too.
    Returns [B, A, T, Dv]."""
    if pos.decoding:
        return attend_decode(q, k, v, cache, pos, scale)
    gqa = q.shape[1] != k.shape[1]
    T = q.shape[2]
    if cache is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=scale, enable_gqa=gqa)
    start = pos.start
    k, v = cache.write(k, v, start)
    if start == 0:  # a prefill
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=scale, enable_gqa=gqa)
    # a chunk after cached tokens: query i sees keys 0..start+i (SDPA's is_causal aligns top-left, wrong here)
    mask = torch.arange(start + T, device=q.device)[None, :] <= torch.arange(T, device=q.device)[:, None] + start
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, pos: Positions,
                  scale: float) -> torch.Tensor:
    """A decode forward (static shapes): q [B, A, T, D], k/v [B, Hk, T, D] of tokens at positions pos.index [B, T];
    k/v are written into the cache at those positions, and each query attends to the keys at positions <= its own.
    Returns [B, A, T, Dv].

    Every query row is computed the same way whatever the batch, the width T and the cache length S, so a position
    gets the same numbers in a plain step, in any row of a verify and in any batch row (what lossless greedy
    speculative decoding and batching rest on). Eagerly, with the rows' positions on the host (`pos.starts`), each
    query row attends over exactly the keys it sees (one C call on x86 CPUs, attention_kernel.py; else SDPA per
    row); in a compiled graph, every row reduces over all S positions with
    the later ones masked to exact zeros (their additions leave every partial sum unchanged)."""
    cache.write_at(k, v, pos.index)
    if pos.starts is not None and not torch.compiler.is_compiling():
        if attention_kernel.usable(q, cache.k, cache.v):
            return attention_kernel.attend(q, cache.k, cache.v, pos.starts, scale)
        gqa = q.shape[1] != k.shape[1]
        return torch.cat([attend_rows(q[b : b + 1], cache.k[b : b + 1], cache.v[b : b + 1], s, scale, gqa)
                          for b, s in enumerate(pos.starts)])
    return attend_masked(q, cache.k, cache.v, pos.index, scale)


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, A, T, D] at positions index [B, T] over all keys k/v [B, Hk, S, D] of positions 0..S-1, those after a
    query's position masked; fp32 reductions written as sums (no matmul, whose blocking may depend on the sizes).
    Returns [B, A, T, Dv] in q's dtype."""
    B, A, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = A // Hk  # query head a reads kv head a // G
    qf = q.float().reshape(B, Hk, G * T, D)
    scores = (qf[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * scale  # [B, Hk, G*T, S]
    allowed = torch.arange(S, device=q.device) <= index[:, None, :, None]  # [B, 1, T, S]
    scores = scores.reshape(B, Hk, G, T, S).masked_fill(~allowed[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(B, Hk, G * T, S)
    out = (probs[..., None] * v.float()[:, :, None, :, :]).sum(-2)  # [B, Hk, G*T, Dv]
    return out.reshape(B, A, T, -1).to(q.dtype)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, gqa: bool) -> torch.Tensor:
    """Query row t of q [B, A, T, D] (position start + t) over keys 0..start+t of k/v [B, Hk, >=start+T, D], one row at
    a time: exactly what a plain decoding step at that position computes."""
    rows = [F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, : start + t + 1], v[:, :, : start + t + 1],
                                           scale=scale, enable_gqa=gqa) for t in range(q.shape[2])]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)
