"""Draft provenance: the kind of every new token (prefill / plain / draft / correction / bonus) as the decoder
records it, and `mtp generate --show-drafts` colouring it on a terminal (and printing plain text otherwise)."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest

import mtp
from mtp.cli import KIND_COLOURS, RESET
from serve_support import build_trained_model_dir

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CANDIDATES = ["abcabcabc", "cdcdcdcdc", "abdeabdeabde", "abcdeabcdeabcde", "hgahgahga"]
GEN = dict(max_new_tokens=24, draft_tokens=3)


def expected_kinds(stats, n_tokens: int) -> list[str]:
    """The kinds the rounds in `stats` imply: the prefill token, then per round n drafts and the backbone's token."""
    kinds = ["prefill"]
    for k, n in zip(stats.k_history, stats.n_history):
        kinds += ["draft"] * n + ["plain" if k == 0 else "bonus" if n == k else "correction"]
    return kinds[:n_tokens]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_trained_model_dir(tmp_path_factory.mktemp("drafts") / "trained")


@pytest.fixture(scope="module")
def model(model_dir):
    return mtp.load_model(model_dir)


@pytest.fixture(scope="module")
def prompt(model):
    """A prompt whose greedy continuation has accepted drafts, corrections and bonus tokens (picked, so that a
    numerical change in the model cannot silently leave a kind untested)."""
    for text in CANDIDATES:
        kinds = mtp.generate(model, model.tokenizer.encode(text), **GEN).kinds
        if {"draft", "correction", "bonus"} <= set(kinds):
            return text
    pytest.fail(f"no prompt among {CANDIDATES} gives accepted drafts, corrections and bonus tokens")


@pytest.mark.parametrize("draft_tokens", [None, 1, 3, "auto"])
@pytest.mark.parametrize("max_new_tokens", [1, 7, 24])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kinds_follow_the_rounds(model, prompt, draft_tokens, max_new_tokens, temperature):
    r = mtp.generate(model, model.tokenizer.encode(prompt), max_new_tokens=max_new_tokens, draft_tokens=draft_tokens,
                     temperature=temperature, seed=0, eos_token_ids=[])
    assert len(r.kinds) == len(r.tokens) == max_new_tokens
    if draft_tokens is None:
        assert r.kinds == ["prefill"] + ["plain"] * (max_new_tokens - 1)
    else:
        assert r.kinds == expected_kinds(r.stats, len(r.tokens))
        assert r.kinds.count("draft") == sum(r.stats.n_history) == sum(r.stats.accepted)


def test_kinds_are_cut_with_the_tokens_at_a_stop_string(model, prompt):
    ids = model.tokenizer.encode(prompt)
    full = mtp.generate(model, ids, max_new_tokens=40, eos_token_ids=[], draft_tokens=3)
    stop = full.text[len(full.text) // 2:][:2]
    for k in (None, 3, "auto"):
        r = mtp.generate(model, ids, max_new_tokens=40, eos_token_ids=[], stop=[stop], draft_tokens=k)
        assert r.finish_reason == "stop" and len(r.tokens) < len(full.tokens)
        assert len(r.kinds) == len(r.tokens)
        if k is not None:
            assert r.kinds == expected_kinds(r.stats, len(r.tokens))


def test_emit_checks_and_defaults_its_kinds(model):
    s = mtp.decode.Session(model, [1, 2], 5, mtp.decode.SamplingParams(), [], None)
    assert s.emit([3, 4]) == [3, 4] and s.kinds == ["plain", "plain"]
    with pytest.raises(ValueError, match="2 tokens but 1 kinds"):
        s.emit([5, 6], ["draft"])
    assert s.emit([5, 6, 7, 8], ["draft", "draft", "bonus", "draft"]) == [5, 6, 7]  # max_new_tokens=5
    assert s.kinds == ["plain", "plain", "draft", "draft", "bonus"] and s.result().kinds == s.kinds


def cli(model_dir, prompt: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mtp.cli", "generate", "--model", str(model_dir), "--prompt", prompt,
            "--max-new-tokens", str(GEN["max_new_tokens"]), "--draft-tokens", str(GEN["draft_tokens"]), "--threads", "1", *extra]


def run_in_pty(cmd: list[str]) -> tuple[str, str, int]:
    """Run `cmd` with its stdout on a pseudo-terminal (stderr piped); returns (stdout, stderr, exit code)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    return b"".join(chunks).decode().replace("\r\n", "\n"), err, proc.returncode


def char_kinds(coloured: str) -> list[str]:
    """The kind each printed character was coloured as ("default" outside any colour)."""
    by_code = {code: kind for kind, code in KIND_COLOURS.items()}
    kinds, current = [], "default"
    for piece in re.split(f"({ANSI.pattern})", coloured):
        if ANSI.fullmatch(piece):
            current = "default" if piece == RESET else by_code[piece]
        else:
            kinds += [current] * len(piece)
    return kinds


def test_show_drafts_colours_a_terminal_and_leaves_pipes_plain(model_dir, model, prompt):
    want = json.loads(subprocess.run(cli(model_dir, prompt, "--json"), capture_output=True, text=True, timeout=120,
                                     check=True).stdout)
    ref = mtp.generate(model, model.tokenizer.encode(prompt), **GEN)
    assert want["tokens"] == ref.tokens and want["kinds"] == ref.kinds

    out, err, code = run_in_pty(cli(model_dir, prompt, "--show-drafts"))
    assert code == 0, err
    assert KIND_COLOURS["draft"] in out and KIND_COLOURS["correction"] in out
    assert ANSI.sub("", out) == want["text"] + "\n"
    assert "green = accepted MTP draft" in err.splitlines()[-1]
    # each character in the colour of the token that produced it
    per_char = []
    for i, kind in enumerate(ref.kinds):
        n = len(model.tokenizer.decode(ref.tokens[: i + 1])) - len(model.tokenizer.decode(ref.tokens[:i]))
        per_char += ["default" if kind in ("prefill", "plain") else kind] * n
    assert char_kinds(out)[: len(per_char)] == per_char

    piped = subprocess.run(cli(model_dir, prompt, "--show-drafts"), capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == want["text"] + "\n" and "\x1b" not in piped.stdout + piped.stderr
    plain = subprocess.run(cli(model_dir, prompt), capture_output=True, text=True, timeout=120)
    assert plain.stdout == piped.stdout
