"""The checkpoint families `mtp` runs: `model_type` (of `config.json`) -> the family's model class.

Each model class carries its config class (`config_class`) and its checkpoint naming (`internal_name`,
`checkpoint_name`, `is_mtp_tensor`); see `base.CausalLM` for the rest of the seam.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ConfigError, read_config_file
from .base import CausalLM
from .deepseek_v3 import DeepseekV3ForCausalLM
from .glm4_moe import Glm4MoeForCausalLM
from .llama import LlamaForCausalLM
from .mimo import MiMoForCausalLM
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
    "qwen3_next": Qwen3NextForCausalLM,  # issue 20 (i-families)
    "llama": LlamaForCausalLM,  # issue 20 (i-families): Meta's multi-token heads (`mtp convert`)
}
# Families whose MTP we know but whose backbone we do not run: model_type -> what is missing.
UNSUPPORTED = {
    "deepseek_v32": "DeepSeek-V3.2 uses DeepSeek Sparse Attention (its lightning indexer), which mtp does not implement",
    "glm_moe_dsa": "GLM-5 uses DeepSeek Sparse Attention (its lightning indexer), which mtp does not implement",
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
    return FAMILIES[model_type]


def config_from_dict(data: dict[str, Any]):
    """Parse a HF config dict into its family's config dataclass."""
    return model_class(data).config_class.from_hf_dict(data)


def config_from_json(path: str | Path):
    """Read `config.json` into its family's config dataclass (errors name the file and the key)."""
    data = read_config_file(path)
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def model_class_for(config) -> type[CausalLM]:
    """The model class of a parsed config."""
    for cls in FAMILIES.values():
        if type(config) is cls.config_class:
            return cls
    raise ConfigError(f"no model family for config type {type(config).__name__}")
