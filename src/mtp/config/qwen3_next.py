"""Qwen3-Next (`qwen3_next`, Qwen3-Next-80B-A3B): the Gated DeltaNet + gated-attention predecessor of Qwen3.5, with
DeepSeek's key for its MTP count (`num_nextn_predict_layers`, absent in the released config.json: 1). Defaults are
transformers' (`Qwen3NextConfig`); docs/families.md, "Qwen3-Next"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import ConfigError
from .nextn import NextNConfig
from .qwen3_5 import LAYER_TYPES, warn_layer_types_vs_interval


@dataclass
class Qwen3NextConfig(NextNConfig):
    """Layer i's MLP is the sparse MoE block unless i is in `mlp_only_layers` or (i + 1) is not a multiple of
    `decoder_sparse_step` (`is_moe_layer`; the MTP layers are numbered 0.. for this rule, as vLLM numbers them);
    `norm_topk_prob` says whether the top-k router weights are renormalised (Qwen3.5-MoE always does)."""

    model_types = ("qwen3_next",)
    architecture = "Qwen3NextForCausalLM"
    # What the Qwen3.5 blocks read (`model/qwen3_5.py`): Qwen3-Next's MTP is the sequential chain, no own embedding.
    mtp_style = "sequential"
    mtp_use_dedicated_embeddings = False

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    partial_rotary_factor: float | None = 0.25
    attention_bias: bool = False
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] = field(default_factory=list)

    def layer_type(self, i: int) -> str:
        """Layer i's mixer: 'full_attention' or 'linear_attention'."""
        if self.layer_types is not None:
            return self.layer_types[i]
        return "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (an MTP layer: its index among the MTP layers) has the sparse MoE block, as transformers decides."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def rotary_dim(self) -> int:
        return self.rotary_dim_of(self.head_dim)

    def validate(self) -> None:
        super().validate()
        self.positive("head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                      "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval", "decoder_sparse_step",
                      "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        self.non_negative("num_experts", "router_aux_loss_coef")
        self.divides("linear_num_key_heads", "linear_num_value_heads")
        if self.num_experts:
            self.at_most("num_experts_per_tok", "num_experts")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"config key 'layer_types' has {len(self.layer_types)} entries but "
                                  f"'num_hidden_layers' is {self.num_hidden_layers}")
            for i, kind in enumerate(self.layer_types):
                if kind not in LAYER_TYPES:
                    raise ConfigError(f"config key 'layer_types[{i}]' is {kind!r}; expected one of {LAYER_TYPES}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"config key 'mlp_only_layers' names layer {bad[0]}, outside 0..{self.num_hidden_layers - 1}")
        if self.attention_bias:
            raise ConfigError("config key 'attention_bias' must be false for Qwen3-Next")
        if self.extra.get("use_sliding_window"):
            raise ConfigError("config key 'use_sliding_window' is true: sliding-window attention is not supported")
        self.check_rotary_dim()

    @classmethod
    def read_keys(cls, kwargs: dict[str, Any], extra: dict[str, Any]) -> None:
        super().read_keys(kwargs, extra)
        warn_layer_types_vs_interval(kwargs)
