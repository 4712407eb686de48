"""The greedy token choice as one C call (`argmax.c`) on x86 CPUs: `argmax(logits)` is `logits.argmax(-1)` with the
same result (the first index of the largest value; a row holding NaN: its first NaN), where torch's CPU argmax of
bfloat16 logits costs ~3 ms for a 248,320-token vocabulary on one core (~10x its fp32 argmax) and a decode round
takes one per verified position and per draft (docs/decisions.md, 2026-12-02). Elsewhere (compiling, not the
CPU, another dtype, MTP_NATIVE=0) it is torch's. Built and loaded as native.py describes.
"""

from __future__ import annotations

import ctypes

import torch

from .native import NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.argmax_rows.argtypes = [i64, i64, p, i64, i32, p, i32]
    lib.argmax_rows.restype = None


LIBRARY = NativeLibrary("argmax.c", None, "argmax runs in torch", _declare)


def usable(x: torch.Tensor) -> bool:
    """Is the C argmax the faster here? (bf16 rows; fp32 rows of a large vocabulary: torch's fp32 argmax is as fast on
    short rows)"""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dim() > 0 and x.numel() > 0
            and (x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and x.shape[-1] >= 32768))
            and LIBRARY.available())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> long [...]: `x.argmax(-1)`."""
    if not usable(x):
        return x.argmax(-1)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.long)
    LIBRARY.lib().argmax_rows(x2.shape[0], x2.shape[1], x2.data_ptr(), x2.stride(0), int(x.dtype == torch.bfloat16),
                              out.data_ptr(), torch.get_num_threads())
    return out.reshape(x.shape[:-1])
