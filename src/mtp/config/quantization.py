"""A checkpoint's `quantization_config` (config.json), validated: how its quantized weights are stored.

Supported (the loader, model/quantized.py, decodes the weights once; this module only reads the config):
- "fp8" (transformers' fine-grained FP8, as DeepSeek-V3/R1, Qwen3.5/3.6 and GLM-4.5 FP8 releases ship it): float8
  weights with a float32 multiplier per [`weight_block_size`] tile (`weight_scale_inv`), or, with no block size,
  one per tensor or per output channel.
- "gptq" (AutoGPTQ / GPTQModel): `bits` 2, 4 or 8 packed in int32 along the inputs, `group_size` (-1: one group per
  row), `sym`, `desc_act` (a `g_idx` maps each input to its group), `checkpoint_format` "gptq" (v1: the stored zero
  points are the zero points minus one) or "gptq_v2" (stored as they are).
- "awq" (AutoAWQ, `version` "gemm"): 4-bit codes packed in int32 along the outputs in AWQ's interleaved order,
  `group_size`, zero points.
- "compressed-tensors" (llm-compressor): config groups of schemes, their targets and `ignore`
  (config/compressed_tensors.py; `Quantization.ct`).
Which modules stay unquantized is `modules_to_not_convert` (alias `ignored_layers`), matched against checkpoint
module names as transformers matches them (`excluded_by`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .base import ConfigError, short
from .compressed_tensors import CompressedTensors, parse_compressed_tensors

METHODS = ("fp8", "gptq", "awq", "compressed-tensors")
# Methods people ship that we name in the error, so the message says what is missing rather than "unknown".
KNOWN_UNSUPPORTED = ("bitsandbytes", "mxfp4", "fbgemm_fp8", "torchao", "hqq", "eetq")
# The fp8 formats' config keys we read; the others (activation_scheme, fmt, scale_fmt, ...) do not change how the
# weights decode.
FP8_FORMATS = ("e4m3", "e5m2", None)


GPTQ_BITS = (2, 4, 8)  # the widths that pack evenly into int32 (3-bit GPTQ packs across words: not supported)
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class Quantization:
    """method "fp8" | "gptq" | "awq" | "compressed-tensors" (its schemes and ignore list: `ct`); block (rows, cols)
    of one fp8 scale, or None (a scale per tensor or per output channel); bits / group (None: one group per row) /
    zero_offset (1 for GPTQ v1's stored zero - 1) of the integer methods; exclude: the module-name patterns that are
    not quantized."""

    method: str
    block: tuple[int, int] | None = None
    exclude: tuple[str, ...] = ()
    bits: int = 8
    group: int | None = None
    zero_offset: int = 0
    ct: CompressedTensors | None = None

    @property
    def int4(self) -> bool:
        """Are the checkpoint's quantized weights 4-bit integer codes (GPTQ / AWQ 4-bit, compressed-tensors int4)?"""
        if self.ct is not None:
            return any(s.kind == "int" and s.bits == 4 for s in self.ct.schemes)
        return self.method in ("gptq", "awq") and self.bits == 4

    @property
    def int8(self) -> bool:
        """Are the checkpoint's quantized weights int8 codes in the int8 kernel's own form (compressed-tensors
        symmetric int8 with one scale per output channel or per tensor, as W8A8 / W8A16 releases store them), all of
        them (a release that mixes in other schemes keeps its default)?"""
        if self.ct is None or not self.ct.schemes:
            return False
        return all(s.kind == "int" and s.bits == 8 and s.symmetric and s.strategy in ("channel", "tensor")
                   for s in self.ct.schemes)

    def excluded_by(self, module: str) -> str | None:
        """The `exclude` pattern that keeps checkpoint module `module` unquantized, or None. As transformers matches:
        a pattern matches from the start up to a module boundary (also as a regex: "layers.*.gate" matches
        "layers.3.mlp.gate", not "...gate_proj"), or as a suffix."""
        for pattern in self.exclude:
            try:
                if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module):
                    return pattern
            except re.error:
                pass
            if module.endswith(pattern):
                return pattern
        return None


def parse_quantization(qc: Any) -> Quantization | None:
    """config.json's `quantization_config` (None: absent) -> Quantization; ConfigError naming the key otherwise."""
    if qc is None:
        return None
    key = "quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"config key '{key}' must be an object, got {short(qc)}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return Quantization(method, ct=parse_compressed_tensors(qc, key))
    if method not in METHODS:
        hint = " (not supported yet; use the bf16 weights)" if method in KNOWN_UNSUPPORTED else ""
        raise ConfigError(f"config key '{key}.quant_method' is {short(method)}{hint}; supported: "
                          + ", ".join(map(repr, METHODS)))
    exclude = qc.get("modules_to_not_convert")
    if exclude is None:
        exclude = qc.get("ignored_layers")
    exclude = [] if exclude is None else exclude
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ConfigError(f"config key '{key}.modules_to_not_convert' must be a list of module names, got {short(exclude)}")
    if method == "fp8":
        return _fp8(qc, key, tuple(exclude))
    return _integer(qc, key, method, tuple(exclude))


def _fp8(qc: dict, key: str, exclude: tuple[str, ...]) -> Quantization:
    if qc.get("fmt") not in FP8_FORMATS:
        raise ConfigError(f"config key '{key}.fmt' is {short(qc.get('fmt'))}; supported: 'e4m3', 'e5m2'")
    if qc.get("scale_fmt", "float") not in ("float", None):
        raise ConfigError(f"config key '{key}.scale_fmt' is {short(qc.get('scale_fmt'))}; supported: 'float'")
    block = qc.get("weight_block_size")
    if block is not None:
        if not isinstance(block, list) or len(block) != 2 or not all(_positive_int(b) for b in block):
            raise ConfigError(f"config key '{key}.weight_block_size' must be two positive integers or null, got {short(block)}")
        block = (block[0], block[1])
    return Quantization("fp8", block, exclude)


def _integer(qc: dict, key: str, method: str, exclude: tuple[str, ...]) -> Quantization:
    bits = qc.get("bits", qc.get("w_bit"))
    allowed = GPTQ_BITS if method == "gptq" else (4,)
    if bits not in allowed or isinstance(bits, bool):
        raise ConfigError(f"config key '{key}.bits' is {short(bits)}; {method} supports " + ", ".join(map(str, allowed)))
    group = qc.get("group_size", qc.get("q_group_size"))
    if group == -1 and method == "gptq":
        group = None
    elif not _positive_int(group):
        raise ConfigError(f"config key '{key}.group_size' must be a positive integer" + (" or -1" if method == "gptq" else "")
                          + f", got {short(group)}")
    offset = 0
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in GPTQ_FORMATS:
            raise ConfigError(f"config key '{key}.checkpoint_format' is {short(fmt)}; supported: 'gptq', 'gptq_v2'")
        offset = 1 if fmt == "gptq" else 0  # v1 stores each zero point minus one
    else:
        version = qc.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ConfigError(f"config key '{key}.version' is {short(version)}; supported: 'gemm' (AWQ's GEMM packing)")
        if qc.get("zero_point", True) is not True:
            raise ConfigError(f"config key '{key}.zero_point' is {short(qc.get('zero_point'))}; supported: true")
    return Quantization(method, None, exclude, bits, group, offset)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
