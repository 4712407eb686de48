"""Tokenizer of a checkpoint folder: `tokenizer.json` (the `tokenizers` library) + chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..config.base import ConfigError, read_config_file
from .chat_template import fallback_chat_prompt, output_limit_error, render_chat_template

# Tokenizer pipeline steps that never drop input text, so that one token stands for a bounded number of input
# characters (see `Tokenizer.max_chars_per_token`). Unicode normalization can fold up to 4 code points into one
# (the longest canonical decomposition, e.g. U+1F82 = alpha + 3 combining marks).
_KEEPING_NORMALIZERS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


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
        # encode_batch releases the GIL while the Rust side works (encode does not: a 1 MB prompt held every other
        # Python thread, the server's event loop included, for 2 s); the same ids, and no slower for short texts
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    @cached_property
    def max_chars_per_token(self) -> int | None:
        """At most how many characters of input text one token stands for, or None when no bound holds (a step that
        can drop text: BERT-style whitespace splitting, a Strip or Replace normalizer, characters outside the
        vocabulary with no unknown token or a fused one, an added token that swallows the whitespace around it, a
        model other than BPE). A text longer than the
        context times this bound cannot fit the context, which can be said without tokenizing it."""
        spec = json.loads(self.tok.to_str())
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or not _no_text_vanishes(model, spec.get("pre_tokenizer")):
            return None
        factor = _step_factor(spec.get("normalizer"), _KEEPING_NORMALIZERS, "normalizers")
        if factor is None or _step_factor(spec.get("pre_tokenizer"), dict.fromkeys(_KEEPING_PRE_TOKENIZERS, 1),
                                          "pretokenizers") is None:
            return None
        added = spec.get("added_tokens") or []
        if any(a.get("lstrip") or a.get("rstrip") for a in added):
            return None
        # vocabulary keys are at least as long as the text they decode to (a byte-level key is one character a byte)
        longest = max([len(k) for k in model.get("vocab") or {}] + [len(a.get("content", "")) for a in added] + [1])
        return longest * factor

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, max_chars: int | None = None,
                            render: Callable[..., str] = render_chat_template, **extra) -> str:
        """Render chat messages with the model's Jinja template in a sandbox (as transformers does; a template
        that reaches for Python internals raises ChatTemplateError), or the documented fallback without one:
        `role: content` lines followed by `assistant:`. A prompt longer than `max_chars` characters raises
        ChatTemplateLimitError. `render`: `render_chat_template` (in this process) or the `render` of an
        io/template_worker.py TemplateWorkers (time and memory bounded, in a worker process)."""
        if self.chat_template:
            extra.setdefault("eos_token", self.eos_token or "")
            extra.setdefault("bos_token", self.config.get("bos_token") or "")
            return render(self.chat_template, messages, add_generation_prompt, max_chars=max_chars, **extra)
        text = fallback_chat_prompt(messages, add_generation_prompt)
        if max_chars is not None and len(text) > max_chars:
            raise output_limit_error(max_chars)
        return text


def _no_text_vanishes(model: dict, pre_tokenizer: dict | None) -> bool:
    """Whether a BPE maps every input character to some token: characters outside its vocabulary are dropped
    without an unknown token, and a fused unknown token stands for any run of them."""
    vocab = model.get("vocab") or {}
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    steps = [pre_tokenizer] if pre_tokenizer else []
    steps += (pre_tokenizer or {}).get("pretokenizers") or []
    if any(step.get("type") == "ByteLevel" for step in steps) and all(c in vocab for c in _byte_level_alphabet()):
        return True
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _byte_level_alphabet() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return ByteLevel.alphabet()


def _step_factor(step: dict | None, allowed: dict[str, int], nested: str) -> int | None:
    """How many input characters one character after this normalizer / pre-tokenizer can stand for (1: none
    merged), or None when the step may drop text."""
    if step is None:
        return 1
    kind = step.get("type")
    if kind == "Sequence":
        factor = 1
        for sub in step.get(nested) or []:
            f = _step_factor(sub, allowed, nested)
            if f is None:
                return None
            factor *= f
        return factor
    if str(step.get("behavior", "")).lower() == "removed":  # Split / Punctuation that drop what they match
        return None
    if kind == "Replace":  # a fixed string for a non-empty one (Llama's " " -> "▁"), not a pattern that may delete
        pattern, content = (step.get("pattern") or {}).get("String"), step.get("content") or ""
        return -(-len(pattern) // len(content)) if pattern and content and nested == "normalizers" else None
    return allowed.get(kind)
