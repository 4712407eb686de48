"""Shared helpers for the `mtp serve` tests: a tiny checkpoint folder with a real tokenizer, and a server
started as a real process on a free loopback port (always killed afterwards)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import mtp
from conftest import pattern_batch, tiny_model

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café ✓ 日本語",
    "for i in range(10):\n    print(i * i)\n",
    "import torch\nx = torch.zeros(3)\n",
] * 4
CONTEXT = 4096
LETTERS = "abcdefgh"  # the alphabet `build_trained_model_dir` trains on


def train_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE (multi-byte characters split across tokens) with chat special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def build_model_dir(path: Path, chat_template: bool | str, seed: int = 0) -> Path:
    """Save a tiny random model + tokenizer.json + tokenizer_config.json (with CHAT_TEMPLATE, without a chat
    template, or with the template given as a string)."""
    tok = train_tokenizer()
    model = tiny_model(seed=seed, vocab_size=tok.get_vocab_size(), max_position_embeddings=CONTEXT,
                       eos_token_id=tok.token_to_id(EOS))
    mtp.save_model(model, path)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": EOS}
    if chat_template:
        config["chat_template"] = chat_template if isinstance(chat_template, str) else CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def build_trained_model_dir(path: Path, steps: int = 100, seed: int = 0) -> Path:
    """Like `build_model_dir` (no chat template), but the backbone and its MTP module were trained together for
    `steps` steps (a few seconds) on `pattern_batch` motifs over the letters a..h: greedy continuations of such
    text are repetitive and drafts are often, but not always, accepted."""
    tok = train_tokenizer()
    model = tiny_model(seed=seed, std=0.02, vocab_size=tok.get_vocab_size(), max_position_embeddings=CONTEXT,
                       eos_token_id=tok.token_to_id(EOS)).train()
    letters = torch.tensor([tok.token_to_id(c) for c in LETTERS])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = letters[pattern_batch(len(LETTERS), 8, 32, gen)]
        h = model.hidden(ids)
        loss = torch.nn.functional.cross_entropy(model.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        hd = next(iter(model.mtp_hidden_states(ids, 1, hidden=h)))
        loss = loss + torch.nn.functional.cross_entropy(model.mtp_head(hd[:, :-1], 1).flatten(0, 1), ids[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    mtp.save_model(model.eval(), path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m mtp.cli serve ...` on a free loopback port; stderr (the JSON request log) goes to a file."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str, startup_timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "mtp.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--threads", "1", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not answer /health in {startup_timeout}s:\n{log_path.read_text()}")
            time.sleep(0.1)

    def health(self) -> dict:
        r = httpx.get(self.url + "/health", timeout=5.0)
        assert r.status_code == 200, r.text
        return r.json()

    def request_logs(self) -> list[dict]:
        """The structured request log: one JSON object per line."""
        lines = self.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
