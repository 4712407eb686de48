"""The generation engine behind the HTTP server: admission control and continuous batching on one worker thread.

Admitted requests join a `decode.decoder.Decoder` between rounds: the worker thread loops over `step()` (one
prompt chunk of a newcomer, then one batched speculative round for every decoding request) and hands each request's
new tokens to its `Job` on the event loop. The event loop never runs a forward, and torch never sees two forwards
at once. At most `max_concurrency` requests are admitted (beyond: 429); at most `max_batch` decode together, the
others wait in the decoder's queue.

A `Job` is one admitted generation. `Job.steps()` yields the tokens emitted at each round; `Job.finish()`
(idempotent) cancels the request (the worker frees its row) and frees the admission slot, whether the job ran to
the end, failed, its client went away, or the server stopped it (`Engine.abort_all`, at shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from ..decode.decoder import Decoder, Sequence
from ..decode.draft_vocab import DraftVocab
from ..decode.prompt_cache import PromptCache
from ..decode.sampling import SamplingParams
from ..decode.session import GenerationResult, Session
from ..model.budget import available_memory, gigabytes

log = logging.getLogger("mtp.serve")
_END = object()


class Aborted(Exception):
    """The server stopped a generation before its end (`Engine.abort_all`); the message says why."""


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


class JobStream:
    """What the HTTP layer reads of a job's generation: its session, and the result once it has ended."""

    def __init__(self, session: Session):
        self.session = session
        self.result: GenerationResult | None = None


