"""Configs of the DeepSeek Sparse Attention families: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`).

Both are DeepSeek-V3's config (MLA, DeepSeekMoE, `num_nextn_predict_layers` MTP layers stored after the backbone's)
plus the lightning indexer's keys: `index_topk` keys kept per query, `index_n_heads` x `index_head_dim` indexer
heads, and how its RoPE pairs dimensions (`indexer_rope_interleave`). GLM-5 adds IndexShare: a "shared" layer has
no indexer and reuses the selection of the last "full" layer before it (`indexer_types`, or the pattern
`index_topk_pattern`, or the schedule `index_topk_freq` / `index_skip_topk_offset`). Defaults are transformers'
(docs/families.md, "DeepSeek-V3.2 and GLM-5")."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigError, short
from .nextn import DeepseekV3Config

INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")


@dataclass
class DeepseekV32Config(DeepseekV3Config):
    """DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3 with a lightning indexer in every attention layer (the MTP
    layer's included). `mlp_layer_types` (optional, one "dense"/"sparse" per backbone layer) overrides
    `first_k_dense_replace` as transformers reads it; MTP layers are MoE."""

    model_types = ("deepseek_v32",)
    architecture = "DeepseekV32ForCausalLM"

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    # False: the indexer's RoPE rotates halves (DeepSeek-V3.2, unlike its MLA); True: interleaved pairs (GLM-5).
    indexer_rope_interleave: bool = False
    mlp_layer_types: list[str] | None = None

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (MTP layers continue the numbering) has the MoE block: `mlp_layer_types` when it covers i."""
        if self.mlp_layer_types is not None and i < len(self.mlp_layer_types):
            return self.mlp_layer_types[i] == "sparse"
        return super().is_moe_layer(i)

    def indexer_type(self, i: int) -> str:
        """Layer i's indexer: 'full' (its own) or 'shared' (the previous full layer's selection). Every layer of
        DeepSeek-V3.2 and every MTP layer is full."""
        return "full"

    def validate(self) -> None:
        super().validate()
        if self.q_lora_rank is None:
            raise ConfigError("config key 'q_lora_rank' is null: the lightning indexer reads the query latent, so "
                              "sparse attention needs a q_lora_rank")
        self.positive("index_topk", "index_head_dim", "index_n_heads")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"config key 'index_head_dim' ({self.index_head_dim}) is smaller than 'qk_rope_head_dim' "
                              f"({self.qk_rope_head_dim}): the indexer's RoPE covers its first qk_rope_head_dim dims")
        self.check_layer_list("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)
        layer_types = self.extra.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list)
                                        or any(t != "indexed_attention" for t in layer_types)):
            raise ConfigError(f"config key 'layer_types' is {short(layer_types)}; every layer of this family is "
                              "'indexed_attention'")

    def check_layer_list(self, key: str, value: list | None, choices: tuple[str, ...]) -> None:
        """A per-layer list has one entry of `choices` per backbone layer."""
        if value is None:
            return
        if len(value) != self.num_hidden_layers:
            raise ConfigError(f"config key '{key}' has {len(value)} entries; 'num_hidden_layers' is {self.num_hidden_layers}")
        bad = next((v for v in value if v not in choices), None)
        if bad is not None:
            raise ConfigError(f"config key '{key}' holds {short(bad)}; each entry must be one of "
                              + ", ".join(map(repr, choices)))


@dataclass
class GlmMoeDsaConfig(DeepseekV32Config):
    """GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's model with interleaved indexer RoPE and IndexShare. Layer i's indexer
    type is `indexer_types[i]`; without the list, `index_topk_pattern` ("F"/"S" per layer, or a list); without it,
    layer i is full when max(i - index_skip_topk_offset + 1, 0) is a multiple of `index_topk_freq` (defaults 2 and 1:
    every layer full), as transformers derives it. MTP layers always have their own indexer."""

    model_types = ("glm_moe_dsa",)
    architecture = "GlmMoeDsaForCausalLM"

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_rope_interleave: bool = True
    indexer_types: list[str] | None = None
    index_topk_pattern: str | list[str] | None = None
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None

    def indexer_type(self, i: int) -> str:
        if i >= self.num_hidden_layers:
            return "full"  # an MTP layer: its own indexer (the checkpoint holds one)
        if self.indexer_types is not None:
            return self.indexer_types[i]
        pattern = self.index_topk_pattern
        if pattern is not None:
            entry = pattern[i]
            return {"F": "full", "S": "shared"}.get(entry, entry) if isinstance(pattern, str) else entry
        freq = max(self.index_topk_freq or 1, 1)
        offset = 2 if self.index_skip_topk_offset is None else self.index_skip_topk_offset
        return "full" if max(i - offset + 1, 0) % freq == 0 else "shared"

    def validate(self) -> None:
        super().validate()
        self.check_layer_list("indexer_types", self.indexer_types, INDEXER_TYPES)
        pattern = self.index_topk_pattern
        if pattern is not None:
            if len(pattern) != self.num_hidden_layers:
                raise ConfigError(f"config key 'index_topk_pattern' has {len(pattern)} entries; 'num_hidden_layers' is "
                                  f"{self.num_hidden_layers}")
            allowed = ("F", "S") if isinstance(pattern, str) else INDEXER_TYPES
            bad = next((c for c in pattern if c not in allowed), None)
            if bad is not None:
                raise ConfigError(f"config key 'index_topk_pattern' holds {short(bad)}; each entry must be one of "
                                  + ", ".join(map(repr, allowed)))
        if self.index_topk_freq is not None:
            self.positive("index_topk_freq")
        if self.index_skip_topk_offset is not None:
            self.non_negative("index_skip_topk_offset")
        if self.indexer_type(0) != "full":
            raise ConfigError(f"config key '{self.indexer_key()}' makes layer 0 'shared': a shared layer reuses the "
                              "selection of an earlier full layer, so the first layer must be full")

    def indexer_key(self) -> str:
        """The key the indexer types come from (for messages)."""
        if self.indexer_types is not None:
            return "indexer_types"
        return "index_topk_pattern" if self.index_topk_pattern is not None else "index_skip_topk_offset"
