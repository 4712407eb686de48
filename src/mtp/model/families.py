"""The checkpoint families `mtp` runs: `model_type` (of `config.json`) -> the family's model class.

Each model class carries its config class (`config_class`) and its checkpoint naming (`internal_name`,
`checkpoint_name`, `is_mtp_tensor`); see `base.CausalLM` for the rest of the seam.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ConfigError, read_config_file
from ..config.quantization import parse_quantization
from .base import CausalLM
from .deepseek_v3 import DeepseekV3ForCausalLM
from .deepseek_v32 import DeepseekV32ForCausalLM
from .glm4_moe import Glm4MoeForCausalLM
from .glm_moe_dsa import GlmMoeDsaForCausalLM
from .hf_causal import REFUSED as HF_REFUSED
from .hf_causal import SUPPORTED as HF_SUPPORTED
from .hf_causal import HFCausalLM
from .llama import LlamaForCausalLM
from .mimo import MiMoForCausalLM
from .mimo_v2 import MiMoV2FlashForCausalLM
from .qwen3_5 import Qwen35ForCausalLM, Qwen35MoeForCausalLM
from .qwen3_next import Qwen3NextForCausalLM

FAMILIES: dict[str, type[CausalLM]] = {
    "qwen3_5": Qwen35ForCausalLM,
    "qwen3_5_text": Qwen35ForCausalLM,
    "qwen3_5_moe": Qwen35MoeForCausalLM,
    "qwen3_5_moe_text": Qwen35MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "mimo": MiMoForCausalLM,
    # DeepSeek Sparse Attention (issue 20)
    "deepseek_v32": DeepseekV32ForCausalLM,
    "glm_moe_dsa": GlmMoeDsaForCausalLM,
    **dict.fromkeys(HF_SUPPORTED, HFCausalLM),  # any transformers causal LM with attention-only layers (hf_causal.py)
    "qwen3_next": Qwen3NextForCausalLM,  # issue 20
    "mimo_v2_flash": MiMoV2FlashForCausalLM,  # issue 20
}
# `llama` is two families: transformers' own Llama through the generic family (any HF Llama checkpoint, and what
# `mtp retrofit` writes on one), and Meta's multi-token models as `mtp convert` writes them (model/meta.py), which
# declare our key `mtp_style` ("parallel"); that key decides.
META_LLAMA = LlamaForCausalLM
# Families whose MTP we know but whose backbone we do not run: model_type -> what is missing.
UNSUPPORTED = {
    # transformers architectures the generic family refuses, with the reason (unless a family of ours runs them)
    **{k: why for k, why in HF_REFUSED.items() if k not in FAMILIES},
    "deepseek_v4": "DeepSeek-V4 (hyper-connections, MTP at mtp.{i}.*) is not implemented yet",
    "step3p7": "Step-3.5/3.7 is not implemented yet",
    "nemotron_h": "Nemotron-H (hybrid Mamba-2) is not implemented yet",
}


def model_class(data: dict[str, Any]) -> type[CausalLM]:
    """The model class for a HF config dict (by its `model_type`)."""
    model_type = data.get("model_type")
    if model_type is None and isinstance(data.get("text_config"), dict):
        model_type = data["text_config"].get("model_type")
    if model_type is None:
        model_type = "qwen3_5_text"  # text-only Qwen3.5 configs written by hand often omit it
    if model_type in UNSUPPORTED:
        raise ConfigError(f"config key 'model_type' is {model_type!r}: not supported: {UNSUPPORTED[model_type]}")
    if model_type not in FAMILIES:
        raise ConfigError(f"config key 'model_type' is {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    if model_type == "llama" and "mtp_style" in data:
        return META_LLAMA
    return FAMILIES[model_type]


def config_from_dict(data: dict[str, Any]):
    """Parse a HF config dict into its family's config dataclass (its `quantization_config` checked too)."""
    config = model_class(data).config_class.from_hf_dict(data)
    parse_quantization(config.quantization_config)
    return config


def config_from_json(path: str | Path):
    """Read `config.json` into its family's config dataclass (errors name the file and the key)."""
    data = read_config_file(path)
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def model_class_for(config) -> type[CausalLM]:
    """The model class of a parsed config."""
    for cls in [*FAMILIES.values(), META_LLAMA]:
        if type(config) is cls.config_class:
            return cls
    raise ConfigError(f"no model family for config type {type(config).__name__}")
