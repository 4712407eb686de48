"""Configs of the families whose MTP layers are DeepSeek-style "next-n" layers counted by `num_nextn_predict_layers`:
DeepSeek-V3/R1 and GLM-4.5/4.6/4.7 (MoE, `NextNMoeConfig`), MiMo-7B (`MiMoConfig`). Defaults are transformers'."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigError, DecoderConfig


@dataclass
class NextNConfig(DecoderConfig):
    """`num_nextn_predict_layers` MTP layers, read under the name the loader and trainer use
    (`mtp_num_hidden_layers`)."""

    mtp_keys = ("num_nextn_predict_layers",)

    num_nextn_predict_layers: int = 1

    @property
    def mtp_num_hidden_layers(self) -> int:
        return self.num_nextn_predict_layers

    @mtp_num_hidden_layers.setter
    def mtp_num_hidden_layers(self, value: int) -> None:
        self.num_nextn_predict_layers = value

    def validate(self) -> None:
        super().validate()
        self.non_negative("num_nextn_predict_layers")


@dataclass
class HeadDimConfig(NextNConfig):
    """A family with a `head_dim` key: absent, hidden_size / num_attention_heads."""

    head_dim: int | None = None

    def complete(self) -> None:
        super().complete()
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return self.rotary_dim_of(self.head_dim)

    def validate(self) -> None:
        super().validate()
        self.positive("head_dim")
        self.check_rotary_dim()


@dataclass
class NextNMoeConfig(NextNConfig):
    """What DeepSeek-V3 and GLM-4.5 share: a dense MLP in the first `first_k_dense_replace` layers, then
    DeepSeekMoE (grouped sigmoid router, `n_shared_experts` shared experts), and `num_nextn_predict_layers` MTP
    layers stored after the backbone's (docs/families.md, "DeepSeek-V3/R1 and GLM-4.5/4.6/4.7")."""

    checkpoint_keys = ("mtp_embed_tokens", "mtp_shared_head")

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    attention_bias: bool = False
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    # Whether the MTP layers hold their own `embed_tokens` / `shared_head.head` (DeepSeek-V3, GLM-4.5) or use the
    # backbone's (GLM-4.6). Not HF keys: the loader sets them from the checkpoint's tensor names.
    mtp_embed_tokens: bool = True
    mtp_shared_head: bool = True

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (MTP layers continue the numbering after the backbone's) has the MoE block."""
        return i >= self.first_k_dense_replace

    def validate(self) -> None:
        super().validate()
        self.positive("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                      "routed_scaling_factor")
        self.non_negative("n_shared_experts", "first_k_dense_replace")
        self.divides("n_group", "n_routed_experts")
        self.at_most("topk_group", "n_group")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:  # groups are ranked by the sum of their top-2 experts
            raise ConfigError(f"config keys 'n_routed_experts' / 'n_group' give {per_group} expert per group; "
                              "group-limited routing needs at least 2")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(f"config key 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds the experts of "
                              f"'topk_group' ({self.topk_group}) groups of {per_group}")
        self.one_of("scoring_func", ("sigmoid",), self.extra.get("scoring_func", "sigmoid"))
        self.one_of("topk_method", ("noaux_tc",), self.extra.get("topk_method", "noaux_tc"))
        # 1: every layer after 'first_k_dense_replace' is MoE
        self.one_of("moe_layer_freq", (1,), self.extra.get("moe_layer_freq", 1))


@dataclass
class DeepseekV3Config(NextNMoeConfig):
    """DeepSeek-V3/R1 (`deepseek_v3`): multi-head latent attention, DeepSeekMoE, MTP layers at
    `model.layers.{num_hidden_layers + i}`. Defaults are transformers' (`DeepseekV3Config`)."""

    model_types = ("deepseek_v3",)
    architecture = "DeepseekV3ForCausalLM"

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_interleave: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> None:
        super().validate()
        self.positive("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            self.positive("q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config key 'qk_rope_head_dim' must be even, got {self.qk_rope_head_dim}")
        if self.rope()["partial_rotary_factor"] != 1.0:
            raise ConfigError("config key 'partial_rotary_factor' must be 1 for DeepSeek-V3 (RoPE covers "
                              "'qk_rope_head_dim')")


@dataclass
class Glm4MoeConfig(NextNMoeConfig, HeadDimConfig):
    """GLM-4.5/4.6/4.7 (`glm4_moe`): grouped-query attention with q/k/v bias and optional q/k norm, partial
    rotate-half RoPE, DeepSeekMoE, MTP layers at `model.layers.{num_hidden_layers + i}`. Defaults are transformers'
    (`Glm4MoeConfig`)."""

    model_types = ("glm4_moe",)
    architecture = "Glm4MoeForCausalLM"

    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    moe_intermediate_size: int = 1408
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    use_qk_norm: bool = False
    partial_rotary_factor: float | None = 0.5


@dataclass
class MiMoConfig(HeadDimConfig):
    """MiMo-7B (`mimo`, `MiMoForCausalLM`): a Qwen2 backbone and `num_nextn_predict_layers` MTP layers at
    `model.mtp_layers.{i}` (docs/families.md, "MiMo-7B"). Defaults are transformers' `Qwen2Config`'s."""

    model_types = ("mimo",)
    architecture = "MiMoForCausalLM"

    # hidden_size 4096, 32 layers, 32 heads: DecoderConfig's defaults
    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False

    def validate(self) -> None:
        super().validate()
        if self.use_sliding_window:
            raise ConfigError("config key 'use_sliding_window' is true: sliding-window attention is not supported")
