"""Qwen3.5 (dense) and Qwen3.5-MoE configs: flat (`qwen3_5_text`) or nested in a multimodal one (`qwen3_5`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from .base import ConfigError, ConfigWarning, DecoderConfig

LAYER_TYPES = ("linear_attention", "full_attention")
MTP_STYLES = ("sequential", "parallel")


def warn_layer_types_vs_interval(kwargs: dict[str, Any]) -> None:
    """Warn when an explicit `layer_types` disagrees with `full_attention_interval` (the hybrid families' two ways of
    saying the same thing); transformers lets the explicit list win (it writes such configs for all-attention models)."""
    types, interval = kwargs.get("layer_types"), kwargs.get("full_attention_interval")
    if (isinstance(types, list) and all(t in LAYER_TYPES for t in types) and isinstance(interval, int)
            and not isinstance(interval, bool) and interval > 0):
        expect = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]
        if expect != types:
            warnings.warn(f"config key 'layer_types' disagrees with 'full_attention_interval' ({interval}); "
                          "using 'layer_types'", ConfigWarning, stacklevel=5)


@dataclass
class Qwen35Config(DecoderConfig):
    """Qwen3.5 (dense) text config. Without `layer_types`, layer i is full attention when (i + 1) is a multiple of
    `full_attention_interval` (`layer_type(i)`; the list is not built, so a config is parsed in constant memory
    whatever its layer count)."""

    # The keys that describe the MTP module (what `mtp heal` carries over from a base checkpoint).
    mtp_keys = ("mtp_num_hidden_layers", "mtp_style", "mtp_use_dedicated_embeddings")
    model_types = ("qwen3_5_text", "qwen3_5")
    outer_model_type = "qwen3_5"  # the multimodal config that nests the text one under `text_config`
    architecture = "Qwen3_5ForCausalLM"
    extension_keys = ("mtp_style",)
    rope_in_parameters = True
    rope_types = ("default",)

    vocab_size: int = 248320
    hidden_size: int = 1024
    intermediate_size: int = 3584
    num_hidden_layers: int = 24
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 2
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float | None = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    attn_output_gate: bool = True
    mtp_num_hidden_layers: int = 1
    mtp_use_dedicated_embeddings: bool = False
    # "sequential": the Qwen3.5/DeepSeek chain; "parallel": Meta-style independent heads (an mtp extension).
    mtp_style: str = "sequential"

    def layer_type(self, i: int) -> str:
        """Layer i's mixer: 'full_attention' or 'linear_attention'."""
        if self.layer_types is not None:
            return self.layer_types[i]
        return "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"

    @property
    def rotary_dim(self) -> int:
        return self.rotary_dim_of(self.head_dim)

    def validate(self) -> None:
        super().validate()
        self.positive("head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                      "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval")
        self.non_negative("mtp_num_hidden_layers")
        self.divides("linear_num_key_heads", "linear_num_value_heads")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"config key 'layer_types' has {len(self.layer_types)} entries but "
                                  f"'num_hidden_layers' is {self.num_hidden_layers}")
            for i, kind in enumerate(self.layer_types):
                if kind not in LAYER_TYPES:
                    raise ConfigError(f"config key 'layer_types[{i}]' is {kind!r}; expected one of {LAYER_TYPES}")
        if self.attention_bias:
            raise ConfigError("config key 'attention_bias' must be false for Qwen3.5")
        if not self.attn_output_gate:
            raise ConfigError("config key 'attn_output_gate' must be true: Qwen3.5 attention is always gated")
        self.one_of("mtp_style", MTP_STYLES)
        if self.mtp_style == "parallel" and self.mtp_use_dedicated_embeddings:
            raise ConfigError("config key 'mtp_use_dedicated_embeddings' must be false with mtp_style 'parallel'")
        self.check_rotary_dim()

    @classmethod
    def read_keys(cls, kwargs: dict[str, Any], extra: dict[str, Any]) -> None:
        super().read_keys(kwargs, extra)
        warn_layer_types_vs_interval(kwargs)


@dataclass
class Qwen35MoeConfig(Qwen35Config):
    """Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B): the dense keys plus the sparse MoE block's. Every layer's
    MLP, the MTP layer's included, is the MoE block; there is no `norm_topk_prob`: the top-k weights are always
    renormalised (docs/families.md, "Qwen3.5-MoE")."""

    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    outer_model_type = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForCausalLM"

    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    def validate(self) -> None:
        super().validate()
        self.positive("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        self.at_most("num_experts_per_tok", "num_experts")
        self.non_negative("router_aux_loss_coef")
