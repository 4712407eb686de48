"""Generation entry points (`generate`, `stream`) and the plain decoding loop (one token per backbone
forward): the reference that speculative decoding (`speculative.py`) is held against."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import torch

from .draft_vocab import DraftVocab
from .prefill import prefill
from .sampling import SamplingParams
from .session import GenerationResult, Session
from .speculative import speculative_decode


def plain_decode(session: Session) -> Iterator[list[int]]:
    """Prefill, then one backbone forward per token. Yields the tokens emitted at each step."""
    model, stats = session.model, session.stats
    dev = model.device
    t0 = time.perf_counter()
    cache = model.new_cache(1, len(session.tokens) + session.max_new + 1)
    logits = model.head(prefill(model, session.tokens, cache)[0, -1])
    stats.prefill_forwards += 1
    stats.time_prefill = time.perf_counter() - t0
    step = torch.empty(1, 1, dtype=torch.long, device=dev)
    kind = "prefill"
    while True:
        t = time.perf_counter()
        tok = session.choose(logits)
        out = session.emit([tok], [kind])
        kind = "plain"
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
           draft_tokens: int | str | None = None, tokenizer=None,
           draft_vocab: int | DraftVocab | None = None) -> GenerationStream:
    """Streaming generation for one sequence. input_ids: list[int] or [1, T] tensor.

    draft_tokens: None or 0 = plain decoding; 1..8 = MTP speculative decoding with k drafts; "auto" =
    adaptive k. A model with no usable MTP falls back to plain decoding with a warning.
    draft_vocab: draft over the N most frequent tokens (an int N, read from the model folder's
    token_frequencies.json) or a given DraftVocab; None = the full vocabulary.
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
    if isinstance(draft_vocab, int):
        draft_vocab = DraftVocab.for_model(model, draft_vocab)
    return GenerationStream(session, speculative_decode(session, draft_tokens, draft_vocab))


def generate(model, input_ids, **kwargs) -> GenerationResult:
    """Generate for one sequence; returns tokens, text, finish reason and statistics (see `stream`)."""
    s = stream(model, input_ids, **kwargs)
    for _ in s:
        pass
    return s.result
