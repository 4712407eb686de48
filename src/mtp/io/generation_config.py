"""A checkpoint's default sampling parameters: `generation_config.json` beside the weights.

transformers' `generate` and vLLM's server read this file for the parameters a caller leaves out; `mtp generate`
and `mtp serve` do the same (the Python API `mtp.generate` takes exactly what it is given). As in transformers,
`temperature`, `top_k` and `top_p` only apply when `do_sample` is true, while `repetition_penalty` applies to
greedy decoding as well.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"


def sampling_defaults(folder: str | Path | None) -> dict:
    """A model folder -> {"temperature"?, "top_k"?, "top_p"?, "repetition_penalty"?}: the defaults its
    generation_config.json sets ({} without one). A value of the wrong type or range is a ValueError naming it."""
    if folder is None or not (Path(folder) / GENERATION_CONFIG).is_file():
        return {}
    path = Path(folder) / GENERATION_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    out = {}
    keys = ("repetition_penalty", "temperature", "top_k", "top_p") if cfg.get("do_sample") else ("repetition_penalty",)
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        ok = (isinstance(value, int) and value >= 1) if key == "top_k" else (
            isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 and (key != "top_p" or 0 < value <= 1)
            and (key != "repetition_penalty" or value > 0))
        if not ok or isinstance(value, bool):
            raise ValueError(f"{path}: {key}={value!r} is not a valid {key}")
        out[key] = value
    if cfg.get("do_sample") and "temperature" not in out:
        out["temperature"] = 1.0   # transformers' default once sampling is on
    return out
