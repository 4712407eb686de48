"""Measure the CPU matmul kernels a quantized linear layer could use, at the Qwen3.5-0.8B widths: time per call for
1..8 rows and whether row i of an M-row product equals the 1-row product of row i exactly (row invariance, which
lossless speculative decoding needs). Used for docs/decisions.md, 2026-12-01 (issue 19).

    python scripts/int4_kernels.py [--threads 1] [--iters 50] [--shapes all|mlp|head]

Candidates: bf16 `F.linear` (the AVX2 path), int8 weight-only `_weight_int8pack_mm`, int4 weight-only
`_weight_int4pack_mm_for_cpu` (bf16 and fp32 activations, group sizes 32..256; torchao's CPU int4 weight-only
tensor calls this same op), `_dyn_quant_matmul_4bit` (int8 dynamic activations x int4 weights), and the
dequantize-then-bf16 fallback.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # (out, in): the 0.8B shape's linear layers (fused as at inference), and the tied output head
    "mlp.gate_up": (7168, 1024), "mlp.down": (1024, 3584), "deltanet.in_proj": (8224, 1024),
    "deltanet.out": (1024, 2048), "attn.qkv": (5120, 1024), "head": (248320, 1024),
    "small": (384, 1024),  # a narrow layer, where per-call overhead shows
}


def int4_pack(w: torch.Tensor, group: int):
    """Asymmetric group-wise int4 of w [N, K] in torch's CPU layout: codes q in 0..15, w ~ (q - 8) * s + z."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[..., None]) / s[..., None]).round().clamp(0, 15)
    z = lo + 8 * s
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(N, K).to(torch.int32), 1)
    return packed, s.t().contiguous(), z.t().contiguous(), q.reshape(N, K)


def kernels(w: torch.Tensor):
    """name -> fn(x bf16 [M, K]) for one weight w [N, K] (bf16)."""
    N, K = w.shape
    wc = w.contiguous()
    out = {"bf16 F.linear": lambda x: F.linear(x, wc)}
    scale = (w.float().abs().amax(1) / 127).clamp_min(1e-12)
    w8 = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    s8 = scale.to(torch.bfloat16)
    out["int8 _weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, w8, s8)
    for group in (32, 128, 256):
        if K % group:
            continue
        packed, s, z, q = int4_pack(w, group)
        sz16 = torch.stack([s, z], -1).to(torch.bfloat16).contiguous()
        sz32 = torch.stack([s, z], -1).contiguous()
        out[f"int4 g{group} bf16-act"] = lambda x, p=packed, sz=sz16, g=group: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, g, sz)
        if group == 128:
            out[f"int4 g{group} fp32-act"] = (lambda x, p=packed, sz=sz32, g=group:
                                              torch.ops.aten._weight_int4pack_mm_for_cpu(x.float(), p, g, sz).to(x.dtype))
            deq = ((q - 8) * s.t().repeat_interleave(group, 1) + z.t().repeat_interleave(group, 1)).to(torch.bfloat16)
            codes = q.to(torch.uint8)
            s_full, z_full = s.t().repeat_interleave(group, 1), z.t().repeat_interleave(group, 1)
            out["int4 g128 dequant+bf16"] = (lambda x, c=codes, sf=s_full, zf=z_full:
                                             F.linear(x, ((c.float() - 8) * sf + zf).to(torch.bfloat16)))
            del deq
            try:  # symmetric per-group scales, two codes per byte; on x86 the op runs torch's reference kernel
                nib = q.to(torch.uint8).reshape(N, K // 2, 2)
                pw = torch.ops.aten._dyn_quant_pack_4bit_weight((nib[..., 0] | (nib[..., 1] << 4)).contiguous(),
                                                                s.t().contiguous().to(torch.bfloat16), None, group, K, N)
                out["int4 g128 _dyn_quant_matmul_4bit"] = (lambda x, pw=pw, g=group:
                                                           torch.ops.aten._dyn_quant_matmul_4bit(x.float(), pw, g, K, N).to(x.dtype))
            except RuntimeError as e:
                print(f"  (_dyn_quant_matmul_4bit not available: {str(e).splitlines()[0][:100]})")
    return out


def timed(fn, x, iters: int) -> float:
    fn(x)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def row_invariant(fn, K: int) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, K, generator=g).to(torch.bfloat16)
    single = torch.cat([fn(x[i : i + 1].contiguous()) for i in range(8)])
    return all(torch.equal(fn(x[:m].contiguous()), single[:m]) for m in range(2, 9))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--shapes", default="all", help="comma list of " + ", ".join(SHAPES) + " (default all)")
    p.add_argument("--rows", default="1,2,4", help="row counts timed")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.iters}; µs per call; M = rows")
    for name in names:
        N, K = SHAPES[name]
        w = (torch.randn(N, K) * 0.02).to(torch.bfloat16)
        print(f"\n{name} [{N} x {K}]  bf16 {N * K * 2 / 1e6:.1f} MB")
        for kname, fn in kernels(w).items():
            try:
                fn(torch.randn(1, K).to(torch.bfloat16))
            except RuntimeError as e:
                print(f"  {kname:34s} fails: {str(e).splitlines()[0][:100]}")
                continue
            ts = {m: timed(fn, torch.randn(m, K).to(torch.bfloat16), args.iters) for m in rows}
            inv = row_invariant(fn, K)
            cells = "  ".join(f"M={m}: {ts[m] * 1e6:8.0f}" for m in rows)
            print(f"  {kname:34s} {cells}   t(M={rows[-1]})/t(1) {ts[rows[-1]] / ts[rows[0]]:.2f}   "
                  f"row-invariant: {'yes' if inv else 'NO'}")


if __name__ == "__main__":
    main()
