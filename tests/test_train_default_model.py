"""The shipped default model (models/code-small): loads in mtp and in transformers with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mtp

MODEL = Path(__file__).resolve().parents[1] / "models" / "code-small"

CODE = '''def read_config(path):
    """Read a JSON config file and return a dict."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
'''


def test_default_model_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (MODEL / name).exists(), name
    assert sum(f.stat().st_size for f in MODEL.iterdir()) <= 80 * 2**20       # the folder, plot included


@torch.no_grad()
def test_default_model_matches_transformers():
    transformers = pytest.importorskip("transformers")
    model = mtp.load_model(MODEL, dtype="float32")                     # the weights are bf16: compare in fp32
    assert model.has_mtp and model.tokenizer is not None and model.config.mtp_num_hidden_layers == 1
    ids = torch.tensor([model.tokenizer.encode(CODE)])
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    assert hf_tok.encode(CODE, add_special_tokens=False) == ids[0].tolist()


def test_cli_generate_uses_default_model(capsys):
    from mtp.cli import main

    assert main(["generate", "--prompt", "def main(", "--max-new-tokens", "8", "--json"]) == 0
    assert '"tokens"' in capsys.readouterr().out
