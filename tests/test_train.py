"""Trainer: modes, exact resume after a kill, heads-only bit identity, 2-process torchrun == 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import Killed, kill_after_step
from mtp import load_model
from mtp.config import ConfigError
from mtp.io import read_tensors
from mtp.train.config import TrainConfig, load_config
from mtp.train.trainer import train
from serve_support import free_port
from test_data import build_toy

MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, full_attention_interval=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
             max_position_embeddings=256, rope_theta=10000.0, mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_toy(tmp_path_factory.mktemp("toy"))


def cfg(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), model=MODEL, seq_len=32, micro_batch=4, max_steps=6, lr=3e-3,
                warmup_steps=2, eval_every=3, save_every=2, eval_seqs=8, eval_batch=4, progress=False, threads=1)
    base.update(kw)
    return TrainConfig.from_dict(base)


def rows(out: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_pretrain_writes_hf_checkpoints_metrics_and_plot(data, tmp_path):
    val = train(cfg(data, tmp_path / "r", max_steps=12, eval_every=6))
    tr = rows(tmp_path / "r")
    assert len(tr) == 12 and tr[-1]["main"] < tr[0]["main"] and tr[-1]["mtp"][0] < tr[0]["mtp"][0]
    assert {"loss", "acc", "loss_1", "acc_1", "accept_1", "accept_pos_1"} <= set(val)
    ck = tmp_path / "r" / "checkpoints" / "step-000012"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "trainer_state.pt"):
        assert (ck / f).exists(), f
    assert (tmp_path / "r" / "loss.png").stat().st_size > 1000
    assert len(list((tmp_path / "r" / "checkpoints").glob("step-*"))) == 2          # keep_checkpoints
    m = load_model(tmp_path / "r" / "model")
    assert m.has_mtp and m.tokenizer is not None


def test_exact_resume_after_kill(data, tmp_path, monkeypatch):
    full = tmp_path / "full"
    train(cfg(data, full))
    killed = tmp_path / "killed"
    with monkeypatch.context() as m, pytest.raises(Killed):
        kill_after_step(m, 5)
        train(cfg(data, killed))                                       # last checkpoint: step 4
    assert (killed / "latest").read_text().strip() == "step-000004"
    train(cfg(data, killed))                                           # resumes at step 4
    a, b = rows(full), rows(killed)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [(r["main"], r["mtp"]) for r in a] == [(r["main"], r["mtp"]) for r in b]   # bit-exact
    sa, sb = read_tensors(full / "model"), read_tensors(killed / "model")
    for k in sa:
        assert torch.equal(sa[k][0].tensor(sa[k][1]), sb[k][0].tensor(sb[k][1])), k


@pytest.mark.parametrize("target", ["tokens", "self"])
def test_heads_mode_leaves_backbone_bit_identical(data, tmp_path, target):
    train(cfg(data, tmp_path / "base", max_steps=4))
    init = tmp_path / "base" / "model"
    before = {k: f.tensor(n).clone() for k, (f, n) in read_tensors(init).items()}
    train(cfg(data, tmp_path / "heads", mode="heads", init=str(init), heads_target=target, lr=1e-2, model={}))
    after = {k: f.tensor(n) for k, (f, n) in read_tensors(tmp_path / "heads" / "model").items()}
    assert before.keys() == after.keys()
    for k in before:
        if k.startswith("mtp."):
            continue
        assert torch.equal(before[k], after[k]), k                       # frozen: bit-identical
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("mtp."))
    tr = rows(tmp_path / "heads")
    assert tr[-1]["mtp"][0] < tr[0]["mtp"][0]


def test_finetune_keeps_mtp_loss_and_parallel_school(data, tmp_path):
    train(cfg(data, tmp_path / "base", max_steps=2, model={**MODEL, "mtp_style": "parallel", "mtp_num_hidden_layers": 2},
              mtp_schedule="decay"))
    train(cfg(data, tmp_path / "ft", mode="finetune", init=str(tmp_path / "base" / "model"), model={}, max_steps=3,
              mtp_schedule="decay"))
    tr = rows(tmp_path / "ft")
    assert all(len(r["mtp"]) == 2 and r["w"] == pytest.approx([0.8, 0.64]) for r in tr)
    val = rows(tmp_path / "ft", "val")[-1]
    assert "accept_pos_2" in val and 0.0 <= val["accept_pos_2"] <= 1.0
    m = load_model(tmp_path / "ft" / "model")
    assert m.config.mtp_style == "parallel" and m.has_mtp


def test_ntp_only_bf16_and_checkpointing_options(data, tmp_path):
    val = train(cfg(data, tmp_path / "r", mtp_depth=0, bf16=True, gradient_checkpointing=True, checkpoint_logits=True,
                    max_steps=3))
    assert "loss_1" not in val and rows(tmp_path / "r")[-1]["mtp"] == []


def test_config_errors_name_the_key(data, tmp_path):
    with pytest.raises(ConfigError, match="'nonsense'"):
        cfg(data, tmp_path, nonsense=1)
    with pytest.raises(ConfigError, match="heads_target"):
        cfg(data, tmp_path, heads_target="self")
    with pytest.raises(ConfigError, match="'init'"):
        cfg(data, tmp_path, mode="heads")
    with pytest.raises(ConfigError, match="mode"):
        cfg(data, tmp_path, mode="distill")
    c = load_config(preset="tiny", overrides=["data=x", "out=y", "max_steps=7", "model.hidden_size=48"])
    assert c.max_steps == 7 and c.model["hidden_size"] == 48
    with pytest.raises(ConfigError, match="preset"):
        load_config(preset="huge")


@pytest.mark.slow
def test_torchrun_two_processes_match_one(data, tmp_path):
    common = [f"data={data}", f"model={json.dumps(MODEL)}", "seq_len=32", "max_steps=3", "lr=3e-3", "warmup_steps=1",
              "eval_every=3", "save_every=3", "eval_seqs=4", "eval_batch=4", "progress=false", "threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one"
    subprocess.run([sys.executable, "-m", "mtp.cli", "train", "--preset", "tiny", *common, f"out={one}",
                    "micro_batch=2", "grad_accum=2"], check=True, env=env, capture_output=True)
    two = tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                        "-m", "mtp.cli", "train", "--preset", "tiny", *common, f"out={two}", "micro_batch=2",
                        "grad_accum=1"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = rows(one), rows(two)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        assert x["main"] == pytest.approx(y["main"], rel=1e-5) and x["mtp"] == pytest.approx(y["mtp"], rel=1e-5)
    sa, sb = read_tensors(one / "model"), read_tensors(two / "model")
    for k in sa:
        torch.testing.assert_close(sb[k][0].tensor(sb[k][1]), sa[k][0].tensor(sa[k][1]), rtol=1e-4, atol=1e-5, msg=k)
