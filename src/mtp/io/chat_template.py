"""Render Hugging Face chat templates the way transformers does, inside Jinja's immutable sandbox.

Chat templates ship with checkpoints from the Hub, so they are untrusted code: every template runs in
`ImmutableSandboxedEnvironment`, and any failure surfaces as one `ChatTemplateError` naming the problem. The sandbox
keeps a template away from Python internals but not from loops or huge strings: `max_chars` stops a render whose
output grows past it, and io/template_worker.py bounds time and memory by rendering in a worker process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older releases have known sandbox escapes (CVE-2024-56201, CVE-2024-56326, CVE-2025-27516); transformers refuses them too.
_MIN_JINJA = (3, 1, 6)


class ChatTemplateError(ValueError):
    """A chat template that is unsafe (reaches for Python internals), has a syntax error, or failed while rendering."""


class ChatTemplateLimitError(ChatTemplateError):
    """A render stopped at one of its limits; `limit` is "time", "output" or "memory"."""

    def __init__(self, limit: str, message: str):
        super().__init__(message)
        self.limit = limit


def output_limit_error(max_chars: int) -> ChatTemplateLimitError:
    return ChatTemplateLimitError("output", f"the chat template's output exceeded the limit of {max_chars} characters")


class _TemplateRaised(TemplateError):
    """What the template's own `raise_exception(msg)` raises, kept apart from Jinja's errors."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    # Jinja's sandbox returns a blank Undefined for `{{ x.__class__ }}` and only fails once it is used further;
    # failing on the first touch means every attempt to reach Python internals is reported, never silently blank.
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _TemplateDict:
    # Stands in for the `dict` global: the builtin type would hand templates a class to poke at.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # A namespace stores attributes by name, so underscore names could shadow its internals; transformers refuses them too.
    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick, so that `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace cannot hold the underscore-prefixed attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_version() -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    if _jinja_version() < _MIN_JINJA:
        raise ChatTemplateError(
            f"chat templates need jinja2>=3.1.6 (older sandboxes can be escaped); found {jinja2.__version__}: pip install -U jinja2"
        )
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"broken chat template: syntax error at line {e.lineno}: {e.message}") from e
    except SecurityError as e:
        raise ChatTemplateError(f"unsafe chat template refused: {e}") from e


def _plain(value: Any) -> Any:
    # Rebuild what the template sees out of plain JSON-like types: rich objects (arrays, tensors, str subclasses) carry
    # methods the sandbox does not know are dangerous. Same idea as transformers' `_plain_template_data`.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        # numpy scalars: `np.bool_(False)` must stay falsy rather than become a placeholder string
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         max_chars: int | None = None, **extra: Any) -> str:
    """Render `messages` with the Jinja chat `template` in a sandbox and return the prompt text.

    `extra` (bos_token, eos_token, tools, documents, enable_thinking, ...) is passed to the template as variables;
    `tools` and `documents` are None unless given, as in transformers. Raises ChatTemplateError when the template is
    unsafe, has a syntax error, calls raise_exception(msg), or fails while rendering; ChatTemplateLimitError as soon
    as the output passes `max_chars` characters (None: no limit). MemoryError passes through (the process's limit,
    see io/template_worker.py).
    """
    compiled = _compile(template)
    variables = {"tools": None, "documents": None, **extra}
    try:
        pieces = compiled.generate(
            messages=_plain(list(messages)), add_generation_prompt=bool(add_generation_prompt), **_plain(variables)
        )
        if max_chars is None:
            return "".join(pieces)
        out, n = [], 0
        for piece in pieces:  # stop at the first piece past the limit, however long the template would go on
            n += len(piece)
            if n > max_chars:
                raise output_limit_error(max_chars)
            out.append(piece)
        return "".join(out)
    except (ChatTemplateLimitError, MemoryError):
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"unsafe chat template refused: {e}") from e
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template raised an error: {e.message}") from e
    except TemplateError as e:
        raise ChatTemplateError(f"broken chat template: {type(e).__name__}: {e.message}") from e
    except Exception as e:
        # The template is code from the checkpoint: any Python error it hits (e.g. `1 + 'a'`) is the template's fault.
        raise ChatTemplateError(f"broken chat template: {type(e).__name__} while rendering: {e}") from e


def fallback_chat_prompt(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The documented prompt for checkpoints without a chat template: `role: content` lines, then `assistant:`."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")
