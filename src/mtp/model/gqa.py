"""Grouped-query attention with optional q/k/v bias and per-head q/k norm, partial rotate-half RoPE: GLM-4.5's
attention (`use_qk_norm`, bias on q/k/v only) and Qwen2's (MiMo: bias on q/k/v, no norm, full RoPE)."""

from __future__ import annotations

import torch
from torch import nn

from .attention import attend
from .cache import KVCache, Positions
from .norm import PlainRMSNorm
from .rope import apply_rope


class GroupedQueryAttention(nn.Module):
    """`self_attn`: q_proj [A*D, H], k_proj / v_proj [K*D, H] (bias when `qkv_bias`), o_proj [H, A*D] (no bias);
    `q_norm` / `k_norm` [D] (plain RMSNorm) before RoPE when `qk_norm_eps` is given; RoPE on the first R dims of each
    head, R = the width of `pos.cos`; scale D^-1/2."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = PlainRMSNorm(head_dim, qk_norm_eps)
            self.k_norm = PlainRMSNorm(head_dim, qk_norm_eps)

    def forward(self, x: torch.Tensor, pos: Positions, cache: KVCache | None = None) -> tuple[torch.Tensor, None]:
        """x [B, T, H] at positions pos.start.. -> ([B, T, H], None); writes K/V into `cache` at those positions
        (nothing to snapshot for a verify: entries are addressed by position)."""
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, self.num_heads, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), pos.cos, pos.sin)
        k = apply_rope(k.transpose(1, 2), pos.cos, pos.sin)
        out = attend(q, k, v, cache, pos, D**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * D)), None

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return KVCache.allocate(batch, self.num_kv_heads, max_len, self.head_dim, self.head_dim, dtype, device)
