"""The Gated DeltaNet decode step as one C call (`deltanet.c`) on x86 CPUs: `GatedDeltaNet.decode` and
`DeltaState.keep_at` use it where `usable(...)` says so, else their torch form.

The eager step spends ~60 tensor operations per layer and token between the input projections and the output
projection (conv taps, SiLU, norms, gates, the recurrence, the gated norm), each a full pass over its operands and
a few microseconds of dispatch; at the Qwen3.5-0.8B shape the recurrence alone read and wrote each 1 MB state ~6
times per token. One call reads the state once per token and writes the state after it (docs/decisions.md,
2026-12-02). Row-invariant by construction (deltanet.c), as the torch form is: greedy speculative == plain either way.

Built and loaded as native.py describes; MTP_NATIVE=0 (or no compiler, or not x86-64 with AVX2) keeps the torch form.
Inside a compiled graph the call goes through the `mtp::deltanet_decode` custom op, which the compiler keeps whole.
"""

from __future__ import annotations

import ctypes

import torch

from .native import AVX512_VNNI, NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.deltanet_decode.argtypes = [i64] * 7 + [i32, p, p, p, i64, i64, p, i64, i64, p, p, p, i64, i64, p, f32, p, p, p, i32]
    lib.deltanet_decode.restype = i32
    lib.deltanet_keep.argtypes = [i64, i64, i64, i64, i64, p, p, p, i64, i64, i64, p, p, i32]
    lib.deltanet_keep.restype = None
    lib.deltanet_keep_layers.argtypes = [i64, p, p, i32]
    lib.deltanet_keep_layers.restype = None


class _Keep(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("B", "Hv", "T", "Kd", "Vd", "C", "kernel", "esize")] + [
        (n, ctypes.c_void_p) for n in ("updates", "ssm", "window", "conv")]


# AVX-512 CPUs take a build whose recurrence runs 16 columns a vector (the same bits: deltanet.c)
LIBRARY = NativeLibrary("deltanet.c", None, "Gated DeltaNet decodes with torch ops", _declare, isas=(AVX512_VNNI,))


