"""Quantized weights' codes -> the float weight they stand for (GPTQ and AWQ int32 packings; scaled fp8 / int8 codes;
int codes in groups).

Both store, for a linear layer with weight [N out, K in], `qweight` (codes), `qzeros` (zero points, packed), and
`scales` [G, N] (G groups of `group` inputs; fp16 as released), with w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n].

- GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K * bits / 32, N], 32 / bits codes per word along the inputs (input
  k is word k // (32 / bits), bits (k % (32 / bits)) * bits); qzeros int32 [G, N * bits / 32] packed the same way
  along the outputs; g(k) = g_idx[k] when the checkpoint has `g_idx` (act order: desc_act), else k // group. The
  v1 format (checkpoint_format "gptq", the common one) stores z - 1: `zero_offset` 1 adds it back.
- AWQ (GEMM): qweight int32 [K, N / 8] and qzeros int32 [G, N / 8], 8 codes per word along the outputs in AWQ's
  interleaved order: nibble i of word c holds output 8c + AWQ_ORDER[i]; g(k) = k // group.

`dequantize_scaled` decodes codes with one scale per tensor, output row or [b0, b1] tile (fp8 and symmetric int8
checkpoints; model/quantized.py); `dequantize_codes` is the GPTQ formula in the [N, K] layout (codes and one scale /
zero point per group of inputs of each output row), which compressed-tensors stores and `linear.Int4Weight` holds.

The packers are the exact inverses (tests build checkpoints with them; a writer of such checkpoints would too).
"""

from __future__ import annotations

import math
import sys

import torch

from . import dequant

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the scale dtypes the formats store
ROWS = 128  # rows `dequantize_scaled` decodes at a time

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output AWQ_ORDER[i] of its eight
AWQ_REVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))  # output c of a word's eight is nibble AWQ_REVERSE[c]


