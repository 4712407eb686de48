"""Tokenizer of a checkpoint folder: `tokenizer.json` (the `tokenizers` library) + chat template."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..config.base import ConfigError, read_config_file
from .chat_template import fallback_chat_prompt, render_chat_template


def check_tokenizer_config(path: Path, config: dict) -> None:
    """The keys we read from tokenizer_config.json have the types transformers gives them: `eos_token` / `bos_token`
    a string, {"content": string} or null; `chat_template` a string, or a list of {"name", "template"} (the one named
    "default" is used, as transformers does)."""
    for key in ("eos_token", "bos_token"):
        value = config.get(key)
        if not (value is None or isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))):
            raise ConfigError(f"{path}: key '{key}' must be a string or an object with a string 'content', got {value!r:.60}")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
        config["chat_template"] = template
    if not (template is None or isinstance(template, str)):
        raise ConfigError(f"{path}: key 'chat_template' must be a string or a list of named templates, got {template!r:.60}")


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
            config = read_config_file(tc)  # a folder, binary or non-object file: one error naming it
            check_tokenizer_config(tc, config)
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
