"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's model (`deepseek_v32.py`) with GLM-5's defaults, interleaved RoPE in the
indexer (`indexer_rope_interleave`) and IndexShare: layers whose indexer type is "shared" have no indexer and attend to
the keys the last full layer before them chose (`config.indexer_type`, `dsa.SparseMLAttention`). The MTP layer at
`model.layers.{num_hidden_layers}` has its own indexer (docs/families.md, "DeepSeek-V3.2 and GLM-5")."""

from __future__ import annotations

from ..config import GlmMoeDsaConfig
from .deepseek_v32 import DeepseekV32ForCausalLM


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    config_class = GlmMoeDsaConfig