def usable(*tensors: torch.Tensor) -> bool:
    """Can the C step run on these tensors (all on the CPU, bf16 or fp32, no autograd) here?"""
    if torch.is_grad_enabled() or not all(t.device.type == "cpu" for t in tensors):
        return False
    return tensors[0].dtype in (torch.bfloat16, torch.float32) and LIBRARY.available()


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A [B, T, D] tensor whose last dim is contiguous, and its two leading strides (views of a fused projection's
    output are passed as they are)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def decode_step(window: torch.Tensor, taps: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, ssm: torch.Tensor, k_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gated DeltaNet decode forward of T tokens per row, from the conv window to the gated norm.

    window [B, C, kernel-1+T] (the cached conv inputs then the T new ones), taps [C, kernel] (the conv weight), b and
    a [B, T, Hv] (projections), A_log and dt_bias [Hv], z [B, T, Hv*Vd] (the gate), norm_w [Vd] (the gated norm's
    weight), ssm fp32 [B, Hv, Kd, Vd] (the state before the tokens; not changed), all but ssm in the model dtype
    (bf16 or fp32) -> (out [B, T, Hv*Vd] in the model dtype: the output projection's input, updates fp32
    [B, Hv, T, Kd + Vd + 1]: each token's update of the state, its key, delta and decay, for `keep`)."""
    if torch.compiler.is_compiling():
        return torch.ops.mtp.deltanet_decode(window, taps, b, a, A_log, dt_bias, z, norm_w, eps, ssm, k_heads)
    return _decode_step(window, taps, b, a, A_log, dt_bias, z, norm_w, eps, ssm, k_heads)


def step_in_place(window: torch.Tensor, taps: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, ssm: torch.Tensor,
                  conv: torch.Tensor, k_heads: int) -> torch.Tensor:
    """`decode_step` of T tokens per row that every row keeps (a plain step; a prompt's chunk): the state ssm
    [B, Hv, Kd, Vd] and the conv inputs conv [B, C, kernel-1] are updated in place to what `keep` of n = T would
    select, with the same arithmetic, and no per-token updates are written or applied again. Eager only (contiguous
    ssm and conv). -> out [B, T, Hv*Vd]."""
    if not (ssm.is_contiguous() and conv.is_contiguous()):
        raise ValueError("deltanet step in place: a contiguous state and conv inputs")
    out, _ = _decode_step(window, taps, b, a, A_log, dt_bias, z, norm_w, eps, ssm, k_heads, updates=ssm)
    conv.copy_(window[..., -conv.shape[-1]:])
    return out


def _decode_step(window, taps, b, a, A_log, dt_bias, z, norm_w, eps, ssm, k_heads, updates=None):
    B, C, width = window.shape
    _, Hv, Kd, Vd = ssm.shape
    kernel = taps.shape[-1]
    T = width - kernel + 1
    dtype = window.dtype
    if C != 2 * k_heads * Kd + Hv * Vd or Hv % k_heads or not (b.shape == a.shape == (B, T, Hv)):
        raise ValueError(f"deltanet_decode: window {list(window.shape)} does not fit state {list(ssm.shape)}")
    window, taps, ssm = window.contiguous(), taps.to(dtype).contiguous(), ssm.contiguous()
    (b, sb0, sb1), (a, sa0, sa1), (z, sz0, sz1) = _rows(b.to(dtype)), _rows(a.to(dtype)), _rows(z.to(dtype))
    A_log, dt_bias = A_log.float().contiguous(), dt_bias.float().contiguous()
    norm_w = norm_w.to(dtype).contiguous()
    out = torch.empty(B, T, Hv * Vd, dtype=dtype)
    if updates is None:
        updates = torch.empty(B, Hv, T, Kd + Vd + 1, dtype=torch.float32)
    status = LIBRARY.lib().deltanet_decode(
        B, T, k_heads, Hv, Kd, Vd, kernel, int(dtype == torch.bfloat16), window.data_ptr(), taps.data_ptr(),
        b.data_ptr(), sb0, sb1, a.data_ptr(), sa0, sa1, A_log.data_ptr(), dt_bias.data_ptr(), z.data_ptr(), sz0, sz1,
        norm_w.data_ptr(), eps, ssm.data_ptr(), updates.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("deltanet_decode: out of memory for its conv outputs")
    return out, updates


def keep(ssm: torch.Tensor, conv: torch.Tensor, updates: torch.Tensor, window: torch.Tensor, n: torch.Tensor) -> None:
    """`DeltaState.keep_at` in place: row r of ssm [B, Hv, Kd, Vd] := its state after the first n[r] of the tokens'
    updates [B, Hv, T, Kd + Vd + 1] (`decode_step`'s; the step's own arithmetic, so the plain steps' state bit for bit)
    and of conv [B, C, kernel-1] := window [B, C, kernel-1+T] at n[r].. where n[r] > 0 (n [B] long): the state is read
    and written once, whatever n."""
    if torch.compiler.is_compiling():
        torch.ops.mtp.deltanet_keep(ssm, conv, updates, window, n)
    else:
        _keep(ssm, conv, updates, window, n)


def _keep(ssm, conv, updates, window, n):
    B, Hv, T, R = updates.shape
    Kd, Vd = ssm.shape[-2:]
    if not all(t.is_contiguous() for t in (ssm, conv, updates, window)) or conv.dtype != window.dtype:
        raise ValueError("deltanet_keep: the state, the conv inputs and the steps must be contiguous, conv as window")
    if R != Kd + Vd + 1 or ssm.shape != (B, Hv, Kd, Vd):
        raise ValueError(f"deltanet_keep: updates {list(updates.shape)} do not fit state {list(ssm.shape)}")
    n = n.to(torch.int64).contiguous()
    LIBRARY.lib().deltanet_keep(B, Hv, T, Kd, Vd, n.data_ptr(), updates.data_ptr(), ssm.data_ptr(), conv.shape[1],
                                conv.shape[2] + 1, conv.element_size(), window.data_ptr(), conv.data_ptr(),
                                torch.get_num_threads())


def keep_program(kept: list, B: int) -> ctypes.Array | None:
    """`deltanet_keep_layers`' layers for the (DeltaState, DeltaSteps) pairs in `kept` of B rows, or None where one of
    them cannot run so."""
    layers = (_Keep * len(kept))()
    for L, (state, steps) in zip(layers, kept):
        ssm, conv, updates, window = state.ssm, state.conv, steps.updates, steps.window
        if updates is None:
            return None
        tensors = (ssm, conv, updates, window)
        Kd, Vd = ssm.shape[-2:]
        if (ssm.dtype != torch.float32 or updates.dtype != torch.float32 or conv.dtype != window.dtype
                or conv.dtype not in (torch.bfloat16, torch.float32) or updates.dim() != 4 or updates.shape[0] != B
                or updates.shape[3] != Kd + Vd + 1 or updates.shape[1] != ssm.shape[1]
                or not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)):
            return None
        B, Hv, T, _ = updates.shape
        L.B, L.Hv, L.T, L.Kd, L.Vd, L.C, L.kernel, L.esize = (B, Hv, T, Kd, Vd, conv.shape[1], conv.shape[2] + 1,
                                                             conv.element_size())
        L.updates, L.ssm, L.window, L.conv = updates.data_ptr(), ssm.data_ptr(), window.data_ptr(), conv.data_ptr()
    return layers


def keep_layers(kept: list, n: torch.Tensor) -> bool:
    """`DeltaState.keep_at` of every (DeltaState, DeltaSteps) pair in `kept` as one C call (n [B] long); False (nothing
    done) where one of them cannot run so."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not LIBRARY.available() or n.device.type != "cpu":
        return False
    layers = keep_program(kept, n.shape[0])
    if layers is None:
        return False
    n = n.to(torch.int64).contiguous()
    LIBRARY.lib().deltanet_keep_layers(len(kept), layers, n.data_ptr(), torch.get_num_threads())
    return True


@torch.library.custom_op("mtp::deltanet_decode", mutates_args=())
def _decode_op(window: torch.Tensor, taps: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, ssm: torch.Tensor, k_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode_step(window, taps, b, a, A_log, dt_bias, z, norm_w, eps, ssm, k_heads)


@_decode_op.register_fake
def _(window, taps, b, a, A_log, dt_bias, z, norm_w, eps, ssm, k_heads):
    B, Hv, Kd, Vd = ssm.shape
    T = window.shape[-1] - taps.shape[-1] + 1
    return window.new_empty(B, T, Hv * Vd), ssm.new_empty(B, Hv, T, Kd + Vd + 1)


@torch.library.custom_op("mtp::deltanet_keep", mutates_args=("ssm", "conv"))
def _keep_op(ssm: torch.Tensor, conv: torch.Tensor, updates: torch.Tensor, window: torch.Tensor, n: torch.Tensor) -> None:
    _keep(ssm, conv, updates, window, n)


@_keep_op.register_fake
def _(ssm, conv, updates, window, n):
    return None