class Job:
    """One admitted generation; see the module docstring."""

    def __init__(self, engine: Engine, session: Session, prompt_tokens: int, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.stream = JobStream(session)
        self.prompt_tokens = prompt_tokens
        self.seq: Sequence | None = None  # set by the worker when the job joins the decoder
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._finished = False
        # why the generation ended before its own end: "disconnected" (the client went away), "error" (generation
        # failed), "shutdown" (Engine.abort_all); None while it runs and when it ran to its end
        self.stopped: str | None = None
        self.cancelled = False  # the worker is to drop it (Engine.cancel; read by the worker thread)
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    @property
    def new_tokens(self) -> list[int]:
        return self.stream.session.new_tokens

    def deliver(self, item) -> None:
        """From the worker thread: tokens (a list), an exception, or the end."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop that asked for this job has closed: nobody is listening, so drop it
            self.engine.cancel(self)

    async def steps(self) -> AsyncIterator[list[int]]:
        """The tokens emitted at each round; the stream's `result` is set once this is exhausted."""
        try:
            while True:
                item = await self.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            self.stopped = self.stopped or "disconnected"  # the client went away (Starlette cancels the response task)
            raise
        except Aborted:
            self.stopped = "shutdown"
            raise
        except Exception:
            self.stopped = "error"
            raise
        finally:
            self.finish()

    def abort(self, reason: str) -> None:
        """End the generation now (on the event loop): `steps()` raises Aborted(reason) at its next wait."""
        if not self._finished and self.stream.result is None:
            self.queue.put_nowait(Aborted(reason))
            self.engine.cancel(self)

    def finish(self) -> None:
        """Stop the generation (the worker drops it before its next round) and free the admission slot."""
        if self._finished:
            return
        self._finished = True
        if self.stream.result is None:
            self.stopped = self.stopped or "disconnected"  # its reader stopped reading
            self.engine.cancel(self)
        self.engine.release(self)

    def timing(self) -> dict:
        now = time.perf_counter()
        return {"time_to_first_token_s": None if self.t_first is None else round(self.t_first - self.t_start, 5),
                "generation_s": round(now - self.t_start, 5)}


def prompt_cache_budget(requested: int, device) -> int:
    """The prompt cache's bytes: what was asked, at most half the memory available now (the cache fills as requests
    come, long after the server started; past the machine's memory it would be killed, not refused)."""
    free = available_memory(device)
    if free is not None and requested > free // 2:
        log.warning("the prompt cache keeps %s, half the memory available (--prompt-cache-mb asked %s)",
                    gigabytes(free // 2), gigabytes(requested))
        return free // 2
    return requested


class Engine:
    """The model, the batched decoder on its worker thread, and the admission counter."""

    def __init__(self, model, draft_tokens: int | str | None, max_concurrency: int, draft_vocab: int | None = None,
                 max_batch: int | None = None, metrics=None, compile: bool = False, prompt_cache_bytes: int = 0):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.model = model
        self.tokenizer = model.tokenizer
        self.draft_tokens = usable_draft_tokens(model, draft_tokens)
        # built once (it reads the model folder's token counts): every request drafts over the same tokens
        self.draft_vocab = DraftVocab.for_model(model, draft_vocab) if draft_vocab and self.draft_tokens else None
        self.max_concurrency = max_concurrency
        self.compile = compile  # the rounds as compiled graphs (decode/compiled.py)
        self.max_batch = max(1, min(max_batch or max_concurrency, max_concurrency))
        self.context = model.context_length
        self.eos_token_ids = set(model.eos_token_ids)  # the same stop rule as `mtp.generate`
        self.metrics = metrics  # a serve.metrics.Metrics (set by create_app) or None
        # prompts' states kept for later requests that start with them (decode/prompt_cache.py); outlives a decoder
        budget = prompt_cache_budget(prompt_cache_bytes, model.device)
        self.prompt_cache = PromptCache(budget) if budget else None
        self.active = 0
        self.served = 0
        self.live: set[Job] = set()  # started and not finished (event loop thread only)
        self._decoder = self._new_decoder()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: list[Job] = []
        self._jobs: list[Job] = []  # in the decoder (worker thread only)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mtp-generate", daemon=True)
        self._thread.start()

    def _new_decoder(self) -> Decoder:
        return Decoder(self.model, self.max_batch, self.context, self.draft_tokens, self.draft_vocab, compile=self.compile,
                       prompt_cache=self.prompt_cache)

    # ------------------------------------------------------------------ the event loop's side
    def try_admit(self) -> bool:
        """Take a slot if one is free (called on the event loop thread only, so no lock is needed)."""
        if self.active >= self.max_concurrency:
            return False
        self.active += 1
        return True

    def release(self, job: Job | None = None) -> None:
        """Free an admission slot (and forget `job`, when the slot was its)."""
        self.active -= 1
        self.served += 1
        self.live.discard(job)

    def start(self, prompt_ids: list[int], params: GenerationParams) -> Job:
        """Open a generation for an admitted request (on the event loop). The request must have been validated:
        Session's ValueError here is a bug. On any error the caller must release the slot itself."""
        sampling = SamplingParams(params.temperature, params.top_k, params.top_p, params.repetition_penalty, params.seed)
        session = Session(self.model, list(prompt_ids), params.max_tokens, sampling, [] if params.ignore_eos else None,
                          params.stop, self.tokenizer)
        job = Job(self, session, len(prompt_ids), asyncio.get_running_loop())
        self.live.add(job)
        with self._lock:
            self._incoming.append(job)
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job (its client went away): the worker frees its row before the next round."""
        job.cancelled = True
        if job.seq is not None:
            job.seq.cancelled = True
        self._wake.set()

    def abort_all(self, reason: str) -> int:
        """End every generation in flight (on the event loop; at shutdown): each request's `steps()` raises
        Aborted(reason). Returns how many there were."""
        jobs = list(self.live)
        for job in jobs:
            job.abort(reason)
        return len(jobs)

    def speculative_stats(self, stats) -> dict:
        """The `usage.speculative` extension: how well MTP drafting went for one request."""
        d = stats.as_dict()
        return {"draft_tokens": self.draft_tokens, "mean_accepted_length": d["mean_accepted_length"],
                "mean_accepted_length_note": d["mean_accepted_length_note"],
                "acceptance_per_position": d["acceptance_per_position"],
                "backbone_forwards": d["backbone_forwards"], "tokens_per_second": d["tokens_per_second"]}

    def shutdown(self, wait: float = 0.0) -> None:
        """Stop the worker thread after its step; `wait` > 0: wait up to that many seconds for it to end."""
        self._stop = True
        self._wake.set()
        if wait > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait)

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            with self._lock:
                incoming, self._incoming = self._incoming, []
            for job in incoming:
                if not job.cancelled:
                    job.seq = self._decoder.add(job.stream.session)
                    job.seq.cancelled = job.cancelled  # the event loop may have cancelled it meanwhile
                    self._jobs.append(job)
            if not self._jobs:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    emitted = self._decoder.step()
            except Exception as e:  # noqa: BLE001 - every request in the batch fails with it; the server keeps serving
                log.exception("generation failed")
                failed, self._jobs = self._jobs, []
                self._decoder = self._new_decoder()
                if self.metrics is not None:  # before the clients hear of it, so a scrape after their answer agrees
                    self.metrics.set_running(0)
                    self.metrics.set_waiting(0)
                for job in failed:
                    job.deliver(e)
                continue
            self._report(emitted)

    def _report(self, emitted: list[tuple[Sequence, list[int]]]) -> None:
        """Metrics first (so a scrape after a client's answer agrees), then each job's tokens and ends."""
        dec = self._decoder
        if self.metrics is not None:
            if dec.last_round:
                self.metrics.step(len(dec.last_round))
            for _, k, n in dec.last_round:
                self.metrics.speculative_round(k, n)
            self.metrics.set_running(sum(not s.finished for s in dec.rows))
            self.metrics.set_waiting(sum(not s.cancelled for s in dec.waiting))
        by_seq = {id(job.seq): job for job in self._jobs}
        for seq, toks in emitted:
            by_seq[id(seq)].deliver(toks)
        still = []
        for job in self._jobs:
            if job.seq.session.done:
                # (the request's time, admission to its last token: `usage.speculative.tokens_per_second`)
                job.seq.session.stats.time_total = time.perf_counter() - job.t_start
                job.stream.result = job.seq.session.result()
                job.deliver(_END)
            elif not job.seq.cancelled:
                still.append(job)
        self._jobs = still
