"""The C decode of scaled 8-bit codes (model/dequant.c) gives bit for bit the weights of the torch form it replaces
(`packed.dequantize_scaled`'s chunked fp32 passes): every bit pattern of float8 e4m3fn / e5m2 and int8, every scale
layout a checkpoint may store (128x128 tiles with partial tiles, per output channel, per tensor, per expert), scales in
fp32 / bf16 / fp16 down to subnormal products, bf16 and fp32 outputs, one and two threads; and decoded straight into
qmatmul's bf16 packing, the packing of that decode."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp
from conftest import tiny_model
from mtp.model import dequant, packed, qmatmul
from mtp.model.checkpoint import NonFiniteWeightsWarning, non_finite
from test_quantized import release_fp8

pytestmark = pytest.mark.skipif(not dequant.LIBRARY.available(), reason=f"dequant.c unavailable: {dequant.LIBRARY.reason()}")

CODES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
# (weight shape, weight_block_size, scale shape): the layouts `quantized.expected_scale_shapes` allows
LAYOUTS = [
    ((300, 520), (128, 128), (3, 5)),  # partial tiles both ways
    ((256, 384), (128, 128), (2, 3)),
    ((4, 130, 260), (128, 128), (4, 2, 3)),  # stacked experts
    ((7, 13), (4, 4), (2, 4)),  # tiles narrower than a vector
    ((64, 96), None, ()),
    ((64, 96), None, (1,)),
    ((64, 96), None, (64, 1)),
    ((64, 96), None, (64,)),
    ((3, 64, 96), None, (3, 64, 1)),
    ((3, 64, 96), None, (3, 1, 1)),
    ((3, 64, 96), None, (3,)),
    ((1, 7), None, ()),
]


def torch_form(w, scale, block, dtype):
    """`packed.dequantize_scaled` with the C pass turned off."""
    orig = dequant.scaled
    dequant.scaled = lambda *a: None
    try:
        return packed.dequantize_scaled(w, scale, block, dtype)
    finally:
        dequant.scaled = orig


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bits (-0.0 and 0.0 differ), NaN where the other has NaN (torch writes every NaN as one
    bf16 pattern; the C rounding keeps its sign and payload: a NaN weight is refused or warned about by NaN-ness)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    bits = torch.int16 if a.dtype.itemsize == 2 else torch.int32
    return torch.equal(a[keep].view(bits), b[keep].view(bits))


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_decode_is_the_torch_forms(code, layout):
    shape, block, sshape = layout
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    w = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(code)
    for sdt in (torch.float32, torch.bfloat16, torch.float16):
        # magnitudes from 1e-40 (subnormal products) to 1e4
        s = (torch.rand(sshape, generator=g) * 10.0 ** torch.randint(-40, 5, sshape, generator=g).float()).to(sdt)
        for out in (torch.bfloat16, torch.float32):
            fast, n = dequant.scaled_counted(w, s, block, out)
            assert same_bits(fast, torch_form(w, s, block, out)), (sdt, out)
            assert n == int((~torch.isfinite(fast)).sum()), (sdt, out)  # the count the loader's check would make
            assert same_bits(packed.dequantize_scaled(w, s, block, out), fast)


def test_every_code_decodes_as_torch_converts_it():
    """All 256 patterns of each format in one row, scale 1: the table is torch's own conversion, NaN included."""
    for code in CODES:
        w = torch.arange(256, dtype=torch.uint8).view(code).reshape(1, 256)
        fast = dequant.scaled(w, torch.ones(()), None, torch.float32)
        assert same_bits(fast, w.float())


