"""SwiGLU's `silu(gate) * up` and the gated attention's `out * sigmoid(gate)` as one C call each (`act.c`) on x86
CPUs, for inference: `layer.MLP` and `attention.GatedAttention` use them where `usable(...)` says so (no autograd,
eager, CPU, bf16), else their torch form with the same roundings (the activation rounded to bf16, then the product).

Each eager form is three tensor operations (the activation on a padded copy - `rowwise` - a slice and the product);
the one-call decode forward (step.c) runs these same kernels, so its bits are the eager step's (docs/decisions.md,
2026-12-02, "one call per decode forward"). Row-invariant by construction (act.c). Built and loaded as native.py
describes; MTP_NATIVE=0 keeps the torch form.
"""

from __future__ import annotations

import ctypes

import torch

from .native import AVX512_VNNI, NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.silu_mul.argtypes = [i64, i64, p, i64, p, i64, p, i32]
    lib.sigmoid_mul.argtypes = [i64, i64, p, i64, p, i64, p, i32]
    lib.silu_mul.restype = lib.sigmoid_mul.restype = None


# AVX-512 CPUs take a build that runs 16 elements a vector (the same bits: act.c)
LIBRARY = NativeLibrary("act.c", None, "SwiGLU and the attention gate run in torch ops", _declare, isas=(AVX512_VNNI,))


def usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Can the C kernels combine a and b (the same shape [..., N]) here?"""
    return (a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and a.is_cpu and a.shape == b.shape
            and a.numel() > 0 and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and LIBRARY.available())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as [rows, N] with a unit last stride (a view where it can be: fused projections' outputs are)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _combine(kernel: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """act.c's `kernel` on a, b bf16 [..., N] -> [..., N]."""
    a2, b2 = _rows(a), _rows(b)
    out = torch.empty(a.shape, dtype=torch.bfloat16)
    getattr(LIBRARY.lib(), kernel)(a2.shape[0], a2.shape[1], a2.data_ptr(), a2.stride(0), b2.data_ptr(), b2.stride(0),
                                   out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up bf16 [..., N] -> round(round(silu(gate)) * up) [..., N] (`usable`)."""
    return _combine("silu_mul", gate, up)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate bf16 [..., N] -> round(x * round(sigmoid(gate))) [..., N] (`usable`)."""
    return _combine("sigmoid_mul", x, gate)
