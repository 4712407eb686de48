"""Qwen3.5 text config as a dataclass that round-trips HF `config.json` (both checkpoint shapes)."""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")
MTP_STYLES = ("sequential", "parallel")


class ConfigError(ValueError):
    """A config value is missing, malformed or contradicts another key (the message names the key)."""


class ConfigWarning(UserWarning):
    """A config value that is used, but not as its other keys suggest (the message names the keys)."""


@dataclass
class Qwen35Config:
    # The keys that describe the MTP module (what `mtp heal` carries over from a base checkpoint).
    mtp_keys = ("mtp_num_hidden_layers", "mtp_style", "mtp_use_dedicated_embeddings")
    text_model_type = "qwen3_5_text"  # a flat, text-only config
    outer_model_type = "qwen3_5"  # the multimodal config that nests the text one under `text_config`
    architecture = "Qwen3_5ForCausalLM"

    vocab_size: int = 248320
    hidden_size: int = 1024
    intermediate_size: int = 3584
    num_hidden_layers: int = 24
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
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
    partial_rotary_factor: float = 0.25
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"
    attention_bias: bool = False
    attn_output_gate: bool = True
    initializer_range: float = 0.02
    mtp_num_hidden_layers: int = 1
    mtp_use_dedicated_embeddings: bool = False
    # "sequential": the Qwen3.5/DeepSeek chain; "parallel": Meta-style independent heads (an mtp extension).
    mtp_style: str = "sequential"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Keys we do not model, kept verbatim so a round trip loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)
    # For multimodal checkpoints (`model_type: qwen3_5`): every top-level key except `text_config`.
    outer: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.rope_parameters is None:
            self.rope_parameters = {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            }
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first bad or contradictory key."""
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "full_attention_interval", "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config key '{name}' must be a positive integer, got {value!r}")
        if not isinstance(self.mtp_num_hidden_layers, int) or self.mtp_num_hidden_layers < 0:
            raise ConfigError(f"config key 'mtp_num_hidden_layers' must be an integer >= 0, got {self.mtp_num_hidden_layers!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config key 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                f"'num_attention_heads' ({self.num_attention_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"config key 'linear_num_key_heads' ({self.linear_num_key_heads}) must divide "
                f"'linear_num_value_heads' ({self.linear_num_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config key 'layer_types' has {len(self.layer_types)} entries but "
                f"'num_hidden_layers' is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"config key 'layer_types[{i}]' is {kind!r}; expected one of {LAYER_TYPES}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config key 'hidden_act' must be 'silu' for Qwen3.5, got {self.hidden_act!r}")
        if self.attention_bias:
            raise ConfigError("config key 'attention_bias' must be false for Qwen3.5")
        if not self.attn_output_gate:
            raise ConfigError("config key 'attn_output_gate' must be true: Qwen3.5 attention is always gated")
        if self.mtp_style not in MTP_STYLES:
            raise ConfigError(f"config key 'mtp_style' is {self.mtp_style!r}; expected one of {MTP_STYLES}")
        if self.mtp_style == "parallel" and self.mtp_use_dedicated_embeddings:
            raise ConfigError("config key 'mtp_use_dedicated_embeddings' must be false with mtp_style 'parallel'")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"config key 'partial_rotary_factor' must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(
                f"config keys 'head_dim' x 'partial_rotary_factor' give rotary dim {self.rotary_dim}; it must be even and > 0"
            )
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"config key 'rope_parameters.rope_type' is {rope_type!r}; only 'default' is supported")

    # ------------------------------------------------------------------ derived
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    # ------------------------------------------------------------------ HF dict round trip
    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen35Config:
        """Parse a HF config dict: `qwen3_5` (nested `text_config`) or `qwen3_5_text` (flat) - or the other pair
        of model types a subclass names."""
        data = copy.deepcopy(data)
        outer = None
        if "text_config" in data:
            text = data.pop("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config key 'text_config' must be an object")
            outer = data
            # Real multimodal configs keep tie_word_embeddings at the top level; it may also be in text_config.
            if "tie_word_embeddings" in outer:
                if "tie_word_embeddings" in text and text["tie_word_embeddings"] != outer["tie_word_embeddings"]:
                    raise ConfigError(
                        "config key 'tie_word_embeddings' differs between the top level "
                        f"({outer['tie_word_embeddings']}) and text_config ({text['tie_word_embeddings']})"
                    )
        else:
            text = data
        model_type = text.get("model_type", cls.text_model_type)
        if model_type not in (cls.text_model_type, cls.outer_model_type):
            raise ConfigError(f"config key 'model_type' is {model_type!r}; expected '{cls.outer_model_type}' or "
                              f"'{cls.text_model_type}'")

        known = {f.name for f in fields(cls)} - {"extra", "outer"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in text.items():
            (kwargs if key in known else extra)[key] = value
        if outer is not None and "tie_word_embeddings" not in kwargs and "tie_word_embeddings" in outer:
            kwargs["tie_word_embeddings"] = outer["tie_word_embeddings"]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if outer is not None and key not in kwargs and key in outer:
                kwargs[key] = outer[key]

        rope = kwargs.get("rope_parameters")
        if rope is not None:
            if not isinstance(rope, dict):
                raise ConfigError("config key 'rope_parameters' must be an object")
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rope:
                    if key in kwargs and float(kwargs[key]) != float(rope[key]):
                        raise ConfigError(
                            f"config key '{key}' ({kwargs[key]}) contradicts rope_parameters.{key} ({rope[key]})"
                        )
                    kwargs[key] = rope[key]
        else:
            # Old-style flat rope keys: remember we saw them flat so we write them back flat.
            extra["__flat_rope__"] = True

        given_types = kwargs.get("layer_types") is not None
        cfg_interval = kwargs.get("full_attention_interval")
        if given_types:
            for i, kind in enumerate(kwargs["layer_types"]):
                if kind not in LAYER_TYPES:
                    raise ConfigError(f"config key 'layer_types[{i}]' is {kind!r}; expected one of {LAYER_TYPES}")
        if given_types and isinstance(cfg_interval, int) and cfg_interval > 0:
            expect = [
                "full_attention" if (i + 1) % cfg_interval == 0 else "linear_attention"
                for i in range(len(kwargs["layer_types"]))
            ]
            if expect != kwargs["layer_types"]:
                # transformers lets an explicit layer_types win (it writes such configs for all-attention models)
                warnings.warn(f"config key 'layer_types' disagrees with 'full_attention_interval' ({cfg_interval}); "
                              "using 'layer_types'", ConfigWarning, stacklevel=3)
        # Remember which keys the file had, so that writing it back adds none of our defaults.
        extra["__keys__"] = sorted(k for k in text if k in known)
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if key not in kwargs:
                raise ConfigError(f"config key '{key}' is missing")
        extra["__model_type__"] = model_type
        try:
            return cls(**kwargs, extra=extra, outer=outer)
        except TypeError as e:  # wrong value types surface here
            raise ConfigError(f"bad config: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` dict, in the shape (flat or nested) this config came from."""
        extra = dict(self.extra)
        flat_rope = extra.pop("__flat_rope__", False)
        present = extra.pop("__keys__", None)
        model_type = extra.pop("__model_type__", self.text_model_type)
        text: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("extra", "outer"):
                continue
            text[f.name] = copy.deepcopy(getattr(self, f.name))
        text["model_type"] = model_type if self.outer is None else self.text_model_type
        if model_type == self.outer_model_type and self.outer is None:
            text["model_type"] = self.text_model_type
        rope = dict(text["rope_parameters"])
        rope["rope_theta"] = self.rope_theta
        rope["partial_rotary_factor"] = self.partial_rotary_factor
        text["rope_parameters"] = rope
        if flat_rope:
            del text["rope_parameters"]
        else:
            del text["rope_theta"], text["partial_rotary_factor"]
        if self.mtp_style == "sequential":
            del text["mtp_style"]  # keep configs we write identical to Qwen's own
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if text[key] is None:
                del text[key]
        if present is not None:  # read from a file: write back its keys, plus any value changed since
            defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
            rope_keys = {"rope_theta", "partial_rotary_factor"} if flat_rope else {"rope_parameters"}
            for key in list(text):
                if key in present or key == "model_type" or key in rope_keys:
                    continue
                if key in ("layer_types", "full_attention_interval"):
                    interval = self.full_attention_interval
                    derived = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(self.num_hidden_layers)]
                    if self.layer_types == derived:
                        del text[key]
                elif key in defaults and text[key] == defaults[key]:
                    del text[key]
        text.update(extra)
        if self.outer is None:
            text.setdefault("architectures", [self.architecture])
            return text
        outer = copy.deepcopy(self.outer)
        outer["text_config"] = text
        return outer

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen35Config:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_hf_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")

    def text_only(self) -> Qwen35Config:
        """A copy that writes as a flat text-only config (`qwen3_5_text`; what `save_model` writes)."""
        c = copy.deepcopy(self)
        c.outer = None
        c.extra = {k: v for k, v in c.extra.items() if k != "__model_type__"}
        return c


@dataclass
class Qwen35MoeConfig(Qwen35Config):
    """Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B): the dense keys plus the sparse MoE block's. Every layer's
    MLP, the MTP layer's included, is the MoE block; there is no `norm_topk_prob`: the top-k weights are always
    renormalised (docs/families.md, "Qwen3.5-MoE")."""

    text_model_type = "qwen3_5_moe_text"
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
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config key '{name}' must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"config key 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                              f"'num_experts' ({self.num_experts})")
        if not self.router_aux_loss_coef >= 0:
            raise ConfigError(f"config key 'router_aux_loss_coef' must be >= 0, got {self.router_aux_loss_coef}")
