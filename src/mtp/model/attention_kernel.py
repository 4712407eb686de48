"""Decode attention as one C call (`attention.c`) on x86 CPUs: `attention.attend_decode` uses it in eager decoding
where `usable(...)` says so, else one SDPA call per query row over the keys that row sees.

SDPA is built for long queries: for the 1-query rows of decoding it cost ~1 ms a call at the Qwen3.5-0.8B shape
(docs/decisions.md, 2026-12-02). The C form computes each query row alone in a fixed order, so it is row-invariant
as the per-row SDPA calls are. Built and loaded as native.py describes; MTP_NATIVE=0 keeps SDPA.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from .native import AMX, AVX512_VNNI, NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("attend_decode", "attend_prompt"):
        getattr(lib, name).argtypes = [i64] * 7 + [i32, p, i64, i64, i64, p, p, p, f32, p, i32]
        getattr(lib, name).restype = i32


# the AMX build: a bf16 prompt's attention on the tiles (attention.c `prompt_kv_head_amx`); it asks for the tiles itself
LIBRARY = NativeLibrary("attention.c", None, "decode attention runs SDPA", _declare,
                        isas=(dataclasses.replace(AMX, ready="attention_ready"), AVX512_VNNI))


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Can the C kernel attend q [B, A, T, D] over the cache's k [B, Hk, S, D] / v [B, Hk, S, Dv] here?"""
    return (not torch.is_grad_enabled() and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32)
            and q.dtype == k.dtype == v.dtype and q.shape[-1] % 8 == 0 and q.stride(-1) == 1
            and k.is_contiguous() and v.is_contiguous() and q.shape[1] % k.shape[1] == 0 and LIBRARY.available())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], scale: float,
           prompt: bool = False) -> torch.Tensor:
    """q [B, A, T, D] (row b's token t at position starts[b] + t) over the keys k [B, Hk, S, D] / values v [B, Hk, S, Dv]
    at positions <= its own -> [B, A, T, Dv] in q's dtype; query head a reads kv head a // (A // Hk). `prompt`: the
    kernel of a prompt's chunk (`attend_prompt`: blocked products, other bits; step.c's prompt reads)."""
    B, A, T, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if max(starts) + T > S:
        raise ValueError(f"attend: positions up to {max(starts) + T - 1} past the cache's {S}")
    out = torch.empty(B, A, T, Dv, dtype=q.dtype)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    kernel = LIBRARY.lib().attend_prompt if prompt else LIBRARY.lib().attend_decode
    status = kernel(B, A, T, Hk, S, D, Dv, int(q.dtype == torch.bfloat16), q.data_ptr(), q.stride(0), q.stride(1),
                    q.stride(2), k.data_ptr(), v.data_ptr(), starts_t.data_ptr(), scale, out.data_ptr(),
                    torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"{kernel.__name__}: out of memory")
    return out
