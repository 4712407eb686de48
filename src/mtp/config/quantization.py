"""A checkpoint's `quantization_config` (config.json), validated: how its quantized weights are stored.

Supported: "fp8" (transformers' fine-grained FP8, as DeepSeek-V3/R1, Qwen3.5/3.6 and GLM-4.5 FP8 releases ship it):
float8 weights with a float32 multiplier per [`weight_block_size`] tile (`weight_scale_inv`), or, with no block size,
one per tensor or per output channel. Which modules stay unquantized is `modules_to_not_convert` (alias
`ignored_layers`), matched against checkpoint module names as transformers matches them (`excluded_by`). The
loader (model/quantized.py) decodes the weights once; this module only reads the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .base import ConfigError, short

METHODS = ("fp8",)
# Methods people ship that we name in the error, so the message says what is missing rather than "unknown".
KNOWN_UNSUPPORTED = ("gptq", "awq", "compressed-tensors", "bitsandbytes", "mxfp4", "fbgemm_fp8", "torchao", "hqq", "eetq")
# The fp8 formats' config keys we read; the others (activation_scheme, fmt, scale_fmt, ...) do not change how the
# weights decode.
FP8_FORMATS = ("e4m3", "e5m2", None)


@dataclass(frozen=True)
class Quantization:
    """method "fp8"; block (rows, cols) of one scale, or None (a scale per tensor or per output channel); exclude:
    the module-name patterns that are not quantized."""

    method: str
    block: tuple[int, int] | None
    exclude: tuple[str, ...] = ()

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
    if method not in METHODS:
        hint = " (not supported yet; use the bf16 weights)" if method in KNOWN_UNSUPPORTED else ""
        raise ConfigError(f"config key '{key}.quant_method' is {short(method)}{hint}; supported: "
                          + ", ".join(map(repr, METHODS)))
    if qc.get("fmt") not in FP8_FORMATS:
        raise ConfigError(f"config key '{key}.fmt' is {short(qc.get('fmt'))}; supported: 'e4m3', 'e5m2'")
    if qc.get("scale_fmt", "float") not in ("float", None):
        raise ConfigError(f"config key '{key}.scale_fmt' is {short(qc.get('scale_fmt'))}; supported: 'float'")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"config key '{key}.weight_block_size' must be two positive integers or null, got {short(block)}")
        block = (block[0], block[1])
    exclude = qc.get("modules_to_not_convert")
    if exclude is None:
        exclude = qc.get("ignored_layers")
    exclude = [] if exclude is None else exclude
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ConfigError(f"config key '{key}.modules_to_not_convert' must be a list of module names, got {short(exclude)}")
    return Quantization(method, block, tuple(exclude))
