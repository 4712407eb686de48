"""Decoding with a retrofit against the native MTP on the same backbone: real greedy generations from held-out
prompts, plain and speculative, with the tokens each backbone forward gave and the wall time.

    python scripts/retrofit_compare.py --data DATA --model NAME=DIR [--model NAME=DIR ...] [--prompts 6] [--new 64]
                                       [--draft-tokens 3] [--threads 1]

Prompts are the first 48 tokens of windows of DATA's held-out split (`retrofit.heldout`); decoding is pure greedy
(no repetition penalty), so every speculative output must equal its plain output (checked). Prints one JSON object:
per model, the mean accepted drafts per round, tokens per backbone forward and the plain/speculative wall-time ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import mtp
from mtp.train.retrofit import heldout


def measure(model, prompts: list[list[int]], new: int, k: int | str) -> dict:
    plain_s = spec_s = 0.0
    forwards = tokens = rounds = drafted = accepted = 0
    for p in prompts:
        t = time.perf_counter()
        want = mtp.generate(model, p, max_new_tokens=new, repetition_penalty=1.0).tokens
        plain_s += time.perf_counter() - t
        t = time.perf_counter()
        r = mtp.generate(model, p, max_new_tokens=new, draft_tokens=k, repetition_penalty=1.0)
        spec_s += time.perf_counter() - t
        if r.tokens != want:
            raise SystemExit("speculative output differs from plain output: a bug")
        forwards += r.stats.backbone_forwards
        tokens += len(r.tokens)
        rounds += sum(1 for kk in r.stats.k_history if kk > 0)
        drafted += sum(r.stats.drafted)
        accepted += sum(r.stats.accepted)
    return {"tokens_per_backbone_forward": round(tokens / forwards, 3), "drafting_rounds": rounds,
            "accepted_per_drafting_round": round(accepted / max(1, rounds), 3),
            "accepted_fraction_of_drafts": round(accepted / max(1, drafted), 3),
            "speedup_wall": round(plain_s / spec_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", action="append", required=True, help="NAME=DIR")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--draft-tokens", default="3")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    k = a.draft_tokens if a.draft_tokens == "auto" else int(a.draft_tokens)
    windows = torch.cat(heldout(a.data, 48, a.prompts, batch=a.prompts))
    prompts = [w.tolist() for w in windows[: a.prompts]]
    out = {"prompts": len(prompts), "new_tokens": a.new, "draft_tokens": k, "threads": a.threads}
    for spec in a.model:
        name, path = spec.split("=", 1)
        model = mtp.load_model(path, dtype="float32")
        out[name] = measure(model, prompts, a.new, k)
        print(name, out[name], flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
