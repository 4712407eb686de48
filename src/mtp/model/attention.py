"""Gated full attention of Qwen3.5: query+gate projection, per-head q/k norm, partial RoPE, GQA, sigmoid gate."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from .cache import KVCache, Positions
from .linear import project
from .norm import RMSNorm
from .rope import apply_rope


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

    def forward(self, x: torch.Tensor, pos: Positions, cache: KVCache | None = None,
                keep_states: bool = False) -> tuple[torch.Tensor, None]:
        """x [B, T, H] at positions pos.start.. -> ([B, T, H], None); writes K/V into `cache` at those positions.
        (Nothing to snapshot for a verify: entries are addressed by position.)"""
        B, T, _ = x.shape
        D = self.head_dim
        # Per head the projection holds [query (D), gate (D)].
        q, k, v = project(self, x, "q_proj", "k_proj", "v_proj")
        q, gate = q.reshape(B, T, self.num_heads, 2 * D).chunk(2, dim=-1)
        gate = gate.reshape(B, T, self.num_heads * D)
        q = self.q_norm(q).transpose(1, 2)  # [B, A, T, D]
        k = self.k_norm(k.reshape(B, T, self.num_kv_heads, D)).transpose(1, 2)
        v = v.reshape(B, T, self.num_kv_heads, D).transpose(1, 2)
        q, k = apply_rope(q, pos.cos, pos.sin), apply_rope(k, pos.cos, pos.sin)
        out = attend(q, k, v, cache, pos, D**-0.5)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * D) * torch.sigmoid(gate)
        return self.o_proj(out), None

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return KVCache.allocate(batch, self.num_kv_heads, max_len, self.head_dim, self.head_dim, dtype, device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, pos: Positions,
           scale: float) -> torch.Tensor:
    """Causal (grouped-query) attention of q [B, A, T, D] over k/v [B, Hk, T, D] at positions pos.start.. (or per
    row, pos.starts); with a cache, k/v are stored there first and q attends to every earlier position too.
    Returns [B, A, T, Dv].

    A block of a few new tokens after cached ones (a verify) runs one query row at a time over exactly the keys a
    plain decoding step at that position sees: SDPA with a mask over more keys sums differently in the last bits
    (seen in bf16), and each verified position must be computed exactly as a plain step (docs/decisions.md)."""
    gqa = q.shape[1] != k.shape[1]
    if cache is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=gqa)
    T = q.shape[2]
    if pos.starts is not None:  # a batch of sequences at different positions: each row over its own keys
        cache.write_rows(k, v, pos.starts)
        return torch.cat([attend_rows(q[b : b + 1], cache.k[b : b + 1], cache.v[b : b + 1], s, scale, gqa)
                          for b, s in enumerate(pos.starts)])
    start = pos.start
    k, v = cache.write(k, v, start)
    if start == 0:  # a prefill
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=scale, enable_gqa=gqa)
    if T <= VERIFY_ROWS:
        return attend_rows(q, k, v, start, scale, gqa)
    # a long chunk after cached tokens: query i sees keys 0..start+i (SDPA's is_causal aligns top-left, wrong here)
    mask = torch.arange(start + T, device=q.device)[None, :] <= torch.arange(T, device=q.device)[:, None] + start
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# Blocks up to this many tokens after cached ones are verify blocks (k + 1 <= 9): attended row by row.
VERIFY_ROWS = 16


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, gqa: bool) -> torch.Tensor:
    """Query row t of q [B, A, T, D] (position start + t) over keys 0..start+t of k/v [B, Hk, >=start+T, D], one row at
    a time: exactly what a plain decoding step at that position computes."""
    rows = [F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, : start + t + 1], v[:, :, : start + t + 1],
                                           scale=scale, enable_gqa=gqa) for t in range(q.shape[2])]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)
