"""`mtp quantize` (quantize.py): a model's int4 / int8 weights written as a compressed-tensors pack-quantized
checkpoint. Round trip: the written checkpoint loads (our loader) as exactly the codes `--quantize int4` runs in
memory dequantized, its logits are those of the in-memory int4 model to tolerance, greedy speculative == plain on
it; the MTP stays bf16 and in `ignore` unless asked; the compressed-tensors package validates the config and
decompresses our tensors to the same weights; transformers loads the symmetric variant to the same weights; the CLI
runs as a real process and refuses bad arguments in one line; a failed write leaves the folder as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import mtp
from conftest import tiny_model
from mtp.model.linear import Int4Weight, quantize_int8
from mtp.model.moe import split_experts
from mtp.quantize import plan_layer, quantize_checkpoint
from test_families import tiny
from test_moe import MOE_CFG, write
from test_quantized import greedy_spec_equals_plain

IDS = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
WIDE = dict(hidden_size=64, intermediate_size=128)  # layers in int4 groups of 128, 64 and 32, and int8 (4 outputs)


def expected_state(src, bits=4, group=None, quantize_mtp=False, symmetric=False) -> dict[str, torch.Tensor]:
    """What each parameter of the written checkpoint must load as (our names, bf16): the in-memory quantizer's codes
    dequantized with the stored bf16 scales, by formula; kept tensors unchanged."""
    out = {}
    state = split_experts(src.state_dict(), {})
    for name, t in state.items():
        kind = plan_layer(src, name, t, bits, group, quantize_mtp, symmetric)
        if kind is None or kind == ("keep",):
            out[name] = t
        elif kind[0] == "int4":
            wq = Int4Weight.quantize(t, kind[1], kind[2])
            N, K = t.shape
            s = wq.scale.to(torch.bfloat16).float()
            w = (wq.codes.float().view(N, -1, kind[1]) - wq.zero.float()[..., None]) * s[..., None]
            out[name] = w.view(N, K).to(torch.bfloat16)
        else:
            q, s = quantize_int8(t)
            out[name] = (q.float() * s.to(torch.bfloat16).float()[:, None]).to(torch.bfloat16)
    return out


def assert_loaded(model, want: dict[str, torch.Tensor]) -> None:
    got = split_experts(model.state_dict(), {})
    for name, t in got.items():
        if name in want:
            assert torch.equal(t, want[name].to(t.dtype)), name


def rel(a, b) -> float:
    with torch.no_grad():
        la, lb = a(IDS).float(), b(IDS).float()
    return float((la - lb).abs().max() / lb.abs().max())


def test_int4_round_trip_is_the_in_memory_int4_model(tmp_path, monkeypatch):
    src = tiny_model(std=0.02, **WIDE).to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "src")
    counts = quantize_checkpoint(tmp_path / "src", tmp_path / "q4")
    assert {k for k in counts} == {"int4 g128", "int4 g64", "int4 g32", "int8", "bf16 (ignore)"}, counts
    qc = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert "mtp.fc" in qc["ignore"] and "mtp.layers.0.mlp.down_proj" in qc["ignore"] and "lm_head" in qc["ignore"]
    stored = load_file(tmp_path / "q4" / "model.safetensors")
    assert stored["mtp.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert stored["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.int32
    assert "model.layers.0.linear_attn.in_proj_a.weight_zero_point" not in stored  # int8 channels: symmetric

    model = mtp.load_model(tmp_path / "q4")
    assert model.has_mtp
    assert_loaded(model, expected_state(src))
    in_memory = mtp.load_model(tmp_path / "src", quantize="int4")
    assert rel(model, in_memory) < 0.1  # the same codes; only the int4 kernel's bf16 arithmetic and its int4 head differ
    greedy_spec_equals_plain(model, monkeypatch, 64)
    greedy_spec_equals_plain(mtp.load_model(tmp_path / "q4", quantize="int4"), monkeypatch, 64)


def test_the_compressed_tensors_package_reads_what_we_write(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    src = tiny_model(std=0.02, **WIDE).to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q4")
    qc = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in ("version", "sparsity_config", "transform_config")})
    stored = load_file(tmp_path / "q4" / "model.safetensors")
    want = expected_state(src)
    comp = BaseCompressor.get_value_from_registry("pack-quantized")
    names = {g: scheme["targets"] for g, scheme in qc["config_groups"].items()}
    checked = 0
    for key in [k for k in stored if k.endswith(".weight_packed")]:
        base = key.removesuffix(".weight_packed")
        group = next((g for g, t in names.items() if base in t), "group_0")  # an exact target, else "Linear"
        scheme = QuantizationScheme(**qc["config_groups"][group])
        parts = {k.removeprefix(base + "."): v for k, v in stored.items() if k.startswith(base + ".weight_")}
        w = comp.decompress(parts, scheme)["weight"].to(torch.bfloat16)
        assert torch.equal(w, want[base + ".weight"]), base
        checked += 1
    assert checked > 20


def test_symmetric_int4_loads_in_transformers_as_ours(tmp_path):
    pytest.importorskip("compressed_tensors")
    import transformers

    src = tiny_model(std=0.02, **WIDE).to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "src")
    counts = quantize_checkpoint(tmp_path / "src", tmp_path / "q4", symmetric=True)
    assert "int4 g128 sym" in counts
    stored = load_file(tmp_path / "q4" / "model.safetensors")
    assert not any(k.endswith("weight_zero_point") for k in stored)
    ours = mtp.load_model(tmp_path / "q4")
    assert_loaded(ours, expected_state(src, symmetric=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q4", dtype=torch.bfloat16).eval()
    assert hf.get_submodule("model.layers.0.mlp.down_proj").quantization_scheme.weights.group_size == 128
    with torch.no_grad():  # (transformers decompresses on the first forward)
        torch.testing.assert_close(hf(IDS).logits.float(), ours(IDS).float(), atol=0.05, rtol=0.05)
    theirs = hf.state_dict()
    mine = ours.state_dict()
    shared = [k for k in mine if k in theirs]
    assert "model.layers.0.mlp.up_proj.weight" in shared and len(shared) > 40
    for k in shared:
        assert torch.equal(theirs[k].to(torch.bfloat16), mine[k].to(torch.bfloat16)), k


def test_int8_round_trip(tmp_path, monkeypatch):
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "src")
    assert set(quantize_checkpoint(tmp_path / "src", tmp_path / "q8", bits=8)) == {"int8", "bf16 (ignore)"}
    model = mtp.load_model(tmp_path / "q8")
    assert_loaded(model, expected_state(src, bits=8))
    assert rel(model, mtp.load_model(tmp_path / "src", quantize="int8")) < 0.02
    greedy_spec_equals_plain(model, monkeypatch, 64)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
def test_moe_families_export_per_expert(tmp_path, family, monkeypatch):
    if family == "deepseek_v3":
        src = tiny("deepseek_v3", std=0.02).to(torch.bfloat16)
        mtp.save_model(src, tmp_path / "src")
    else:
        src = tiny_model(std=0.02, **MOE_CFG).to(torch.bfloat16)
        write(src, tmp_path / "src", "fused", "fused")  # read fused, written per expert
    quantize_mtp = family == "deepseek_v3"  # DeepSeek-style: the MTP layer quantized like the rest
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", group=32, quantize_mtp=quantize_mtp)
    stored = load_file(tmp_path / "q" / "model.safetensors")
    assert any(k.endswith("experts.3.down_proj.weight_packed") for k in stored)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert any(p.endswith("mlp.gate") for p in qc["ignore"])  # routers stay bf16
    if quantize_mtp:
        assert "model.layers.3.mlp.experts.0.up_proj.weight_packed" in stored
        assert "model.layers.3.eh_proj" in qc["ignore"]  # keep_precision: the MTP's input projection
    model = mtp.load_model(tmp_path / "q")
    assert_loaded(model, expected_state(src, group=32, quantize_mtp=quantize_mtp))
    greedy_spec_equals_plain(model, monkeypatch, 64)


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "src")
    mtp.save_model(src, tmp_path / "out")  # a previous checkpoint in OUT
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    import mtp.io.files as files

    real = files.FolderWriter.write_text
    monkeypatch.setattr(files.FolderWriter, "write_text", lambda self, *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        quantize_checkpoint(tmp_path / "src", tmp_path / "out")
    monkeypatch.setattr(files.FolderWriter, "write_text", real)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_the_cli_writes_a_checkpoint_and_refuses_bad_arguments(tmp_path):
    src = tiny_model(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "mtp.cli", "quantize", *map(str, a)], capture_output=True,
                                    text=True, env=env, timeout=120)
    r = run(tmp_path / "src", tmp_path / "q4", "--group-size", "32")
    assert r.returncode == 0, r.stderr
    assert "compressed-tensors pack-quantized" in r.stdout and "int4 g32" in r.stdout
    assert mtp.load_model(tmp_path / "q4").has_mtp
    r = run(tmp_path / "src", tmp_path / "bad", "--group-size", "48")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("mtp quantize: error: group size 48")
    assert not (tmp_path / "bad").exists()
    r = run(tmp_path / "nowhere", tmp_path / "bad")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "mtp quantize: error:" in r.stderr
