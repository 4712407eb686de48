"""The top-p cut of sampling as one C call (`top_p.c`) on x86 CPUs: decode/sampling.py's `shape_logits` cuts its rows
here, and the one-call round (`step.c`) calls the same code, so the two give the same bits (torch's softmax and
cumulative sum would round apart from any C at the cut). Elsewhere (compiling, not the CPU, MTP_NATIVE=0) the cut is
torch's, by the same rule. Built and loaded as native.py describes.
"""

from __future__ import annotations

import ctypes

import torch

from .native import NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.top_p_rows.argtypes = [i64, i64, p, i64, p]
    lib.top_p_rows.restype = ctypes.c_int


LIBRARY = NativeLibrary("top_p.c", None, "the top-p cut runs in torch", _declare)


def usable(x: torch.Tensor) -> bool:
    """Can `cut` run on shaped logits x [..., V] here (fp32, contiguous, on the CPU, eager)?"""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
            and x.dim() > 0 and x.is_contiguous() and LIBRARY.available())


def cut(x: torch.Tensor, top_p: torch.Tensor) -> None:
    """Where `usable`: shaped logits x [..., V] (after temperature and top-k, -inf where cut), top_p [...] (each row's,
    in (0, 1]; 1: none) -> x with -inf on every token the row's top-p cuts, in place."""
    p = top_p.to(torch.float32).expand(x.shape[:-1]).contiguous()
    if LIBRARY.lib().top_p_rows(p.numel(), x.shape[-1], x.data_ptr(), x.shape[-1], p.data_ptr()):
        raise MemoryError("top_p_rows: out of memory")