def test_threads_do_not_change_a_bit():
    g = torch.Generator().manual_seed(1)
    w = torch.randint(0, 256, (1024, 1280), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)  # >= 2**20 codes
    s = torch.rand(8, 10, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dequant.scaled(w, s, (128, 128), torch.bfloat16)
        torch.set_num_threads(2)
        two = dequant.scaled(w, s, (128, 128), torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    assert same_bits(one, two) and same_bits(one, torch_form(w, s, (128, 128), torch.bfloat16))


def test_what_the_c_pass_does_not_take_goes_to_the_torch_form():
    w = torch.randint(0, 256, (16, 32), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(16)
    assert dequant.scaled(w, s, None, torch.float16) is None  # fp16 output
    assert dequant.scaled(w.float(), s, None, torch.bfloat16) is None  # not codes
    assert same_bits(packed.dequantize_scaled(w, s, None, torch.float16), torch_form(w, s, None, torch.float16))


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if len(lay[0]) == 2], ids=str)
def test_a_packed_decode_is_the_packing_of_the_decode(monkeypatch, group, layout):
    """`scaled_packed` (a released FP8 load's decode) is `pack_bf16` of `scaled_counted`'s bf16 weight in both of the
    packing's layouts, bit for bit, NaN codes and the pads (zeros, whatever `out` held) included, with the same count,
    into a new buffer or a given one, at one and two threads."""
    if not qmatmul.available():
        pytest.skip(f"the qmatmul kernels do not run here: {qmatmul.reason()}")
    monkeypatch.setattr(qmatmul, "bf16_group", lambda: group)
    shape, block, sshape = layout
    g = torch.Generator().manual_seed(shape[-1] + group)
    s = torch.rand(sshape, generator=g) * 4
    threads = torch.get_num_threads()
    for code in CODES:
        w = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(code)
        decoded, n = dequant.scaled_counted(w, s, block, torch.bfloat16)
        want = qmatmul.pack_bf16(decoded).view(torch.int16)
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                fresh, n1 = dequant.scaled_packed(w, s, block)
                given = torch.full(want.shape, -1, dtype=torch.int16).view(torch.bfloat16)  # NaN bits everywhere
                into, n2 = dequant.scaled_packed(w, s, block, given)
                assert into is given and n1 == n2 == n, (code, t)
                assert torch.equal(fresh.view(torch.int16), want) and torch.equal(into.view(torch.int16), want), (code, t)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("N, K", [(16, 64), (17, 33), (1, 2), (3, 1), (40, 384), (9, 70)])
def test_a_bf16_weight_packs_in_c_as_in_torch(monkeypatch, group, N, K):
    """`dequant.pack_bf16_counted` (a bf16 load's packing) is `qmatmul.pack_bf16` bit for bit in both layouts, pads included
    (zeros, whatever `out` held), NaN and infinities moved as they are and counted, at one and two threads."""
    if not qmatmul.available():
        pytest.skip(f"the qmatmul kernels do not run here: {qmatmul.reason()}")
    monkeypatch.setattr(qmatmul, "bf16_group", lambda: group)
    g = torch.Generator().manual_seed(N * K + group)
    w = torch.randn(N, K, generator=g).bfloat16()
    bad = torch.randperm(N * K, generator=g)[: min(5, N * K)]
    w.view(-1)[bad] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), 1.0])[: bad.numel()].bfloat16()
    want, count = qmatmul.pack_bf16(w).view(torch.int16), int((~torch.isfinite(w)).sum())
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            fresh, n1 = dequant.pack_bf16_counted(w)
            given = torch.full(want.shape, -1, dtype=torch.int16).view(torch.bfloat16)
            into, n2 = dequant.pack_bf16_counted(w, given)
            assert into is given and n1 == n2 == count
            assert torch.equal(fresh.view(torch.int16), want) and torch.equal(into.view(torch.int16), want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_values_are_counted_in_c(dtype):
    """`dequant.count_nonfinite` (the loader's check of the weights it keeps as stored) counts NaN and +-Inf as
    `isfinite` does, across its blocks and vector tails and at one and two threads; the loader's `non_finite` gives
    the same count with the C pass or without it."""
    g = torch.Generator().manual_seed(7)
    threads = torch.get_num_threads()
    try:
        for n in (0, 1, 15, 33, 1000, (1 << 16) + 17, (1 << 22) + 5):
            x = torch.randn(n, generator=g).to(dtype)
            if n:
                at = torch.randint(0, n, (min(n, 40),), generator=g)
                x[at] = torch.tensor([float("nan"), float("inf"), -float("inf"), 2.0]).to(dtype)[torch.arange(at.numel()) % 4]
            want = int((~torch.isfinite(x)).sum())
            for t in (1, 2):
                torch.set_num_threads(t)
                assert dequant.count_nonfinite(x) == want, (n, t)
            assert non_finite(x) == want
    finally:
        torch.set_num_threads(threads)
    assert dequant.count_nonfinite(torch.ones(4, 4).t()) is None  # not contiguous: the torch form counts it
    assert non_finite(torch.tensor([[1.0, float("nan")], [2.0, 3.0]]).t()) == 1


@pytest.mark.parametrize("R, N", [(16, 64), (4, 24), (6, 13), (2, 17), (3, 1), (1, 7), (9, 16)])
def test_gptq_and_ct_words_go_straight_to_the_q4_kernels_layout(R, N):
    """`int4_words_packed` of GPTQ's words [K/8, N] (input 8r+i of output n in nibble i of word (r, n)) and of
    compressed-tensors' pack-quantized ones [N, K/8] (the same nibbles of word (n, r)) is `qmatmul.pack_int4` of the
    codes those words hold, every bit pattern of the words, zero codes past N; and `gptq_int4` / the compressed-tensors
    `int4_weight` give the same Int4Weight as from the unpacked codes (`codes` unpacks them on demand)."""
    from mtp.config.compressed_tensors import Scheme
    from mtp.model.compressed_tensors import int4_weight
    from mtp.model.packed import int4_nibbles
    from mtp.model.quantized import gptq_int4

    g = torch.Generator().manual_seed(R * 100 + N)
    words = torch.randint(-(2**31), 2**31 - 1, (R, N), generator=g, dtype=torch.int64).to(torch.int32)
    codes = torch.stack([(words.t().long() >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(N, R * 8).to(torch.uint8)
    assert torch.equal(dequant.int4_words_packed(words, N, R * 8, "gptq"), qmatmul.pack_int4(codes))
    assert torch.equal(dequant.int4_words_packed(words.t().contiguous(), N, R * 8, "ct"), qmatmul.pack_int4(codes))
    assert dequant.int4_words_packed(words, N, R * 8, "ct") is None or R == N  # (the other layout's shape: refused)
    zeros = torch.randint(-(2**31), 2**31 - 1, (1, -(-N // 8)), generator=g, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(1, N, generator=g).half()
    wq = gptq_int4(words, zeros, scales, None, R * 8, 1)
    assert wq.packed is not None and wq.shape == (N, R * 8)
    assert torch.equal(wq.codes, codes) and torch.equal(wq.packed_codes(), qmatmul.pack_int4(codes))
    assert torch.equal(int4_nibbles(words.t().contiguous()).reshape(N, R * 8), codes)  # (the unpacked form's reader)
    scheme = Scheme("group_0", ("Linear",), 4, "int", True, "channel", "pack-quantized")
    ct = int4_weight({"weight_packed": words.t().contiguous(), "weight_scale": scales.t().contiguous()}, scheme, N, R * 8,
                     R * 8)
    assert ct.packed is not None and torch.equal(ct.codes, codes) and bool((ct.zero == 8).all())


@pytest.mark.parametrize("K, C", [(8, 1), (16, 8), (24, 9), (64, 17), (128, 48)])
def test_awq_words_go_straight_to_the_q4_kernels_layout(K, C):
    """`awq_int4_packed` (AWQ's words [K, N/8], output 8c+j of input k in nibble AWQ_REVERSE[j] of word (k, c)) is
    `qmatmul.pack_int4` of the codes those words hold, every bit pattern of the words, the column count not a whole
    number of 8s too; and `awq_int4` gives the same Int4Weight as from the unpacked codes."""
    from mtp.model.quantized import awq_int4

    g = torch.Generator().manual_seed(K * 100 + C)
    words = torch.randint(-(2**31), 2**31 - 1, (K, C), generator=g, dtype=torch.int64).to(torch.int32)
    nibbles = torch.stack([(words.long() >> (4 * i)) & 15 for i in range(8)], dim=-1)  # [K, C, 8]: nibble i
    codes = nibbles[..., list(packed.AWQ_REVERSE)].reshape(K, C * 8).t().contiguous().to(torch.uint8)  # [N, K]
    assert torch.equal(dequant.awq_int4_packed(words), qmatmul.pack_int4(codes))
    zeros = torch.randint(-(2**31), 2**31 - 1, (1, C), generator=g, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(1, C * 8, generator=g).half()
    wq = awq_int4(words, zeros, scales, K)
    assert wq.packed is not None and wq.shape == (C * 8, K)
    assert torch.equal(wq.codes, codes) and torch.equal(wq.packed_codes(), qmatmul.pack_int4(codes))
    assert torch.equal(wq.dequantize(), packed.awq_weight(words, zeros, scales, K, torch.float32))


@pytest.mark.parametrize("method", ["gptq", "gptq8", "awq", "ct", "ct-asym", "ct8", "ct8-asym"])
@pytest.mark.parametrize("K, N, group", [(64, 16, 32), (128, 24, 8), (256, 40, 128), (96, 8, 16)])
def test_release_words_decode_straight_to_bf16(method, K, N, group):
    """`dequant.words_bf16` of a GPTQ (4 / 8 bits) / AWQ / compressed-tensors (pack-quantized, 4 / 8 bits, symmetric
    and not) release's words as stored == the format's own decode to bf16, bit for bit, into qmatmul's bf16 packing
    and as an [N, K] weight (into a given tensor too), with NaN / Inf scales (and products that overflow bf16) counted
    as the loader's check counts them; act order is left to the decoder (None), as are widths it does not take."""
    from mtp.config.compressed_tensors import Scheme
    from mtp.config.quantization import Quantization
    from mtp.model import compressed_tensors as ct
    from mtp.model.quantized import _words_bf16

    if not qmatmul.available():  # (the bf16 packing is qmatmul's)
        pytest.skip(f"the qmatmul kernels do not run here: {qmatmul.reason()}")
    bits = 8 if "8" in method else 4
    g = torch.Generator().manual_seed(K + N + group + bits)
    codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 1 << bits, (N, K // group), generator=g, dtype=torch.int32)
    scales = (torch.rand(K // group, N, generator=g) * 0.1).half()
    scales[0, 0], scales[0, -1] = float("nan"), float("inf")
    if method.startswith("ct"):  # stored codes q + 2^(bits-1), zero points likewise packed along the outputs
        scheme = Scheme("group_0", ("Linear",), bits, "int", not method.endswith("asym"), "group", "pack-quantized", group)
        t = {"weight_packed": ct.pack(codes, bits), "weight_scale": scales.t().contiguous().bfloat16()}
        zero = None
        if method.endswith("asym"):
            t["weight_zero_point"] = ct.pack(zeros.t().contiguous(), bits).t().contiguous()
            zero = zeros - (1 << (bits - 1))
        want = ct.dequantize(codes - (1 << (bits - 1)), t["weight_scale"], zero, scheme, torch.bfloat16)
        decode = lambda t, out, packed: ct._words_bf16(t, scheme, N, K, group, out, packed)  # noqa: E731
        act_order = {**t, "weight_g_idx": (torch.arange(K) // group)[torch.randperm(K, generator=g)].to(torch.int32)}
    else:
        quant = Quantization(method[:4], bits=bits, group=group, zero_offset=1 if method.startswith("gptq") else 0)
        if method.startswith("gptq"):
            words = packed.pack_rows(codes.t().contiguous(), bits)
            qzeros = packed.pack_cols(((zeros - 1) & ((1 << bits) - 1)).t().contiguous(), bits)
            want = packed.gptq_weight(words, qzeros, scales, None, bits, group, 1, torch.bfloat16)
        else:
            words, qzeros = packed.awq_pack(codes.t().contiguous()), packed.awq_pack(zeros.t().contiguous())
            want = packed.awq_weight(words, qzeros, scales, group, torch.bfloat16)
        t = {"qweight": words, "qzeros": qzeros, "scales": scales}
        decode = lambda t, out, packed: _words_bf16(t, quant, group, out, packed)  # noqa: E731
        act_order = {**t, "g_idx": (torch.arange(K) // group)[torch.randperm(K, generator=g)].to(torch.int32)}
    bad = int((~torch.isfinite(want.float())).sum())
    assert bad > 0
    for as_packed, ref in [(True, qmatmul.pack_bf16(want)), (False, want)]:
        got, n = decode(t, None, as_packed)
        assert same_bits(got, ref) and n == bad, (as_packed, n, bad)
        into = torch.empty_like(got)
        assert decode(t, into, as_packed)[0] is into and torch.equal(into.view(torch.int16), got.view(torch.int16))
    if method != "awq":
        assert decode(act_order, None, True) is None
    if method.startswith("gptq"):
        ordered = (torch.arange(K) // group).to(torch.int32)  # (a g_idx in input order is no act order)
        assert same_bits(decode({**t, "g_idx": ordered}, None, True)[0], qmatmul.pack_bf16(want))
        assert decode({**t, "qweight": words[:, :-1], "scales": scales[:, :-1]}, None, True) is None


def test_the_count_of_non_finite_weights_includes_overflow():
    """NaN codes, e5m2 infinities, and finite products that overflow (fp32, or only when rounded to bf16): counted as
    the loader's check counts the weight it was given."""
    w = torch.tensor([[0x7F, 0xFF, 0x7E, 0x01] * 4], dtype=torch.uint8)  # e4m3fn: NaN, -NaN, 448, tiny
    for scale, out in [(1.0, torch.bfloat16), (3.0e38, torch.float32), (7.59e35, torch.bfloat16)]:
        fast, n = dequant.scaled_counted(w.view(torch.float8_e4m3fn), torch.tensor(scale), None, out)
        assert n == int((~torch.isfinite(fast)).sum()) and n >= 8, (scale, out)
    e5 = torch.tensor([[0x7C, 0xFC, 0x7D, 0x3C] * 4], dtype=torch.uint8).view(torch.float8_e5m2)  # +inf, -inf, NaN, 1
    fast, n = dequant.scaled_counted(e5, torch.ones(()), None, torch.bfloat16)
    assert n == 12 == int((~torch.isfinite(fast)).sum())


def test_an_fp8_checkpoints_nan_is_named_at_load(tmp_path):
    """The loader takes the C decode's count instead of reading the weight again: a NaN code in an FP8 release is
    still named with its count (a warning; refused under strict)."""
    mtp.save_model(tiny_model(std=0.02).to(torch.bfloat16), tmp_path)
    release_fp8(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors = load_file(tmp_path / "model.safetensors")
    codes = tensors[name].view(torch.uint8).clone()
    codes[0, :3] = 0x7F
    tensors[name] = codes.view(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for release in (False, True):  # (released: decoded at prepare, straight into its packed copy)
        with pytest.warns(NonFiniteWeightsWarning, match=f"NaN or Inf in tensor '{name}' \\(3 values\\)"):
            mtp.load_model(tmp_path, release=release)
        with pytest.raises(mtp.CheckpointError, match=f"NaN or Inf in tensor '{name}'"):
            mtp.load_model(tmp_path, strict=True, release=release)
