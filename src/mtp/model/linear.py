"""Linear layers for inference that are row-invariant (and fast on CPU), swapped in once after loading
(`prepare_for_inference`).

Greedy speculative decoding is identical to plain decoding only if each row of a verify block is computed exactly
as a 1-row plain step, and batching is lossless only if a row does not depend on the others. Every `nn.Linear`
becomes a `FastLinear` that keeps the same `weight` parameter (state dict, saving and training are unchanged) and
runs one of these kernels, each row-invariant (tests/test_precision.py checks every layer of a model on the machine
that runs it):

- "bf16": oneDNN's packed weight layout (`mkldnn._linear_pointwise`): about 2x `F.linear` in bf16 on a 1-row
  decode step, and verifying 4 rows costs about 1.5 rows (docs/decisions.md, 2026-11-30 speed). oneDNN packs bf16
  weights only on CPUs with AVX-512 (bw/vl/dq) or AVX-NE-CONVERT; on an AVX2-only CPU (AMD EPYC Zen 3, say) the
  kernel is `F.linear` on the bf16 weight, which is row-invariant there.
- "int8": weight-only int8 with per-output-channel scales (`_weight_int8pack_mm`, bf16 activations).
- "fp32": `F.linear`, one row at a time in decode rounds (`linear_rows` within `row_invariant()`). MKL's fp32 GEMM
  is not row-invariant (a 1-row product takes its GEMV path, several rows its blocked GEMM, and they round
  differently), so a verify block multiplies row by row: each row reads the weights again (fp32 is not the fast
  path) but is exactly its plain step.
(fbgemm's int8 x int8 dynamic kernel was 1.7-4x faster than bf16 at Qwen3.5-0.8B widths but quantizes activations
with one scale per call, so it is not row-invariant: not used, docs/decisions.md.)

The prepared kernel is used only under no_grad/inference mode and only while the weight is unchanged (its version
counter is checked), so a model that trains afterwards silently goes back to `F.linear`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("bf16", "int8", "fp32")

_PACKED_BF16: bool | None = None


def packed_bf16_supported() -> bool:
    """Can oneDNN pack bf16 linear weights on this CPU (AVX-512 bw/vl/dq or AVX-NE-CONVERT)? Probed once."""
    global _PACKED_BF16
    if _PACKED_BF16 is None:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
            _PACKED_BF16 = True
        except RuntimeError:
            _PACKED_BF16 = False
    return _PACKED_BF16


class FastLinear(nn.Linear):
    """nn.Linear with a prepared inference copy of its weight: [..., in] -> [..., out].

    Inside a compiled graph (`torch.compile`) the prepared kernel is called through the `mtp::prepared_linear`
    custom op, so the compiler neither decomposes nor replaces it: a compiled decode step multiplies with exactly the
    kernel the eager one uses (and so keeps its row invariance)."""

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
        if kernel == "fp32":
            # the parameter itself, or an aligned copy: MKL rounds differently for a weight at another alignment (a
            # memory-mapped tensor sits wherever the file put it), and the same checkpoint should give the same bits
            self._packed = w if w.is_contiguous() and w.data_ptr() % 64 == 0 else w.clone(memory_format=torch.contiguous_format)
        elif kernel == "bf16":
            w = w.to(torch.bfloat16)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1) if packed_bf16_supported() else w.contiguous()
        else:
            scale = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
            self._packed = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            self._scale = scale.to(torch.bfloat16)
        if not hasattr(self, "_slot"):
            self._slot = _register(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self.kernel is None:
                return F.linear(x, self.weight, self.bias)
            return torch.ops.mtp.prepared_linear(x, self.weight, self._slot)
        if self.kernel is None or torch.is_grad_enabled() or self.weight._version != self._version:
            return F.linear(x, self.weight, self.bias)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The prepared kernel: x [..., in] -> [..., out] in x's dtype."""
        if self.kernel == "fp32":
            return linear_rows(x, self._packed, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        if self.kernel == "bf16" and self._packed.layout == torch.strided:  # no oneDNN bf16 packing on this CPU
            y = F.linear(x2, self._packed, bias)
        elif self.kernel == "bf16":
            y = torch.ops.mkldnn._linear_pointwise(x2, self._packed, bias, "none", [None], "")
        else:
            y = torch._weight_int8pack_mm(x2.contiguous(), self._packed, self._scale)
            if bias is not None:
                y = y + bias
        return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])


_ROWS = threading.local()


@contextmanager
def row_invariant() -> Iterator[None]:
    """Within: `linear_rows` multiplies row by row. The decoder runs its rounds in it (a plain step and every row of a
    verify or of a batch then round alike); a prefill or training forward over many rows does not pay for it."""
    before = getattr(_ROWS, "on", False)
    _ROWS.on = True
    try:
        yield
    finally:
        _ROWS.on = before


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed one row at a time within `row_invariant()` when there are several rows and no gradient:
    x [..., in] -> [..., out], each row then exactly what a 1-row product gives whatever the BLAS. Each row is made
    contiguous: a GEMV may round differently for an input at another alignment."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 1 or torch.is_grad_enabled() or not getattr(_ROWS, "on", False):
        return F.linear(x, weight, bias)
    y = torch.cat([F.linear(x2[i : i + 1].contiguous(), weight, bias) for i in range(x2.shape[0])])
    return y.reshape(*shape[:-1], weight.shape[0])


# Prepared layers by slot, for the custom op (a compiled graph holds the slot number, not the module).
_SLOTS: weakref.WeakValueDictionary[int, FastLinear] = weakref.WeakValueDictionary()
_NEXT_SLOT = itertools.count()


def _register(layer: FastLinear) -> int:
    slot = next(_NEXT_SLOT)
    _SLOTS[slot] = layer
    return slot


@torch.library.custom_op("mtp::prepared_linear", mutates_args=())
def prepared_linear(x: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor:
    """The prepared kernel of the FastLinear in `slot` (whose parameter is `weight`): [..., in] -> [..., out]."""
    return _SLOTS[slot].run(x)


@prepared_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


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
