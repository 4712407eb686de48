"""The int8/int4 x int8 CPU kernels (`model/qmatmul.c`): their arithmetic against an fp64 reference of the same
scheme, row and thread invariance (what lossless speculative decoding rests on), the linear layers' use of them,
and the fallback to torch's kernels where they cannot be built (that they build where they can:
tests/test_native_kernels.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mtp.model import native, qmatmul
from mtp.model.linear import WIDE_MIN_ROWS, FastLinear, Int4Weight, prompt_products, quantize_int8

needs_kernels = pytest.mark.skipif(not qmatmul.available(), reason=f"qmatmul kernels unavailable: {qmatmul.reason()}")


def quantized_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation scheme, written independently: x bf16 [M, K] -> codes [M, K/block, block] and block
    scales [M, K/block, 1] (fp32 max |x| / 127; codes round(x * 127 / max), half to even, in fp32)."""
    M, K = x.shape
    b = x.float().reshape(M, K // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    # a true fp32 division, as the kernel's (`127.0 / tensor` is computed as a reciprocal times 127: other roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (b * inv).round(), amax / 127.0


def reference_q8(x, codes, scale, bias=None):
    q, d = quantized_activations(x)
    blocks = torch.einsum("mbj,nbj->mnb", q.double(), codes.double().reshape(codes.shape[0], -1, 32))
    y = (blocks * d.double().squeeze(-1)[:, None, :]).sum(-1) * scale.double()
    return y if bias is None else y + bias.double()


def activation_block(group: int) -> int:
    """int4 weights' activations are quantized in blocks as wide as their groups allow (int8's in blocks of 32): the
    widest of 128, 64, 32 dividing the group."""
    return next(b for b in (128, 64, 32) if group % b == 0)


def reference_q4(x, wq: Int4Weight, bias=None):
    q, d = quantized_activations(x, activation_block(wq.group))
    xd = (q * d).double().reshape(x.shape[0], -1)  # the quantized activations' values (exact in fp64)
    y = xd @ wq.dequantize(torch.float64).t()
    return y if bias is None else y + bias.double()


def close_to_bf16(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within one bf16 step of the output (relative 2^-7; its rounding alone is up to 2^-8) plus fp32 accumulation."""
    tol = ref.abs() * 2.0**-7 + ref.abs().amax(-1, keepdim=True) * 1e-5
    return bool(((y.double() - ref).abs() <= tol).all())


def int4_parts(w: torch.Tensor, group: int):
    wq = Int4Weight.quantize(w, group)
    scale = wq.scale.float().contiguous()
    return wq, qmatmul.pack_int4(wq.codes), scale, (-wq.zero.float() * scale).contiguous()


@needs_kernels
@pytest.mark.parametrize("shape", [(8, 32), (24, 96), (48, 64), (96, 256), (40, 1024)])  # odd block counts too
def test_int8_kernel_computes_the_scheme(shape):
    g = torch.Generator().manual_seed(0)
    N, K = shape
    w = torch.randn(N, K, generator=g) * 0.05
    codes, scale = quantize_int8(w)
    bias = torch.randn(N, generator=g)
    for M in (1, 3, 4, 6, 9):
        x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
        assert close_to_bf16(qmatmul.q8_linear(x, codes, scale), reference_q8(x, codes, scale)), (shape, M)
        assert close_to_bf16(qmatmul.q8_linear(x, codes, scale, bias), reference_q8(x, codes, scale, bias)), (shape, M)


@needs_kernels
@pytest.mark.parametrize("shape,group", [((48, 64), 32), ((96, 256), 64), ((40, 1024), 128), ((16, 512), 256),
                                         ((24, 96), 32), ((32, 288), 96), ((16, 352), 32)])  # odd blocks, odd groups
def test_int4_kernel_computes_the_scheme(shape, group):
    g = torch.Generator().manual_seed(1)
    N, K = shape
    wq, packed, scale, low = int4_parts(torch.randn(N, K, generator=g) * 0.05, group)
    bias = torch.randn(N, generator=g)
    for M in (1, 2, 5, 8):
        x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
        assert close_to_bf16(qmatmul.q4_linear(x, packed, scale, low, group), reference_q4(x, wq)), (shape, M)
        assert close_to_bf16(qmatmul.q4_linear(x, packed, scale, low, group, bias), reference_q4(x, wq, bias))


@needs_kernels
def test_activation_quantization_costs_little_accuracy():
    """Against the exact product of the (quantized) weight with unquantized activations: ~0.5% relative error."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 1024, generator=g) * 0.05
    x = torch.randn(8, 1024, generator=g).to(torch.bfloat16)
    codes, scale = quantize_int8(w)
    exact = x.double() @ (codes.double() * scale.double()[:, None]).t()
    rel = (qmatmul.q8_linear(x, codes, scale).double() - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.015
    wq, packed, s, low = int4_parts(w, 128)
    exact = x.double() @ wq.dequantize(torch.float64).t()
    rel = (qmatmul.q4_linear(x, packed, s, low, 128).double() - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.015


@pytest.mark.parametrize("isa", ["avx2", "amx"])
@pytest.mark.parametrize("N", [16, 13, 1])
def test_pack_int8_and_int4_put_every_code_where_their_layouts_say(monkeypatch, isa, N):
    """By the layouts' definitions, code by code: int8 byte (g, c, j, i) = q[8g+j, 4c+i] (+ 128 in the AVX-512
    builds); int4 byte (g, c, j, i) of [N/8][K/8][8][4] = q[8g+j, 8c+i] | q[8g+j, 8c+4+i] << 4; zero codes past N."""
    monkeypatch.setattr(qmatmul, "isa", lambda: isa)
    K = 64
    g = torch.Generator().manual_seed(N)
    q8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    q4 = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    p8, p4 = qmatmul.pack_int8(q8), qmatmul.pack_int4(q4).reshape(-(-N // 8), K // 8, 8, 4)
    assert p8.shape == (-(-N // 8), K // 4, 8, 4) and p8.dtype == torch.uint8
    for n in range(-(-N // 8) * 8):
        for k in range(K):
            code8 = int(q8[n, k]) if n < N else 0
            assert int(p8[n // 8, k // 4, n % 8, k % 4]) == (code8 + (0 if isa == "avx2" else 128)) % 256
            byte = int(p4[n // 8, k // 8, n % 8, k % 4])
            assert (byte >> 4 if k % 8 >= 4 else byte & 15) == (int(q4[n, k]) if n < N else 0)
    assert torch.equal(qmatmul.unpack_int4(qmatmul.pack_int4(q4), N), q4)  # the inverse
    # codes at any byte offset (a checkpoint's mapped int8 codes), and into a given buffer
    shifted = torch.zeros(N * K + 1, dtype=torch.int8)
    shifted[1:] = q8.reshape(-1)
    into = torch.full_like(p8, 7)
    assert qmatmul.pack_int8(shifted[1:].view(N, K), into) is into and torch.equal(into, p8)


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("shape", [(48, 64), (33, 70), (8, 1), (1, 1)])
def test_pack_bf16_puts_every_weight_where_its_layout_says(monkeypatch, group, shape):
    """pack_bf16's two layouts by their definition, element by element, on distinct bit patterns (NaNs included):
    vector builds (g, p, j, e) = w[8g+j, 2p+e]; the AMX build (b, c, p, j, e) = w[16b+j, 32c+2p+e]; zeros past w."""
    monkeypatch.setattr(qmatmul, "bf16_group", lambda: group)
    N, K = shape
    w = torch.arange(1, N * K + 1, dtype=torch.int16).reshape(N, K).view(torch.bfloat16)
    bits = qmatmul.pack_bf16(w).view(torch.int16)
    k = 2 if group == 8 else 32
    full = torch.zeros(-(-N // group) * group, -(-K // k) * k, dtype=torch.int16)
    full[:N, :K] = w.view(torch.int16)
    if group == 8:
        want = full.reshape(-1, 8, full.shape[1] // 2, 2).permute(0, 2, 1, 3)
    else:
        want = full.reshape(-1, 16, full.shape[1] // 32, 16, 2).permute(0, 2, 3, 1, 4)
    assert bits.shape == want.shape and bits.is_contiguous()
    assert torch.equal(bits, want)


@needs_kernels
@pytest.mark.parametrize("shape", [(384, 768), (201, 37), (8, 1)])
def test_bf16_kernel_is_the_fp32_product_rounded_once(shape):
    """bf16 x bf16 with fp32 accumulation: within a few fp32 roundings of the float64 product, then one bf16
    rounding; an odd K and outputs that are not a multiple of 8 included; an fp32 bias added before the rounding."""
    N, K = shape
    g = torch.Generator().manual_seed(6)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    x = torch.randn(5, K, generator=g).to(torch.bfloat16)
    bias = torch.randn(N, generator=g)
    ref = x.double() @ w.double().T + bias.double()
    y = qmatmul.bf16_linear(x, qmatmul.pack_bf16(w), N, bias).double()
    assert ((y - ref).abs() <= ref.abs() * 2**-8 + 1e-5 * K**0.5).all()
    assert torch.equal(qmatmul.bf16_linear(x[:0], qmatmul.pack_bf16(w), N), torch.zeros(0, N, dtype=torch.bfloat16))


@needs_kernels
def test_zeros_and_empty_inputs():
    codes, scale = quantize_int8(torch.randn(32, 64))
    assert torch.equal(qmatmul.q8_linear(torch.zeros(2, 64, dtype=torch.bfloat16), codes, scale),
                       torch.zeros(2, 32, dtype=torch.bfloat16))
    assert qmatmul.q8_linear(torch.zeros(0, 64, dtype=torch.bfloat16), codes, scale).shape == (0, 32)


@needs_kernels
def test_rows_and_threads_do_not_change_a_row():
    """Row m of an M-row product is the 1-row product of row m, bit for bit, at 1 and 2 threads."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(201, 512, generator=g) * 0.05  # not a multiple of 8: the last group of outputs is padded
    codes, scale = quantize_int8(w)
    _, packed, s, low = int4_parts(w, 128)
    x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        bf = qmatmul.pack_bf16(w.to(torch.bfloat16))
        for kernel in (lambda a: qmatmul.q8_linear(a, codes, scale), lambda a: qmatmul.q4_linear(a, packed, s, low, 128),
                       lambda a: qmatmul.bf16_linear(a, bf, 201)):
            torch.set_num_threads(1)
            single = torch.cat([kernel(x[i : i + 1]) for i in range(64)])
            for n in (1, 2):
                torch.set_num_threads(n)
                for rows in (2, 3, 4, 5, 7, 16, 33, 64):
                    assert torch.equal(kernel(x[:rows].contiguous()), single[:rows]), (n, rows)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_linear_layers_run_the_kernels_here():
    g = torch.Generator().manual_seed(4)
    for kernel in ("int8", "int4"):
        lin = FastLinear(256, 64, bias=True).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(64, 256, generator=g) * 0.05)
        lin.prepare(kernel)
        assert lin._native, kernel
        x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            y = lin(x)
        if kernel == "int8":
            ref = reference_q8(x, *quantize_int8(lin.weight.detach()), lin.bias.detach().float())
        else:
            ref = reference_q4(x, lin.int4_weight(), lin.bias.detach().float())
        assert close_to_bf16(y, ref), kernel


@needs_kernels
@pytest.mark.skipif(not qmatmul.wide_available(), reason="no AMX build here: prompts' int8/int4 rows stay on the integer kernels")
@pytest.mark.parametrize("N,K,group", [(40, 1024, 128), (24, 96, 32), (136, 288, 96), (2048, 384, 128)])
def test_prompt_products_are_the_bf16_tiles_over_the_decoded_codes(N, K, group):
    """`wide`: the codes decoded to bf16 weights (w = scale * code (+ low), rounded once) times the rows on the bf16
    tiles - bit for bit bf16_linear over those weights, whatever N (pad outputs, a last set of fewer than 4 blocks);
    and a layer takes it only for WIDE_MIN_ROWS rows or more within `prompt_products`."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(N, K, generator=g) * 0.05
    bias = torch.randn(N, generator=g)
    codes, scale = quantize_int8(w)
    wq, packed, s, low = int4_parts(w, group)
    w8 = (codes.float() * scale[:, None]).to(torch.bfloat16)
    w4 = (wq.codes.float() * s.repeat_interleave(group, 1) + low.repeat_interleave(group, 1)).to(torch.bfloat16)
    for M in (1, 13, 70):
        x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
        assert torch.equal(qmatmul.q8_linear(x, codes, scale, bias, wide=True),
                           qmatmul.bf16_linear(x, qmatmul.pack_bf16(w8), N, bias))
        assert torch.equal(qmatmul.q4_linear(x, packed, s, low, group, bias, wide=True),
                           qmatmul.bf16_linear(x, qmatmul.pack_bf16(w4), N, bias))
    lin = FastLinear(K, N, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.prepare("int8")
    codes, scale = quantize_int8(lin.weight.detach())  # (the layer's own: of its bf16 weight)
    for M in (WIDE_MIN_ROWS - 1, WIDE_MIN_ROWS):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            plain = lin(x)
            with prompt_products():
                prompt = lin(x)
        assert torch.equal(plain, qmatmul.q8_linear(x, codes, scale))
        wide = qmatmul.q8_linear(x, codes, scale, wide=True)
        assert torch.equal(prompt, wide if M >= WIDE_MIN_ROWS else plain) and not torch.equal(wide, plain)


@needs_kernels
@pytest.mark.skipif(not qmatmul.wide_available(), reason="no AMX build here: step.c runs each product and its step apart")
def test_fused_tile_products_are_the_product_then_its_step():
    """The tile products with their next step in one pass (step.c's layers): SwiGLU of the gate and up outputs and
    the residual sum, bit for bit the product and then `act.silu_mul` / the bf16 sum, for any rows and threads (a
    last set of fewer blocks, outputs past I/16 sets, up apart from I); a shape that does not fit writes nothing."""
    from mtp.model import act

    g = torch.Generator().manual_seed(8)
    threads = torch.get_num_threads()
    try:
        for width, up, K in ((48, 48, 384), (80, 96, 100), (16, 32, 64)):
            N = up + width
            w = (torch.randn(N, K, generator=g) * 0.1).to(torch.bfloat16)
            packed = qmatmul.pack_bf16(w)
            for n, M in ((1, 1), (1, 70), (2, 33)):
                torch.set_num_threads(n)
                x = torch.randn(M, K, generator=g).to(torch.bfloat16)
                plain = qmatmul.bf16_linear(x, packed, N)
                y = torch.full((M, width), 7.0, dtype=torch.bfloat16)
                assert qmatmul.bf16_linear_fused(x, packed, N, y, qmatmul.Fuse(qmatmul.FUSE_SWIGLU, width, up))
                assert torch.equal(y, act.silu_mul(plain[:, :width].contiguous(), plain[:, up : up + width].contiguous()))
                res = torch.randn(M, N, generator=g).to(torch.bfloat16)
                want = (res.float() + plain.float()).to(torch.bfloat16)
                assert qmatmul.bf16_linear_fused(x, packed, N, res, qmatmul.Fuse(qmatmul.FUSE_ADD, 0, 0))
                assert torch.equal(res, want)
        y = torch.zeros(3, 40, dtype=torch.bfloat16)
        assert not qmatmul.bf16_linear_fused(torch.ones(3, 64, dtype=torch.bfloat16), qmatmul.pack_bf16(w[:80, :64]),
                                             80, y, qmatmul.Fuse(qmatmul.FUSE_SWIGLU, 40, 40))
        assert not y.any()
    finally:
        torch.set_num_threads(threads)


BUILDS = textwrap.dedent("""
    import sys, torch
    from mtp.model import qmatmul
    from mtp.model.linear import Int4Weight, quantize_int8
    print("isa:", qmatmul.isa())
    g = torch.Generator().manual_seed(5)
    out = {}
    # (136 outputs: 17 groups of 8, the AMX tiles' sets of 8 groups and a last set of one)
    for N, K, group in ((40, 1024, 128), (24, 96, 32), (32, 288, 96), (16, 352, 32), (136, 256, 64)):
        w = torch.randn(N, K, generator=g) * 0.05
        codes, scale = quantize_int8(w)
        wq = Int4Weight.quantize(w, group)
        s = wq.scale.float().contiguous()
        packed, low = qmatmul.pack_int4(wq.codes), (-wq.zero.float() * s).contiguous()
        for M in (1, 2, 3, 4, 6, 13, 40):  # (13, 40: the AMX build's int8 / int4 tiles, 16 rows at a time)
            x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
            out[f"q8 {N} {K} {M}"] = qmatmul.q8_linear(x, codes, scale)
            out[f"q4 {N} {K} {group} {M}"] = qmatmul.q4_linear(x, packed, s, low, group)
            out[f"bf16 {N} {K} {M}"] = qmatmul.bf16_linear(x, qmatmul.pack_bf16(w.to(torch.bfloat16)), N)
    w = (torch.randn(8192, 385, generator=g) * 0.05).to(torch.bfloat16)  # many outputs: some round apart by build
    x = torch.randn(4, 385, generator=g).to(torch.bfloat16)
    out["bf16 8192 385 4"] = qmatmul.bf16_linear(x, qmatmul.pack_bf16(w), 8192)
    torch.save(out, sys.argv[1])
""")


def run_build(isa: str, path) -> dict:
    """BUILDS's outputs from `isa`'s build of the kernels, in a real process (MTP_NATIVE_ISA names the build)."""
    done = subprocess.run([sys.executable, "-c", BUILDS, str(path)], env={**os.environ, "MTP_NATIVE_ISA": isa},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"isa: {isa}" in done.stdout, done.stdout + done.stderr
    return torch.load(path)


def cpu_runs(isa: native.Isa) -> bool:
    return all(f in native.cpu_flags() for f in isa.cpu_flags)


@needs_kernels
@pytest.mark.skipif(not cpu_runs(native.AVX512_VNNI), reason="this CPU has no AVX-512 VNNI: only the AVX2 build runs here")
def test_vnni_and_avx2_builds_compute_the_same_bits(tmp_path):
    """The AVX-512 VNNI build changes one instruction (the u8 x s8 products), not a rounding: both builds' outputs are
    bit for bit the same, bf16 products included (the same 8-lane FMAs)."""
    vnni, avx2 = run_build("avx512vnni", tmp_path / "vnni"), run_build("avx2", tmp_path / "avx2")
    assert avx2.keys() == vnni.keys()
    for k, y in avx2.items():
        assert torch.equal(y, vnni[k]), k


@needs_kernels
@pytest.mark.parametrize("isa", [native.AVX512_BF16, native.AMX], ids=lambda isa: isa.name)
def test_bf16_build_keeps_the_integer_bits_and_rounds_bf16_its_own_way(tmp_path, isa):
    """The AVX-512 BF16 and AMX builds: int8 / int4 outputs bit for bit the AVX2 build's (the AMX build's tiles for 6+
    int4 rows and 12+ int8 rows included); their bf16 products (`vdpbf16ps`, the tiles' `tdpbf16ps`) within the bf16
    kernel's bound of the AVX2 build's, and not all equal to them (the build really runs)."""
    if not cpu_runs(isa):
        pytest.skip(f"this CPU cannot run the {isa.name} build")
    bf, avx2 = run_build(isa.name, tmp_path / "bf16"), run_build("avx2", tmp_path / "avx2")
    assert avx2.keys() == bf.keys()
    differ = 0
    for k, y in avx2.items():
        if not k.startswith("bf16"):
            assert torch.equal(y, bf[k]), k
            continue
        a, b = y.double(), bf[k].double()
        assert ((a - b).abs() <= a.abs() * 2**-7 + 1e-4).all(), k
        differ += not torch.equal(y, bf[k])
    assert differ


@torch.no_grad()
def check_int8_widths():
    """int8 layers of widths that are not a multiple of 32 (tiny models; torch 2.13's int8 kernel returned NaN or
    crashed at K % 16 = 8 on AVX-512 CPUs): finite, close to the float product, every row its 1-row product."""
    g = torch.Generator().manual_seed(6)
    for K in (8, 24, 40, 72):
        lin = FastLinear(K, 32, bias=False).to(torch.bfloat16)
        lin.weight.copy_(torch.randn(32, K, generator=g) * 0.05)
        lin.prepare("int8")
        x = torch.randn(6, K, generator=g).to(torch.bfloat16)
        y = lin(x)
        exact = torch.nn.functional.linear(x.float(), lin.weight.float())
        assert torch.isfinite(y).all() and ((y.float() - exact).norm() / exact.norm()) < 0.03, K
        assert torch.equal(y, torch.cat([lin(x[i : i + 1]) for i in range(6)])), K


def test_int8_layers_of_any_width():
    check_int8_widths()


FALLBACK = textwrap.dedent("""
    import torch
    from mtp.model import qmatmul
    from mtp.model.linear import FastLinear
    from test_qmatmul import check_int8_widths
    assert not qmatmul.available(), "expected the fallback"
    print("reason:", qmatmul.reason())
    check_int8_widths()
    g = torch.Generator().manual_seed(0)
    for kernel in ("int8", "int4"):
        lin = FastLinear(256, 64).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(64, 256, generator=g) * 0.05)
            lin.prepare(kernel)
            assert not lin._native
            x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
            y = lin(x)
            assert torch.equal(y, torch.cat([lin(x[i : i + 1]) for i in range(9)]))
            exact = torch.nn.functional.linear(x.float(), lin.weight.float())
            assert ((y.float() - exact).norm() / exact.norm()) < 0.2  # int4: ~10% on random weights
    print("fallback ok")
""")


def run_py(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))


@needs_kernels
def test_fallback_when_disabled_or_no_compiler(tmp_path):
    """MTP_QMATMUL=0, and a compiler that fails (the cache empty): torch's kernels, row-invariant, one warning."""
    done = run_py(FALLBACK, {"MTP_QMATMUL": "0"})
    assert done.returncode == 0 and "disabled by MTP_QMATMUL=0" in done.stdout and "fallback ok" in done.stdout, done.stderr
    done = run_py(FALLBACK, {"MTP_CACHE": str(tmp_path / "cache"), "CC": "false", "TMPDIR": str(tmp_path)})
    assert done.returncode == 0 and "fallback ok" in done.stdout, done.stderr
    assert "false failed on qmatmul.c" in done.stdout and "int8/int4 layers use torch's kernels" in done.stderr
    assert not list((tmp_path / "cache").rglob("*.so*"))  # nothing half-written left in the cache


@needs_kernels
def test_built_once_into_the_cache(tmp_path):
    code = "from mtp.model import qmatmul; assert qmatmul.available(), qmatmul.reason()"
    env = {"MTP_CACHE": str(tmp_path)}
    assert run_py(code, env).returncode == 0
    built = list((tmp_path / "kernels").glob("qmatmul-*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob("*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    assert run_py(code, env).returncode == 0 and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_an_unknown_build_name_is_refused(monkeypatch):
    """MTP_NATIVE_ISA names a build; a name that is none of them is an error, not a silent baseline."""
    monkeypatch.setenv("MTP_NATIVE_ISA", "avx512bf")
    with pytest.raises(ValueError, match="MTP_NATIVE_ISA"):
        native.pick_isas((native.AVX512_BF16, native.AVX512_VNNI))
    monkeypatch.setenv("MTP_NATIVE_ISA", "avx2")
    assert native.pick_isas((native.AMX, native.AVX512_BF16, native.AVX512_VNNI)) == [None]


@needs_kernels  # (an x86-64 Linux with a compiler)
def test_a_build_that_cannot_run_gives_way_to_the_next(tmp_path, monkeypatch):
    """A build whose flags the compiler refuses, or whose `ready` function says no (AMX where Linux withholds the
    tiles), is passed over for the next one the CPU runs; the baseline is the last."""
    source = tmp_path / "probe.c"
    source.write_text("int refuse(void) { return -1; }\nint accept(void) { return 0; }\nint which(void) { return WHICH; }\n")
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MTP_NATIVE_ISA", raising=False)
    bad_flag = native.Isa("bad-flag", ("-DWHICH=1", "-mno-such-flag-at-all"), ())
    refused = native.Isa("refused", ("-DWHICH=2",), (), ready="refuse")
    accepted = native.Isa("accepted", ("-DWHICH=3",), (), ready="accept")
    declare = lambda lib: None  # noqa: E731
    lib = native.NativeLibrary(source, None, "probe", declare, (bad_flag, refused, accepted))
    assert lib.available() and lib.isa is accepted and lib.handle().which() == 3
    native_flags = native.FLAGS
    monkeypatch.setattr(native, "FLAGS", native_flags + ("-DWHICH=0",))
    lib = native.NativeLibrary(source, None, "probe", declare, (bad_flag, refused))
    assert lib.available() and lib.isa is None and lib.handle().which() == 0  # the baseline
