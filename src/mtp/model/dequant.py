"""A checkpoint's scaled 8-bit codes (FP8 e4m3fn / e5m2, symmetric int8) decoded to float weights in one C pass
(`dequant.c`): what an FP8 release spends its load on beyond a bf16 one. `scaled_packed` decodes straight into
qmatmul's bf16 packing; `int4_words_packed` and `awq_int4_packed` move GPTQ's, compressed-tensors' and AWQ's int4 words
to the q4 kernel's layout, and `words_bf16` decodes 4- and 8-bit words straight into the bf16 packing.

The torch form, `packed.dequantize_scaled`, converts the codes to fp32, multiplies by the scales and casts, 128 rows
at a time: ~4 s of a 10 s FP8 load at the Qwen3.5-0.8B shape on one core (docs/decisions.md, 2026-12-06 eleventh
session). dequant.c does the same fp32 operations (each code's exact value, one multiply, torch's rounding to bf16), so
its weights are bit for bit the torch form's (tests/test_dequant.py).

`scaled` returns None where it does not apply, and the caller then runs the torch form: the library is not available
(native.py: no compiler, not x86-64 with AVX2, MTP_NATIVE=0), the codes are not a CPU tensor of 8-bit codes, or the
output is neither bf16 nor fp32.
"""

from __future__ import annotations

import ctypes

import torch

from . import qmatmul
from .native import AVX512_VNNI, NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.scaled_decode.argtypes = [i64, i64, p, i32, p, p, i64, i64, i64, i32, p, p, i32, i32, p]
    lib.scaled_decode.restype = ctypes.c_int
    lib.int4_words_pack.argtypes = [i64, i64, p, i64, i64, p, i32]
    lib.awq_int4_pack.argtypes = [i64, i64, p, p, i32]
    lib.int4_words_pack.restype = lib.awq_int4_pack.restype = None
    lib.count_nonfinite.argtypes = [p, i64, i32, ctypes.c_uint32, i32]
    lib.count_nonfinite.restype = i64


LIBRARY = NativeLibrary("dequant.c", None, "decoding scaled codes runs in torch ops", _declare, isas=(AVX512_VNNI,))
KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}  # the codes dequant.c's decode8 takes
_tables: dict[torch.dtype, torch.Tensor] = {}


