"""Profile one plain decode step of a random-weight model of a named shape (`mtp bench --shape`) in bf16, int8 and
int4: the step's median time per variant (interleaved) and, per variant, the aten ops that take the time (torch
profiler, self CPU time). Used for docs/decisions.md, 2026-12-01 (issue 19: why int8 was no faster than bf16).

    python scripts/profile_step.py [--shape qwen3.5-0.8b] [--threads 2] [--variants bf16,int8,int4] [--top 12]
        [--torch-ops]

--torch-ops also times each variant with the Gated DeltaNet step, decode attention and RMSNorm in torch ops instead
of their C kernels (model/deltanet_kernel.py, attention_kernel.py, norm_kernel.py), interleaved with the others in
the same process (docs/decisions.md, 2026-12-02).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mtp.bench.costmodel import build_shape_model
from mtp.model import attention_kernel, deltanet_kernel, norm_kernel
from mtp.model.argmax_kernel import argmax


def step_fn(model, context: int = 128):
    """A plain decode step at position `context` (its argmax read back, the recurrent state kept)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=g)
    cache = model.new_cache(1, context + 8)
    with torch.inference_mode():
        model.hidden(prompt, cache)
    model.prepare_decode(context + 8)
    tok = torch.randint(0, model.config.vocab_size, (1, 1), generator=g)
    pos = model.decode_positions(torch.tensor([[cache.pos]]), [cache.pos])
    pos.commit = True  # the plain step of decode/round.py: the recurrent states update in place
    keep = torch.tensor([1])

    def f():
        with torch.inference_mode():
            h, steps = model.decode(tok, cache, pos)
            argmax(model.head(h)).tolist()
            cache.keep_at(steps, keep)
    return f


def torch_ops(f):
    """f, run with the DeltaNet step, decode attention and RMSNorm in torch ops rather than our C kernels."""
    kernels = (attention_kernel, deltanet_kernel, norm_kernel)

    def g():
        usable = [k.usable for k in kernels]
        for k in kernels:
            k.usable = lambda *tensors: False
        try:
            f()
        finally:
            for k, u in zip(kernels, usable):
                k.usable = u
    return g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-0.8b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="bf16,int8,int4")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--torch-ops", action="store_true", help="also time each variant without our non-matmul C kernels")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fns = {}
    for v in args.variants.split(","):
        model = build_shape_model(args.shape, torch.bfloat16)
        model.prepare_for_inference(None if v == "bf16" else v)
        fns[v] = step_fn(model)
        fns[v]()
        if args.torch_ops:
            fns[f"{v} (torch ops)"] = torch_ops(step_fn(model))
    times: dict[str, list[float]] = {v: [] for v in fns}
    for _ in range(args.iters):
        for v, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[v].append(time.perf_counter() - t0)
    print(f"{args.shape}, {args.threads} thread(s), plain decode step, median of {args.iters} (interleaved):")
    for v, ts in times.items():
        print(f"  {v}: {statistics.median(ts) * 1e3:.1f} ms")
    for v, f in fns.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            f()
        print(f"\n{v}: top ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40))


if __name__ == "__main__":
    main()
