"""Gated full attention of Qwen3.5: query+gate projection, per-head q/k norm, partial RoPE, GQA, sigmoid gate."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from .cache import KVCache, Positions
from .norm import RMSNorm
from .rope import apply_rope


class GatedAttention(nn.Module):
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
        q, gate = self.q_proj(x).view(B, T, self.num_heads, 2 * D).chunk(2, dim=-1)
        gate = gate.reshape(B, T, self.num_heads * D)
        q = self.q_norm(q).transpose(1, 2)  # [B, A, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, D)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        q, k = apply_rope(q, pos.cos, pos.sin), apply_rope(k, pos.cos, pos.sin)
        out = attend(q, k, v, cache, pos.start, D**-0.5)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * D) * torch.sigmoid(gate)
        return self.o_proj(out), None

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return KVCache.allocate(batch, self.num_kv_heads, max_len, self.head_dim, self.head_dim, dtype, device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, start: int,
           scale: float) -> torch.Tensor:
    """Causal (grouped-query) attention of q [B, A, T, D] over k/v [B, Hk, T, D] at positions start..; with a
    cache, k/v are stored there first and q attends to every earlier position too. Returns [B, A, T, Dv]."""
    T = q.shape[2]
    mask, causal = None, T > 1
    if cache is not None:
        k, v = cache.write(k, v, start)
        if start > 0:
            causal = False
            if T > 1:  # query i sees keys 0..start+i (SDPA's is_causal aligns top-left, wrong here)
                rows = torch.arange(T, device=q.device)[:, None] + start
                mask = torch.arange(start + T, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
