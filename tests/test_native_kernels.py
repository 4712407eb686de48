"""Our non-matmul C kernels of decoding (model/deltanet.c, attention.c, norm.c, argmax.c): each close to (argmax:
equal to) its torch form (the
reference, which runs on every other machine), row-invariant (a block or a batch row is bit for bit its single-row
call), and, disabled, decoding stays exact in the torch forms."""

from __future__ import annotations

import copy
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import tiny_model
from mtp.config import Qwen35Config
from mtp.model import argmax_kernel, attention_kernel, deltanet_kernel, norm_kernel, qmatmul, rtn, top_p_kernel
from mtp.model.attention import attend_rows
from mtp.model.cache import Positions
from mtp.model.deltanet import GatedDeltaNet
from mtp.model.linear import prepare_for_inference, row_invariant
from mtp.model.native import AMX, AVX512_VNNI, cpu_flags, cpu_problem
from mtp.model.norm import PlainRMSNorm, RMSNorm

KERNELS = (deltanet_kernel, attention_kernel, norm_kernel, argmax_kernel)
needs_kernels = pytest.mark.skipif(not all(k.LIBRARY.available() for k in KERNELS),
                                   reason=f"C kernels unavailable: {deltanet_kernel.LIBRARY.reason()}")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def states_after(state, steps, T: int) -> torch.Tensor:
    """The state after each of a decode forward's T tokens, every row ([B, Hv, T, Kd, Vd]): what `keep_at` sets for
    n = 1..T, from either form of `DeltaSteps` (the C step's updates, the torch form's states)."""
    out = []
    for t in range(1, T + 1):
        s = copy.deepcopy(state)
        s.keep_at(steps, torch.full((s.ssm.shape[0],), t))
        out.append(s.ssm)
    return torch.stack(out, 2)


def torch_forms(monkeypatch) -> None:
    for k in KERNELS:
        monkeypatch.setattr(k, "usable", lambda *tensors: False)


def test_the_kernels_build_where_they_can():
    """Not a skip: on an x86-64 Linux machine with AVX2 and a C compiler every C kernel (native.py) must build and
    load."""
    if cpu_problem() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip(f"not a machine for the kernels: {cpu_problem() or 'no C compiler'}")
    if os.environ.get("MTP_NATIVE") == "0":
        pytest.skip("MTP_NATIVE=0 switches the kernels off")
    for k in (*KERNELS, qmatmul, rtn, top_p_kernel):
        assert k.LIBRARY.available(), k.LIBRARY.reason()


