"""Generation entry points (`generate`, `stream`): one sequence, decoded by the same rounds as a batch
(`decoder.Decoder` with one row). Plain decoding is the round with no drafts (k = 0): one backbone forward per
token, the reference that speculative decoding is held against."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import torch

from .decoder import Decoder
from .draft_vocab import DraftVocab
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .session import GenerationResult, Session


def decode(session: Session, draft_tokens: int | str | None, vocab: DraftVocab | None = None,
           compile: bool = False, prompt_cache: PromptCache | None = None) -> Iterator[list[int]]:
    """Decode one session to its end, yielding the tokens emitted per round (the prefill's first token first)."""
    model = session.model
    # (a step may run up to 16 rounds in one call: a lone greedy sequence, `Decoder._chain`)
    decoder = Decoder(model, 1, len(session.tokens) + session.max_new, draft_tokens, vocab, compile=compile,
                      prompt_cache=prompt_cache, chain=16)
    session.stats.draft_tokens_max = decoder.policy.k_max
    seq = decoder.add(session)
    while not seq.finished:
        for _, toks in decoder.step():
            yield toks


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
           draft_vocab: int | DraftVocab | None = None, compile: bool = False,
           prompt_cache: PromptCache | None = None) -> GenerationStream:
    """Streaming generation for one sequence. input_ids: list[int] or [1, T] tensor.

    draft_tokens: None or 0 = plain decoding; 1..8 = MTP speculative decoding with k drafts; "auto" =
    adaptive k. A model with no usable MTP falls back to plain decoding with a warning.
    draft_vocab: draft over the N most frequent tokens (an int N, read from the model folder's
    token_frequencies.json) or a given DraftVocab; None = the full vocabulary.
    compile: run the rounds through compiled graphs (`decode/compiled.py`; the first use of each graph on a machine
    compiles it, later ones read inductor's disk cache).
    prompt_cache: a `PromptCache` kept across calls on this model (a conversation's turns, a shared system prompt):
    the prompt resumes from the longest prefix it holds, with the same output as a cold read.
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
    if draft_tokens not in (None, 0) and not model.has_mtp:
        warnings.warn("model has no usable MTP module; falling back to plain decoding", stacklevel=2)
        draft_tokens = None
    if draft_tokens in (None, 0):
        draft_vocab = None
    elif isinstance(draft_vocab, int):
        draft_vocab = DraftVocab.for_model(model, draft_vocab)
    return GenerationStream(session, decode(session, draft_tokens, draft_vocab, compile, prompt_cache))


def generate(model, input_ids, **kwargs) -> GenerationResult:
    """Generate for one sequence; returns tokens, text, finish reason and statistics (see `stream`)."""
    s = stream(model, input_ids, **kwargs)
    for _ in s:
        pass
    return s.result
