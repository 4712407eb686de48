"""Gated full attention of Qwen3.5: query+gate projection, per-head q/k norm, partial RoPE, GQA, sigmoid gate."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from .cache import AttnCache
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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttnCache | None = None, pos: int = 0
    ) -> torch.Tensor:
        """x [B, T, H] at positions pos..pos+T-1 -> [B, T, H]; writes K/V into `cache` at those positions."""
        B, T, _ = x.shape
        D = self.head_dim
        # Per head the projection holds [query (D), gate (D)].
        q, gate = self.q_proj(x).view(B, T, self.num_heads, 2 * D).chunk(2, dim=-1)
        gate = gate.reshape(B, T, self.num_heads * D)
        q = self.q_norm(q).transpose(1, 2)  # [B, A, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, D)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        mask, causal = None, T > 1
        if cache is not None:
            cache.k[:, :, pos : pos + T] = k
            cache.v[:, :, pos : pos + T] = v
            k, v = cache.k[:, :, : pos + T], cache.v[:, :, : pos + T]
            if pos > 0:
                causal = False
                if T > 1:  # query i sees keys 0..pos+i (SDPA's is_causal aligns top-left, wrong here)
                    rows = torch.arange(T, device=x.device)[:, None] + pos
                    mask = torch.arange(pos + T, device=x.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=D**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * D) * torch.sigmoid(gate)
        return self.o_proj(out)
