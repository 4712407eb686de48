"""What every family's config shares: reading `config.json`, the one round trip (HF dict -> dataclass -> HF dict,
losing and adding nothing), checking every value's type from the field's annotation, and the validators the
families call (`positive`, `divides`, ...). `DecoderConfig` holds the keys every family has, RoPE's among them."""

from __future__ import annotations

import copy
import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

ROPE_TYPES = ("default", "yarn")
# What a text config may take from the multimodal config that nests it (`text_config`), when it lacks them.
OUTER_KEYS = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


class ConfigError(ValueError):
    """A config value is missing, malformed or contradicts another key (the message names the key)."""


class ConfigWarning(UserWarning):
    """A config value that is used, but not as its other keys suggest (the message names the keys)."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's JSON object; a folder, an unreadable, binary or non-JSON file, or JSON that is not an object
    is a ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text)
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a JSON file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (not valid UTF-8)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object (the file holds a {type(data).__name__})")
    return data


def short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (a message stays one line whatever the file holds)."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def conforms(value: Any, hint: Any) -> bool:
    """Does a JSON value fit a field's annotation? int: an integer (not a bool); float: a finite number; bool, str;
    list[X], dict[K, V], unions, None. Anything else is not checked."""
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(conforms(v, item) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    return True


def describe(hint: Any) -> str:
    """An annotation in words, for messages: 'an integer', 'a number or null', 'a list of strings'."""
    if hint is type(None) or hint is None:
        return "null"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return f"a list of {describe(item).removeprefix('an ').removeprefix('a ')}s"
    if origin is dict or hint is dict:
        return "an object"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(hint, str(hint))


@dataclass
class HFConfig:
    """A HF `config.json` as a dataclass. The keys a family models are fields; every other key is kept verbatim in
    `extra`. Read from a file, it writes back the keys the file had plus any value changed since it was read; built
    in code, it writes all its fields but unset optional ones. Nested multimodal files (`text_config` inside the
    file, `outer` here) are written back nested.

    A subclass names its `model_types` (the first is written), `architecture` and `mtp_keys` (what `mtp heal` carries
    over from a base checkpoint; the first is the MTP layer count), may override the two round-trip hooks
    (`read_keys`, `write_keys`) and extends `validate`. Private markers in `extra` start and end with `__`."""

    model_types: ClassVar[tuple[str, ...]] = ()
    architecture: ClassVar[str] = ""
    mtp_keys: ClassVar[tuple[str, ...]] = ()
    # The model type of the multimodal config that may nest this one under `text_config` (None: never nested).
    outer_model_type: ClassVar[str | None] = None
    required_keys: ClassVar[tuple[str, ...]] = ("num_hidden_layers", "hidden_size", "vocab_size")
    # Fields that are not config.json keys.
    non_keys: ClassVar[frozenset[str]] = frozenset({"extra", "outer"})
    # Keys the loader completes from the checkpoint's tensor names: written back only where the file had them (or,
    # for a config built in code, where they differ from the default).
    checkpoint_keys: ClassVar[tuple[str, ...]] = ()
    # Our own keys (not the family's HF config's): a config built in code writes them only when not at the default.
    extension_keys: ClassVar[tuple[str, ...]] = ()
    # A config read from a file: its field values as read (what `to_hf_dict` compares with); None: built in code.
    _as_read: ClassVar[dict[str, Any] | None] = None

    # Keys we do not model, kept verbatim so a round trip loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)
    # For a text config read from a multimodal file: every top-level key of that file but `text_config`.
    outer: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.check_types()
        self.complete()
        self.validate()

    def complete(self) -> None:
        """Fill the keys whose absence stands for a value derived from other keys (e.g. `head_dim` = hidden / heads)."""

    def validate(self) -> None:
        """Raise ConfigError naming the first bad or contradictory key."""

    # ------------------------------------------------------------------ validators (shared by the families)
    @classmethod
    def _hints(cls) -> dict[str, Any]:
        hints = cls.__dict__.get("_type_hints")
        if hints is None:
            hints = typing.get_type_hints(cls)
            cls._type_hints = hints
        return hints

    def check_types(self) -> None:
        """Every config-key field holds a value of its annotated type (before any arithmetic is done with it)."""
        hints = self._hints()
        for f in fields(self):
            if f.name in self.non_keys:
                continue
            value = getattr(self, f.name)
            if not conforms(value, hints[f.name]):
                raise ConfigError(f"config key '{f.name}' must be {describe(hints[f.name])}, got {short(value)}")

    def positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ConfigError(f"config key '{name}' must be > 0, got {short(value)}")

    def non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                raise ConfigError(f"config key '{name}' must be >= 0, got {short(value)}")

    def divides(self, divisor: str, name: str) -> None:
        """`divisor` divides `name` (both positive integers by now)."""
        if getattr(self, name) % getattr(self, divisor):
            raise ConfigError(f"config key '{divisor}' ({getattr(self, divisor)}) must divide '{name}' "
                              f"({getattr(self, name)})")

    def at_most(self, name: str, bound: str) -> None:
        if getattr(self, name) > getattr(self, bound):
            raise ConfigError(f"config key '{name}' ({getattr(self, name)}) exceeds '{bound}' ({getattr(self, bound)})")

    def one_of(self, name: str, choices: tuple, value: Any = MISSING) -> None:
        """`name`'s value (or `value`, for keys kept in `extra`) is one of `choices`."""
        value = getattr(self, name) if value is MISSING else value
        if value not in choices:
            raise ConfigError(f"config key '{name}' is {short(value)}; supported: {', '.join(map(repr, choices))}")

    @property
    def quantization_config(self) -> Any:
        """config.json's `quantization_config` as written (None: a float checkpoint), from the top level of a
        multimodal file too; parsed and checked by `config.quantization.parse_quantization`."""
        qc = self.extra.get("quantization_config")
        if qc is None and self.outer is not None:
            qc = self.outer.get("quantization_config")
        return qc

    # ------------------------------------------------------------------ derived
    @property
    def mtp_layers_key(self) -> str:
        """The config key that counts the MTP layers (`mtp_num_hidden_layers`, `num_nextn_predict_layers`)."""
        return self.mtp_keys[0]

    # ------------------------------------------------------------------ the HF dict round trip
    @classmethod
    def known_keys(cls) -> set[str]:
        return {f.name for f in fields(cls)} - cls.non_keys

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]):
        """Parse a HF config dict: flat, or (for a family with an `outer_model_type`) nested under `text_config`."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        data = copy.deepcopy(data)
        outer = None
        if cls.outer_model_type is not None and "text_config" in data:
            outer, data = data, data.pop("text_config")
            if not isinstance(data, dict):
                raise ConfigError("config key 'text_config' must be an object")
        model_type = data.get("model_type", cls.model_types[0])
        if model_type not in cls.model_types:
            raise ConfigError(f"config key 'model_type' is {short(model_type)}; expected "
                              + " or ".join(f"'{t}'" for t in cls.model_types))
        known = cls.known_keys()
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        # Remember which keys the file had, so that writing it back adds none of our defaults.
        extra["__keys__"] = sorted(kwargs)
        if outer is not None:
            cls.read_outer(kwargs, outer)
        cls.read_keys(kwargs, extra)
        for key in cls.required_keys:
            if key not in kwargs:
                raise ConfigError(f"config key '{key}' is missing")
        try:
            config = cls(**kwargs, extra=extra, outer=outer)
        except TypeError as e:  # not expected after check_types; kept so no value reaches the user as a traceback
            raise ConfigError(f"bad config: {e}") from None
        config._as_read = config.field_values()
        return config

    @classmethod
    def read_outer(cls, kwargs: dict[str, Any], outer: dict[str, Any]) -> None:
        """Take what the text config lacks from the multimodal file around it (`OUTER_KEYS`). Real multimodal configs
        keep tie_word_embeddings at the top level; it may also be in text_config, but not differently."""
        tie = "tie_word_embeddings"
        if tie in outer and tie in kwargs and kwargs[tie] != outer[tie]:
            raise ConfigError(f"config key '{tie}' differs between the top level ({short(outer[tie])}) and "
                              f"text_config ({short(kwargs[tie])})")
        for key in OUTER_KEYS:
            if key not in kwargs and key in outer:
                kwargs[key] = outer[key]

    @classmethod
    def read_keys(cls, kwargs: dict[str, Any], extra: dict[str, Any]) -> None:
        """Family hook: normalise the file's keys (`kwargs`: the modelled ones) before the config is built."""

    def write_keys(self, out: dict[str, Any]) -> None:
        """Family hook: the inverse of `read_keys` on the dict about to be written."""

    def field_values(self) -> dict[str, Any]:
        """Every config-key field, copied."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in self.non_keys}

    def public_extra(self) -> dict[str, Any]:
        """`extra` without our private markers."""
        return {k: v for k, v in self.extra.items() if not (k.startswith("__") and k.endswith("__"))}

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` dict, in the shape (flat or nested) this config was read in."""
        out = self.field_values()
        present = self.extra.get("__keys__")
        as_read = self._as_read
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        for key in list(out):
            if present is not None and as_read is not None:  # read from a file: its keys, and what changed since
                if key not in present and (key in self.checkpoint_keys or out[key] == as_read.get(key)):
                    del out[key]
            elif out[key] is None and defaults.get(key, 0) is None:  # built in code: not its unset optional keys
                del out[key]
            elif key in self.checkpoint_keys + self.extension_keys and out[key] == defaults.get(key):
                del out[key]
        out["model_type"] = self.model_types[0]
        self.write_keys(out)
        out.update(self.public_extra())
        if self.outer is None:
            out.setdefault("architectures", [self.architecture])
            return out
        nested = copy.deepcopy(self.outer)
        nested["text_config"] = out
        return nested

    @classmethod
    def from_json(cls, path: str | Path):
        data = read_config_file(path)
        try:
            return cls.from_hf_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")

    def text_only(self):
        """A copy that writes as a flat text-only config (what `save_model` writes)."""
        c = copy.deepcopy(self)
        c.outer = None
        return c