def _table(dtype: torch.dtype) -> torch.Tensor:
    """Every 8-bit pattern of `dtype` as torch converts it to fp32 [256] (index: the pattern as a byte)."""
    if dtype not in _tables:
        _tables[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float().contiguous()
    return _tables[dtype]


def _tiles(scale: torch.Tensor, N: int, K: int, block: tuple[int, int] | None) -> tuple[torch.Tensor, int, int, int]:
    """One matrix's scale (one of `quantized.expected_scale_shapes` less the lead dims) -> (fp32 scales, b0, b1,
    row stride): row n, column k takes scales[(n // b0) * stride + k // b1]."""
    s = scale.float().contiguous()
    if block is not None:
        return s, block[0], block[1], s.shape[-1]
    if s.numel() == 1:
        return s.reshape(1), N, K, 1
    return s.reshape(N), 1, K, 1


def _by_matrix(scale: torch.Tensor, E: int, N: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A scale for E matrices of N rows (`quantized.expected_scale_shapes`) -> fp32, one entry per matrix: [E, tiles
    down, tiles across] for blocks, else [E, N] per row or [E, 1] per matrix (per tensor: the one value for each)."""
    s = scale.float()
    if block is not None:
        return s.reshape(E, *s.shape[-2:])
    if s.numel() == 1:
        return s.reshape(1, 1).expand(E, 1)
    if s.numel() == E * N:
        return s.reshape(E, N)
    return s.reshape(E, 1)  # one per expert


def scaled(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`packed.dequantize_scaled(w, scale, block, dtype)` in C, or None (module docstring). w [..., N, K] 8-bit codes;
    scale as `quantized.expected_scale_shapes` allows for w's shape."""
    decoded = scaled_counted(w, scale, block, dtype)
    return None if decoded is None else decoded[0]


# float dtype -> (bytes an element, its exponent's bits) for `count_nonfinite`
EXPONENTS = {torch.bfloat16: (2, 0x7F80), torch.float16: (2, 0x7C00), torch.float32: (4, 0x7F800000)}


def count_nonfinite(t: torch.Tensor) -> int | None:
    """How many elements of t (a contiguous bf16 / fp16 / fp32 CPU tensor) are NaN or +-Inf, in C (dequant.c); or
    None (another dtype, layout or device, or no native library)."""
    if t.device.type != "cpu" or t.dtype not in EXPONENTS or not t.is_contiguous() or not LIBRARY.available():
        return None
    width, exponent = EXPONENTS[t.dtype]
    return int(LIBRARY.lib().count_nonfinite(t.data_ptr(), t.numel(), width, exponent, torch.get_num_threads()))


@torch.no_grad()
def scaled_counted(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
    """`scaled`, and how many of the weights it gives are NaN or +-Inf (counted as they are written: what the loader's
    check would count by reading them again), or None. `out`: a contiguous `dtype` tensor of w's shape to decode
    into (a load's reused scratch) instead of a new one."""
    if (w.device.type != "cpu" or w.dtype not in KINDS or w.dim() < 2 or dtype not in (torch.bfloat16, torch.float32)
            or not LIBRARY.available()):
        return None
    *lead, N, K = w.shape
    E = 1
    for d in lead:
        E *= d
    codes = w.contiguous().view(torch.uint8).reshape(E, N, K)
    s = _by_matrix(scale, E, N, block)
    out = qmatmul.out_tensor(out, tuple(w.shape), dtype, "scaled_counted").view(E, N, K)
    if out.numel() == 0:
        return out.reshape(w.shape), 0
    bad = torch.empty(E, N, dtype=torch.int64)
    lut, lib, threads = _table(w.dtype), LIBRARY.lib(), torch.get_num_threads()
    for e in range(E):
        t, b0, b1, stride = _tiles(s[e], N, K, block)
        lib.scaled_decode(N, K, codes[e].data_ptr(), KINDS[w.dtype], lut.data_ptr(), t.data_ptr(), b0, b1, stride,
                          int(dtype == torch.bfloat16), out[e].data_ptr(), bad[e].data_ptr(), 0, threads, None)
    return out.reshape(w.shape), int(bad.sum())


@torch.no_grad()
def scaled_packed(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, out: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, int] | None:
    """`qmatmul.pack_bf16(scaled(w, scale, block, torch.bfloat16), out)` in one pass, with no [N, K] weight between
    (what a load that runs the weight on qmatmul's bf16 product keeps), and its NaN / Inf count as `scaled_counted`
    gives it; or None (module docstring; also for stacked codes). w [N, K] 8-bit codes; scale as for `scaled`."""
    if w.device.type != "cpu" or w.dtype not in KINDS or w.dim() != 2 or not LIBRARY.available():
        return None
    N, K = w.shape
    t, b0, b1, stride = _tiles(_by_matrix(scale, 1, N, block)[0], N, K, block)
    return _packed(w.contiguous().view(torch.uint8), N, K, KINDS[w.dtype], _table(w.dtype), t, b0, b1, stride, out,
                   "scaled_packed")


@torch.no_grad()
def pack_bf16_counted(w: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int | None]:
    """`qmatmul.pack_bf16(w, out)`, and how many of w's values are NaN or +-Inf (counted as they are moved; None where
    the torch form packed them). bf16 weight [N, K]. In C (scaled_decode's packing, the rows copied as they are) where
    it can: torch's permuted copy took ~1 s of loading a bf16 checkpoint of the Qwen3.5-0.8B shape
    (docs/decisions.md, 2026-12-07 fourteenth session)."""
    if w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2 and LIBRARY.available():
        got = _packed(w.contiguous(), *w.shape, 5, None, None, 1, 1, 0, out, "pack_bf16_counted")
        if got is not None:
            return got
    return qmatmul.pack_bf16(w, out), None


def _packed(codes: torch.Tensor, N: int, K: int, kind: int, lut: torch.Tensor | None, tiles: torch.Tensor | None,
            b0: int, b1: int, stride: int, out: torch.Tensor | None, what: str, zero: torch.Tensor | None = None,
            packed: bool = True) -> tuple[torch.Tensor, int] | None:
    """scaled_decode of the codes of an [N, K] weight (`kind`, its table, scale tiles and zero points) into qmatmul's
    bf16 packing (`packed`; None where qmatmul does not run) or an [N, K] bf16 weight, and the NaN / Inf count."""
    if packed and not qmatmul.available():
        return None
    group = qmatmul.bf16_group() if packed else 0
    out = qmatmul.out_tensor(out, qmatmul.bf16_packed_shape(N, K) if packed else (N, K), torch.bfloat16, what)
    if N == 0 or K == 0:
        return out.zero_(), 0
    bad = torch.empty(N, dtype=torch.int64)
    if LIBRARY.lib().scaled_decode(N, K, codes.data_ptr(), kind, None if lut is None else lut.data_ptr(),
                                   None if tiles is None else tiles.data_ptr(), b0, b1, stride, 1, out.data_ptr(),
                                   bad.data_ptr(), group, torch.get_num_threads(), None if zero is None else zero.data_ptr()):
        raise MemoryError(f"{what}: no memory for a scratch block of {group} rows x {K} inputs")
    return out, int(bad.sum())


# Integer codes packed in int32 words as releases store them, by layout: (scaled_decode's kind by bits, the words'
# shape for an [N, K] weight, the strides of int4_words_pack: between an output's consecutive words and between two
# outputs' words). GPTQ's qweight: input i of output n in bits (i % p) * bits of word (i / p, n), p = 32 / bits;
# compressed-tensors' pack-quantized weight_packed: the same bits of word (n, i / p); AWQ's GEMM qweight [K, N/8]
# (4-bit): output 8c+j of input k in nibble AWQ_REVERSE[j] of word (k, c).
WORDS = {"gptq": ({4: 4, 8: 8}, lambda N, K, p: (K // p, N), lambda N, K: (N, 1)),
         "ct": ({4: 7, 8: 9}, lambda N, K, p: (N, K // p), lambda N, K: (1, K // 8)),
         "awq": ({4: 6}, lambda N, K, p: (K, N // 8), None)}


@torch.no_grad()
def words_bf16(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, layout: str, bits: int = 4,
               out: torch.Tensor | None = None, packed: bool = True) -> tuple[torch.Tensor, int] | None:
    """A release's 4- or 8-bit words read in place (`WORDS[layout]`), scale float [N, K/group] and zero points
    [N, K/group] -> the weight (q - zero) * scale (fp32, then bf16: `packed.dequantize_codes`) in qmatmul's bf16
    packing (`packed`: `qmatmul.pack_bf16` of it) or as an [N, K] bf16 weight, into `out` when given, in one pass with
    no other [N, K] weight between, and its NaN / Inf count; or None: a group or N that is not a multiple of 8, a
    layout / width it does not read, or the libraries not available. What a GPTQ / AWQ / compressed-tensors release
    decoded to bf16 (`--quantize none`) keeps, or a quantizing load decodes into its scratch. (Moving 4-bit words to
    the q4 kernel's layout first cost a pass over fresh pages, ~0.1 s of a 0.8B-shape GPTQ load; the torch decoders
    took 2-5 s of GPTQ 8-bit and compressed-tensors int4 loads, docs/decisions.md, 2026-12-07 fifteenth session.)"""
    N, K = scale.shape[0], scale.shape[1] * group
    kinds, shape, _ = WORDS[layout]
    if (bits not in kinds or group % 8 or N % 8 or not LIBRARY.available() or words.device.type != "cpu"
            or words.dtype != torch.int32 or tuple(words.shape) != shape(N, K, 32 // bits)):
        return None
    scale = scale.float().contiguous()
    return _packed(words.contiguous(), N, K, kinds[bits], None, scale, 1, group, scale.shape[1], out, "words_bf16",
                   zero.to(torch.uint8).contiguous(), packed)


@torch.no_grad()
def int4_words_packed(words: torch.Tensor, N: int, K: int, layout: str) -> torch.Tensor | None:
    """A release's 4-bit words of 8 inputs (`WORDS`: GPTQ's qweight int32 [K/8, N], compressed-tensors' weight_packed
    [N, K/8]; AWQ's: `awq_int4_packed`) -> the q4 kernel's codes in `qmatmul.pack_int4`'s layout, uint8
    [ceil(N/8), 4K] (outputs past N zero codes): one pass over the words, each a permutation of its nibbles, where
    unpacking to one code a byte and packing again took two (~1 s of a 0.8B-shape GPTQ int4 load). Bit for bit
    `qmatmul.pack_int4` of the codes; None where the library is not available, or K is not a multiple of 8."""
    _, shape, strides = WORDS[layout]
    if (layout == "awq" or words.device.type != "cpu" or words.dtype != torch.int32 or K % 8
            or tuple(words.shape) != shape(N, K, 8) or not LIBRARY.available()):
        return None
    R = K // 8
    out = torch.empty(-(-N // 8), R, 8, dtype=torch.int32)
    if out.numel():
        LIBRARY.lib().int4_words_pack(R, N, words.contiguous().data_ptr(), *strides(N, K), out.data_ptr(),
                                      torch.get_num_threads())
    return out.view(torch.uint8).reshape(out.shape[0], R * 32)


@torch.no_grad()
def awq_int4_packed(qweight: torch.Tensor) -> torch.Tensor | None:
    """AWQ's GEMM 4-bit words qweight int32 [K, N/8] (8 outputs of one input a word, in AWQ's order) -> the q4
    kernel's codes in `qmatmul.pack_int4`'s layout, uint8 [N/8, 4K] (K % 8 == 0): one pass over the words, an 8 x 8
    transpose of nibbles each, where unpacking to one code a byte, transposing and packing again took ~2 s of a
    0.8B-shape AWQ int4 load. Bit for bit `qmatmul.pack_int4` of the codes; None where the library is not available."""
    if (qweight.device.type != "cpu" or qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] % 8
            or not LIBRARY.available()):
        return None
    K, C = qweight.shape
    words = qweight.contiguous()
    out = torch.empty(C, K // 8, 8, dtype=torch.int32)
    if out.numel():
        LIBRARY.lib().awq_int4_pack(K, C, words.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out.view(torch.uint8).reshape(C, K * 4)
