"""Multi-head latent attention (DeepSeek-V3), under the checkpoint's names (docs/families.md, "DeepSeek MLA")."""

from __future__ import annotations

import torch
from torch import nn

from ..config import DeepseekV3Config
from .attention import attend
from .cache import KVCache, Positions
from .norm import PlainRMSNorm
from .rope import apply_rope, apply_rope_interleaved, yarn_mscale

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not `rms_norm_eps` (both are 1e-6 in
# DeepSeek-V3's config).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """`self_attn` of DeepSeek-V3, A heads:
    - q = q_b_proj(q_a_layernorm(q_a_proj(x))) [A, nope + rope] (`q_proj` when `q_lora_rank` is null);
    - kv_a_proj_with_mqa(x) -> [compressed kv (kv_lora_rank) | k_rot (rope, shared by the heads)];
      kv_b_proj(kv_a_layernorm(compressed)) -> per head [k_nope (nope) | v (v_head_dim)];
    - RoPE (interleaved when `rope_interleave`) on q's and k's rope parts only; softmax scale
      (nope + rope)^-1/2 x YaRN's mscale(factor, mscale_all_dim)^2; o_proj [H, A * v_head_dim].

    The decode cache holds the expanded per-head keys [A, nope + rope] and values [A, v_head_dim], as transformers'
    cache does: simple, and addressed by position like every attention cache, but far larger than the compressed
    latent (kv_lora_rank + rope per token) that MLA could cache."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        c = config
        H, A = c.hidden_size, c.num_attention_heads
        self.num_heads, self.nope, self.rope, self.v_dim = A, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        qk = c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(H, A * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = PlainRMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, A * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = PlainRMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, A * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(A * c.v_head_dim, H, bias=c.attention_bias)
        self.rope_fn = apply_rope_interleaved if c.rope_interleave else apply_rope
        self.scale = qk**-0.5
        rope = c.rope()
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            factor = rope.get("factor") or c.max_position_embeddings / rope["original_max_position_embeddings"]
            self.scale *= yarn_mscale(factor, rope["mscale_all_dim"]) ** 2

    def project(self, x: torch.Tensor, pos: Positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [B, T, H] at positions pos -> q [B, A, T, qk], k [B, A, T, qk] (RoPE applied), v [B, A, T, v_head_dim], and
        the query latent q_a_layernorm(q_a_proj(x)) [B, T, q_lora_rank] (None without q-LoRA; the sparse-attention
        indexer reads it, `dsa.py`)."""
        B, T, _ = x.shape
        A = self.num_heads
        latent_q = None if hasattr(self, "q_proj") else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if latent_q is None else self.q_b_proj(latent_q)
        q_nope, q_rot = q.view(B, T, A, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, A, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot = self.rope_fn(q_rot, pos.cos, pos.sin)
        k_rot = self.rope_fn(k_rot.view(B, 1, T, self.rope), pos.cos, pos.sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, A, T, self.rope)], dim=-1)
        return q, k, v, latent_q

    def forward(self, x: torch.Tensor, pos: Positions, cache: KVCache | None = None) -> tuple[torch.Tensor, None]:
        """x [B, T, H] at positions pos.start.. -> ([B, T, H], None); writes K/V into `cache` at those positions."""
        B, T, _ = x.shape
        q, k, v, _ = self.project(x, pos)
        out = attend(q, k, v, cache, pos, self.scale)  # [B, A, T, v_head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim)), None

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return KVCache.allocate(batch, self.num_heads, max_len, self.nope + self.rope, self.v_dim, dtype, device)
