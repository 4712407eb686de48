"""`mtp check` as a user runs it (a real process): the report and its verdicts - a trained head (ok, also as an FP8
release), a random head and a zeroed one (untrained / zeroed), a fine-tune that lost its MTP tensors (missing),
a config without MTP layers (none) - with the exit status and --json."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp
from conftest import trained_tiny_model
from test_quantized import release_fp8


def run_check(path, *extra):
    p = subprocess.run([sys.executable, "-m", "mtp.cli", "check", str(path), "--threads", "1", *extra],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def trained():
    return trained_tiny_model(steps=100)


def test_a_trained_head_is_ok_with_its_agreement(tmp_path, trained):
    mtp.save_model(trained, tmp_path)
    code, out, err = run_check(tmp_path, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["verdict"] == "ok" and r["mtp_expected"] == r["mtp_found"] == 1 and r["family"] == "qwen3_5_text"
    assert r["first_draft_agreement"] >= 0.4 and r["quantization"] is None
    assert r["tensor_dtypes"]["mtp"] == {"float32": 15}


def test_an_fp8_release_reports_its_quantization_and_still_drafts(tmp_path, trained):
    mtp.save_model(trained.to(torch.bfloat16), tmp_path)
    release_fp8(tmp_path, (16, 16))
    code, out, err = run_check(tmp_path)
    assert code == 0, err
    assert "quantization quant_method fp8, weight_block_size [16, 16]" in out and "float8_e4m3fn" in out
    assert "verdict      ok" in out


@pytest.mark.parametrize("damage, verdict", [("random", "untrained"), ("zero", "zeroed")])
def test_a_random_or_zeroed_head_fails(tmp_path, trained, damage, verdict):
    m = copy.deepcopy(trained)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.mtp.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 if damage == "random" else torch.zeros_like(p))
    mtp.save_model(m, tmp_path)
    code, out, _ = run_check(tmp_path, "--json")
    r = json.loads(out)
    assert code == 1 and r["verdict"] == verdict and "mtp heal" in r["advice"]
    if damage == "random":
        assert r["first_draft_agreement"] < 0.2


def test_a_finetune_without_mtp_tensors_is_missing(tmp_path, trained):
    mtp.save_model(trained, tmp_path)
    f = tmp_path / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not k.startswith("mtp.")}, f)
    code, out, _ = run_check(tmp_path)
    assert code == 1
    assert "MTP layers   expected 1 (mtp_num_hidden_layers), found 0" in out and "verdict      missing: " in out
    assert "mtp heal --base BASE" in out


def test_a_config_without_mtp_layers_says_none(tmp_path, trained):
    mtp.save_model(trained, tmp_path)
    f = tmp_path / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not k.startswith("mtp.")}, f)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run_check(tmp_path, "--json")
    assert code == 1 and json.loads(out)["verdict"] == "none"


def test_a_head_with_tensors_missing_is_incomplete(tmp_path, trained):
    mtp.save_model(trained, tmp_path)
    f = tmp_path / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if k != "mtp.fc.weight"}, f)
    code, out, _ = run_check(tmp_path, "--json")
    r = json.loads(out)
    assert code == 1 and r["verdict"] == "incomplete" and "mtp.fc.weight" in r["error"]
