"""Partial rotary position embedding (rotate-half style) on the first `rotary_dim` dims of each head; the interleaved
(GPT-J) variant and YaRN scaling that DeepSeek-V3 uses; tables from a config's RoPE parameters."""

import math
from collections.abc import Callable
from functools import partial

import torch


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """[rotary_dim // 2] inverse frequencies, fp32, on the CPU (also when built under a meta-device context)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [T, R] with R <= D -> [B, H, T, D]; dims R.. pass through."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class RotaryTable:
    """cos/sin [n, R] for positions 0..n-1 (times `scale`, YaRN's attention factor), grown on demand and
    cached for one dtype and device: a decode step slices, it never allocates. Not a module buffer, so a
    model built on the meta device and loaded later needs no fix-up; the inverse frequencies are computed on
    first use, so building a model on the meta device (to check a config against a checkpoint) allocates nothing."""

    def __init__(self, inv_freq: Callable[[], torch.Tensor], scale: float = 1.0):
        self._make_inv_freq: Callable[[], torch.Tensor] | None = inv_freq
        self._inv_freq: torch.Tensor | None = None
        self.scale = scale
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def inv_freq(self) -> torch.Tensor:
        """[R // 2] inverse frequencies, fp32, on the CPU."""
        if self._inv_freq is None:
            self._inv_freq = self._make_inv_freq().float().cpu()
            self._make_inv_freq = None
        return self._inv_freq

    def __call__(self, start: int, length: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, R] of positions start..start+length-1 (`gather` for a decode forward's positions)."""
        end = start + length
        table = self.ensure(end, dtype, device)
        return table[0][start:end], table[1][start:end]

    @property
    def table(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos, sin tables [P, R] built so far (positions 0..P-1), or None: what `gather` indexes (step.py's
        one-call draft reads them directly)."""
        return self._table

    def gather(self, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, R] of the positions index [B, T] (a tensor; the table must already reach them:
        `ensure` first - a compiled decode step cannot grow it)."""
        table = self._table
        if table is None or table[0].dtype != dtype or table[0].device != index.device:
            table = self.ensure(1, dtype, index.device)
        return table[0][index].unsqueeze(1), table[1][index].unsqueeze(1)

    def ensure(self, end: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table for positions 0..end-1 at least, in this dtype and on this device (built or grown here)."""
        table = self._table
        if table is None or table[0].shape[0] < end or table[0].dtype != dtype or table[0].device != device:
            n = max(end, 2 * (0 if table is None else table[0].shape[0]), 1024)
            # a normal tensor even when first built under inference_mode, so training can reuse it
            with torch.inference_mode(False), torch.no_grad():
                freqs = torch.arange(n, dtype=torch.float32, device="cpu")[:, None] * self.inv_freq[None, :]
                emb = torch.cat([freqs, freqs], dim=-1)
                cos, sin = emb.cos(), emb.sin()
                if self.scale != 1.0:
                    cos, sin = cos * self.scale, sin * self.scale
                table = self._table = (cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device))
        return table


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] whose dims are rotated in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's `rope_interleave`),
    cos/sin [T, D] as the tables hold them (the angles twice) -> [B, H, T, D] with the rotated pairs written as
    [evens | odds], as transformers writes them: q and k get the same layout, so their dot products are unchanged."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended `scale` times: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position_embeddings: int, beta_fast: float = 32,
                  beta_slow: float = 1, truncate: bool = True) -> torch.Tensor:
    """YaRN inverse frequencies [dim // 2] (fp32, CPU): the low frequencies interpolated by `factor`, the high ones
    kept, a linear ramp between the dims that turn `beta_fast` and `beta_slow` times over the original context."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotary_table(params: dict, head_dim: int, max_position_embeddings: int) -> RotaryTable:
    """The rotary table of a config's RoPE parameters (`rope_type` "default" or "yarn", `rope_theta`,
    `partial_rotary_factor`, YaRN's `factor`, `mscale`, `mscale_all_dim`, ...) over the first
    head_dim * partial_rotary_factor dims; YaRN's cos/sin are multiplied by its attention factor."""
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    theta = params["rope_theta"]
    if params.get("rope_type", "default") == "default":
        return RotaryTable(partial(rope_inv_freq, dim, theta))
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow, truncate = params.get("beta_fast") or 32, params.get("beta_slow") or 1, params.get("truncate", True)
    return RotaryTable(partial(yarn_inv_freq, dim, theta, factor, original, beta_fast, beta_slow, truncate), float(attention_factor))