def int4_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [R, C] of eight 4-bit codes -> uint8 [R, C, 8], code i of a word at bits 4i..4i+3 (what
    `unpack_rows` / `unpack_cols` read), computed on the bytes: a quarter of the int32 unpacking's memory traffic."""
    if sys.byteorder != "little":  # byte j of a word holds codes 2j, 2j + 1 only in little-endian order
        return unpack_cols(words.reshape(-1, 1), 4).reshape(*words.shape, 8).to(torch.uint8)
    # (flattened first: a contiguous [R, 1] may keep a stride that a view as bytes refuses)
    b = words.contiguous().reshape(-1).view(torch.uint8).view(*words.shape, 4)
    return torch.stack([b & 15, b >> 4], dim=-1).view(*words.shape, 8)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 / bits codes per word along dim 0 -> int32 codes [R * 32 / bits, C] in 0..2^bits - 1."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 / bits codes per word along dim 1 -> int32 codes [R, C * 32 / bits] (contiguous)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack_rows`: codes [R, C] (R a multiple of 32 / bits) -> int32 [R * bits / 32, C]."""
    per = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0] // per, per, codes.shape[1])
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (c << shifts[None, :, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, as int32


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_rows(codes.t().contiguous(), bits).t().contiguous()


def act_order(g_idx: torch.Tensor | None, K: int, group: int) -> bool:
    """Does an act-order index g_idx [K] (GPTQ's g_idx, compressed-tensors' weight_g_idx; None: none stored) put the
    inputs in groups other than consecutive runs of `group`?"""
    return g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // group)


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group: int | None, zero_offset: int, dtype: torch.dtype) -> torch.Tensor:
    """GPTQ tensors (module docstring) -> the float weight [N, K] in `dtype`, computed in fp32."""
    q = unpack_rows(qweight, bits)  # [K, N]
    K = q.shape[0]
    # v1 stores z - 1 in `bits` bits (z = 0 wraps to 2^bits - 1): add the offset back within the same bits
    z = (unpack_cols(qzeros, bits)[:, : q.shape[1]] + zero_offset) & ((1 << bits) - 1)  # [G, N]
    if g_idx is None and K % (group or K) == 0:  # groups are contiguous runs of inputs: broadcast, no gather
        G = z.shape[0]
        w = (q.view(G, K // G, -1).float() - z[:, None].float()).mul_(scales.float()[:, None]).view(K, -1)
    else:
        g = g_idx.long() if g_idx is not None else torch.arange(K) // (group or K)
        w = (q.float() - z[g].float()).mul_(scales.float()[g])
    return w.t().to(dtype).contiguous()


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """AWQ GEMM tensors (module docstring) -> the float weight [N, K] in `dtype`, computed in fp32."""
    q = _awq_unorder(unpack_cols(qweight, 4))  # [K, N]
    z = _awq_unorder(unpack_cols(qzeros, 4))  # [G, N]
    K, G = q.shape[0], z.shape[0]
    if K % group == 0:
        w = (q.view(G, group, -1).float() - z[:, None].float()).mul_(scales.float()[:, None]).view(K, -1)
    else:
        g = torch.arange(K) // group
        w = (q.float() - z[g].float()).mul_(scales.float()[g])
    return w.t().to(dtype).contiguous()


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                     dtype: torch.dtype, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Integer codes [N, K] with a scale and zero point per group of `group` inputs (scale float [N, K / group], zero
    int [N, K / group], None: 0) -> the weight [N, K] in `dtype`, w[n, perm[j]] = (codes[n, j] - zero) * scale
    computed in fp32 (perm None: the identity; act-order weights store their inputs permuted, groups contiguous)."""
    N, K = codes.shape
    q = codes.float().view(N, K // group, group)
    if zero is not None:
        q = q - zero.float()[..., None]
    w = q.mul_(scale.float()[..., None]).view(N, K)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(1, perm, w)
    return w.to(dtype)


def _awq_unorder(codes: torch.Tensor) -> torch.Tensor:
    R, C = codes.shape
    return codes.reshape(R, C // 8, 8)[..., list(AWQ_REVERSE)].reshape(R, C)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [R, C] (outputs along dim 1) -> AWQ's int32 [R, C / 8] (the inverse of the unpacking above)."""
    R, C = codes.shape
    return pack_cols(codes.reshape(R, C // 8, 8)[..., list(AWQ_ORDER)].reshape(R, C), 4)


def dequantize_scaled(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Codes w [..., N, K] (float8, or symmetric int8) and their scale (see `quantized.expected_scale_shapes`) -> w * scale in
    `dtype` [..., N, K], computed in fp32 (exactly (q.float() * s.float()).to(dtype)), ROWS rows at a time; in one C
    pass where it can (`dequant.scaled`: the same bits)."""
    fast = dequant.scaled(w, scale, block, dtype)
    if fast is not None:
        return fast
    *lead, N, K = w.shape
    s = scale.float()
    if block is None:  # per tensor / per channel / per expert: a multiplier per row, broadcast over the columns
        per_row = s.numel() == math.prod(lead) * N
        s = s.reshape(1, 1) if s.numel() == 1 else s.reshape(*lead, N, 1) if per_row else s.reshape(*lead, 1, 1)
    out = torch.empty(w.shape, dtype=dtype)
    b0, b1 = block if block is not None else (ROWS, K)
    step = b0 * max(1, ROWS // b0)  # whole tiles of rows
    for r in range(0, N, step):
        rows = w[..., r : r + step, :].float()
        if block is None:
            rows.mul_(s[..., r : r + step, :] if s.shape[-2] == N else s)
        else:  # the tiles' scales of these rows, broadcast over each tile's columns (a view: no weight-sized copy)
            sr = s[..., r // b0 : -(-(r + rows.shape[-2]) // b0), :].repeat_interleave(b0, -2)[..., : rows.shape[-2], :]
            full = K // b1
            rows[..., : full * b1].unflatten(-1, (full, b1)).mul_(sr[..., :full, None])
            if full * b1 < K:  # the last, partial tile
                rows[..., full * b1 :].mul_(sr[..., full:])
        out[..., r : r + step, :] = rows.to(dtype)
    return out
