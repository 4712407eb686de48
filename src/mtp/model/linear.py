"""Faster linear layers for CPU inference, swapped in once after loading (`prepare_for_inference`).

Every `nn.Linear` becomes a `FastLinear` that keeps the same `weight` parameter (state dict, saving and training
are unchanged) and also holds a copy prepared for one of these kernels:

- "bf16": oneDNN's packed weight layout (`mkldnn._linear_pointwise`): about 2x `F.linear` in bf16 on a 1-row
  decode step here, and verifying 4 rows costs about 1.5 rows (docs/decisions.md, 2026-11-30 speed).
- "int8": weight-only int8 with per-output-channel scales (`_weight_int8pack_mm`, bf16 activations).

Greedy speculative decoding stays identical to plain decoding only if each row of a verify block is computed
exactly as a 1-row plain step. Both kernels are row-invariant at the shapes we measured (tests/test_precision.py
checks it on the layers of a model); fp32 `F.linear` is not (MKL blocks rows by three), which fp32 decoding has
always lived with. (fbgemm's int8 x int8 dynamic kernel was 1.7-4x faster than bf16 at Qwen3.5-0.8B widths but
quantizes activations with one scale per call, so it is not row-invariant: not used, docs/decisions.md.)

The prepared copy is used only under no_grad/inference mode and only while the weight is unchanged (its version
counter is checked), so a model that trains afterwards silently goes back to `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("bf16", "int8")


class FastLinear(nn.Linear):
    """nn.Linear with a prepared inference copy of its weight: [..., in] -> [..., out]."""

    kernel: str | None = None

    @classmethod
    def wrap(cls, linear: nn.Linear, kernel: str) -> FastLinear:
        """The same module (same parameters) with a prepared copy for `kernel`."""
        linear.__class__ = cls
        linear.prepare(kernel)
        return linear

    @torch.no_grad()
    def prepare(self, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {KERNELS}")
        w = self.weight.detach()
        self.kernel = kernel
        self._version = self.weight._version
        if kernel == "bf16":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 1)
        else:
            scale = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
            self._packed = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            self._scale = scale.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None or torch.is_grad_enabled() or self.weight._version != self._version:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel == "bf16":
            y = torch.ops.mkldnn._linear_pointwise(x2.to(torch.bfloat16), self._packed, self._bias_bf16(), "none", [None], "")
        else:
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self._packed, self._scale)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])

    def _bias_bf16(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(torch.bfloat16)


class FusedProjections:
    """Several prepared linear layers that read the same input, run as ONE prepared matmul over their concatenated
    weights (fewer, larger kernel calls per decoding step: q|k|v, gate|up, the Gated DeltaNet's four input
    projections). Held as a plain attribute of the module that owns the layers, never a submodule, so parameter
    names and the state dict do not change. Used only while every part is prepared, unchanged and grad is off."""

    def __init__(self, parts: list[FastLinear]):
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        weight = torch.cat([p.weight.detach() for p in parts], dim=0)
        bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        self.fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.fused.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.fused.bias = nn.Parameter(bias, requires_grad=False)
        FastLinear.wrap(self.fused, parts[0].kernel)
        self.versions = [p.weight._version for p in parts]

    def usable(self) -> bool:
        return (not torch.is_grad_enabled() and all(p.kernel == self.fused.kernel for p in self.parts)
                and [p.weight._version for p in self.parts] == self.versions)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., in] -> one output per part, [..., out_i]."""
        return list(self.fused(x).split(self.sizes, dim=-1))


def project(module: nn.Module, x: torch.Tensor, *names: str) -> list[torch.Tensor]:
    """The outputs of `module`'s linear layers `names` on the same input x: through their fused form when
    `prepare_for_inference` built one (`module._fused`), else one by one."""
    fused = module.__dict__.get("_fused")
    if fused is not None and fused.usable():
        return fused(x)
    return [getattr(module, n)(x) for n in names]


def prepare_for_inference(model: nn.Module, kernel: str, skip: tuple[str, ...] = ()) -> int:
    """Swap every nn.Linear of `model` (but those whose name ends with one of `skip`) for a FastLinear prepared for
    `kernel`. Returns how many layers were prepared. Parameters, names and the state dict do not change."""
    n = 0
    for name, m in model.named_modules():
        if type(m) is nn.Linear or isinstance(m, FastLinear):
            if any(name.endswith(s) for s in skip):
                continue
            if isinstance(m, FastLinear):
                m.prepare(kernel)
            else:
                FastLinear.wrap(m, kernel)
            n += 1
    for m in model.modules():
        names = getattr(m, "fused_projections", None)
        if names and all(isinstance(getattr(m, x), FastLinear) and getattr(m, x).kernel == kernel for x in names):
            m.__dict__["_fused"] = FusedProjections([getattr(m, x) for x in names])
    return n
