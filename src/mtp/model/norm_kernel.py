"""RMSNorm as one C call (`norm.c`) on x86 CPUs, for inference: `norm.RMSNorm` and `norm.PlainRMSNorm` use it where
`usable(...)` says so (no autograd, eager, CPU, bf16), else their torch form with the same roundings. fp32 keeps the
torch form: its sums run in another order, which moved fp32 logits past the 1e-4 parity with transformers that
tests/test_parity.py holds (in bf16 the two forms gave identical bits on random inputs).

The eager form is ~8 tensor operations (a float copy, a square, a mean, an add, a rsqrt, two products, a cast): at
the shipped model's widths each norm cost ~60 us of dispatch for ~1 us of arithmetic, and a decode step runs dozens
(docs/decisions.md, 2026-12-02). Row-invariant by construction (norm.c). Built and loaded as native.py describes;
MTP_NATIVE=0 keeps the torch form.
"""

from __future__ import annotations

import ctypes

import torch

from .native import AVX512_VNNI, NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.rmsnorm.argtypes = [i64, i64, p, i64, p, i32, f32, i32, p, i32]
    lib.rmsnorm.restype = None


# AVX-512 CPUs take a build that writes the output 16 lanes a vector (the same bits: norm.c)
LIBRARY = NativeLibrary("norm.c", None, "RMSNorm runs in torch ops", _declare, isas=(AVX512_VNNI,))


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the C kernel normalise x [..., D] with weight [D] here? (the cheap checks first: a norm runs dozens of
    times a step, and at the shipped model's widths its dispatch is most of its time)"""
    D = x.shape[-1]
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu and D % 8 == 0
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and x.numel() > 0
            and weight.is_contiguous() and LIBRARY.available())


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """x [..., D] -> [..., D] in x's dtype: `rmsnorm(x) * (1 + w)` in fp32 (zero_centred), else `w * rmsnorm(x)`
    with the normalised value rounded to x's dtype first. weight [D] contiguous (`usable`)."""
    D = x.shape[-1]
    x2 = x.view(-1, D) if x.is_contiguous() else x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    LIBRARY.lib().rmsnorm(x2.shape[0], D, x2.data_ptr(), x2.stride(0), weight.data_ptr(), int(zero_centred), eps,
                          int(x.dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads())
    return out
