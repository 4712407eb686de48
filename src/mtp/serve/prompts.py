"""From a validated request to the prompt's token ids, off the event loop and within limits.

- Chat templates render in worker processes with a time, output-size and memory limit (io/template_worker.py); a
  template past a limit is a 400 naming the limit.
- Text is tokenized in a thread (`Tokenizer.encode` releases the GIL), never on the event loop.
- A text that cannot fit the context is refused before it is tokenized when the tokenizer bounds the characters a
  token stands for (`Tokenizer.max_chars_per_token`); the same bound caps a template's output.
"""

from __future__ import annotations

import asyncio

from ..io.chat_template import ChatTemplateError, ChatTemplateLimitError, render_chat_template
from ..io.template_worker import DEFAULT_TIMEOUT_S, TemplateWorkers
from . import protocol as P
from .body import unencodable
from .errors import APIError


class Prompts:
    """`completion(body)` / `chat(body)` -> token ids (async; APIError for what does not fit); `close()` ends the
    template workers."""

    def __init__(self, tokenizer, context: int, vocab_size: int, max_request_bytes: int,
                 template_timeout_s: float = DEFAULT_TIMEOUT_S):
        self.tok, self.context, self.vocab_size = tokenizer, context, vocab_size
        per_token = tokenizer.max_chars_per_token
        # a prompt must leave room for one new token; None: this tokenizer gives no bound (see max_chars_per_token)
        self.max_chars = (context - 1) * per_token if per_token else None
        self.per_token = per_token
        # without a bound from the tokenizer, a template may at most double what a request can send
        self.template_max_chars = self.max_chars or 2 * max_request_bytes
        self.workers = TemplateWorkers(timeout_s=template_timeout_s) if tokenizer.chat_template else None

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    async def completion(self, body: P.CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            ids = await self.tokenize(body.prompt, "prompt")
        else:
            ids = list(body.prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}", param="prompt")
        return self.nonempty(ids, "prompt")

    async def chat(self, body: P.ChatCompletionRequest) -> list[int]:
        messages = [m.as_template_dict() for m in body.messages]
        render = self.workers.render if self.workers is not None else render_chat_template
        try:
            prompt = await asyncio.to_thread(self.tok.apply_chat_template, messages, True,
                                             max_chars=self.template_max_chars, render=render)
        except ChatTemplateLimitError as e:
            fits = f" (more than fit the context of {self.context} tokens)" if e.limit == "output" and self.max_chars else ""
            raise APIError(400, f"{e}{fits}", param="messages", code="chat_template_limit") from None
        except ChatTemplateError as e:  # a template's raise_exception() (e.g. wrong role order), an unsafe or broken one
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        if (bad := unencodable(prompt)) is not None:
            raise APIError(400, f"the chat template's output is not valid Unicode text (a lone surrogate {bad[1]})",
                           param="messages")
        return self.nonempty(await self.tokenize(prompt, "messages"), "messages")

    async def tokenize(self, text: str, field: str) -> list[int]:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise APIError(400, f"the prompt has {len(text)} characters, more than can fit the context of {self.context} "
                                f"tokens (a token of this model's tokenizer stands for at most {self.per_token} characters: "
                                f"at most {self.max_chars} characters fit)", param=field, code="context_length_exceeded")
        return await asyncio.to_thread(self.tok.encode, text)

    @staticmethod
    def nonempty(ids: list[int], field: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt must hold at least one token", param=field)
        return ids
