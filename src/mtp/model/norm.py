"""Norms: Qwen3.5's zero-centred RMSNorm (`(1 + w)`, fp32) and the gated RMSNorm of Gated DeltaNet; the plain
RMSNorm (`w * x`) of DeepSeek-V3, GLM and Qwen2/MiMo. At inference on x86 CPUs the first and the last run as one C
call each (norm_kernel.py); the gated one is part of the Gated DeltaNet decode step's C call (deltanet_kernel.py)."""

import torch
import torch.nn.functional as F
from torch import nn

from . import norm_kernel
from .rowwise import rowwise


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: weight starts at 0 and the output is `rmsnorm(x) * (1 + w)`, in fp32.

    Forgetting the `+1` gives ~0% MTP acceptance on real checkpoints (docs/reference.md, "Backbone").
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., D]"""
        if norm_kernel.usable(x, self.weight):  # inference on a CPU: one C call, the same roundings
            return norm_kernel.rmsnorm(x, self.weight, self.eps, zero_centred=True)
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class RMSNormGated(nn.Module):
    """Gated DeltaNet output norm: `w * rmsnorm(o) * silu(z)`, plain weight initialised to ones."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., D] -> [..., D]"""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * rowwise(F.silu, gate.float())).to(dtype)


class PlainRMSNorm(nn.Module):
    """RMSNorm with a plain weight (initialised to ones): `w * rmsnorm(x)`, normalised in fp32 and cast back before
    the weight, as transformers' DeepSeek-V3 / GLM / Qwen2 norms compute it. [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_kernel.usable(x, self.weight):  # inference on a CPU: one C call, the same roundings
            return norm_kernel.rmsnorm(x, self.weight, self.eps, zero_centred=False)
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
