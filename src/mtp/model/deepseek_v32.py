"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3 (`deepseek_v3.py`: MLA, DeepSeekMoE, MTP layers at
`model.layers.{num_hidden_layers + i}`, names, init) whose attention is DeepSeek Sparse Attention (`dsa.py`) in every
layer, the MTP layer's included: the MTP layer's decoder layer holds its own `self_attn.indexer.*` and chooses its
keys over the MTP's own cache, as the checkpoint defines it (docs/families.md, "DeepSeek-V3.2 and GLM-5")."""

from __future__ import annotations

import torch
from torch import nn

from ..config import DeepseekV32Config
from .deepseek_v3 import DeepseekV3ForCausalLM
from .dsa import SparseMLAttention


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    config_class = DeepseekV32Config

    @staticmethod
    def attention(config: DeepseekV32Config, layer: int) -> nn.Module:
        """Sparse MLA; a layer whose indexer is "shared" (GLM-5) reuses the last full layer's choice."""
        source = layer
        while source > 0 and config.indexer_type(source) == "shared":
            source -= 1
        return SparseMLAttention(config, layer, source)

    @torch.no_grad()
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """DeepSeek-V3's init (`nextn.normal_init`), and the indexers' key norms at weight 1, bias 0 (transformers)."""
        super().init_weights(std, modules)
        for m in (modules or self).modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()
