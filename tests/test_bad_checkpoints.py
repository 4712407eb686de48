"""Hostile checkpoints and configs (issue 22): every bad value is refused before anything is allocated, with one line
naming the file and the key or tensor; sizes are bounded by the checkpoint's tensors and by memory; NaN/Inf weights
are named at load (refused under strict); the CLI prints one line, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp
from conftest import tiny_config, tiny_model
from mtp.config import ConfigError
from mtp.model import budget
from mtp.model.base import CausalLM, NonFiniteLogitsWarning
from mtp.model.checkpoint import NonFiniteWeightsWarning
from mtp.model.families import model_class_for
from serve_support import build_model_dir


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny checkpoint (4 decoder layers, 1 MTP layer, hidden 32, vocab 64, fp32) with a tokenizer."""
    return build_model_dir(tmp_path_factory.mktemp("bad") / "tiny", chat_template=False)


def copy_with(src, dst, config=None, drop=(), tensors=None):
    """A copy of checkpoint `src` with config keys changed (`config`), removed (`drop`) and tensors edited."""
    shutil.copytree(src, dst)
    if config is not None or drop:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config or {})
        for key in drop:
            cfg.pop(key, None)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# Each: config keys changed (or dropped), what the one-line error must say. None of them may allocate what it asks:
# the old loader hung on the first (building 10**6 MTP layers), ran out of memory on the second (a 10**9-entry
# layer_types list) and tried to allocate 5 GB for the third.
CONFIG_CASES = {
    "mtp layers": ({"mtp_num_hidden_layers": 10**6}, (),
                   r"config.json: config key 'mtp_num_hidden_layers' is 1000000 but the checkpoint holds MTP layer tensors "
                   r"mtp.layers.0.\*"),
    "layers": ({"num_hidden_layers": 10**9}, ("layer_types",),
               r"config.json: config key 'num_hidden_layers' is 1000000000 but the checkpoint holds decoder layers 0-3"),
    "head_dim": ({"head_dim": 10**10}, (), r"model.safetensors: tensor 'model.layers.1.self_attn.q_proj.weight' has shape "
                                           r"\[128, 32\], expected \[80000000000, 32\] for this config"),
    "heads": ({"num_attention_heads": 2**62, "num_key_value_heads": 2**62}, (),
              r"config.json: the model this config describes cannot be built \("),
    "hidden": ({"hidden_size": 10**12}, (), r"config.json: config keys 'vocab_size' x 'hidden_size' ask for an embedding of "
                                            r"\[\d+, 1000000000000\] but the checkpoint's tensor 'model.embed_tokens.weight' is"),
    "eps string": ({"rms_norm_eps": "tiny"}, (), r"config.json: config key 'rms_norm_eps' must be a finite number, got 'tiny'"),
    "eps negative": ({"rms_norm_eps": -1e-6}, (), r"config.json: config key 'rms_norm_eps' must be > 0, got -1e-06"),
    "eps NaN": ({"rms_norm_eps": float("nan")}, (), r"config key 'rms_norm_eps' must be a finite number, got nan"),
    "layers string": ({"num_hidden_layers": "4"}, (), r"config key 'num_hidden_layers' must be an integer, got '4'"),
    "layers bool": ({"num_hidden_layers": True}, (), r"config key 'num_hidden_layers' must be an integer, got True"),
    "eos list of strings": ({"eos_token_id": ["x"]}, (), r"config key 'eos_token_id' must be an integer or a list of integers"),
    "rope dict": ({"rope_parameters": [1]}, (), r"config key 'rope_parameters' must be an object or null"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_values_are_refused_before_the_model_is_built(saved, tmp_path, case):
    config, drop, message = CONFIG_CASES[case]
    path = copy_with(saved, tmp_path / "m", config=config, drop=drop)
    with pytest.raises((ConfigError, mtp.CheckpointError), match=message) as e:
        mtp.load_model(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("what, write, message", [
    ("a folder", lambda p: p.mkdir(), "is a folder, not a JSON file"),
    ("binary", lambda p: p.write_bytes(bytes(range(256))), r"not a text file \(not valid UTF-8\)"),
    ("a list", lambda p: p.write_text("[1]"), r"not a JSON object \(the file holds a list\)"),
    ("not JSON", lambda p: p.write_text("{nope"), "not valid JSON"),
])
def test_unreadable_config_json_is_named(saved, tmp_path, what, write, message):
    path = copy_with(saved, tmp_path / "m")
    (path / "config.json").unlink()
    write(path / "config.json")
    with pytest.raises(ConfigError, match=f"{path / 'config.json'}: {message}"):
        mtp.load_model(path)


@pytest.mark.parametrize("text, message", [
    ("[1]", r"tokenizer_config.json: not a JSON object \(the file holds a list\)"),
    (b"\xff\xfe{{", r"tokenizer_config.json: not a text file"),
    ('{"eos_token": 5}', r"tokenizer_config.json: key 'eos_token' must be a string"),
    ('{"chat_template": 7}', r"tokenizer_config.json: key 'chat_template' must be a string or a list of named templates"),
])
def test_bad_tokenizer_config_is_named(saved, tmp_path, text, message):
    path = copy_with(saved, tmp_path / "m")
    f = path / "tokenizer_config.json"
    f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        mtp.load_model(path)


def test_named_chat_templates_take_the_default_one_as_transformers_does(saved, tmp_path):
    path = copy_with(saved, tmp_path / "m")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"}, "chat_template": [{"name": "tool_use", "template": "T"},
                                                                       {"name": "default", "template": "D"}]}))
    assert mtp.load_model(path).tokenizer.chat_template == "D"


