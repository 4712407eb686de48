"""`mtp retrofit --style head` (`train/retrofit.py`): fresh MTP layers trained onto a frozen transformers Llama /
Qwen3 (the generic family, `model/hf_causal.py`) by self-distillation. The backbone stays bit-identical, the result
reloads (with mtp and, as a plain model, with transformers), greedy speculative decoding with it equals plain
decoding, a killed run resumes exactly, and the report holds held-out acceptance per position before and after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtp
from conftest import Killed, kill_after_step
from mtp.io import read_tensors
from mtp.train.retrofit import retrofit_head
from test_data import build_toy

transformers = pytest.importorskip("transformers")

V = 320  # >= the toy data's vocabulary
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)
ARCHS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config"}
RUN = dict(steps=6, lr=3e-3, seq_len=32, micro_batch=4, eval_seqs=8, eval_every=2, threads=1, device="cpu",
           progress=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_toy(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """arch -> a random transformers model saved by transformers itself (no MTP)."""
    out = {}
    for arch, cls in ARCHS.items():
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**COMMON))
        path = tmp_path_factory.mktemp(arch)
        ref.save_pretrained(path)
        out[arch] = path
    return out


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: f.tensor(n).clone() for k, (f, n) in read_tensors(path).items()}


def metric_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


@pytest.mark.parametrize("arch, layers", [("llama", 1), ("qwen3", 2)])
def test_head_retrofit_frozen_backbone_reload_and_lossless(data, bases, tmp_path, arch, layers):
    base = bases[arch]
    report = retrofit_head(str(base), str(data), tmp_path / "run", layers=layers, **RUN)
    assert report["before"]["note"].startswith("no MTP") and report["before"]["loss"] > 0
    after = report["after"]
    assert len(after["acceptance_per_position"]) == layers and all(0 <= a <= 1 for a in after["acceptance_per_position"])
    assert after["mean_accepted_length"] >= 1
    assert json.loads((tmp_path / "run" / "report.json").read_text()) == report

    model_dir = tmp_path / "run" / "model"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["mtp_num_hidden_layers"] == layers
    before, now = tensors(base), tensors(model_dir)
    assert {k for k in now if not k.startswith("mtp.")} == set(before)
    for k in before:
        assert torch.equal(before[k], now[k]), k                     # the backbone: bit-identical
    assert sum(k.startswith(f"mtp.layers.{layers - 1}.") for k in now) > 0

    model = mtp.load_model(model_dir, dtype="float32")
    assert type(model).__name__ == "HFCausalLM" and model.mtp is not None and model.mtp.num_layers == layers
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, V, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        want = mtp.generate(model, prompt, max_new_tokens=20).tokens
        for k in (1, 2, 4, "auto"):
            assert mtp.generate(model, prompt, max_new_tokens=20, draft_tokens=k).tokens == want, (arch, k)
    # transformers reads the folder as the plain model it was (the mtp.* tensors are keys it drops)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(0, V, (1, 16), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, model(ids), atol=1e-5, rtol=0)


def test_head_retrofit_resumes_exactly_after_a_kill(data, bases, tmp_path, monkeypatch):
    full = tmp_path / "full"
    retrofit_head(str(bases["llama"]), str(data), full, **RUN)
    killed = tmp_path / "killed"
    with monkeypatch.context() as m, pytest.raises(Killed):
        kill_after_step(m, 5)
        retrofit_head(str(bases["llama"]), str(data), killed, **RUN)   # last checkpoint: step 4
    assert (killed / "latest").read_text().strip() == "step-000004"
    report = retrofit_head(str(bases["llama"]), str(data), killed, **RUN)
    a, b = metric_rows(full), metric_rows(killed)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [(r["main"], r["mtp"]) for r in a] == [(r["main"], r["mtp"]) for r in b]   # bit-exact
    sa, sb = tensors(full / "model"), tensors(killed / "model")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert report == {**json.loads((full / "report.json").read_text()), "model": str(killed / "model")}


def test_cli_retrofit_head_real_process(data, bases, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "mtp.cli", "retrofit", "--base", str(bases["qwen3"]), "--data", str(data), "--out",
           str(out), "--style", "head", "--steps", "2", "--seq-len", "32", "--micro-batch", "2", "--eval-seqs", "4",
           "--eval-every", "2", "--threads", "1", "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["style"] == "head" and len(report["after"]["acceptance_per_position"]) == 1
    assert mtp.load_model(out / "model").mtp is not None
    # a second run resumes from OUT/latest (already at the last step: nothing more is trained)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["after"] == report["after"], r.stderr[-2000:]
