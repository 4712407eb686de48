"""MiMo-V2-Flash's config (`mimo_v2_flash`): hybrid sliding-window / global attention with attention sinks in the
sliding-window layers, sigmoid-routed MoE without shared experts, and MTP layers at `model.mtp.layers.{i}`.

The released config.json spells the layer kinds as SGLang and vLLM read them (`hybrid_layer_pattern` 0 = global /
1 = sliding, `moe_layer_freq` 0 = dense / 1 = MoE, `rope_theta` / `swa_rope_theta`, `swa_*` head shapes,
`sliding_window_size`, `layernorm_epsilon`); transformers writes its own spelling (`layer_types`, `mlp_layer_types`,
`rope_parameters` per layer kind, `rms_norm_eps`, `sliding_window` = window + 1). Either is read; where a file has
both they must agree. The model is transformers' (docs/families.md, "MiMo-V2-Flash"): a `swa_*` shape other than the
one transformers derives is refused, not guessed at."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import ConfigError, conforms, short
from .nextn import NextNConfig

KINDS = ("full_attention", "sliding_attention")
DEFAULT_PARTIAL_ROTARY = 0.334  # transformers' default for both layer kinds


@dataclass
class MiMoV2FlashConfig(NextNConfig):
    """Backbone layer i is global attention or sliding-window attention (`layer_type`); both kinds share `head_dim`
    (queries, keys) and `v_head_dim` (values); the sliding kind has twice `num_key_value_heads`, a window of `window`
    keys (the query's own included) and a learned sink logit per head; each kind has its own RoPE theta (partial
    RoPE). Layer i's MLP is dense (`intermediate_size`) or MoE (`is_moe_layer`). MTP layers are sliding-window
    layers with a dense MLP. `num_nextn_predict_layers` (absent from the released config) defaults to the release's
    three; the loader takes the count from the checkpoint's tensors when the file lacks the key."""

    model_types = ("mimo_v2_flash",)
    architecture = "MiMoV2FlashForCausalLM"
    checkpoint_keys = ("num_nextn_predict_layers",)

    vocab_size: int = 152576
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 4
    head_dim: int = 192
    v_head_dim: int = 128
    # SGLang/vLLM's spelling of the sliding-window layers' shapes; transformers derives them (`attention_shape`).
    swa_num_attention_heads: int | None = None
    swa_num_key_value_heads: int | None = None
    swa_head_dim: int | None = None
    swa_v_head_dim: int | None = None
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    layernorm_epsilon: float | None = None
    rope_theta: float = 5_000_000.0
    swa_rope_theta: float = 10_000.0
    partial_rotary_factor: float | None = DEFAULT_PARTIAL_ROTARY
    sliding_window: int = 129  # transformers' meaning: keys a query sees, itself included
    sliding_window_size: int | None = None  # SGLang's meaning: keys before the query (window = size + 1)
    layer_types: list[str] | None = None
    hybrid_layer_pattern: list[int] | None = None
    mlp_layer_types: list[str] | None = None
    moe_layer_freq: list[int] | None = None
    add_swa_attention_sink_bias: bool = True
    add_full_attention_sink_bias: bool = False
    attention_value_scale: float | None = 0.707
    attention_bias: bool = False
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float | None = 1.0  # the released file has null: 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    bos_token_id: int | None = 1
    num_nextn_predict_layers: int = 3

    # ------------------------------------------------------------------ derived
    def in_file(self, key: str) -> bool:
        """Did the file this config was read from hold `key`? (False for a config built in code.)"""
        return key in self.extra.get("__keys__", ())

    def layer_type(self, i: int) -> str:
        """Layer i's attention, 'full_attention' or 'sliding_attention' (MTP layers, i >= num_hidden_layers: sliding).
        Default: global at layer 0 and every sixth layer, as transformers'."""
        if i >= self.num_hidden_layers:
            return "sliding_attention"
        if self.layer_types is not None:
            return self.layer_types[i]
        if self.hybrid_layer_pattern is not None:
            return KINDS[self.hybrid_layer_pattern[i]]
        return "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"

    def is_moe_layer(self, i: int) -> bool:
        """Layer i has the MoE block (default: all but layer 0, as transformers'); MTP layers are dense."""
        if i >= self.num_hidden_layers:
            return False
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[i] == "sparse"
        if self.moe_layer_freq is not None:
            return self.moe_layer_freq[i] == 1
        return i > 0

    @property
    def window(self) -> int:
        """Keys a sliding-window query attends to, itself included."""
        return self.sliding_window if self.sliding_window_size is None else self.sliding_window_size + 1

    @property
    def norm_eps(self) -> float:
        return self.rms_norm_eps if self.layernorm_epsilon is None else self.layernorm_epsilon

    @property
    def value_scale(self) -> float:
        return 1.0 if self.attention_value_scale is None else self.attention_value_scale

    @property
    def scaling_factor(self) -> float:
        return 1.0 if self.routed_scaling_factor is None else self.routed_scaling_factor

    def attention_shape(self, kind: str) -> tuple[int, int]:
        """(query heads, key/value heads) of a layer kind: the sliding kind has twice the key/value heads."""
        kv = self.num_key_value_heads
        return self.num_attention_heads, kv if kind == "full_attention" else 2 * kv

    def nested_rope(self) -> dict | None:
        """`rope_parameters` when it holds one entry per layer kind (transformers' spelling), else None."""
        p = self.rope_parameters
        return p if isinstance(p, dict) and any(k in p for k in KINDS) else None

    def rope_for(self, kind: str) -> dict[str, Any]:
        """RoPE parameters of a layer kind: `rope_parameters[kind]` (transformers' spelling), else the flat keys."""
        flat_theta = self.rope_theta if kind == "full_attention" else self.swa_rope_theta
        flat_factor = DEFAULT_PARTIAL_ROTARY if self.partial_rotary_factor is None else self.partial_rotary_factor
        p = (self.nested_rope() or {}).get(kind) or {}
        return {"rope_type": "default", "rope_theta": float(p.get("rope_theta", flat_theta)),
                "partial_rotary_factor": float(p.get("partial_rotary_factor", flat_factor))}

    def rotary_dim(self, kind: str) -> int:
        return int(self.head_dim * self.rope_for(kind)["partial_rotary_factor"])

    # ------------------------------------------------------------------ checks
    def check_rope(self) -> None:
        nested = self.nested_rope()
        if nested is None:
            super().check_rope()
            return
        flat = {"full_attention": "rope_theta", "sliding_attention": "swa_rope_theta"}
        for kind in KINDS:
            p = nested.get(kind)
            if not isinstance(p, dict):
                raise ConfigError(f"config key 'rope_parameters.{kind}' must be an object, got {short(p)}")
            if p.get("rope_type", "default") != "default":
                raise ConfigError(f"config key 'rope_parameters.{kind}.rope_type' is {short(p.get('rope_type'))}; "
                                  "supported: 'default'")
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in p and not (conforms(p[key], float) and p[key] > 0):
                    raise ConfigError(f"config key 'rope_parameters.{kind}.{key}' must be a number > 0, got {short(p[key])}")
            for inner, outer in (("rope_theta", flat[kind]), ("partial_rotary_factor", "partial_rotary_factor")):
                if inner in p and self.in_file(outer) and float(p[inner]) != float(getattr(self, outer)):
                    raise ConfigError(f"config key '{outer}' ({short(getattr(self, outer))}) contradicts "
                                      f"rope_parameters.{kind}.{inner} ({short(p[inner])})")

    def validate(self) -> None:
        super().validate()
        self.positive("head_dim", "v_head_dim", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                      "n_group", "topk_group", "sliding_window", "swa_rope_theta")
        for key in ("sliding_window_size", "layernorm_epsilon", "attention_value_scale", "routed_scaling_factor"):
            if getattr(self, key) is not None:
                self.positive(key)
        derived = {"swa_num_attention_heads": self.num_attention_heads, "swa_num_key_value_heads": 2 * self.num_key_value_heads,
                   "swa_head_dim": self.head_dim, "swa_v_head_dim": self.v_head_dim}
        for key, want in derived.items():
            value = getattr(self, key)
            if value is not None and value != want:
                raise ConfigError(f"config key '{key}' is {short(value)}; MiMo-V2-Flash's sliding-window layers have "
                                  f"{want} (as transformers derives it); other shapes are not supported")
        if self.add_full_attention_sink_bias or not self.add_swa_attention_sink_bias:
            key = "add_full_attention_sink_bias" if self.add_full_attention_sink_bias else "add_swa_attention_sink_bias"
            raise ConfigError(f"config key '{key}' is {short(getattr(self, key))}: MiMo-V2-Flash has attention sinks in "
                              "its sliding-window layers only; other placements are not supported")
        if self.attention_bias:
            raise ConfigError("config key 'attention_bias' must be false for MiMo-V2-Flash")
        for kind in KINDS:
            heads, kv = self.attention_shape(kind)
            if heads % kv:
                raise ConfigError(f"config keys give {kv} key/value heads for {heads} query heads in the "
                                  f"{kind.replace('_', ' ')} layers; they must divide them")
            rot = self.rotary_dim(kind)
            if rot % 2 or not 0 < rot <= self.head_dim:
                raise ConfigError(f"config keys 'head_dim' x 'partial_rotary_factor' give rotary dim {rot} for the "
                                  f"{kind.replace('_', ' ')} layers; it must be even and in 1..{self.head_dim}")
        self.divides("n_group", "n_routed_experts")
        self.at_most("topk_group", "n_group")
        self.at_most("num_experts_per_tok", "n_routed_experts")
        self.one_of("scoring_func", ("sigmoid",), self.extra.get("scoring_func", "sigmoid"))
        self.one_of("topk_method", ("noaux_tc",), self.extra.get("topk_method", "noaux_tc"))
        if self.extra.get("n_shared_experts"):
            raise ConfigError(f"config key 'n_shared_experts' is {short(self.extra['n_shared_experts'])}: MiMo-V2-Flash's "
                              "MoE has no shared experts")
        self.check_list("layer_types", self.layer_types, KINDS)
        self.check_list("hybrid_layer_pattern", self.hybrid_layer_pattern, (0, 1))
        self.check_list("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse"))
        self.check_list("moe_layer_freq", self.moe_layer_freq, (0, 1))
        L = self.num_hidden_layers
        if self.layer_types is not None and self.hybrid_layer_pattern is not None:
            i = next((i for i in range(L) if self.layer_types[i] != KINDS[self.hybrid_layer_pattern[i]]), None)
            if i is not None:
                raise ConfigError(f"config keys 'layer_types' and 'hybrid_layer_pattern' disagree at layer {i} "
                                  f"({self.layer_types[i]!r} vs {self.hybrid_layer_pattern[i]})")
        if self.mlp_layer_types is not None and self.moe_layer_freq is not None:
            i = next((i for i in range(L) if (self.mlp_layer_types[i] == "sparse") != (self.moe_layer_freq[i] == 1)), None)
            if i is not None:
                raise ConfigError(f"config keys 'mlp_layer_types' and 'moe_layer_freq' disagree at layer {i} "
                                  f"({self.mlp_layer_types[i]!r} vs {self.moe_layer_freq[i]})")
        if self.sliding_window_size is not None and self.in_file("sliding_window") \
                and self.sliding_window not in (self.sliding_window_size, self.sliding_window_size + 1):
            raise ConfigError(f"config keys 'sliding_window' ({self.sliding_window}) and 'sliding_window_size' "
                              f"({self.sliding_window_size}) disagree")
        if self.layernorm_epsilon is not None and self.in_file("rms_norm_eps") and self.layernorm_epsilon != self.rms_norm_eps:
            raise ConfigError(f"config keys 'layernorm_epsilon' ({self.layernorm_epsilon}) and 'rms_norm_eps' "
                              f"({self.rms_norm_eps}) disagree")

    def check_list(self, key: str, value: list | None, choices: tuple) -> None:
        """A per-layer list has one entry of `choices` per backbone layer."""
        if value is None:
            return
        if not isinstance(value, list) or len(value) != self.num_hidden_layers:
            n = len(value) if isinstance(value, list) else short(value)
            raise ConfigError(f"config key '{key}' has {n} entries; 'num_hidden_layers' is {self.num_hidden_layers}")
        bad = next((v for v in value if v not in choices or isinstance(v, bool)), None)
        if bad is not None:
            raise ConfigError(f"config key '{key}' holds {short(bad)}; each entry must be one of "
                              + ", ".join(map(repr, choices)))
