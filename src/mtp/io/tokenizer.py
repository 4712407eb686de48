"""Tokenizer of a checkpoint folder: `tokenizer.json` (the `tokenizers` library) + chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .chat_template import fallback_chat_prompt, render_chat_template


class Tokenizer:
    """encode(str) -> list[int], decode(list[int]) -> str, plus special ids and the chat template."""

    def __init__(self, tok: _HFTokenizer, config: dict | None = None):
        self.tok = tok
        self.config = config or {}
        self.chat_template: str | None = self.config.get("chat_template")
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_token = eos
        self.eos_token_id = tok.token_to_id(eos) if isinstance(eos, str) else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.exists():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        try:
            tok = _HFTokenizer.from_file(str(f))
        except Exception as e:  # the tokenizers library raises bare Exceptions
            raise ValueError(f"{f}: cannot load tokenizer ({e})") from None
        config = {}
        tc = path / "tokenizer_config.json"
        if tc.exists():
            config = json.loads(tc.read_text())
        ct = path / "chat_template.jinja"
        if "chat_template" not in config and ct.exists():
            config["chat_template"] = ct.read_text()
        return cls(tok, config)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render chat messages with the model's Jinja template in a sandbox (as transformers does; a template
        that reaches for Python internals raises ChatTemplateError), or the documented fallback without one:
        `role: content` lines followed by `assistant:`."""
        if self.chat_template:
            extra.setdefault("eos_token", self.eos_token or "")
            extra.setdefault("bos_token", self.config.get("bos_token") or "")
            return render_chat_template(self.chat_template, messages, add_generation_prompt, **extra)
        return fallback_chat_prompt(messages, add_generation_prompt)
