"""strategy=fsdp (FSDP2 `fully_shard`) under torchrun, on CPU with gloo: 2 processes == 1 process (losses, weights,
optimizer state), the HF model folder loads with the embedding still tied, a kill + resume is bit-exact, and a
one-process checkpoint continues under FSDP."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp import load_model
from mtp.config import ConfigError
from mtp.io import read_tensors
from mtp.train.config import load_config
from serve_support import free_port
from test_data import build_toy
from test_train import MODEL, cfg, rows

# A kill under torchrun: each process's train_step is wrapped to exit with status 3 once the step given is done (the
# checkpoint before it is on disk), as tests/conftest.py's kill_after_step does in one process.
CRASH_LAUNCHER = """import sys
from mtp.train import trainer
from mtp.train.config import load_config

real, kill_at = trainer.train_step, int(sys.argv[1])


def step_then_die(run):
    result = real(run)
    if run.step == kill_at:
        sys.exit(3)
    return result


trainer.train_step = step_then_die
trainer.train(load_config(preset="tiny", overrides=sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_toy(tmp_path_factory.mktemp("toy"))


def common(data: Path) -> list[str]:
    """The overrides every run here shares: 6 steps, checkpoints at 2, 4, 6 (the last two kept)."""
    return [f"data={data}", f"model={json.dumps(MODEL)}", "seq_len=32", "max_steps=6", "lr=3e-3", "warmup_steps=1",
            "eval_every=3", "save_every=2", "eval_seqs=4", "eval_batch=4", "progress=false", "threads=1"]


def torchrun(target: list[str], args: list[str]) -> subprocess.CompletedProcess:
    """2 processes on a free port; target: ["-m", "mtp.cli", "train", "--preset", "tiny"] or [script, ...] ->
    the finished process (text output captured)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", *target, *args],
                          env=env, capture_output=True, text=True, timeout=300)


CLI = ["-m", "mtp.cli", "train", "--preset", "tiny"]
FSDP_2X2 = ["micro_batch=2", "grad_accum=1", "strategy=fsdp"]   # 2 processes x 2 sequences = the global batch of 4


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> tuple[Path, Path, str]:
    """One process (micro_batch 2 x grad_accum 2) and 2-process FSDP (micro_batch 2) over the same global batch ->
    (one, two, the FSDP run's stdout)."""
    root = tmp_path_factory.mktemp("fsdp")
    one, two = root / "one", root / "two"
    subprocess.run([sys.executable, "-m", "mtp.cli", "train", "--preset", "tiny", *common(data), f"out={one}",
                    "micro_batch=2", "grad_accum=2"], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   capture_output=True, timeout=300)
    r = torchrun(CLI, [*common(data), f"out={two}", *FSDP_2X2])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return one, two, r.stdout


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: f.tensor(n) for k, (f, n) in read_tensors(folder).items()}


@pytest.mark.slow
def test_fsdp_two_processes_match_one(runs):
    one, two, stdout = runs
    m = re.search(r"fsdp over 2 processes \(gloo, cpu\): ([\d,]+) of ([\d,]+) parameters", stdout)
    assert m, stdout[-2000:]
    held, total = (int(g.replace(",", "")) for g in m.groups())
    assert held < 0.6 * total                                          # sharded, not replicated
    a, b = rows(one), rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        assert x["main"] == pytest.approx(y["main"], rel=1e-5) and x["mtp"] == pytest.approx(y["mtp"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    sa, sb = tensors(one / "model"), tensors(two / "model")
    assert sa.keys() == sb.keys() and "lm_head.weight" not in sb           # tied head not written, as in one process
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-5, msg=k)
    # the optimizer state gathered to rank 0 is the one-process layout (keyed 0..n-1) with the same moments
    oa = torch.load(one / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=False)["optimizer"]
    ob = torch.load(two / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=False)["optimizer"]
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k in ("exp_avg", "exp_avg_sq"):
            assert type(ob["state"][i][k]) is torch.Tensor
            torch.testing.assert_close(ob["state"][i][k], oa["state"][i][k], rtol=1e-3, atol=1e-7, msg=f"{i} {k}")
    model = load_model(two / "model")
    assert model.has_mtp and model.tokenizer is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.slow
def test_fsdp_exact_resume_after_kill(runs, data, tmp_path):
    _, full, _ = runs
    killed = tmp_path / "killed"
    launcher = tmp_path / "crash_launcher.py"
    launcher.write_text(CRASH_LAUNCHER)
    r = torchrun([str(launcher), "5"], [*common(data), f"out={killed}", *FSDP_2X2])
    assert r.returncode != 0 and not (killed / "model").exists(), r.stderr[-3000:]
    assert (killed / "latest").read_text().strip() == "step-000004"
    r = torchrun(CLI, [*common(data), f"out={killed}", *FSDP_2X2])     # resumes at step 4 on both ranks
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    a, b = rows(full), rows(killed)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [(r["main"], r["mtp"], r["grad_norm"]) for r in a] == [(r["main"], r["mtp"], r["grad_norm"]) for r in b]
    sa, sb = tensors(full / "model"), tensors(killed / "model")
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k                                      # bit-exact


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_fsdp(runs, data, tmp_path):
    one, _, _ = runs
    moved = tmp_path / "moved"                  # the one-process run, rolled back to its step-4 checkpoint
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step-000004", moved / "checkpoints" / "step-000004")
    shutil.copyfile(one / "metrics.jsonl", moved / "metrics.jsonl")
    (moved / "latest").write_text("step-000004\n")
    r = torchrun(CLI, [*common(data), f"out={moved}", *FSDP_2X2])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    a, b = rows(one), rows(moved)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a[4:], b[4:]):                                       # steps 5, 6: continued under FSDP
        assert x["main"] == pytest.approx(y["main"], rel=1e-5) and x["mtp"] == pytest.approx(y["mtp"], rel=1e-5)
    sa, sb = tensors(one / "model"), tensors(moved / "model")
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-5, msg=k)


def test_strategy_is_validated(data, tmp_path):
    assert cfg(data, tmp_path).strategy == "ddp"
    assert load_config(preset="tiny", overrides=["data=x", "out=y", "strategy=fsdp"]).strategy == "fsdp"
    with pytest.raises(ConfigError, match="'strategy'.*'zero3'"):
        cfg(data, tmp_path, strategy="zero3")
