"""The generation engine behind the HTTP server: admission control and a single worker thread.

Every decode step of every request runs on one worker thread, one step at a time: concurrent requests are
interleaved step by step (each streams from the start, nobody waits for a whole other generation), the
event loop never runs a forward, and torch never sees two forwards at once (which would not help on a
CPU: the intra-op threads already use the cores). At most `max_concurrency` requests are admitted; the
handler answers the next one 429 at once rather than letting a queue grow without bound.

A `Job` is one admitted generation. `Job.steps()` yields the emitted tokens of each step; `Job.finish()`
(idempotent) closes the decoder's stream on the worker and frees the slot, whether the job ran to the
end, failed, or its client went away.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..decode import stream as decode_stream
from ..decode.draft_vocab import DraftVocab

log = logging.getLogger("mtp.serve")


def usable_draft_tokens(model, draft_tokens: int | str | None) -> int | str | None:
    """The `draft_tokens` the server can actually use: None (plain decoding) when the model has no MTP module,
    with a warning saying so."""
    if draft_tokens in (None, 0):
        return None
    if not model.has_mtp:
        log.warning("model has no usable MTP module: serving with plain decoding (--draft-tokens %s ignored)", draft_tokens)
        return None
    return draft_tokens


@dataclass
class GenerationParams:
    """What one request asks of the decoder (already validated by the protocol layer)."""

    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    repetition_penalty: float
    seed: int | None
    stop: list[str] | None
    ignore_eos: bool = False


def _next_step(it: Iterator[list[int]]) -> list[int] | None:
    # inference_mode around every step: interleaved generators enter and leave their own inference_mode
    # in any order on this thread, so each step must not depend on the mode another one left behind.
    with torch.inference_mode():
        return next(it, None)


class Job:
    """One admitted generation; see the module docstring."""

    def __init__(self, engine: Engine, stream, prompt_tokens: int):
        self.engine = engine
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self._it = iter(stream)
        self._finished = False
        self.cancelled = False  # stopped because the client went away
        self.failed = False  # stopped by an error in generation
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    @property
    def new_tokens(self) -> list[int]:
        return self.stream.session.new_tokens

    async def steps(self) -> AsyncIterator[list[int]]:
        """The tokens emitted at each decode step; the stream's `result` is set once this is exhausted."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                toks = await loop.run_in_executor(self.engine.worker, _next_step, self._it)
                if toks is None:
                    return
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                yield toks
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled = True  # the client went away (Starlette cancels the response task)
            raise
        except Exception:
            self.failed = True
            raise
        finally:
            self.finish()

    def finish(self) -> None:
        """Stop the generation (on the worker, after any step in flight) and free the admission slot."""
        if self._finished:
            return
        self._finished = True
        if self.stream.result is None:
            self.cancelled = not self.failed
            self.engine.worker.submit(self._close)
        self.engine.release()

    def _close(self) -> None:
        self._it.close()
        self.stream.close()

    def timing(self) -> dict:
        now = time.perf_counter()
        return {"time_to_first_token_s": None if self.t_first is None else round(self.t_first - self.t_start, 5),
                "generation_s": round(now - self.t_start, 5)}


class Engine:
    """The model, its worker thread and the admission counter."""

    def __init__(self, model, draft_tokens: int | str | None, max_concurrency: int, draft_vocab: int | None = None):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.model = model
        self.tokenizer = model.tokenizer
        self.draft_tokens = usable_draft_tokens(model, draft_tokens)
        # built once (it reads the model folder's token counts): every request drafts over the same tokens
        self.draft_vocab = DraftVocab.for_model(model, draft_vocab) if draft_vocab and self.draft_tokens else None
        self.max_concurrency = max_concurrency
        self.context = model.context_length
        self.eos_token_ids = set(model.eos_token_ids)  # the same stop rule as `model.generate`
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtp-generate")
        self.active = 0
        self.served = 0

    def try_admit(self) -> bool:
        """Take a slot if one is free (called on the event loop thread only, so no lock is needed)."""
        if self.active >= self.max_concurrency:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1
        self.served += 1

    def start(self, prompt_ids: list[int], params: GenerationParams) -> Job:
        """Open a generation for an admitted request. Raises ValueError (naming the parameter) on bad input;
        the caller must then release the slot itself."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-MTP fallback was already reported at startup
            stream = decode_stream(
                self.model, prompt_ids, max_new_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, repetition_penalty=params.repetition_penalty, seed=params.seed,
                stop=params.stop, draft_tokens=self.draft_tokens, eos_token_ids=[] if params.ignore_eos else None,
                draft_vocab=self.draft_vocab)
        return Job(self, stream, len(prompt_ids))

    def speculative_stats(self, stats) -> dict:
        """The `usage.speculative` extension: how well MTP drafting went for one request."""
        d = stats.as_dict()
        return {"draft_tokens": self.draft_tokens, "mean_accepted_length": d["mean_accepted_length"],
                "mean_accepted_length_note": d["mean_accepted_length_note"],
                "acceptance_per_position": d["acceptance_per_position"],
                "backbone_forwards": d["backbone_forwards"], "tokens_per_second": d["tokens_per_second"]}

    def shutdown(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
