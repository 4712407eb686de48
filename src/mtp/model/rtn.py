"""Round-to-nearest quantization of float weights in one C pass (`rtn.c`): what `--quantize int8 / int4` spends a
quantized load on (`linear.quantize_int8`, `linear.Int4Weight.quantize`, the qmatmul int4 packing).

The torch form in linear.py makes ~10 passes over every weight (a float copy, min, max, a division, a round, an add,
a clamp, a cast, the nibble packing), each with a weight-sized temporary: at the Qwen3.5-0.8B shape it was 4.5 s of a
7 s int4 load on one core (docs/decisions.md, 2026-12-02, "quantized loads"). rtn.c does the same fp32 operations in
the same order on one row at a time, so its codes, scales and zero points are bit for bit the torch form's
(tests/test_rtn.py). The codes may also go straight into the qmatmul kernels' interleaved layouts, with no [N, K]
codes between (`quantize_int8_packed`, `quantize_int4_packed`): what a quantizing load keeps.

Each function returns None where it does not apply, and the caller then runs the torch form: the library is not
available (native.py: no compiler, not x86-64 with AVX2, MTP_NATIVE=0), the weight is not a bf16 / fp32 CPU matrix
with unit stride along its inputs, the group does not fit (int4: group % 32 == 0 and K % group == 0), or a row holds
NaN / Inf (the torch form's NaN propagation is not reproduced in C).
"""

from __future__ import annotations

import ctypes

import torch

from . import qmatmul
from .native import NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.q4_quantize.argtypes = [i64, i64, p, i64, i32, i64, i32, p, p, p, i32]
    lib.q8_quantize.argtypes = [i64, i64, p, i64, i32, p, p, i32]
    lib.q8_quantize_packed.argtypes = [i64, i64, i64, p, i64, i32, i32, p, p, i32]
    lib.q4_quantize_packed.argtypes = [i64, i64, p, i64, i32, i64, i32, p, p, p, i32]
    for f in (lib.q4_quantize, lib.q8_quantize, lib.q8_quantize_packed, lib.q4_quantize_packed):
        f.restype = i32


LIBRARY = NativeLibrary("rtn.c", None, "quantizing runs in torch ops", _declare)


def _usable(w: torch.Tensor) -> bool:
    return (w.dim() == 2 and w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float32)
            and w.stride(1) == 1 and w.shape[0] > 0 and LIBRARY.available())


def int4_fits(w: torch.Tensor, group: int) -> bool:
    """Can the C pass quantize w [N, K] in groups of `group`?"""
    return _usable(w) and group % 32 == 0 and w.shape[1] % group == 0


@torch.no_grad()
def quantize_int4(w: torch.Tensor, group: int, symmetric: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`Int4Weight.quantize` of w [N, K]: (codes uint8 [N, K], scale fp32 [N, K/group], zero uint8 [N, K/group]),
    or None (module docstring)."""
    if not int4_fits(w, group):
        return None
    N, K = w.shape
    codes = torch.empty(N, K, dtype=torch.uint8)
    scale, zero = torch.empty(N, K // group), torch.empty(N, K // group, dtype=torch.uint8)
    ok = LIBRARY.lib().q4_quantize(N, K, w.data_ptr(), w.stride(0), int(w.dtype == torch.bfloat16), group, int(symmetric),
                                   codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), torch.get_num_threads()) == 0
    return (codes, scale, zero) if ok else None


@torch.no_grad()
def quantize_int4_packed(w: torch.Tensor, group: int, symmetric: bool = False,
                         into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`linear._native_int4(Int4Weight.quantize(w, group, symmetric))` of w [N, K] (N % 8 == 0) in one pass: the q4
    kernel's packed codes uint8 [N/8, 4K], scale and low (-zero * scale) fp32 [N/8, K/group * 8], written into `into`
    (those three, contiguous: e.g. one part's rows of a fusion's buffers) when given; or None (module docstring)."""
    if not int4_fits(w, group) or w.shape[0] % 8:
        return None
    N, K = w.shape
    given = into or (None, None, None)
    packed = qmatmul.out_tensor(given[0], (N // 8, 4 * K), torch.uint8, "quantize_int4_packed")
    scale, low = (qmatmul.out_tensor(t, (N // 8, K // group * 8), torch.float32, "quantize_int4_packed") for t in given[1:])
    ok = LIBRARY.lib().q4_quantize_packed(N, K, w.data_ptr(), w.stride(0), int(w.dtype == torch.bfloat16), group,
                                          int(symmetric), packed.data_ptr(), scale.data_ptr(), low.data_ptr(),
                                          torch.get_num_threads()) == 0
    return (packed, scale, low) if ok else None


@torch.no_grad()
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`linear.quantize_int8` of w [N, K]: (codes int8 [N, K], scale fp32 [N]), or None (module docstring)."""
    if not _usable(w):
        return None
    N, K = w.shape
    codes, scale = torch.empty(N, K, dtype=torch.int8), torch.empty(N)
    ok = LIBRARY.lib().q8_quantize(N, K, w.data_ptr(), w.stride(0), int(w.dtype == torch.bfloat16), codes.data_ptr(),
                                   scale.data_ptr(), torch.get_num_threads()) == 0
    return (codes, scale) if ok else None


@torch.no_grad()
def quantize_int8_packed(w: torch.Tensor, in_padded: int, flip: bool, out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`quantize_int8` of w [N, K] with its codes padded by zeros to `in_padded` inputs (a multiple of 32, >= K) and
    laid out as `qmatmul.pack_int8` lays them, with `flip` as that layout's AVX-512 form (each code + 128): (packed
    uint8 [ceil(N/8), in_padded/4, 8, 4], written into `out` when given, scale fp32 [N]), or None (module
    docstring); the [N, K] codes are never held."""
    N, K = w.shape if w.dim() == 2 else (0, 0)
    if not _usable(w) or in_padded % 32 or in_padded < K:
        return None
    out = qmatmul.out_tensor(out, ((N + 7) // 8, in_padded // 4, 8, 4), torch.uint8, "quantize_int8_packed")
    scale = torch.empty(N)
    ok = LIBRARY.lib().q8_quantize_packed(N, K, in_padded, w.data_ptr(), w.stride(0), int(w.dtype == torch.bfloat16),
                                          int(flip), out.data_ptr(), scale.data_ptr(), torch.get_num_threads()) == 0
    return (out, scale) if ok else None
