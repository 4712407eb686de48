"""Elementwise transcendental functions whose result does not depend on how many rows a forward holds.

aten's CPU elementwise kernels compute a tensor in vector blocks of 2 x the SIMD width and the leftover elements with
the scalar function - and the vector exp/log/sigmoid (Sleef) and the scalar ones (libm) differ in the last bit. So
softplus over a [T, 6] tensor rounds a position differently for T = 1 (all scalar) than for T = 4 (all vector): a
verified position would not be bit-identical to its plain step, nor a batch row to the sequence decoded alone.
`rowwise(fn, x)` pads the last dim to a multiple of LANES, so every row covers whole vector blocks on any x86 SIMD
width (AVX2: 16 floats per block, AVX-512: 32) and every element takes the vector path. Used on the decode path's
small per-head vectors (Gated DeltaNet's decay and beta, the MoE shared-expert gate); the wide ones (hidden sizes,
head dims) are multiples of 64 in every config we know of. tests/test_precision.py checks the decode forward."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LANES = 64


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, with x's last dim padded to a multiple of LANES for the computation."""
    n = x.shape[-1]
    pad = -n % LANES
    if pad == 0:
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., :n]
