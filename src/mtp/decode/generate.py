"""Generation entry points and the plain (one token per backbone forward) decoding loop.

`Session` owns what every loop shares: the token list, sampling, stops (EOS ids, stop strings, max new
tokens, context limit) and statistics. The plain loop here is the NTP reference that speculative
decoding (`speculative.py`) is held against.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .sampling import SamplingParams, apply_repetition_penalty, probs_from_logits, sample
from .stats import GenerationStats


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens (an EOS that ended generation included)
    text: str | None  # decoded new tokens, cut before a stop string (None without a tokenizer)
    finish_reason: str  # "eos", "stop" (a stop string) or "length" (max new tokens / context)
    stats: GenerationStats


class Session:
    """State of one generation: tokens so far, sampling, stop rules, statistics."""

    def __init__(self, model, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                 eos_token_ids: list[int] | None, stop: list[str] | None, tokenizer=None):
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = model.config.max_position_embeddings
        if len(prompt) >= limit:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {limit}")
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer (load the model from a folder with tokenizer.json)")
        self.model = model
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.max_new = min(max_new_tokens, limit - len(prompt))
        self.params = params
        self.eos = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.stop = [s for s in (stop or []) if s]
        self.tokenizer = tokenizer
        self.done = False
        self.finish_reason = "length"
        self.text: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(params.seed)
        self._seen = torch.tensor([self.tokens], dtype=torch.long, device=model.device) if params.repetition_penalty != 1.0 else None

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def probs(self, logits: torch.Tensor, extra: list[int] | None = None) -> torch.Tensor:
        """Target distribution [V] for the next token given logits [V]; `extra` tokens (drafts before this
        position) count as seen for the repetition penalty."""
        if self._seen is not None:
            seen = self._seen
            if extra:
                seen = torch.cat([seen, torch.tensor([extra], device=seen.device)], dim=1)
            logits = apply_repetition_penalty(logits[None], seen, self.params.repetition_penalty)[0]
        return probs_from_logits(logits, self.params)

    @property
    def plain_argmax(self) -> bool:
        """Greedy with no repetition penalty: the next token is the raw logits' argmax (the fast path)."""
        return self.params.greedy and self._seen is None

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from logits [V]: argmax (greedy) or a sample."""
        if self.plain_argmax:
            return int(logits.argmax())
        probs = self.probs(logits)
        return int(probs.argmax()) if self.params.greedy else sample(probs, self.generator)

    def emit(self, toks: list[int]) -> list[int]:
        """Append tokens, honouring EOS, stop strings and the length limit; returns those emitted."""
        out: list[int] = []
        for t in toks:
            if self.done:
                break
            self.tokens.append(t)
            out.append(t)
            if t in self.eos:
                self.done, self.finish_reason = True, "eos"
            elif len(self.tokens) - self.prompt_len >= self.max_new:
                self.done, self.finish_reason = True, "length"
        if self._seen is not None and out:
            self._seen = torch.cat([self._seen, torch.tensor([out], device=self._seen.device)], dim=1)
        if self.stop and out:
            out = self._apply_stop_strings(out)
        self.stats.new_tokens = len(self.tokens) - self.prompt_len
        return out

    def _apply_stop_strings(self, out: list[int]) -> list[int]:
        new = self.new_tokens
        text = self.tokenizer.decode(new)
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if not hits:
            return out
        cut = min(i for i, _ in hits)
        # keep the shortest token prefix whose text reaches the stop string; drop the rest
        keep = len(new)
        for n in range(len(new) - len(out), len(new) + 1):
            if len(self.tokenizer.decode(new[:n])) > cut:
                keep = n
                break
        dropped = len(new) - keep
        del self.tokens[len(self.tokens) - dropped:]
        self.done, self.finish_reason, self.text = True, "stop", text[:cut]
        return out[: len(out) - dropped]

    def result(self) -> GenerationResult:
        text = self.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(self.new_tokens)
        return GenerationResult(self.new_tokens, text, self.finish_reason, self.stats)


def plain_decode(session: Session) -> Iterator[list[int]]:
    """Prefill, then one backbone forward per token. Yields the tokens emitted at each step."""
    model, stats = session.model, session.stats
    dev = model.device
    t0 = time.perf_counter()
    cache = model.new_cache(1, len(session.tokens) + session.max_new + 1)
    logits = model(torch.tensor([session.tokens], device=dev), cache)[0, -1]
    stats.prefill_forwards += 1
    stats.time_prefill = time.perf_counter() - t0
    step = torch.empty(1, 1, dtype=torch.long, device=dev)
    while True:
        t = time.perf_counter()
        tok = session.choose(logits)
        out = session.emit([tok])
        stats.time_other += time.perf_counter() - t
        if out:
            yield out
        if session.done:
            return
        t = time.perf_counter()
        step[0, 0] = tok
        logits = model(step, cache)[0, -1]
        stats.backbone_forwards += 1
        stats.time_verify += time.perf_counter() - t  # the plain step's forward counts as its "verify" time


class GenerationStream:
    """Iterate to get the tokens emitted at each step; `.result` holds the GenerationResult afterwards."""

    def __init__(self, session: Session, steps: Iterator[list[int]]):
        self.session = session
        self._steps = steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[list[int]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            yield from self._steps
        self.session.stats.time_total += time.perf_counter() - t0
        self.result = self.session.result()

    def close(self) -> None:
        """Stop early (e.g. the client went away); the caches are freed with the generator."""
        self._steps.close()


def stream(model, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, repetition_penalty: float = 1.0, seed: int | None = None,
           eos_token_ids: list[int] | None = None, stop: list[str] | str | None = None,
           draft_tokens: int | str | None = None, tokenizer=None) -> GenerationStream:
    """Streaming generation for one sequence. input_ids: list[int] or [1, T] tensor.

    draft_tokens: None or 0 = plain decoding; 1..8 = MTP speculative decoding with k drafts; "auto" =
    adaptive k. A model with no usable MTP falls back to plain decoding with a warning.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"generate takes one sequence (batch 1), got batch {input_ids.shape[0]}")
            input_ids = input_ids[0]
        input_ids = input_ids.tolist()
    if isinstance(stop, str):
        stop = [stop]
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    params = SamplingParams(temperature, top_k, top_p, repetition_penalty, seed)
    session = Session(model, list(input_ids), max_new_tokens, params, eos_token_ids, stop, tokenizer)
    if draft_tokens in (None, 0):
        return GenerationStream(session, plain_decode(session))
    if not model.has_mtp:
        warnings.warn("model has no usable MTP module; falling back to plain decoding", stacklevel=2)
        return GenerationStream(session, plain_decode(session))
    from .speculative import speculative_decode

    return GenerationStream(session, speculative_decode(session, draft_tokens))


def generate(model, input_ids, **kwargs) -> GenerationResult:
    """Generate for one sequence; returns tokens, text, finish reason and statistics (see `stream`)."""
    s = stream(model, input_ids, **kwargs)
    for _ in s:
        pass
    return s.result
