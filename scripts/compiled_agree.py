"""Compiled plain vs compiled k=2 vs eager plain on one bench prompt of the shipped model (greedy, 128 tokens): where
they first differ (None: identical). `python scripts/compiled_agree.py {bf16|int8} PROMPT_INDEX`
(docs/decisions.md, issue 18)."""

import sys
import time

import torch

import mtp
from mtp import Tokenizer
from mtp.bench.prompts import load_prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    torch.set_num_threads(1)
    model = mtp.load_model("models/code-small", dtype="bfloat16")
    if sys.argv[1] != "bf16":
        model.prepare_for_inference(sys.argv[1])
    ids = Tokenizer.from_dir("models/code-small").encode(load_prompts()[int(sys.argv[2])].text)
    outs = {}
    for k in (None, 2):
        t = time.time()
        outs[k] = mtp.generate(model, ids, max_new_tokens=128, draft_tokens=k, eos_token_ids=[], compile=True).tokens
        print("compiled k", k, "took", round(time.time() - t), "s", flush=True)
    eager = mtp.generate(model, ids, max_new_tokens=128, eos_token_ids=[]).tokens
    print(sys.argv[1:], "spec vs plain:", first_difference(outs[2], outs[None]), "plain vs eager:",
          first_difference(outs[None], eager), "spec vs eager:", first_difference(outs[2], eager))


if __name__ == "__main__":
    main()
