"""int8 and int4 weights times int8 activations on x86 CPUs: the "int8" and "int4" linear kernels of decoding
(`linear.FastLinear`) where this machine can run them.

torch's CPU kernels for quantized weights (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) widen every weight
to float and multiply in float: on an AVX2 CPU they run at 4-6 GB/s of weights, well below the memory bandwidth, so
a quantized 0.8B-shape step was little faster than bf16 (docs/decisions.md, 2026-12-01, "int8 and int4 at the
memory's speed"). `qmatmul.c` does what llama.cpp's q8_0 path does instead: it quantizes the activations to int8 in
blocks of 32 (for int4 weights, as wide as their groups allow up to 128) and multiplies int8 by int8 (or int4 by int8)
with exact integer block sums (`vpmaddubsw`, `vpdpbusd` with AVX-512 VNNI, or the AMX tiles' `tdpbsud` for several
rows). The weights are stored interleaved by groups of 8 outputs (`pack_int8`, `pack_int4`),
so one product gives 8 outputs' partial sums and one weight load serves up to 4 rows (a verify block, a batch):
docs/decisions.md, 2026-12-02, "interleaved". Each output's float accumulation runs in one fixed order, so the
kernels are row-invariant by construction: at any row count and thread count, row m of a product is its 1-row
product.

The C source is built and loaded as native.py describes. Where that cannot happen (no compiler, not x86-64 with
AVX2/FMA/F16C, MTP_QMATMUL=0 or MTP_NATIVE=0) the linear layers keep torch's kernels, which are row-invariant too;
`available()` says which, and `reason()` why not.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .native import AMX, AVX512_BF16, AVX512_VNNI, NativeLibrary

BLOCK = 32  # activation block, and the granularity of K and of int4 groups


class Fuse(ctypes.Structure):
    """What a tile product's sums become (native.h `Fuse`): kind FUSE_SWIGLU or FUSE_ADD, SwiGLU's width I and where
    its up outputs start."""
    _fields_ = [("kind", ctypes.c_int64), ("I", ctypes.c_int64), ("up", ctypes.c_int64)]


FUSE_SWIGLU, FUSE_ADD = 1, 2


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.q8_linear.argtypes = [p, i64, i64, p, p, p, i64, p, i32]
    lib.q4_linear.argtypes = [p, i64, i64, p, p, p, i64, p, i64, p, i32]
    lib.q8_linear.restype = lib.q4_linear.restype = i32
    lib.bf16_linear.argtypes = [p, i64, i64, p, p, i64, p, i32]
    lib.bf16_linear.restype = i32
    if hasattr(lib, "q8_linear_wide"):  # (the AMX build)
        lib.q8_linear_wide.argtypes = lib.q8_linear.argtypes
        lib.q4_linear_wide.argtypes = lib.q4_linear.argtypes
        lib.q8_linear_wide.restype = lib.q4_linear_wide.restype = i32
        lib.bf16_linear_fused.argtypes = [p, i64, i64, p, i64, p, ctypes.POINTER(Fuse), i32]
        lib.bf16_linear_fused.restype = i32
    lib.qmatmul_isa.restype = ctypes.c_char_p
    lib.qmatmul_ready.restype = i32


LIBRARY = NativeLibrary("qmatmul.c", "MTP_QMATMUL", "int8/int4 layers use torch's kernels", _declare,
                        (AMX, AVX512_BF16, AVX512_VNNI))


def available() -> bool:
    """Can this process run the kernels (built and loaded on the first call)?"""
    return LIBRARY.available()


def reason() -> str:
    """Why the kernels are not used ("" when they are)."""
    return LIBRARY.reason()


def isa() -> str:
    """The instruction set the loaded kernels were built for ("avx2", "avx512vnni", "avx512bf16" or "amx"; "" when
    not loaded)."""
    return _library().qmatmul_isa().decode() if available() else ""


def supports(in_features: int, group: int | None = None) -> bool:
    """Can the kernels run a layer of this input width (and int4 group size)?"""
    ok = in_features % BLOCK == 0
    return ok if group is None else ok and group % BLOCK == 0 and in_features % group == 0


def out_tensor(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, who: str) -> torch.Tensor:
    """Where a packing or decode of `who` writes: `out` (ValueError unless contiguous, of `shape` and `dtype`: e.g.
    one part's rows of a fusion's buffer, or a load's scratch), or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{who}: out must be a contiguous {dtype} {list(shape)}, got {out.dtype} {list(out.shape)}")
    return out


def pack_int8(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 codes [N, K] (K % 32 == 0) -> uint8 [ceil(N/8), K/4, 8, 4], the q8 kernel's interleaved layout: byte
    (g, c, j, i) is output 8g+j's code for input 4c+i (the last group padded with zero codes), stored as code + 128 for
    the AVX-512 builds (VNNI's u8 x s8 product takes the weights unsigned) and as the code itself for the AVX2 build.
    Written into `out` (contiguous, that shape) when given."""
    N, K = codes.shape
    pad = -N % 8
    if pad:
        codes = F.pad(codes, (0, 0, 0, pad))
    codes = codes.contiguous()
    if codes.storage_offset() % 4:  # (a checkpoint's mapped codes sit wherever the file put them)
        codes = codes.clone()
    # a chunk's 4 codes move as one int32 (torch's permuted copy of 4-byte elements, not of bytes: pack_bf16)
    c = codes.view(torch.int32).reshape(-1, 8, K // 4).permute(0, 2, 1)
    out = out_tensor(out, (c.shape[0], K // 4, 8, 4), torch.uint8, "pack_int8")
    words = out.view(torch.int32).reshape(c.shape)
    if isa() != "avx2":  # code + 128 as a byte is the code's bits with the top one flipped
        torch.bitwise_xor(c, -0x7F7F7F80, out=words)  # 0x80808080 as an int32
    else:
        words.copy_(c)
    return out


def unpack_int8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`pack_int8`'s inverse: uint8 [ceil(N/8), K/4, 8, 4] -> int8 codes [N, K] (N = out_features)."""
    G, C = packed.shape[:2]
    codes = packed.view(torch.int8) if isa() == "avx2" else (packed.to(torch.int16) - 128).to(torch.int8)
    return codes.permute(0, 2, 1, 3).reshape(G * 8, C * 4)[:out_features]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes uint8 [N, K] in 0..15 (K % 8 == 0) -> uint8 [ceil(N/8), 4K], the q4 kernel's interleaved layout: per
    group of 8 outputs (the last padded with zero codes), per 8 inputs, 32 bytes, byte (j, i) = q[j, i] | q[j, 4 + i] << 4."""
    if codes.shape[0] % 8:  # (only then: F.pad copies even when it pads nothing)
        codes = F.pad(codes, (0, 0, 0, -codes.shape[0] % 8))
    N, K = codes.shape
    # [N/8, K/8, 8 outputs, 2 halves] of int32 words, 4 inputs a word (codes < 16: a byte shifted by 4 stays in its
    # byte): one pass of 4-byte elements instead of torch's byte-wise permutes (1.6 s of a 0.8B-shape int4 load)
    c = codes.contiguous().view(torch.int32).reshape(N // 8, 8, K // 8, 2).permute(0, 2, 1, 3)
    out = torch.empty(N // 8, K // 8, 8, dtype=torch.int32)
    torch.bitwise_or(c[..., 0], c[..., 1] << 4, out=out)
    return out.view(torch.uint8).reshape(N // 8, 4 * K)


def unpack_int4(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`pack_int4`'s inverse: uint8 [ceil(N/8), 4K] -> int4 codes uint8 [N, K] (N = out_features)."""
    G, K = packed.shape[0], packed.shape[1] // 4
    w = packed.view(torch.int32).reshape(G, K // 8, 8, 1)  # byte i of word (g, c, j): inputs 8c+i (low), 8c+4+i (high)
    halves = torch.cat([w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F], dim=-1)  # [G, K/8, 8, 2]: inputs 8c..8c+3, 8c+4..8c+7
    return halves.permute(0, 2, 1, 3).contiguous().view(torch.uint8).reshape(G * 8, K)[:out_features].contiguous()


def pack_int4_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-(output, group) fp32 values [N, K/G] (int4 scales, offsets) -> [ceil(N/8), K/G * 8], interleaved as the
    codes (zeros for the pad outputs)."""
    if t.shape[0] % 8:
        t = F.pad(t, (0, 0, 0, -t.shape[0] % 8))
    N, ng = t.shape
    return t.reshape(N // 8, 8, ng).transpose(1, 2).reshape(N // 8, ng * 8).contiguous()


def bf16_group() -> int:
    """How many outputs one row (dimension 0) of `pack_bf16`'s layout holds: 16 in the AMX build, 8 in the others."""
    return 16 if isa() == AMX.name else 8


def bf16_packed_shape(N: int, K: int) -> tuple[int, ...]:
    """The shape `pack_bf16` gives a bf16 weight [N, K] in the loaded build's layout."""
    if bf16_group() == 16:
        return (-(-N // 16), -(-K // 32), 16, 16, 2)
    return (-(-N // 8), -(-K // 2), 8, 2)


def pack_bf16(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 weight [N, K] -> the loaded build's layout for `bf16_linear`:
    - vector builds: [ceil(N/8), ceil(K/2), 8, 2], element (g, p, j, e) is output 8g+j's weight for input 2p+e;
    - the AMX build: [ceil(N/16), ceil(K/32), 16, 16, 2], one tile per 16 outputs x 32 inputs, element (b, c, p, j, e)
      is output 16b+j's weight for input 32c+2p+e.
    Outputs and inputs past the weight's are zeros. `out` (contiguous bf16 of `bf16_packed_shape(N, K)`, e.g. one
    part's rows of a fusion's buffer) receives the packing and is returned."""
    N, K = w.shape
    n = bf16_group()
    k = 32 if n == 16 else 2
    shape = bf16_packed_shape(N, K)
    out = out_tensor(out, shape, torch.bfloat16, "pack_bf16")
    if N % n or K % k:  # (only then: a pad is a copy, and an output head's weight is the largest there is)
        w = F.pad(w, (0, -K % k, 0, -N % n))
    # each pair of inputs moves as one int32: torch's permuted copy of 4-byte elements ran 2-4x faster than of the
    # bf16 pairs (0.8B shape: ~2.3 s of a load, docs/decisions.md 2026-12-06 eleventh session)
    p = w.contiguous().view(torch.int32)  # [N, K/2]: inputs 2i and 2i+1 of an output
    words = out.view(torch.int32).reshape(shape[:-1])
    if k == 2:
        words.copy_(p.reshape(-1, 8, p.shape[1]).transpose(1, 2))
    else:
        words.copy_(p.reshape(-1, 16, p.shape[1] // 16, 16).permute(0, 2, 3, 1))
    return out


def unpack_bf16(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`pack_bf16`'s inverse, for the loaded build's layout: packed -> bf16 weight [out_features, in_features]."""
    p = packed.view(torch.int32)
    if packed.dim() == 4:  # vector builds: [N/8, K/2, 8, 2]
        w = p.reshape(p.shape[0], p.shape[1], 8).transpose(1, 2).reshape(p.shape[0] * 8, p.shape[1])
    else:  # the AMX build: [N/16, K/32, 16, 16, 2]
        w = p.reshape(*p.shape[:4]).permute(0, 3, 1, 2).reshape(p.shape[0] * 16, p.shape[1] * 16)
    return w.contiguous().view(torch.bfloat16)[:out_features, :in_features].contiguous()


def _library() -> ctypes.CDLL:
    return LIBRARY.lib()


def _bias(bias: torch.Tensor | None) -> int | None:
    return None if bias is None else bias.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("qmatmul: out of memory for the activations' copy")


def wide_available() -> bool:
    """Does the loaded build have the prompt products of int8/int4 codes on the bf16 tiles (`wide=True`)?"""
    return available() and hasattr(_library(), "q8_linear_wide")


def q8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              wide: bool = False) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) times int8 codes w with fp32 scales [N] (w ~ codes * scale[:, None]), plus fp32 bias
    [N] -> bf16 [M, N]. w: `pack_int8`'s layout (what a prepared layer holds), or int8 codes [N, K], packed here.
    `wide` (where `wide_available`): the codes decoded to bf16 weights and multiplied by the bf16 rows on the tiles, not
    the integer product's bits (a prompt's chunks only, qmatmul.c `q8_linear_wide`)."""
    M, K = x.shape
    N = scale.shape[0]
    if w.dtype == torch.int8:
        w = pack_int8(w)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M:
        fn = _library().q8_linear_wide if wide and wide_available() else _library().q8_linear
        _check(fn(x.data_ptr(), M, K, w.data_ptr(), scale.data_ptr(), _bias(bias), N, y.data_ptr(),
                              torch.get_num_threads()))
    return y


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int,
              bias: torch.Tensor | None = None, wide: bool = False) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) times int4 codes (`pack_int4`) with fp32 scales and offsets (w ~ codes * scale + low
    per group) - [N, K/group], interleaved here, or interleaved (`pack_int4_groups`, what a prepared layer holds: its
    N is a multiple of 8) - plus fp32 bias [N] -> bf16 [M, N]. `wide`: as q8_linear's."""
    M, K = x.shape
    N = packed.shape[0] * 8
    if scale.shape[0] != packed.shape[0]:
        N = scale.shape[0]
        scale, low = pack_int4_groups(scale), pack_int4_groups(low)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M:
        fn = _library().q4_linear_wide if wide and wide_available() else _library().q4_linear
        _check(fn(x.data_ptr(), M, K, packed.data_ptr(), scale.data_ptr(), low.data_ptr(), group, _bias(bias),
                              N, y.data_ptr(), torch.get_num_threads()))
    return y


def bf16_linear_fused(x: torch.Tensor, w: torch.Tensor, out_features: int, y: torch.Tensor, fuse: Fuse) -> bool:
    """The AMX build's tile product fused with what follows it (step.c's decode forward uses it; here for its tests):
    FUSE_SWIGLU y bf16 [M, I] := act.silu_mul(gate, up) of the product's outputs gate [:, :I], up [:, up : up + I];
    FUSE_ADD y bf16 [M, N] += the product. The same bits as the product and then the step. False (nothing written)
    where the shape does not fit (I or up not a multiple of 16)."""
    M, K = x.shape
    status = _library().bf16_linear_fused(x.data_ptr(), M, K, w.data_ptr(), out_features, y.data_ptr(),
                                          ctypes.byref(fuse), torch.get_num_threads())
    if status != -2:
        _check(status)
    return status != -2


def bf16_linear(x: torch.Tensor, w: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) times a bf16 weight in `pack_bf16`'s layout, plus fp32 bias [N] -> bf16 [M, N]:
    fp32 sums in one order per output (row-invariant): fp32 multiply-adds, the same bits on every AVX2 CPU, or in the
    AVX-512 BF16 build `vdpbf16ps`, bits of its own."""
    M, K = x.shape
    y = torch.empty(M, out_features, dtype=torch.bfloat16)
    if M:
        _check(_library().bf16_linear(x.data_ptr(), M, K, w.data_ptr(), _bias(bias), out_features, y.data_ptr(),
                                      torch.get_num_threads()))
    return y
