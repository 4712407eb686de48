"""Golden greedy outputs of the shipped model: a refactor of the model or the decoder must not change a token.

`tests/golden/code_small_greedy.json` was written by the decoder before the change it guards (regenerate it
only when the shipped model itself is replaced: `python tests/test_golden.py --write`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import mtp

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "code_small_greedy.json"
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    def __init__(self, path):", "The history of the printing press"]
NEW_TOKENS = 48


def run(model) -> dict:
    out = {"model": "models/code-small", "max_new_tokens": NEW_TOKENS, "cases": []}
    for p in PROMPTS:
        ids = model.tokenizer.encode(p)
        for k in (None, 2, "auto"):
            r = mtp.generate(model, ids, max_new_tokens=NEW_TOKENS, draft_tokens=k, eos_token_ids=[])
            out["cases"].append({"prompt": p, "draft_tokens": k, "tokens": r.tokens})
    return out


@pytest.fixture(scope="module")
def model():
    # one thread, as when the file was written: a reduction split across threads may round differently
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield mtp.load_model(ROOT / "models" / "code-small")
    torch.set_num_threads(threads)


def test_shipped_model_greedy_outputs_are_unchanged(model):
    want = json.loads(GOLDEN.read_text())
    got = run(model)
    assert len(want["cases"]) == len(got["cases"]) == len(PROMPTS) * 3  # a short golden file must not pass
    for w, g in zip(want["cases"], got["cases"], strict=True):
        assert (g["prompt"], g["draft_tokens"]) == (w["prompt"], w["draft_tokens"])
        assert len(w["tokens"]) == NEW_TOKENS, (w["prompt"], w["draft_tokens"])
        assert g["tokens"] == w["tokens"], (w["prompt"], w["draft_tokens"])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    torch.set_num_threads(1)
    GOLDEN.write_text(json.dumps(run(mtp.load_model(ROOT / "models" / "code-small"))) + "\n")
