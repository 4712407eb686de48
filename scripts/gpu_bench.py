"""Decode speed eager vs compiled (CUDA graphs on a GPU), plain vs speculative, on the shipped model and on a
real-size random-weight shape: tokens/s, ms per round, and whether every configuration's greedy output equals its
own plain output. Used by scripts/gpu_check.sh; runs on a CPU too (`--device cpu`, slow to compile).

    python scripts/gpu_bench.py [--device cuda] [--tokens 128] [--shape qwen3.5-0.8b] [--compile both|none|only]
                                [--models code-small,shape] [--shape-tokens 64]

On random weights the MTP's drafts are rarely accepted, so at the shape the speculative rows measure what a round
costs (a verify of k+1 tokens plus k drafts) against a plain step, and `projected` is the speed-up a round of that
cost would give at per-position acceptance (0.9, 0.8, 0.7) (3.124 tokens a round); the shipped model's rows show
real acceptance. MTP_CUDA_STATIC=0 leaves the round's state unmarked (decode/compiled.py: the control).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import mtp
from mtp.bench.costmodel import build_shape_model


def run(model, ids, k, compiled, tokens):
    t0 = time.perf_counter()
    r = mtp.generate(model, ids, max_new_tokens=tokens, temperature=0.0, draft_tokens=k, eos_token_ids=[], compile=compiled)
    wall = time.perf_counter() - t0
    return r, wall


PROJECTED_TOKENS = 1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.7  # a round's tokens at acceptance (0.9, 0.8, 0.7), k = 3


def measure(name, model, prompts, ks, modes, tokens, repeats=2):
    rows = []
    configs = [(k, c) for c in modes for k in ks]
    for k, c in configs:  # warm-up: the first use of a graph compiles (or captures) it
        t0 = time.perf_counter()
        for ids in prompts:
            run(model, ids, k, c, tokens)
        print(f"{name}: warm-up k={k} compile={c}: {time.perf_counter() - t0:.1f} s", flush=True)
    results = {}
    for rep in range(repeats):
        for k, c in configs if rep % 2 == 0 else configs[::-1]:
            for p, ids in enumerate(prompts):
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                r, wall = run(model, ids, k, c, tokens)
                results.setdefault((k, c), []).append((p, r.tokens, r.stats.new_tokens, wall, r.stats.backbone_forwards,
                                                       r.stats.mean_accepted_length))
    plain = {(c, p): toks for (k, c), v in results.items() if k is None for p, toks, *_ in v}
    base, step = None, {}
    for (k, c), v in results.items():
        n, t, f = sum(x[2] for x in v), sum(x[3] for x in v), sum(x[4] for x in v)
        same = all(toks == plain[(c, p)] for p, toks, *_ in v)
        tps = n / t
        base = base or tps  # the model's first configuration: plain, eager where eager ran
        ms = 1e3 * t / f
        step.setdefault(c, ms)  # the plain step's (plain runs first in each mode)
        rows.append(dict(model=name, k=k, compiled=c, tokens_per_s=round(tps, 1), vs_plain=round(tps / base, 2),
                         ms_per_round=round(ms, 2), round_in_steps=round(ms / step[c], 2),
                         projected=round(PROJECTED_TOKENS * step[c] / ms, 2) if k == 3 else None,
                         accepted_length=round(sum(x[5] for x in v) / len(v), 2), equals_plain=same,
                         cuda_static=os.environ.get("MTP_CUDA_STATIC", "1")))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--compile", choices=["both", "none", "only"], default="both")
    ap.add_argument("--models", default="code-small,shape", help="which of code-small, shape (comma-separated)")
    ap.add_argument("--shape-tokens", type=int, default=64)
    args = ap.parse_args()
    dev = torch.device(args.device)
    modes = {"both": [False, True], "none": [False], "only": [True]}[args.compile]
    rows = []
    if "code-small" in args.models:
        model = mtp.load_model("models/code-small", device=dev)
        prompts = [model.tokenizer.encode(t) for t in ("def parse_args(argv):\n", "class Queue:\n    def __init__(self):\n")]
        rows += measure("code-small", model, prompts, [None, 3], modes, args.tokens)
    if "shape" in args.models:
        shape = build_shape_model(args.shape, torch.bfloat16).to(dev)
        shape.prepare_for_inference()
        rows += measure(args.shape, shape, [list(range(1, 33))], [None, 3], modes, args.shape_tokens)
    print("\n| model | k | compiled | static | tokens/s | vs plain | ms / round | round / step | projected | accepted | == plain |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['k'] or 'plain'} | {r['compiled']} | {r['cuda_static']} | {r['tokens_per_s']} | "
              f"{r['vs_plain']}x | {r['ms_per_round']} | {r['round_in_steps']} | {r['projected'] or ''} | "
              f"{r['accepted_length']} | {r['equals_plain']} |")
    return 0 if all(r["equals_plain"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