def deltanet_layer(dtype, k_heads, v_heads, seed=0):
    c = Qwen35Config(hidden_size=64, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                     linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_hidden_layers=2,
                     intermediate_size=64, vocab_size=64)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(c).double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.A_log.uniform_(-2, 1)
    state = layer.new_state(3, 16, torch.float64, "cpu")
    state.conv.normal_()
    state.ssm = torch.randn(3, v_heads, 16, 32) * 0.1  # fp32, as decoding keeps it
    low = copy.deepcopy(layer).to(dtype)
    low_state = copy.deepcopy(state)
    low_state.conv = low_state.conv.to(dtype)
    return layer, state, low, low_state


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
@pytest.mark.parametrize("T", [4, 19])  # 19: two blocks of 8 tokens through deltanet.c's conv_block8, then 3 one by one
@torch.no_grad()  # not inference_mode: prepared layers track their weights' versions
def test_deltanet_step_matches_its_torch_form_and_is_row_invariant(dtype, heads, T, monkeypatch):
    ref_layer, ref_state, layer, state = deltanet_layer(dtype, *heads)
    # the projections prepared as a decoder prepares them (row by row in fp32 within row_invariant): through plain
    # nn.Linear layers the batch-row check below tested the BLAS, and MKL blocks 12 rows differently from 4 on an
    # AMX Xeon
    prepare_for_inference(layer, "fp32" if dtype == torch.float32 else "bf16")
    x = torch.randn(3, T, 64).to(dtype)
    with row_invariant():
        ref, ref_steps = ref_layer.decode(x.double(), ref_state)  # torch form, fp64 but for the fp32 recurrence
        out, steps = layer.decode(x, state)
        with monkeypatch.context() as m:
            torch_forms(m)
            eager, eager_steps = layer.decode(x, state)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert steps.updates is not None and ref_steps.states is not None  # (the C step's form, the torch form's)
    assert rel(out, ref) < tol and rel(states_after(state, steps, T), ref_steps.states) < tol
    assert rel(out, ref) <= 1.5 * rel(eager, ref) + 1e-7  # no less accurate than the torch form in this dtype
    with row_invariant():  # a block is its plain steps, and a batch row its row alone
        one = copy.deepcopy(state)
        outs = []
        for t in range(T):
            o, st = layer.decode(x[:, t : t + 1], one)
            outs.append(o)
            one.keep_at(st, torch.ones(3, dtype=torch.long))
        alone = layer.decode(x[1:2], state.rows(1, 2))[0]
    assert torch.equal(torch.cat(outs, 1), out)
    whole = copy.deepcopy(state)
    whole.keep_at(steps, torch.full((3,), T))
    assert torch.equal(whole.ssm, one.ssm) and torch.equal(whole.conv, one.conv)
    assert torch.equal(alone, out[1:2])
    kept, in_place = copy.deepcopy(state), copy.deepcopy(state)  # a plain step every row keeps: in place, same bits
    for t in range(T):
        o, st = layer.decode(x[:, t : t + 1], kept)
        kept.keep_at(st, torch.ones(3, dtype=torch.long))
        o2, none = layer.decode(x[:, t : t + 1], in_place, commit=True)
        assert none is None and torch.equal(o2, o), t
        assert torch.equal(in_place.ssm, kept.ssm) and torch.equal(in_place.conv, kept.conv), t
    chunk = copy.deepcopy(state)  # a prompt's chunk: in bf16 its T plain steps at once (same bits), in fp32 the
    with row_invariant():  # chunked form (close)
        o3, none = layer(x, Positions(0, T), chunk)
    assert none is None
    if dtype == torch.bfloat16:
        assert torch.equal(o3, out) and torch.equal(chunk.ssm, kept.ssm) and torch.equal(chunk.conv, kept.conv)
    else:
        assert rel(o3, ref) < 1e-5 and rel(chunk.ssm, kept.ssm) < 1e-5 and torch.equal(chunk.conv, kept.conv)
    mixed = copy.deepcopy(state)
    mixed.keep_at(steps, torch.tensor([0, 2, 4]))  # keep nothing / two tokens / all
    assert torch.equal(mixed.ssm[0], state.ssm[0]) and torch.equal(mixed.conv[0], state.conv[0])
    after = states_after(state, steps, T)
    assert torch.equal(mixed.ssm[1], after[1, :, 1]) and torch.equal(mixed.conv[1], steps.window[1, :, 2:5])
    assert torch.equal(mixed.ssm[2], after[2, :, 3]) and torch.equal(mixed.conv[2], steps.window[2, :, 4:7])
    strided = copy.deepcopy(state)  # a strided state (a view's) is kept through copies: the same bits
    strided.ssm = strided.ssm.transpose(-1, -2).contiguous().transpose(-1, -2)
    strided.keep_at(steps, torch.tensor([0, 2, 4]))
    assert not strided.ssm.is_contiguous() and torch.equal(strided.ssm, mixed.ssm)
    replayed = copy.deepcopy(state)  # the keep's arithmetic in torch (where the C keep cannot run): close
    replayed._replay(steps.updates, torch.tensor([0, 2, 4]))
    assert rel(replayed.ssm, mixed.ssm) < 1e-6


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_torchs(dtype):
    """The first index of the largest value, a row's first NaN where it holds one, ties and signed zeros and -inf
    rows as torch chooses; any number of rows, any width (tails of the 8- and 16-lane passes), strided rows."""
    g = torch.Generator().manual_seed(7)
    for V in (1, 7, 8, 9, 16, 33, 1000, 40000):
        x = torch.randn(5, 3, V, generator=g).to(dtype)
        x[1, 0, V // 2] = float("nan")
        x[1, 0, V - 1] = float("nan")
        x[2, 1] = 0.0
        x[2, 1, V // 3] = -0.0
        x[3, 2] = float("-inf")
        x[4, 0, :] = 1.0  # all tied: index 0
        x[4, 1, V // 2 :] = 100.0  # tied maxima: the first
        assert torch.equal(argmax_kernel.argmax(x), x.argmax(-1)), V
        assert torch.equal(argmax_kernel.argmax(x[:, :, : max(1, V // 2)]), x[:, :, : max(1, V // 2)].argmax(-1)), V
        assert torch.equal(argmax_kernel.argmax(x[0, 0]), x[0, 0].argmax(-1)), V


def top_p_reference(x: torch.Tensor, p: float) -> torch.Tensor:
    """sampling.py's torch rule for one row x [V] (fp32, -inf where cut) -> the kept tokens (bool [V]), in float64 (p = 1:
    no top-p, as `probs_from_logits` reads it)."""
    if p >= 1.0:
        return torch.ones_like(x, dtype=torch.bool)
    ranked, order = torch.sort(x.double(), descending=True, stable=True)
    probs = ranked.softmax(-1)
    cut = (probs.cumsum(-1) - probs) >= p
    return ~cut.scatter(-1, order, cut)


@pytest.mark.skipif(not top_p_kernel.LIBRARY.available(), reason="the C kernels are not available here")
def test_the_top_p_cut_keeps_what_the_rule_keeps():
    """top_p.c keeps the tokens torch's rule keeps (the first in descending order while the mass before them is below
    p): peaked and flat rows (the candidates' threshold lowered, down to every token), rows already cut by a top-k
    (-inf), a row of one finite logit, all -inf, p = 1 (nothing cut); equal logits at the cut: the lower ids first."""
    g = torch.Generator().manual_seed(3)
    for V in (5, 64, 8192):
        for scale in (0.01, 1.0, 8.0, 40.0):
            x = torch.randn(6, V, generator=g) * scale
            x[1, : V // 2] = float("-inf")  # a top-k's cut
            x[2] = float("-inf")
            x[3] = float("-inf")
            x[3, V // 3] = 1.5
            for p in (0.05, 0.5, 0.9, 0.999, 1.0):
                y = x.clone()
                top_p_kernel.cut(y, torch.full((6,), p))
                for r in range(6):
                    want = top_p_reference(x[r], p) & (x[r] > float("-inf"))
                    assert torch.equal(y[r] > float("-inf"), want), (V, scale, p, r)
                    assert torch.equal(y[r][want], x[r][want])  # what it keeps is untouched
    x = torch.full((1, 10001), -14 * math.log(2))  # one token, then 10,000 tied ones of 2^-14 its mass each: the
    x[0, 5000] = 0.0  # candidates' threshold is lowered past them, and the cut falls among the tied ones by id
    y = x.clone()
    top_p_kernel.cut(y, torch.tensor([0.9]))
    assert torch.equal(y[0] > float("-inf"), top_p_reference(x[0], 0.9)) and 5000 < (y > float("-inf")).sum() < 10000
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])  # three equal at the top, each 0.27 of the mass
    top_p_kernel.cut(x, torch.tensor([0.25]))
    assert (x > float("-inf")).tolist() == [[False, True, False, False, False]]
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    top_p_kernel.cut(x, torch.tensor([0.5]))
    assert (x > float("-inf")).tolist() == [[False, True, True, False, False]]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# (6, 2, 64, 64): the shipped model's heads (values read in place in the AVX-512 build); (12, 2, 64, 64): 24 queries a kv
# head, past one vector of softmax totals
@pytest.mark.parametrize("shape", [(8, 2, 256, 256), (4, 4, 64, 32), (6, 2, 192, 128), (6, 2, 64, 64), (12, 2, 64, 64)])
@torch.inference_mode()
def test_decode_attention_matches_sdpa_and_is_row_invariant(dtype, shape):
    A, Hk, D, Dv = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, A, D, generator=g).to(dtype).transpose(1, 2)  # [B, A, T, D], strided as the layers pass it
    k, v = torch.randn(3, Hk, 50, D, generator=g).to(dtype), torch.randn(3, Hk, 50, Dv, generator=g).to(dtype)
    starts = [0, 7, 46]
    out = attention_kernel.attend(q, k, v, starts, D**-0.5)
    rows = lambda q, k, v: torch.cat([attend_rows(q[b : b + 1], k[b : b + 1], v[b : b + 1], s, D**-0.5, A != Hk)
                                      for b, s in enumerate(starts)])
    exact, sdpa = rows(q.double(), k.double(), v.double()), rows(q, k, v)
    assert rel(out, exact) <= 1.2 * rel(sdpa, exact) + 1e-7
    single = torch.cat([attention_kernel.attend(q[1:2, :, t : t + 1], k[1:2], v[1:2], [7 + t], D**-0.5) for t in range(4)], 2)
    assert torch.equal(single, out[1:2])
    with pytest.raises(ValueError, match="past the cache"):
        attention_kernel.attend(q, k, v, [0, 7, 47], D**-0.5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(6, 2, 64, 64, 70, 0), (6, 2, 64, 64, 37, 300), (4, 4, 32, 72, 9, 5), (2, 1, 128, 128, 1, 17)])
@torch.inference_mode()
def test_prompt_attention_matches_sdpa(dtype, shape):
    """`attend_prompt` (a prompt's chunk read in one call, step.c): every query over the keys up to its own position,
    within its dtype's rounding of the exact attention - a chunk from position 0 and one deep into the cache, a last key
    block partly filled, value widths past the last whole vector (72), one query - with rows at different positions.
    The AMX build takes bf16 heads of D % 32 == 0 and Dv % 16 == 0 to its tiles (its weights rounded to bf16, as
    PyTorch's CPU flash attention rounds them): the same bound (measured 1.9-2.2e-3 there, SDPA 1.9-2.2e-3)."""
    A, Hk, D, Dv, T, start = shape
    g = torch.Generator().manual_seed(1)
    starts = [start, start + 5]
    q = torch.randn(2, T, A, D, generator=g).to(dtype).transpose(1, 2)  # [B, A, T, D], strided as step.c passes it
    S = start + T + 9
    k, v = torch.randn(2, Hk, S, D, generator=g).to(dtype), torch.randn(2, Hk, S, Dv, generator=g).to(dtype)
    out = attention_kernel.attend(q, k, v, starts, D**-0.5, prompt=True)
    rows = lambda q, k, v: torch.cat([attend_rows(q[b : b + 1], k[b : b + 1], v[b : b + 1], s, D**-0.5, A != Hk)
                                      for b, s in enumerate(starts)])
    exact, sdpa = rows(q.double(), k.double(), v.double()), rows(q, k, v)
    # bounds of the dtype, not of this CPU's SDPA (which rounds its own way): measured here 1.5-5.2e-7 in fp32 (its scores
    # sum over d in order; SDPA 1.2-2.9e-7) and 1.6-1.7e-3 in bf16 (the output's rounding; SDPA 1.7-2.2e-3); a wrong key
    # or weight shows as 1e-2 and more
    assert rel(out, exact) <= (4e-3 if dtype == torch.bfloat16 else 2e-6), (rel(out, exact), rel(sdpa, exact))


@needs_kernels
@pytest.mark.parametrize("cls", [RMSNorm, PlainRMSNorm])
@torch.inference_mode()
def test_rmsnorm_matches_its_torch_form_and_is_row_invariant(cls, monkeypatch):
    norm = cls(256).to(torch.bfloat16)
    norm.weight.normal_(0.5, 0.3, generator=torch.Generator().manual_seed(1))
    x = (torch.randn(5, 7, 512, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)[..., ::2]
    assert norm_kernel.usable(x, norm.weight)
    y = norm(x)
    with monkeypatch.context() as m:
        torch_forms(m)
        eager = norm(x)
    # the same roundings; only the sum of squares runs in another order: at most one bf16 step apart
    assert ((y.float() - eager.float()).abs() <= eager.float().abs() * 2**-7 + 1e-6).all()
    assert torch.equal(torch.cat([norm(x[i : i + 1]) for i in range(5)]), y)
    assert not norm_kernel.usable(x.float(), norm.weight.float())  # fp32 keeps the torch form (module docstring)
    with torch.enable_grad():
        assert not norm_kernel.usable(x, norm.weight)


DELTANET_BUILD = textwrap.dedent("""
    import copy, sys, torch
    from mtp.config import Qwen35Config
    from mtp.model import deltanet_kernel
    from mtp.model.deltanet import GatedDeltaNet
    from mtp.model.linear import prepare_for_inference, row_invariant
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        # value heads of 32 (one 16-lane pass of two vectors), 24 (16 + 8 lanes), 40 (32 + 8)
        for vd, kd in ((32, 16), (24, 16), (40, 32)):
            c = Qwen35Config(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=kd,
                             linear_value_head_dim=vd, linear_conv_kernel_dim=4, num_hidden_layers=2,
                             intermediate_size=64, vocab_size=64)
            torch.manual_seed(0)
            layer = GatedDeltaNet(c).eval()
            with torch.no_grad():
                for p in layer.parameters():
                    p.normal_(0, 0.3)
                layer.A_log.uniform_(-2, 1)
            layer = layer.to(dtype)
            prepare_for_inference(layer, "fp32" if dtype == torch.float32 else "bf16")
            for T in (1, 4, 19):
                state = layer.new_state(3, 16, dtype, "cpu")
                state.conv.normal_()
                state.ssm = torch.randn(3, 4, kd, vd) * 0.1
                x = torch.randn(3, T, 64).to(dtype)
                with torch.no_grad(), row_invariant():
                    o, steps = layer.decode(x, state)
                    kept = copy.deepcopy(state)
                    kept.keep_at(steps, torch.tensor([1, T, T // 2]))
                    in_place = copy.deepcopy(state)
                    layer.decode(x, in_place, commit=True)
                out[f"{dtype} {vd} {kd} {T}"] = (o, kept.ssm, in_place.ssm)
    isa = deltanet_kernel.LIBRARY.isa
    print("isa:", isa.name if isa else "avx2")
    torch.save(out, sys.argv[1])
""")


ACT_BUILD = textwrap.dedent("""
    import sys, torch
    from mtp.model import act
    g = torch.Generator().manual_seed(3)
    out = {}
    for rows, N in ((1, 8), (3, 13), (2, 24), (5, 37), (4, 1029)):  # rows of one vector, a tail, several, 1024 + 5
        a = (torch.randn(rows, N, generator=g) * 6).to(torch.bfloat16)
        b = (torch.randn(rows, N, generator=g) * 3).to(torch.bfloat16)
        flat = a.view(-1)
        flat[::7], flat[1::11], flat[2::13] = float("nan"), float("inf"), -float("inf")
        flat[3::17], flat[4::19], flat[5::23] = 1e30, -1e30, 1e-40
        for name, (x, y) in (("silu_mul", (a, b)), ("sigmoid_mul", (b, a)), ("sigmoid_mul x", (a, b))):
            o = torch.empty(rows, N, dtype=torch.bfloat16)
            getattr(act.LIBRARY.lib(), name.split()[0])(rows, N, x.data_ptr(), N, y.data_ptr(), N, o.data_ptr(), 1)
            out[f"{name} {rows} {N}"] = (o,)
    isa = act.LIBRARY.isa
    print("isa:", isa.name if isa else "avx2")
    torch.save(out, sys.argv[1])
""")


ATTENTION_BUILD = textwrap.dedent("""
    import sys, torch
    from mtp.model import attention_kernel
    g = torch.Generator().manual_seed(5)
    out = {}
    # (B, A, T, Hk, D, Dv, first position): one query; a verify; 8 rows; a prompt's chunk; odd key counts and tails of
    # the 8-key blocks, Dv past 64
    for B, A, T, Hk, D, Dv, start in ((1, 6, 1, 2, 64, 64, 40), (1, 6, 4, 2, 64, 64, 99), (8, 6, 4, 2, 64, 64, 300),
                                      (1, 6, 70, 2, 64, 64, 0), (2, 4, 3, 2, 16, 16, 6), (1, 8, 5, 1, 24, 72, 33)):
        for dtype in (torch.bfloat16, torch.float32):
            S = start + 3 * (B - 1) + T + 2
            q = (torch.randn(B, A, T, D, generator=g) * 2).to(dtype)
            k, v = torch.randn(B, Hk, S, D, generator=g).to(dtype), torch.randn(B, Hk, S, Dv, generator=g).to(dtype)
            if B == 2:  # NaN in some queries: their scores and outputs NaN alike
                q.view(-1)[::97] = float("nan")
            out[f"{dtype} {B} {A} {T} {Hk} {D} {Dv} {start}"] = (
                attention_kernel.attend(q, k, v, [start + 3 * b for b in range(B)], D**-0.5),)
    isa = attention_kernel.LIBRARY.isa
    print("isa:", isa.name if isa else "avx2")
    torch.save(out, sys.argv[1])
""")


DEQUANT_BUILD = textwrap.dedent("""
    import sys, torch
    from mtp.model import dequant, qmatmul
    g = torch.Generator().manual_seed(9)
    out = {}
    # every code of each format, tails of the 16- and 8-code vectors, tiles narrower than a vector, subnormal products
    for N, K, block in ((5, 256, None), (40, 300, (16, 32)), (33, 7, None), (17, 45, (4, 4)), (64, 96, (128, 128))):
        for code in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
            w = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8).view(code)
            shape = (-(-N // block[0]), -(-K // block[1])) if block else (N, 1)
            s = torch.rand(shape, generator=g) * 10.0 ** torch.randint(-40, 5, shape, generator=g).float()
            key = f"{code} {N} {K} {block}"
            for dtype in (torch.bfloat16, torch.float32):
                w2, n = dequant.scaled_counted(w, s, block, dtype)
                out[f"{key} {dtype}"] = (w2.view(torch.int32) if dtype == torch.float32 else w2, torch.tensor(n))  # (NaN)
            for group in (8, 16):
                qmatmul.bf16_group = lambda group=group: group
                w2, n = dequant.scaled_packed(w, s, block)
                out[f"{key} packed {group}"] = (w2, torch.tensor(n))
    isa = dequant.LIBRARY.isa
    print("isa:", isa.name if isa else "avx2")
    torch.save(out, sys.argv[1])
""")


def outputs_by_build(script: str, tmp_path, isas: tuple[str, ...] = ("avx2", AVX512_VNNI.name)) -> dict:
    """`script`'s saved outputs {key: tuple of tensors} from each build of `isas` (the AVX2 build and the AVX-512
    one), each in a real process (MTP_NATIVE_ISA names the build)."""
    outs = {}
    for isa in isas:
        path = tmp_path / f"{isa}.pt"
        done = subprocess.run([sys.executable, "-c", script, str(path)], env={**os.environ, "MTP_NATIVE_ISA": isa},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and f"isa: {isa}" in done.stdout, done.stdout + done.stderr
        outs[isa] = torch.load(path)
    assert all(o.keys() == outs["avx2"].keys() for o in outs.values())
    return outs


@needs_kernels
@pytest.mark.skipif(not all(f in cpu_flags() for f in AVX512_VNNI.cpu_flags), reason="no AVX-512 here: one build only")
@pytest.mark.parametrize("script", [DELTANET_BUILD, ACT_BUILD, ATTENTION_BUILD, DEQUANT_BUILD],
                         ids=["deltanet", "act", "attention", "dequant"])
def test_avx512_builds_compute_the_avx2_bits(tmp_path, script):
    """deltanet.c's AVX-512 build runs the recurrence 16 columns a vector, act.c's gates 16 elements a vector,
    attention.c two keys' scores a vector and the value sums 16 outputs a vector (and so does its AMX build, whose
    tiles only a bf16 prompt's chunk takes), dequant.c 16 codes a vector: their
    outputs (and the DeltaNet's kept and in-place states, the decodes' NaN / Inf counts) are bit for bit the AVX2
    build's, NaN, infinities and tails included (every sum stays within its column, its key or its output, in its
    order; exp16 is exp8's operations lane for lane)."""
    # (attention.c's AMX build, where this process runs it: a CPU with the tiles, a compiler that builds it, a kernel that
    # grants them)
    isa = attention_kernel.LIBRARY.isa if attention_kernel.LIBRARY.available() else None
    amx = script is ATTENTION_BUILD and isa is not None and isa.name == AMX.name
    outs = outputs_by_build(script, tmp_path, ("avx2", AVX512_VNNI.name) + ((AMX.name,) if amx else ()))
    for isa in outs.keys() - {"avx2"}:
        for k, ys in outs["avx2"].items():
            assert all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
                       for a, b in zip(ys, outs[isa][k])), (isa, k)


DISABLED = textwrap.dedent("""
    import torch
    import mtp
    from conftest import tiny_model
    from mtp.model import argmax_kernel, attention_kernel, deltanet_kernel, norm_kernel
    for k in (argmax_kernel, attention_kernel, deltanet_kernel, norm_kernel):
        assert not k.LIBRARY.available() and k.LIBRARY.reason() == "disabled by MTP_NATIVE=0", k.LIBRARY.reason()
    model = tiny_model(seed=4).to(torch.bfloat16)
    model.prepare_for_inference("int8")
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    want = mtp.generate(model, ids, max_new_tokens=24, eos_token_ids=[]).tokens
    for k in (2, 3):
        assert mtp.generate(model, ids, max_new_tokens=24, draft_tokens=k, eos_token_ids=[]).tokens == want, k
    print("torch forms exact")
""")


@needs_kernels
def test_disabled_kernels_leave_decoding_exact_in_the_torch_forms():
    """MTP_NATIVE=0 (a real process): every C kernel reports itself off, and greedy speculative == plain still."""
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "MTP_NATIVE": "0", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", DISABLED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "torch forms exact" in done.stdout, done.stderr[-2000:]


@needs_kernels
def test_kernels_are_as_close_to_fp32_as_the_torch_forms_on_a_model(monkeypatch):
    """A decode forward of a tiny bf16 model: with the C kernels the logits are as close to the fp32 model's (torch
    forms) as with the torch forms."""
    base = tiny_model(seed=0, std=0.02)  # (the default std makes bf16 logits chaotic: 3-17% off fp32 either way)
    ids = torch.randint(0, base.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(7))

    def logits(model):
        model.prepare_for_inference(None)
        cache = model.new_cache(1, 64)
        with torch.inference_mode(), row_invariant():
            model.hidden(ids[:, :26], cache)
            pos = model.decode_positions(torch.arange(26, 30)[None], [26])
            h, _ = model.decode(ids[:, 26:], cache, pos)
            return model.head(h).float()

    ours = logits(copy.deepcopy(base).to(torch.bfloat16))
    with monkeypatch.context() as m:
        torch_forms(m)
        eager = logits(copy.deepcopy(base).to(torch.bfloat16))
        ref = logits(base)
    assert rel(ours, ref) < 0.02 and rel(ours, ref) <= 1.5 * rel(eager, ref), (rel(ours, ref), rel(eager, ref))


PREBUILD = textwrap.dedent("""
    import sys
    import mtp
    from mtp.model.native import LIBRARIES, kernels_dir
    mtp.load_model(sys.argv[1])  # a bf16 load runs only some of the kernels; prebuild compiles them all
    built = sorted(p.name.split("-")[0] for p in kernels_dir().glob("*.so"))
    want = sorted(lib.source.stem for lib in LIBRARIES if not lib.switched_off())
    print("built", built, "want", want)
    assert set(want) <= set(built), (want, built)
""")


@needs_kernels
@pytest.mark.parametrize("switch", [None, "MTP_NATIVE"])
def test_a_fresh_machine_compiles_every_kernel_before_the_first_load(tmp_path, switch):
    """`native.prebuild` (a real process with an empty kernel cache): `load_model` on the CPU leaves every library's
    build in the cache, compiled side by side before the model is built (so a first generation times decoding, not
    the compiler); with MTP_NATIVE=0 nothing is compiled."""
    from mtp.cli_common import default_model_path

    env = {**os.environ, "MTP_CACHE": str(tmp_path / "cache")}
    if switch:
        env[switch] = "0"
    done = subprocess.run([sys.executable, "-c", PREBUILD, str(default_model_path())], env=env, capture_output=True,
                          text=True, timeout=300)
    if switch:
        assert done.returncode == 0 and "built [] want []" in done.stdout, done.stdout + done.stderr[-2000:]
    else:
        assert done.returncode == 0 and "built" in done.stdout, done.stdout + done.stderr[-2000:]
