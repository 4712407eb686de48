"""A compressed-tensors `quantization_config` (llm-compressor's and Red Hat's releases; vLLM's native format),
validated: which modules are quantized, with which scheme, stored how.

The config (config.json, `quant_method` "compressed-tensors"):
- `config_groups`: name -> scheme {`targets`: module names, "re:" regexes or class names; `weights`: {`num_bits`,
  `type` "int" | "float", `symmetric`, `strategy` "tensor" | "channel" | "group" | "block", `group_size`,
  `block_structure` [rows, cols], `actorder`}; `format` (optional: the group's own storage format)}.
- `format`: how quantized weights are stored, for groups that do not say: "pack-quantized" (int codes packed into
  int32), "int-quantized" / "naive-quantized" (one int8 per code, or a float8 code), "float-quantized" (float8),
  "mixed-precision" (every group says its own).
- `ignore`: modules left unquantized (names, "re:" regexes, class names), whatever the targets say.
A module's scheme is that of its most specific matching target, as compressed-tensors picks it: an exact name,
then a regex (re.match from the start), then a class name. In a checkpoint we see names, not classes: the class
name "Linear" matches every module that stores quantized tensors (every quantized module is a linear layer);
other class names match none.

Activation quantization (`input_activations`, W8A8 releases) and `kv_cache_scheme` are accepted and not applied:
activations and the KV cache stay in the model's dtype (the loader drops their static scales). Rotations
(`transform_config`) and sparsity (`sparsity_config`) change what the stored weights mean: refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .base import ConfigError, short

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
MIXED = "mixed-precision"
STRATEGIES = ("tensor", "channel", "group", "block")
INT_BITS = (4, 8)  # int widths we decode (packed 8 or 4 to an int32 word, as every compressed-tensors version packs them)


@dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization. bits; kind "int" | "float"; symmetric (False: a zero point per scale);
    strategy "tensor" | "channel" | "group" | "block"; group (inputs per scale, strategy "group"); block (rows, cols)
    of one scale (strategy "block"); format: how its weights are stored (FORMATS); targets; name (the group's key)."""

    name: str
    targets: tuple[str, ...]
    bits: int
    kind: str
    symmetric: bool
    strategy: str
    format: str
    group: int | None = None
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class CompressedTensors:
    """The parsed config: `schemes` in config order; `ignore` patterns."""

    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...] = ()

    def ignored_by(self, module: str) -> str | None:
        """The `ignore` entry that keeps checkpoint module `module` unquantized, or None."""
        return next((p for p in self.ignore if _name_matches(module, p) or p == "Linear"), None)

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme of checkpoint module `module` (one that stores quantized tensors): the most specific matching
        target wins (exact name, then regex in sorted order, then the class name "Linear"), as compressed-tensors
        assigns them. None: no group targets it."""
        best: tuple[int, str, Scheme] | None = None
        for scheme in self.schemes:
            for t in scheme.targets:
                rank = (0 if t == module else 1 if t.startswith("re:") and _name_matches(module, t) else
                        2 if t == "Linear" else None)
                if rank is not None and (best is None or (rank, t) < best[:2]):
                    best = (rank, t, scheme)
        return None if best is None else best[2]


def _name_matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], module) is not None
        except re.error:
            return False
    return pattern == module


def parse_compressed_tensors(qc: dict, key: str = "quantization_config") -> CompressedTensors:
    """A compressed-tensors `quantization_config` object -> CompressedTensors; ConfigError naming the key otherwise."""
    for k in ("transform_config", "sparsity_config"):
        if qc.get(k):
            raise ConfigError(f"config key '{key}.{k}' is set ({short(qc[k])}): weights stored rotated or sparse are not "
                              "supported; use a checkpoint without it")
    fmt = qc.get("format")
    if fmt not in (*FORMATS, MIXED):
        raise ConfigError(f"config key '{key}.format' is {short(fmt)}; supported: " + ", ".join(map(repr, (*FORMATS, MIXED))))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ConfigError(f"config key '{key}.ignore' must be a list of module names, got {short(ignore)}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"config key '{key}.config_groups' must be an object of quantization schemes, got {short(groups)}")
    schemes = []
    for name, group in groups.items():
        where = f"{key}.config_groups.{name}"
        if not isinstance(group, dict):
            raise ConfigError(f"config key '{where}' must be a scheme object (targets, weights), got {short(group)} "
                              "(preset names are expanded by llm-compressor when it saves; a saved config holds the scheme)")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"config key '{where}.targets' must be a list of module names, got {short(targets)}")
        if group.get("weights") is None:
            continue  # activation-only group: the weights stay float
        schemes.append(_scheme(name, tuple(targets), group["weights"], group.get("format") or fmt, where))
    if not schemes:
        raise ConfigError(f"config key '{key}.config_groups' quantizes no weights")
    return CompressedTensors(tuple(schemes), tuple(ignore))


def _scheme(name: str, targets: tuple[str, ...], w: Any, fmt: Any, where: str) -> Scheme:
    if not isinstance(w, dict):
        raise ConfigError(f"config key '{where}.weights' must be an object, got {short(w)}")
    if fmt not in FORMATS:
        raise ConfigError(f"config key '{where}.format' is {short(fmt)}; supported: " + ", ".join(map(repr, FORMATS)))
    kind = w.get("type", "int")
    bits = w.get("num_bits", 8)
    if kind not in ("int", "float"):
        raise ConfigError(f"config key '{where}.weights.type' is {short(kind)}; supported: 'int', 'float'")
    allowed = INT_BITS if kind == "int" else (8,)
    if bits not in allowed or isinstance(bits, bool):
        raise ConfigError(f"config key '{where}.weights.num_bits' is {short(bits)}; {kind} weights support "
                          + ", ".join(map(str, allowed)))
    if fmt == "pack-quantized" and kind != "int":
        raise ConfigError(f"config key '{where}.weights.type' is 'float' but the format is 'pack-quantized' (int codes)")
    if fmt == "float-quantized" and kind != "float":
        raise ConfigError(f"config key '{where}.weights.type' is 'int' but the format is 'float-quantized' (float8 codes)")
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ConfigError(f"config key '{where}.weights.symmetric' must be true or false, got {short(symmetric)}")
    group = w.get("group_size")
    strategy = w.get("strategy")
    if strategy is None:  # as compressed-tensors infers it
        strategy = "tensor" if group is None else "channel" if group == -1 else "group"
    if strategy not in STRATEGIES:
        raise ConfigError(f"config key '{where}.weights.strategy' is {short(strategy)}; supported: "
                          + ", ".join(map(repr, STRATEGIES)))
    block = None
    if strategy == "group":
        if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
            raise ConfigError(f"config key '{where}.weights.group_size' must be a positive integer for strategy 'group', "
                              f"got {short(group)}")
    else:
        group = None
    if strategy == "block":
        b = w.get("block_structure")
        if not isinstance(b, list) or len(b) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b):
            raise ConfigError(f"config key '{where}.weights.block_structure' must be two positive integers, got {short(b)}")
        block = (b[0], b[1])
        if not symmetric:
            raise ConfigError(f"config key '{where}.weights.symmetric' is false with strategy 'block'; supported: "
                              "symmetric block scales")
    if kind == "float" and not symmetric:
        raise ConfigError(f"config key '{where}.weights.symmetric' is false for float weights; supported: true")
    return Scheme(name, targets, bits, kind, symmetric, strategy, fmt, group, block)