@dataclass
class DecoderConfig(HFConfig):
    """The keys every family has (a family redeclares a field to change its default), RoPE's among them:
    `rope_parameters` (transformers 5), or (older files) the flat `rope_theta` / `partial_rotary_factor` with
    `rope_scaling`. The flat fields hold the values wherever the file kept them (a value in both places that
    disagrees is an error) and are written back where they were read; `rope()` gives what transformers derives."""

    # Where a config built in code writes rope_theta / partial_rotary_factor: in `rope_parameters` (as Qwen3.5's own
    # configs do) or flat (as the older files of the other families do).
    rope_in_parameters: ClassVar[bool] = False
    # Rope types the family's attention implements.
    rope_types: ClassVar[tuple[str, ...]] = ROPE_TYPES

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # absent: num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float | None = None  # absent: 1 (RoPE on every dim)
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def complete(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def validate(self) -> None:
        self.positive("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta")
        self.non_negative("initializer_range")
        self.divides("num_key_value_heads", "num_attention_heads")
        if self.hidden_act != "silu":
            raise ConfigError(f"config key 'hidden_act' must be 'silu', got {short(self.hidden_act)}")
        self.check_rope()

    # ------------------------------------------------------------------ RoPE
    def rope(self) -> dict[str, Any]:
        """The effective RoPE parameters (`rope_type`, `rope_theta`, `partial_rotary_factor`, YaRN's keys), as
        transformers reads them: `rope_scaling`, else `rope_parameters`, with the flat values."""
        p = dict(self.rope_scaling or self.rope_parameters or {})
        p["rope_type"] = p.get("rope_type", p.get("type", "default"))
        p["rope_theta"] = self.rope_theta
        p["partial_rotary_factor"] = 1.0 if self.partial_rotary_factor is None else self.partial_rotary_factor
        if p["rope_type"] == "yarn":
            p.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return p

    def rotary_dim_of(self, head_dim: int) -> int:
        """How many of a head's `head_dim` dims RoPE turns (checked even and > 0 by `check_rotary_dim`)."""
        return int(head_dim * self.rope()["partial_rotary_factor"])

    def check_rope(self) -> None:
        rope = self.rope()
        where = "rope_scaling" if self.rope_scaling else "rope_parameters"
        if rope["rope_type"] not in self.rope_types:
            raise ConfigError(f"config key '{where}.rope_type' is {short(rope['rope_type'])}; supported: "
                              f"{', '.join(self.rope_types)}")
        if not 0.0 < rope["partial_rotary_factor"] <= 1.0:
            raise ConfigError(f"config key 'partial_rotary_factor' must be in (0, 1], got {rope['partial_rotary_factor']}")
        if rope["rope_type"] == "yarn":
            if not rope.get("factor") and not rope.get("original_max_position_embeddings"):
                raise ConfigError(f"config key '{where}.factor' is missing (YaRN)")
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                        "mscale_all_dim", "attention_factor"):
                value = rope.get(key)
                if value is not None and not (conforms(value, float) and value > 0):
                    raise ConfigError(f"config key '{where}.{key}' must be a number > 0, got {short(value)}")

    def check_rotary_dim(self, head_dim_key: str = "head_dim") -> None:
        dim = self.rotary_dim_of(getattr(self, head_dim_key))
        if dim % 2 or dim == 0:
            raise ConfigError(f"config keys '{head_dim_key}' x 'partial_rotary_factor' give rotary dim {dim}; it must "
                              "be even and > 0")

    @classmethod
    def read_keys(cls, kwargs: dict[str, Any], extra: dict[str, Any]) -> None:
        """rope_theta / partial_rotary_factor kept inside `rope_parameters` or `rope_scaling` become the flat
        fields (which are what the model reads)."""
        for where in ("rope_parameters", "rope_scaling"):
            rope = kwargs.get(where)
            if rope is None:
                continue
            if not isinstance(rope, dict):
                raise ConfigError(f"config key '{where}' must be an object or null, got {short(rope)}")
            for key in ("rope_theta", "partial_rotary_factor"):
                if key not in rope:
                    continue
                if key in kwargs and not (conforms(kwargs[key], float) and conforms(rope[key], float)
                                          and float(kwargs[key]) == float(rope[key])):
                    raise ConfigError(f"config key '{key}' ({short(kwargs[key])}) contradicts {where}.{key} "
                                      f"({short(rope[key])})")
                kwargs[key] = rope[key]

    def write_keys(self, out: dict[str, Any]) -> None:
        """The flat values back into the RoPE dicts that held them; a config built in code of a family that keeps
        them in `rope_parameters` writes them there."""
        if "__keys__" not in self.extra and self.rope_in_parameters and out.get("rope_parameters") is None:
            out["rope_parameters"] = {"rope_type": "default"}
            out["rope_parameters"].update({k: out.pop(k) for k in ("rope_theta", "partial_rotary_factor") if k in out})
        for where in ("rope_parameters", "rope_scaling"):
            rope = out.get(where)
            if isinstance(rope, dict):
                for key in ("rope_theta", "partial_rotary_factor"):
                    if key in rope:
                        rope[key] = getattr(self, key)
