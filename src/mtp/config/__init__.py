"""Model configs as dataclasses that round-trip HF `config.json`: Qwen3.5 (both checkpoint shapes), Qwen3.5-MoE,
DeepSeek-V3/R1, GLM-4.5/4.6/4.7 (MoE), DeepSeek-V3.2 and GLM-5 (sparse attention), MiMo-7B, MiMo-V2-Flash, Qwen3-Next
and Llama with Meta's heads. `base.py` holds the one round trip and the validators every family shares; one file per group of
families."""

from .base import ROPE_TYPES, ConfigError, ConfigWarning, DecoderConfig, HFConfig, read_config_file
from .dsa import DeepseekV32Config, GlmMoeDsaConfig
from .llama import LlamaConfig
from .mimo_v2 import MiMoV2FlashConfig
from .nextn import DeepseekV3Config, Glm4MoeConfig, MiMoConfig, NextNConfig, NextNMoeConfig
from .qwen3_5 import LAYER_TYPES, MTP_STYLES, Qwen35Config, Qwen35MoeConfig
from .qwen3_next import Qwen3NextConfig

__all__ = ["LAYER_TYPES", "MTP_STYLES", "ROPE_TYPES", "ConfigError", "ConfigWarning", "DecoderConfig", "DeepseekV32Config",
           "DeepseekV3Config", "Glm4MoeConfig", "GlmMoeDsaConfig", "HFConfig", "LlamaConfig", "MiMoConfig", "MiMoV2FlashConfig",
           "NextNConfig", "NextNMoeConfig", "Qwen35Config", "Qwen35MoeConfig", "Qwen3NextConfig", "read_config_file"]
