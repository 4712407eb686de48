"""Model configs as dataclasses that round-trip HF `config.json`: Qwen3.5 (both checkpoint shapes), Qwen3.5-MoE,
DeepSeek-V3/R1, GLM-4.5/4.6/4.7 (MoE) and MiMo-7B. `HFConfig` holds what they share."""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

LAYER_TYPES = ("linear_attention", "full_attention")
MTP_STYLES = ("sequential", "parallel")
ROPE_TYPES = ("default", "yarn")


class ConfigError(ValueError):
    """A config value is missing, malformed or contradicts another key (the message names the key)."""


class ConfigWarning(UserWarning):
    """A config value that is used, but not as its other keys suggest (the message names the keys)."""


@dataclass
class HFConfig:
    """A HF `config.json` as a dataclass. The keys a family models are fields; every other key is kept verbatim in
    `extra`; writing back gives the keys the file had plus any value changed since, so a round trip loses and adds
    nothing. A config built in code (not read from a file) writes all its fields but unset optional ones.

    A subclass names its `model_types` (the first is written), `architecture` and `mtp_keys` (what `mtp heal`
    carries over from a base checkpoint), and extends `validate`. Private markers in `extra` start with `__`."""

    model_types: ClassVar[tuple[str, ...]] = ()
    architecture: ClassVar[str] = ""
    mtp_keys: ClassVar[tuple[str, ...]] = ()
    required_keys: ClassVar[tuple[str, ...]] = ("num_hidden_layers", "hidden_size", "vocab_size")
    # Fields that are not config.json keys.
    non_keys: ClassVar[frozenset[str]] = frozenset({"extra"})
    # Keys the loader completes from the checkpoint's tensor names: written back only where the file had them (or,
    # for a config built in code, where they differ from the default).
    checkpoint_keys: ClassVar[tuple[str, ...]] = ()

    # Keys we do not model, kept verbatim so a round trip loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first bad or contradictory key."""

    def derived_defaults(self) -> dict[str, Any]:
        """Defaults that depend on other keys (e.g. `head_dim` = hidden / heads): what an absent key stands for."""
        return {}

    # ------------------------------------------------------------------ validation helpers
    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config key '{name}' must be a positive integer, got {value!r}")

    def _refuse_quantized(self) -> None:
        qc = self.extra.get("quantization_config")
        if qc is not None:  # e.g. DeepSeek-V3's fp8 blocks: the weights would load without their scales
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise ConfigError(f"config key 'quantization_config' ({method!r}): quantized checkpoints are not supported; "
                              "use the bf16 weights")

    def _non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"config key '{name}' must be an integer >= 0, got {value!r}")

    # ------------------------------------------------------------------ derived
    @property
    def eos_token_ids(self) -> list[int]:
        eos = getattr(self, "eos_token_id", None)
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    # ------------------------------------------------------------------ HF dict round trip
    @classmethod
    def known_keys(cls) -> set[str]:
        return {f.name for f in fields(cls)} - cls.non_keys

    @classmethod
    def split_keys(cls, data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A config dict -> (the keys we model, the others); the others also record which known keys were there."""
        known = cls.known_keys()
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            (kwargs if key in known else extra)[key] = value
        # Remember which keys the file had, so that writing it back adds none of our defaults.
        extra["__keys__"] = sorted(k for k in data if k in known)
        return kwargs, extra

    @classmethod
    def require(cls, kwargs: dict[str, Any]) -> None:
        for key in cls.required_keys:
            if key not in kwargs:
                raise ConfigError(f"config key '{key}' is missing")

    @classmethod
    def build(cls, kwargs: dict[str, Any], extra: dict[str, Any], **more: Any):
        try:
            return cls(**kwargs, extra=extra, **more)
        except TypeError as e:  # wrong value types surface here
            raise ConfigError(f"bad config: {e}") from None

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]):
        """Parse a flat HF config dict (`model_type` one of the class's `model_types`)."""
        data = copy.deepcopy(data)
        model_type = data.get("model_type", cls.model_types[0])
        if model_type not in cls.model_types:
            raise ConfigError(f"config key 'model_type' is {model_type!r}; expected "
                              + " or ".join(f"'{t}'" for t in cls.model_types))
        kwargs, extra = cls.split_keys(data)
        cls.require(kwargs)
        return cls.build(kwargs, extra)

    def field_values(self) -> dict[str, Any]:
        """Every config-key field, copied."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in self.non_keys}

    def drop_unread(self, out: dict[str, Any], present: list[str] | None, keep: set[str] = frozenset()) -> None:
        """Remove from `out` what a file-read config did not have and did not change (`present`: the keys it had;
        `keep`: keys the caller decides on), and the checkpoint-derived keys it did not have. For a config built in
        code (`present` None), remove only optional keys left unset and derived keys left at their default."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING} | self.derived_defaults()
        for key in list(out):
            if key in keep:
                continue
            if present is None:
                unset = out[key] is None and defaults.get(key, 0) is None
                if unset or (key in self.checkpoint_keys and out[key] == defaults.get(key)):
                    del out[key]
            elif key not in present and (key in self.checkpoint_keys or (key in defaults and out[key] == defaults[key])):
                del out[key]

    def public_extra(self) -> dict[str, Any]:
        """`extra` without our private markers."""
        return {k: v for k, v in self.extra.items() if not (k.startswith("__") and k.endswith("__"))}

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` dict (flat)."""
        out = self.field_values()
        out["model_type"] = self.model_types[0]
        self.drop_unread(out, self.extra.get("__keys__"), keep={"model_type"})
        out.update(self.public_extra())
        out.setdefault("architectures", [self.architecture])
        return out

    @classmethod
    def from_json(cls, path: str | Path):
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

    def text_only(self):
        """A copy to save (`save_model` writes it)."""
        return copy.deepcopy(self)


@dataclass
class Qwen35Config(HFConfig):
    """Qwen3.5 (dense) text config: flat (`qwen3_5_text`) or nested in a multimodal one (`qwen3_5`)."""

    # The keys that describe the MTP module (what `mtp heal` carries over from a base checkpoint).
    mtp_keys = ("mtp_num_hidden_layers", "mtp_style", "mtp_use_dedicated_embeddings")
    model_types = ("qwen3_5_text", "qwen3_5")
    text_model_type = "qwen3_5_text"  # a flat, text-only config
    outer_model_type = "qwen3_5"  # the multimodal config that nests the text one under `text_config`
    architecture = "Qwen3_5ForCausalLM"
    non_keys = frozenset({"extra", "outer"})

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
        self._positive("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                       "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                       "full_attention_interval", "max_position_embeddings")
        self._non_negative("mtp_num_hidden_layers")
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

        kwargs, extra = cls.split_keys(text)
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
        cls.require(kwargs)
        extra["__model_type__"] = model_type
        return cls.build(kwargs, extra, outer=outer)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` dict, in the shape (flat or nested) this config came from."""
        flat_rope = self.extra.get("__flat_rope__", False)
        present = self.extra.get("__keys__")
        model_type = self.extra.get("__model_type__", self.text_model_type)
        text = self.field_values()
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
        layer_keys = {"layer_types", "full_attention_interval"}
        if present is not None:  # read from a file: write back its keys, plus any value changed since
            interval = self.full_attention_interval
            derived = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(self.num_hidden_layers)]
            if self.layer_types == derived:
                for key in layer_keys - set(present):
                    del text[key]
        rope_keys = {"rope_theta", "partial_rotary_factor"} if flat_rope else {"rope_parameters"}
        self.drop_unread(text, present, keep={"model_type"} | rope_keys | layer_keys)
        text.update(self.public_extra())
        if self.outer is None:
            text.setdefault("architectures", [self.architecture])
            return text
        outer = copy.deepcopy(self.outer)
        outer["text_config"] = text
        return outer

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

    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
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


@dataclass
class RopeConfig(HFConfig):
    """The RoPE keys of the transformers 5 families: `rope_parameters`, or (older files) `rope_theta` with
    `rope_scaling`; `rope()` gives the parameters transformers derives from them. Quantized checkpoints are refused."""

    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    partial_rotary_factor: float | None = None

    def __post_init__(self) -> None:
        if getattr(self, "head_dim", 0) is None:  # the families with a `head_dim` key: absent = hidden / heads
            self.head_dim = self.derived_defaults()["head_dim"]
        super().__post_init__()

    def derived_defaults(self) -> dict[str, Any]:
        if not hasattr(self, "head_dim"):
            return {}
        heads = self.num_attention_heads
        return {"head_dim": self.hidden_size // heads if heads else None}

    def rope(self) -> dict[str, Any]:
        """The effective RoPE parameters (`rope_type`, `rope_theta`, `partial_rotary_factor`, YaRN's keys), read as
        transformers does: `rope_scaling` wins over `rope_parameters`, whose values win over the flat keys."""
        p = dict(self.rope_scaling or self.rope_parameters or {})
        p["rope_type"] = p.get("rope_type", p.get("type", "default"))
        p.setdefault("rope_theta", self.rope_theta)
        p.setdefault("partial_rotary_factor", 1.0 if self.partial_rotary_factor is None else self.partial_rotary_factor)
        if p["rope_type"] == "yarn":
            p.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return p

    def validate(self) -> None:
        super().validate()
        self._refuse_quantized()
        for key in ("rope_scaling", "rope_parameters"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"config key '{key}' must be an object")
        rope = self.rope()
        where = "rope_scaling" if self.rope_scaling else "rope_parameters"
        if rope["rope_type"] not in ROPE_TYPES:
            raise ConfigError(f"config key '{where}.rope_type' is {rope['rope_type']!r}; supported: {', '.join(ROPE_TYPES)}")
        if not 0.0 < rope["partial_rotary_factor"] <= 1.0:
            raise ConfigError(f"config key 'partial_rotary_factor' must be in (0, 1], got {rope['partial_rotary_factor']}")
        if rope["rope_type"] == "yarn" and not rope.get("factor") and not rope.get("original_max_position_embeddings"):
            raise ConfigError(f"config key '{where}.factor' is missing (YaRN)")


@dataclass
class NextNMoeConfig(RopeConfig):
    """What DeepSeek-V3 and GLM-4.5 share: a dense MLP in the first `first_k_dense_replace` layers, then
    DeepSeekMoE (grouped sigmoid router, `n_shared_experts` shared experts), and `num_nextn_predict_layers` MTP
    layers stored after the backbone's (docs/families.md, "DeepSeek-V3/R1 and GLM-4.5/4.6/4.7")."""

    mtp_keys = ("num_nextn_predict_layers",)
    checkpoint_keys = ("mtp_embed_tokens", "mtp_shared_head")

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
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
    num_nextn_predict_layers: int = 1
    # Whether the MTP layers hold their own `embed_tokens` / `shared_head.head` (DeepSeek-V3, GLM-4.5) or use the
    # backbone's (GLM-4.6). Not HF keys: the loader sets them from the checkpoint's tensor names.
    mtp_embed_tokens: bool = True
    mtp_shared_head: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__()

    @property
    def mtp_num_hidden_layers(self) -> int:
        """The MTP layer count under the name the loader and trainer read."""
        return self.num_nextn_predict_layers

    @mtp_num_hidden_layers.setter
    def mtp_num_hidden_layers(self, value: int) -> None:
        self.num_nextn_predict_layers = value

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (MTP layers continue the numbering after the backbone's) has the MoE block."""
        return i >= self.first_k_dense_replace

    def validate(self) -> None:
        super().validate()
        self._positive("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "max_position_embeddings", "moe_intermediate_size", "n_routed_experts",
                       "num_experts_per_tok", "n_group", "topk_group")
        self._non_negative("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
        if self.hidden_act != "silu":
            raise ConfigError(f"config key 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"config key 'n_group' ({self.n_group}) must divide 'n_routed_experts' ({self.n_routed_experts})")
        if self.topk_group > self.n_group:
            raise ConfigError(f"config key 'topk_group' ({self.topk_group}) exceeds 'n_group' ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:  # groups are ranked by the sum of their top-2 experts
            raise ConfigError(f"config keys 'n_routed_experts' / 'n_group' give {per_group} expert per group; "
                              "group-limited routing needs at least 2")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(f"config key 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds the experts of "
                              f"'topk_group' ({self.topk_group}) groups of {per_group}")
        scoring = self.extra.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"config key 'scoring_func' is {scoring!r}; only 'sigmoid' is supported")
        topk_method = self.extra.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            raise ConfigError(f"config key 'topk_method' is {topk_method!r}; only 'noaux_tc' is supported")
        freq = self.extra.get("moe_layer_freq", 1)
        if freq != 1:
            raise ConfigError(f"config key 'moe_layer_freq' is {freq!r}; only 1 (every layer after "
                              "'first_k_dense_replace') is supported")


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
        self._positive("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            self._positive("q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config key 'qk_rope_head_dim' must be even, got {self.qk_rope_head_dim}")
        if self.rope()["partial_rotary_factor"] != 1.0:
            raise ConfigError("config key 'partial_rotary_factor' must be 1 for DeepSeek-V3 (RoPE covers "
                              "'qk_rope_head_dim')")


@dataclass
class Glm4MoeConfig(NextNMoeConfig):
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
    head_dim: int | None = None
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

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope()["partial_rotary_factor"])

    def validate(self) -> None:
        super().validate()
        self._positive("head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config key 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                              f"'num_attention_heads' ({self.num_attention_heads})")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(f"config keys 'head_dim' x 'partial_rotary_factor' give rotary dim {self.rotary_dim}; "
                              "it must be even and > 0")


@dataclass
class MiMoConfig(RopeConfig):
    """MiMo-7B (`mimo`, `MiMoForCausalLM`): a Qwen2 backbone and `num_nextn_predict_layers` MTP layers at
    `model.mtp_layers.{i}` (docs/families.md, "MiMo-7B"). Defaults are transformers' `Qwen2Config`'s."""

    model_types = ("mimo",)
    architecture = "MiMoForCausalLM"
    mtp_keys = ("num_nextn_predict_layers",)

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__()

    @property
    def mtp_num_hidden_layers(self) -> int:
        """The MTP layer count under the name the loader and trainer read."""
        return self.num_nextn_predict_layers

    @mtp_num_hidden_layers.setter
    def mtp_num_hidden_layers(self, value: int) -> None:
        self.num_nextn_predict_layers = value

    def validate(self) -> None:
        super().validate()
        self._positive("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "max_position_embeddings")
        self._non_negative("num_nextn_predict_layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config key 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                              f"'num_attention_heads' ({self.num_attention_heads})")
        if self.hidden_act != "silu":
            raise ConfigError(f"config key 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        if self.use_sliding_window:
            raise ConfigError("config key 'use_sliding_window' is true: sliding-window attention is not supported")
        if int(self.head_dim * self.rope()["partial_rotary_factor"]) % 2:
            raise ConfigError(f"config key 'head_dim' ({self.head_dim}) must be even (RoPE)")
