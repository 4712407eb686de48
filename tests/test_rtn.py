"""The C round-to-nearest quantizers (model/rtn.c) give bit for bit the codes, scales and zero points of the torch
form they replace (`linear._quantize_int4_torch`, `linear._quantize_int8_torch`, and qmatmul's packing of the
former), on random weights, awkward shapes and edge values; rows holding NaN / Inf go to the torch form."""

from __future__ import annotations

import pytest
import torch

from mtp.model import linear, rtn
from mtp.model.linear import QUANT_ROWS, Int4Weight, _native_int4, _quantize_int4_torch, _quantize_int8_torch

pytestmark = pytest.mark.skipif(not rtn.LIBRARY.available(), reason=f"rtn.c unavailable: {rtn.LIBRARY.reason()}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bits (-0.0 and 0.0 differ; NaN equals the same NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def weight(N: int, K: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random weight with the awkward cases in it: groups all zero, all positive, all negative, constant, tiny
    (subnormal), huge (the range overflows fp32), ties of the rounding, and an outlier per row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 0.05
    w[:, 0] = 1.0 + torch.rand(N, generator=g)  # an outlier in every row
    if K >= 128 and N >= 8:
        w[0, :32] = 0.0
        w[1, :64] = w[1, :64].abs()
        w[2, :64] = -w[2, :64].abs()
        w[3, :128] = 0.375
        w[4, :32] = 1e-40  # subnormal in fp32 (bf16 keeps it)
        w[5, :32], w[5, 31] = 3.0e38, -3.0e38  # hi - lo overflows to inf
        w[6, :32] = torch.arange(32) * 0.5 - 8  # halves: round-half-even ties
        w[7, :64] = -0.0
    return w.to(dtype)


SHAPES = [(1, 32), (3, 96), (17, 128), (16, 1024), (64, 384), (40, 4096 + 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_codes_are_the_torch_forms(dtype, shape, group, symmetric):
    w = weight(*shape, dtype, seed=shape[0] + group)
    if shape[1] % group:
        assert rtn.quantize_int4(w, group, symmetric) is None
        return
    ref = _quantize_int4_torch(w, group, symmetric)
    got = Int4Weight.quantize(w, group, symmetric)
    assert rtn.quantize_int4(w, group, symmetric) is not None
    assert same_bits(got.codes, ref.codes) and same_bits(got.scale, ref.scale) and same_bits(got.zero, ref.zero)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES + [(5, 7), (2, 33), (9, 1000)])
def test_int8_codes_are_the_torch_forms(dtype, shape):
    w = weight(*shape, dtype, seed=shape[1])
    ref = _quantize_int8_torch(w)
    got = linear.quantize_int8(w)
    assert rtn.quantize_int8(w) is not None
    assert same_bits(got[0], ref[0]) and same_bits(got[1], ref[1])


def packed_int8_reference(w: torch.Tensor, in_padded: int, flip: bool) -> torch.Tensor:
    """The torch form's codes, padded to `in_padded` inputs, in `qmatmul.pack_int8`'s layout (+ 128 where `flip`)."""
    codes = torch.nn.functional.pad(_quantize_int8_torch(w)[0], (0, in_padded - w.shape[1]))
    N, K = codes.shape
    codes = torch.nn.functional.pad(codes, (0, 0, 0, -N % 8)).view(-1, 8, K // 4, 4).permute(0, 2, 1, 3)
    return (codes.to(torch.int16) + (128 if flip else 0)).to(torch.uint8).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES + [(5, 7), (2, 33), (9, 1000)])
@pytest.mark.parametrize("flip", [False, True])
def test_int8_codes_straight_into_the_kernels_layout(dtype, shape, flip):
    """`quantize_int8_packed` == the torch form's codes padded and interleaved by groups of 8 rows (rows past N and
    inputs past K zero codes), its scales the torch form's; into a given buffer too."""
    w = weight(*shape, dtype, seed=shape[0] * 7 + shape[1])
    in_padded = -(-shape[1] // 32) * 32 + (32 if shape[0] == 5 else 0)  # (a whole block of pad inputs once)
    packed, scale = rtn.quantize_int8_packed(w, in_padded, flip)
    assert same_bits(packed, packed_int8_reference(w, in_padded, flip))
    assert same_bits(scale, _quantize_int8_torch(w)[1])
    out = torch.full_like(packed, 7)
    assert rtn.quantize_int8_packed(w, in_padded, flip, out)[0] is out and same_bits(out, packed)
    with pytest.raises(ValueError, match="quantize_int8_packed: out must be a contiguous torch.uint8"):
        rtn.quantize_int8_packed(w, in_padded, flip, out[:, :0])
    assert rtn.quantize_int8_packed(w, -(-shape[1] // 32) * 32 - 32, flip) is None  # fewer inputs than the weight's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 32), (16, 96), (24, 160), (64, 384), (40, 4096 + 128)])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_codes_straight_into_the_kernels_operands(dtype, shape, group, symmetric):
    """`quantize_int4_packed` == the torch form's Int4Weight as the q4 kernel's operands (`_native_int4`: the codes
    packed, scales and offsets interleaved by groups of 8 rows), bit for bit, K an odd number of 32-input halves too."""
    w = weight(*shape, dtype, seed=shape[1] + group)
    got = rtn.quantize_int4_packed(w, group, symmetric)
    if shape[1] % group:
        assert got is None
        return
    want = _native_int4(_quantize_int4_torch(w, group, symmetric))
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert rtn.quantize_int4_packed(w[:-1], group, symmetric) is None  # (rows not a whole number of 8s)


def test_many_rows_and_a_strided_view_are_the_torch_forms():
    """More rows than the torch form's chunk (QUANT_ROWS), and a row-strided view (a slice of a wider matrix)."""
    w = weight(QUANT_ROWS + 37, 64, torch.bfloat16, seed=3)
    ref4, got4 = _quantize_int4_torch(w, 32, False), Int4Weight.quantize(w, 32)
    assert same_bits(got4.codes, ref4.codes) and same_bits(got4.scale, ref4.scale) and same_bits(got4.zero, ref4.zero)
    assert all(same_bits(a, b) for a, b in zip(linear.quantize_int8(w), _quantize_int8_torch(w)))
    view = weight(48, 512, torch.bfloat16, seed=4)[:, 128:384]
    assert view.stride(0) == 512
    ref, got = _quantize_int4_torch(view, 128, False), Int4Weight.quantize(view, 128)
    assert same_bits(got.codes, ref.codes) and same_bits(got.scale, ref.scale)
    assert all(same_bits(a, b) for a, b in zip(linear.quantize_int8(view), _quantize_int8_torch(view)))
    assert same_bits(rtn.quantize_int8_packed(view, 256, False)[0], packed_int8_reference(view, 256, False))
    assert all(same_bits(a, b) for a, b in zip(rtn.quantize_int4_packed(view, 128), _native_int4(ref)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_take_the_torch_form(bad):
    w = weight(32, 256, torch.bfloat16, seed=5)
    w[9, 200] = bad
    assert rtn.quantize_int4(w, 128) is None and rtn.quantize_int8(w) is None
    assert rtn.quantize_int8_packed(w, 256, True) is None and rtn.quantize_int4_packed(w, 128) is None
    ref, got = _quantize_int4_torch(w, 128, False), Int4Weight.quantize(w, 128)
    assert same_bits(got.codes, ref.codes) and same_bits(got.scale, ref.scale) and same_bits(got.zero, ref.zero)
    ref8, got8 = _quantize_int8_torch(w), linear.quantize_int8(w)
    assert same_bits(got8[0], ref8[0]) and same_bits(got8[1], ref8[1])


def test_threads_do_not_change_a_bit():
    w = weight(4096, 1024, torch.bfloat16, seed=6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (rtn.quantize_int4(w, 128), rtn.quantize_int8(w), rtn.quantize_int8_packed(w, 1024, True),
               rtn.quantize_int4_packed(w, 128))
        torch.set_num_threads(2)
        two = (rtn.quantize_int4(w, 128), rtn.quantize_int8(w), rtn.quantize_int8_packed(w, 1024, True),
               rtn.quantize_int4_packed(w, 128))
    finally:
        torch.set_num_threads(before)
    assert all(same_bits(a, b) for x, y in zip(one, two) for a, b in zip(x, y))


def test_a_layer_prepared_for_int4_holds_the_torch_forms_operands():
    """FastLinear.prepare("int4") on the qmatmul kernel (the load path) == the torch form's codes packed, at more rows
    than a chunk of the row-chunked preparation."""
    lin = torch.nn.Linear(256, QUANT_ROWS + 48, bias=False).to(torch.bfloat16)
    layer = linear.FastLinear.wrap(lin, "int4")
    if not layer._native:
        pytest.skip("the qmatmul kernels are not available here")
    want = _native_int4(_quantize_int4_torch(lin.weight.detach(), 128, False))
    assert same_bits(layer._packed, want[0]) and same_bits(layer._sz, want[1]) and same_bits(layer._low, want[2])
