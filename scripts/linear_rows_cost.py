"""Cost and row-invariance of the CPU linear kernels by number of rows (1, 2, 4, 8) at code-small widths: bf16
F.linear, fp32 F.linear (MKL), fp32 oneDNN packed, int8 weight-only. `python scripts/linear_rows_cost.py`
(docs/decisions.md, issue 18: on AVX2, bf16 costs in proportion to the rows)."""

import time

import torch
import torch.nn.functional as F


def bench(f, reps: int = 100) -> float:
    """Best of 3 mean microseconds per call."""
    for _ in range(5):
        f()
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for n, k in [(1024, 384), (384, 1024), (8192, 384)]:
        w = torch.randn(n, k) * 0.05
        wb = w.bfloat16()
        wp32 = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        scales = w.abs().amax(1) / 127
        w8 = (w / scales[:, None]).round().to(torch.int8)
        kernels = {
            "bf16 F.linear": lambda x, wb=wb: F.linear(x.bfloat16(), wb),
            "fp32 F.linear": lambda x, w=w: F.linear(x, w),
            "fp32 onednn": lambda x, wp=wp32: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [None], ""),
            "int8pack": lambda x, w8=w8, s=scales: torch._weight_int8pack_mm(x.bfloat16(), w8, s.bfloat16()),
        }
        X = torch.randn(16, k)
        for name, f in kernels.items():
            ref = torch.cat([f(X[i : i + 1]) for i in range(16)])
            invariant = all(torch.equal(f(X[:m]), ref[:m]) for m in range(1, 17))
            us = [bench(lambda f=f, x=X[:m]: f(x)) for m in (1, 2, 4, 8)]
            print(f"{n}x{k} {name:14s} row-invariant={invariant} us at 1,2,4,8 rows: " + " ".join(f"{t:.0f}" for t in us))


if __name__ == "__main__":
    main()
