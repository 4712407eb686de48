"""`mtp generate` as a real process, and stop strings through a real tokenizer."""

import json
import os
import subprocess
import sys

import pytest

import mtp
from serve_support import EOS, build_model_dir

# prompts among which the test model's greedy continuation ends with EOS for at least one
ENDING_CANDIDATES = ["def add(a, b):", "Hello", "for i in range(10):", "import torch", "The quick brown fox", "x", "Héllo wörld"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("cli") / "tiny", chat_template=False)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mtp.cli", *args], capture_output=True, text=True, timeout=120)


def test_generate_json_equals_the_library_for_plain_and_speculative(model_dir):
    model = mtp.load_model(model_dir)
    prompt = "def add(a, b):"
    want = mtp.generate(model, model.tokenizer.encode(prompt), max_new_tokens=24)
    for k in ("0", "3", "auto"):
        proc = run_cli("generate", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", "24",
                       "--draft-tokens", k, "--json", "--threads", "1")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["tokens"] == want.tokens
        assert out["text"] == want.text
        assert out["prompt_tokens"] == model.tokenizer.encode(prompt)
        assert out["stats"]["new_tokens"] == len(want.tokens) and out["wall_time_s"] > 0
        if k != "0":
            assert out["stats"]["backbone_forwards"] <= len(want.tokens) - 1


def test_quantized_drafts_from_the_command_line_keep_the_output(model_dir):
    """--draft-quantize (default auto: int4 drafts for a bf16 or int8 model on qmatmul's kernels, none for fp32): the
    tokens are the model's own plain decoding whatever the drafts run, and --json says what they ran."""
    from mtp.model import qmatmul

    model = mtp.load_model(model_dir, dtype="bfloat16")
    prompt = "def add(a, b):"
    want = mtp.generate(model, model.tokenizer.encode(prompt), max_new_tokens=24).tokens
    cases = [(["--dtype", "bfloat16"], "int4" if qmatmul.available() else None), (["--dtype", "bfloat16", "--draft-quantize",
             "none"], None), ([], None)]
    if qmatmul.available():
        cases.append((["--dtype", "bfloat16", "--draft-quantize", "int8"], "int8"))
    for extra, drafts in cases:
        proc = run_cli("generate", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", "24",
                       "--draft-tokens", "3", "--json", "--threads", "1", *extra)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["draft_quantize"] == drafts, extra
        if extra:  # (fp32: its own tokens)
            assert out["tokens"] == want, extra
    # an int8 model drafts int4 by default too (its MTP layers requantized, an int4 copy of its head)
    int8 = mtp.load_model(model_dir, dtype="bfloat16", quantize="int8")
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", "24", "--draft-tokens",
                   "3", "--json", "--threads", "1", "--dtype", "bfloat16", "--quantize", "int8")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["draft_quantize"] == ("int4" if qmatmul.available() else None)
    assert out["tokens"] == mtp.generate(int8, model.tokenizer.encode(prompt), max_new_tokens=24).tokens


def test_the_draft_vocabulary_from_the_command_line_keeps_the_output(model_dir, tmp_path):
    """--draft-vocab (default auto: the most frequent tokens making 95% of token_frequencies.json beside the model, a
    multiple of 64; the full vocabulary where the folder has no such file), none, N: the tokens are the model's plain
    decoding whatever the drafts may take, and --json says what they took."""
    import shutil

    folder = shutil.copytree(model_dir, tmp_path / "with_counts")
    model = mtp.load_model(folder)
    V = model.config.vocab_size
    counts = [1000] * 100 + [1] * (V - 100)  # 96 tokens make 95%: 128 drafted over
    (folder / "token_frequencies.json").write_text(json.dumps({"split": "train", "tokens": sum(counts), "counts": counts}))
    assert sum(counts[:96]) >= 0.95 * sum(counts) > sum(counts[:95]) and V >= 4 * 128 / 3
    prompt = "def add(a, b):"
    want = mtp.generate(model, model.tokenizer.encode(prompt), max_new_tokens=24).tokens
    for where, extra, vocab in [(folder, [], 128), (folder, ["--draft-vocab", "none"], None),
                                (folder, ["--draft-vocab", "64"], 64), (model_dir, [], None)]:
        proc = run_cli("generate", "--model", str(where), "--prompt", prompt, "--max-new-tokens", "24",
                       "--draft-tokens", "3", "--json", "--threads", "1", *extra)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["draft_vocab"] == vocab and out["tokens"] == want, (where, extra)
    for bad in ("0", "-3", "many"):
        proc = run_cli("generate", "--model", str(folder), "--prompt", prompt, "--draft-vocab", bad)
        assert proc.returncode == 2 and "expected auto, none or a number of tokens >= 1" in proc.stderr, bad