# ---------------------------------------------------------------------- memory
def test_a_model_larger_than_the_memory_available_is_refused_before_loading(saved, monkeypatch):
    need = budget.model_bytes(mtp.load_model(saved), 4)
    monkeypatch.setattr(budget, "available_memory", lambda device: need - 1)
    with pytest.raises(budget.TooLargeError, match=f"{saved / 'config.json'}: the model this config describes takes "
                                                   r".* MB in float32, more than the .* MB of memory available on cpu"):
        mtp.load_model(saved)
    monkeypatch.setattr(budget, "available_memory", lambda device: need)
    mtp.load_model(saved)  # exactly enough: the tied head counts once


def test_configs_without_a_checkpoint_are_bounded_by_memory():
    """What training from scratch builds: refused from the config's sizes alone (the lower bound: at once), or while
    the meta build counts (a huge layer is refused as soon as it is registered)."""
    deep = tiny_config(num_hidden_layers=10**9, mtp_num_hidden_layers=1)
    with pytest.raises(budget.TooLargeError, match="config keys 'num_hidden_layers' \\(1000000000\\), "
                                                   "'mtp_num_hidden_layers' \\(1\\), 'hidden_size' \\(32\\) and "
                                                   "'vocab_size' \\(64\\) describe a model of at least .* GB"):
        budget.build_on_meta(model_class_for(deep), deep, torch.float32, "cpu", "train config key 'model'")
    wide = tiny_config(intermediate_size=10**12)
    with pytest.raises(budget.TooLargeError, match="the model this config describes takes more than"):
        budget.build_on_meta(model_class_for(wide), wide, torch.float32, "cpu", "x", limit=10**9)
    small = tiny_config()
    model = budget.build_on_meta(model_class_for(small), small, torch.float32, "cpu", "x")
    assert model.model.embed_tokens.weight.is_meta
    assert budget.parameter_bytes(model, 4) == 4 * sum(p.numel() for p in tiny_model().parameters())  # tied: once


def test_training_from_scratch_refuses_a_config_too_big_for_memory(tmp_path):
    from mtp.train.trainer import build_model
    from test_train import MODEL, cfg

    c = cfg(tmp_path, tmp_path / "out", model={**MODEL, "num_hidden_layers": 10**9})
    with pytest.raises(budget.TooLargeError, match="train config key 'model': config keys 'num_hidden_layers' "
                                                   "\\(1000000000\\)"):
        build_model(c, vocab_size=64, eos_id=0)


# ---------------------------------------------------------------------- NaN / Inf weights
NON_FINITE = {
    "embedding": ("model.embed_tokens.weight", lambda t: t.__setitem__((5, 3), float("nan")), "1 value"),
    "a layer": ("model.layers.2.mlp.down_proj.weight", lambda t: t.__setitem__((0, 0), float("inf")), "1 value"),
    "final norm": ("model.norm.weight", lambda t: t.fill_(float("-inf")), "32 values"),
}


@pytest.mark.parametrize("case", list(NON_FINITE))
def test_non_finite_weights_are_named_at_load_and_refused_under_strict(saved, tmp_path, case):
    name, edit, count = NON_FINITE[case]
    path = copy_with(saved, tmp_path / "m", tensors=lambda s: edit(s[name]))
    with pytest.warns(NonFiniteWeightsWarning, match=f"model.safetensors: NaN or Inf in tensor '{name}' \\({count}\\): "
                                                     "every output of this model would be garbage"):
        model = mtp.load_model(path)
    with pytest.raises(mtp.CheckpointError, match=f"NaN or Inf in tensor '{name}'"):
        mtp.load_model(path, strict=True)
    # what the decoder sees: logits that are not finite, which the seam's check reports
    logits = model(torch.tensor([[1, 2, 3]]))
    with pytest.warns(NonFiniteLogitsWarning, match="gave non-finite logits"):
        assert not CausalLM.check_finite(logits, "the prefill forward")


def test_finite_weights_load_without_a_warning(saved):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mtp.load_model(saved, strict=True)
    assert CausalLM.check_finite(model(torch.tensor([[1, 2, 3]])))


# ---------------------------------------------------------------------- the CLI: one line, no traceback
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mtp.cli", "generate", *args, "--prompt", "ab", "--max-new-tokens", "4",
                           "--threads", "1"], capture_output=True, text=True, timeout=120)


def test_cli_prints_one_line_for_a_bad_checkpoint(saved, tmp_path):
    binary = copy_with(saved, tmp_path / "binary")
    (binary / "config.json").write_bytes(bytes(range(256)))
    wide = copy_with(saved, tmp_path / "wide", config={"hidden_size": 10**12})
    nan = copy_with(saved, tmp_path / "nan", tensors=lambda s: s["model.embed_tokens.weight"].__setitem__((1, 1), float("nan")))
    for path, args, message in [(binary, (), "config.json: not a text file"),
                                (wide, (), "ask for an embedding of"),
                                (nan, ("--strict",), "NaN or Inf in tensor 'model.embed_tokens.weight' (1 value)")]:
        r = run_cli("--model", str(path), *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mtp generate: error: ") and message in lines[0], r.stderr
    r = run_cli("--model", str(nan))  # without --strict: it runs, and stderr says why the output is garbage
    assert r.returncode == 0 and "NaN or Inf in tensor 'model.embed_tokens.weight'" in r.stderr, r.stderr


def test_a_load_pauses_the_garbage_collector_and_gives_it_back(tmp_path):
    """load_model runs with the cyclic collector paused (a quarter of a load was collections) and leaves it as it
    found it, also when the load fails."""
    import gc

    from mtp.model.checkpoint import load_model

    assert gc.isenabled()
    with pytest.raises(mtp.CheckpointError):
        load_model(tmp_path)  # no config.json
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(mtp.CheckpointError):
            load_model(tmp_path)
        assert not gc.isenabled()
    finally:
        gc.enable()
