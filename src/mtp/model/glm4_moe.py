"""GLM-4.5/4.6/4.7 (`glm4_moe`): DeepSeek-V3's model (`deepseek_v3.NextNMoeForCausalLM`: DeepSeekMoE, MTP layers at
`model.layers.{num_hidden_layers + i}`, names, init) with grouped-query attention: bias on q/k/v (`attention_bias`),
per-head q/k norm before RoPE (`use_qk_norm`), rotate-half RoPE on the first head_dim x partial_rotary_factor dims
(docs/families.md). GLM-4.6's MTP layer has no `embed_tokens` / `shared_head.head`: the backbone's are used."""

from __future__ import annotations

from torch import nn

from ..config import Glm4MoeConfig
from .deepseek_v3 import NextNMoeForCausalLM
from .gqa import GroupedQueryAttention


class Glm4MoeForCausalLM(NextNMoeForCausalLM):
    config_class = Glm4MoeConfig

    @staticmethod
    def attention(config: Glm4MoeConfig, layer: int) -> nn.Module:
        c = config
        return GroupedQueryAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                     c.attention_bias, c.rms_norm_eps if c.use_qk_norm else None)

    @staticmethod
    def rotary_head_dim(config: Glm4MoeConfig) -> int:
        return config.head_dim