def test_generate_prints_text(model_dir):
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", "for i in", "--max-new-tokens", "8", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    model = mtp.load_model(model_dir)
    assert proc.stdout == mtp.generate(model, model.tokenizer.encode("for i in"), max_new_tokens=8).text + "\n"
    assert "mean accepted length" in proc.stderr


def test_bad_arguments_get_clear_errors(model_dir, tmp_path):
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", "x", "--draft-tokens", "nine")
    assert proc.returncode == 2 and "--draft-tokens must be" in proc.stderr
    proc = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert proc.returncode != 0 and "no such folder, and not a hub id" in proc.stderr
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "1.5")
    assert proc.returncode == 2 and "top_p must be in (0, 1]" in proc.stderr
    proc = run_cli("generate", "--model", "", "--prompt", "x")  # not the shipped model, silently
    assert proc.returncode == 2 and "--model: must name a checkpoint folder or a hub id, got an empty string" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mtp.cli", "generate", "--prompt", "x"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MTP_MODEL": ""})
    assert proc.returncode != 0 and "$MTP_MODEL is set but empty" in proc.stderr
    proc = run_cli("serve", "--model", str(tmp_path / "nope"), "--prompt-cache-mb", "-1")  # (refused before loading)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "mtp serve: error: --prompt-cache-mb must be >= 0, got -1") and "Traceback" not in proc.stderr


def test_the_eos_that_ends_generation_is_not_in_the_text(model_dir):
    model = mtp.load_model(model_dir)
    eos = model.tokenizer.eos_token_id
    runs = {p: mtp.generate(model, model.tokenizer.encode(p), max_new_tokens=60) for p in ENDING_CANDIDATES}
    prompt, want = next((p, r) for p, r in runs.items() if r.finish_reason == "eos")
    assert want.tokens[-1] == eos and EOS not in want.text
    assert want.text == model.tokenizer.decode(want.tokens[:-1])
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", "60", "--threads", "1")
    assert proc.returncode == 0 and proc.stdout == want.text + "\n", proc.stderr
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", "60", "--threads", "1", "--json")
    out = json.loads(proc.stdout)
    assert out["tokens"] == want.tokens and out["text"] == want.text and out["finish_reason"] == "eos"


def test_stop_strings_cut_exactly_under_speculation(model_dir):
    model = mtp.load_model(model_dir)
    ids = model.tokenizer.encode("import torch")
    full = mtp.generate(model, ids, max_new_tokens=40, eos_token_ids=[])
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "pick a non-empty stop string"
    cut = text.index(stop)
    for k in (None, 2, 5, "auto"):
        r = mtp.generate(model, ids, max_new_tokens=40, eos_token_ids=[], stop=[stop], draft_tokens=k)
        assert r.finish_reason == "stop" and r.text == text[:cut]
        assert r.tokens == full.tokens[: len(r.tokens)]
        assert stop not in model.tokenizer.decode(r.tokens[:-1])  # nothing emitted past the stop's token


def test_a_missing_extra_is_one_line_naming_it():
    code = "import sys; sys.modules['fastapi'] = None; from mtp.cli import main; sys.exit(main(['serve', '--threads', '1']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr == "mtp: this command needs the 'serve' extra (fastapi not installed): pip install \"mtp[serve]\"\n"


def test_generation_config_supplies_the_defaults_a_command_leaves_out(model_dir, tmp_path):
    import shutil

    folder = tmp_path / "with-defaults"
    shutil.copytree(model_dir, folder)
    # do_sample false: greedy, temperature ignored (as transformers), the penalty applies
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.7, "repetition_penalty": 0.3, "eos_token_id": 0}))
    model = mtp.load_model(folder)
    ids = model.tokenizer.encode("def add(a, b):")
    penalised = mtp.generate(model, ids, max_new_tokens=24, repetition_penalty=0.3)
    plain = mtp.generate(model, ids, max_new_tokens=24)
    assert penalised.tokens != plain.tokens                  # the default is visible in the output
    for extra, want in (([], penalised), (["--repetition-penalty", "1"], plain)):
        proc = run_cli("generate", "--model", str(folder), "--prompt", "def add(a, b):", "--max-new-tokens", "24",
                       "--json", "--threads", "1", *extra)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["tokens"] == want.tokens
    mtp.save_model(model, tmp_path / "saved")                # the file travels with the weights
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text())["repetition_penalty"] == 0.3
    (folder / "generation_config.json").write_text(json.dumps({"repetition_penalty": "high"}))
    proc = run_cli("generate", "--model", str(folder), "--prompt", "x", "--threads", "1")
    assert proc.returncode != 0 and "repetition_penalty='high' is not a valid repetition_penalty" in proc.stderr
