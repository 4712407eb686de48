"""The OpenAI request bodies `mtp serve` accepts (validated, every error names its field) and the
response objects it returns.

Deliberate choices (documented in the README):
- Types are the OpenAI API's, strictly: an integer field takes a JSON integer (not "8", true or 8.0), a boolean
  field true or false (not "yes" or 1), a number field a finite number (NaN and Infinity, which Python's JSON
  reader lets through, are refused); every optional field may be null, which means "not given".
- Defaults follow the OpenAI API: temperature 1.0, top_p 1.0, n 1 (`OPENAI_DEFAULTS`). `max_tokens` omitted = the
  server's `--default-max-tokens`, capped by the room left in the context.
- Extensions: `top_k`, `repetition_penalty` (both supported by the decoder) and `ignore_eos` (as vLLM).
- Known OpenAI fields the decoder cannot honour are accepted only at their neutral value (`n=1`,
  `presence_penalty=0`, `logprobs=null`, ...); anything else is a 400 naming the field. Unknown fields are
  rejected like the OpenAI API does ("Unrecognized request argument").
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
# What a sampling field means when a request leaves it out (or sends null) and the model's generation_config.json
# says nothing: the OpenAI API's defaults, no top-k, no repetition penalty.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": None, "repetition_penalty": 1.0}
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, description="extension: keep the k most likely tokens")
    repetition_penalty: float | None = Field(None, gt=0.0, description="extension: CTRL/HF repetition penalty")
    ignore_eos: bool | None = Field(None, description="extension (as vLLM): do not stop at the model's EOS token")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # the range torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    user: str | None = None  # accepted and ignored, as an opaque end-user id

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0.0):
            raise ValueError("not supported (only 0); use the `repetition_penalty` extension instead")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        return [s for s in stops if s] or None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, defaults: dict) -> dict:
        """temperature / top_p / top_k / repetition_penalty: what the request gives, else `defaults` (the model's
        generation_config.json), else OPENAI_DEFAULTS."""
        given = {k: getattr(self, k) for k in OPENAI_DEFAULTS if getattr(self, k) is not None}
        return OPENAI_DEFAULTS | defaults | given


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string or a list of token ids (one prompt per request)."""

    prompt: str | list[int]  # also a batch of one: ["text"] or [[ids]] (`_one_prompt`)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError(f"one prompt per request is supported, got a batch of {len(v)}")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported (no fill-in-the-middle)")
        return v


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        """The message as the chat template sees it: text parts joined into one string."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` is the newer name of `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v and v.get("type") != "text":
            raise ValueError("only {'type': 'text'} is supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v):
        if v:
            raise ValueError("not supported")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ------------------------------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, speculative: dict | None, cached_tokens: int = 0) -> dict:
    """OpenAI usage (`prompt_tokens_details.cached_tokens`: prompt tokens taken from the prompt cache, as OpenAI and
    vLLM report them), plus the extension field `speculative` (see `Engine.speculative_stats`)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if speculative is not None:
        out["speculative"] = speculative
    return out


def completion(rid: str, model: str, text: str, finish_reason: str | None, usage_: dict | None,
               created: int | None = None, chunk: bool = False) -> dict:
    """A text_completion object (streamed chunks have the same shape, with finish_reason null until the end)."""
    out = {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out


def chat_completion(rid: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage_: dict | None = None) -> dict:
    """A chat.completion.chunk; `delta=None` makes the usage-only chunk (empty choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """The OpenAI error object: the `openai` client raises it as BadRequestError, AuthenticationError, ..."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
