"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, and Prometheus
metrics on /metrics (metrics.py).

Request flow: API key -> body validation (protocol.py) -> prompt tokens and limits -> admission
(429 + Retry-After when `--max-concurrency` requests are in flight) -> generation on the engine's worker
thread, streamed as Server-Sent Events or returned whole. Every failure is an OpenAI error object
(errors.py) and leaves the server serving.
"""

from __future__ import annotations

import hmac
import json
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .. import __version__
from ..io.generation_config import sampling_defaults
from . import protocol as P
from .engine import Engine, GenerationParams, Job
from .errors import APIError, install_error_handlers
from .metrics import Metrics, finished_reason
from .requestlog import RequestLogMiddleware
from .textstream import TextStream, final_text

RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"


def sse(obj: dict | str) -> str:
    """One Server-Sent Event carrying a JSON object (or the literal `[DONE]`)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class Server:
    """The steps from an HTTP request to a generation and back; `create_app` routes the endpoints here."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None, default_max_tokens: int, metrics: Metrics):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self._counted: weakref.WeakSet[Job] = weakref.WeakSet()  # jobs already in the metrics (finish runs twice for streams)
        self.tok = engine.tokenizer
        # what a request leaves out comes from the model's generation_config.json, as in vLLM
        self.sampling_defaults = sampling_defaults(getattr(engine.model, "source_path", None))
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "mtp",
                           "max_model_len": engine.context, "draft_tokens": engine.draft_tokens}

    # ---- request checks ----------------------------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model {name!r} is not served here (this server serves {self.model_name!r})",
                           param="model", code="model_not_found")

    def completion_prompt(self, body: P.CompletionRequest) -> list[int]:
        """The prompt's token ids (text is tokenized; ids are checked against the vocabulary)."""
        if isinstance(body.prompt, str):
            ids = self.tok.encode(body.prompt)
        else:
            ids = list(body.prompt)
            vocab = self.engine.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}", param="prompt")
        if not ids:
            raise APIError(400, "the prompt must hold at least one token", param="prompt")
        return ids

    def chat_prompt(self, body: P.ChatCompletionRequest) -> list[int]:
        try:
            prompt = self.tok.apply_chat_template([m.as_template_dict() for m in body.messages], add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception() (e.g. wrong role order), an unsafe or broken template
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return self.tok.encode(prompt)

    def generation_params(self, body: P.SamplingFields, n_prompt: int, max_tokens: int | None,
                          prompt_field: str) -> GenerationParams:
        """Limits checked against the context: an over-long prompt or max_tokens is a 400, never a crash."""
        room = self.engine.context - n_prompt
        if room < 1:
            raise APIError(400, f"the prompt has {n_prompt} tokens, which does not fit the context of "
                                f"{self.engine.context} tokens (room is needed for at least one new token)", param=prompt_field)
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens exceeds the context of "
                                f"{self.engine.context} tokens (at most {room} new tokens fit)", param="max_tokens")
        given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")
                 if k in body.model_fields_set}
        s = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
             "repetition_penalty": body.repetition_penalty} | self.sampling_defaults | given
        return GenerationParams(max_tokens=max_tokens, temperature=s["temperature"],
                                top_p=None if s["top_p"] >= 1.0 else s["top_p"], top_k=s["top_k"],
                                repetition_penalty=s["repetition_penalty"], seed=body.seed, stop=body.stop,
                                ignore_eos=body.ignore_eos)

    # ---- admission and the job's life --------------------------------------------------------------------
    def admit(self, request: Request, prompt_ids: list[int], params: GenerationParams, prompt_field: str) -> Job:
        engine = self.engine
        if not engine.try_admit():
            raise APIError(429, f"server busy: {engine.active} requests in flight (--max-concurrency "
                                f"{engine.max_concurrency}); retry after {RETRY_AFTER_S}s",
                           type_="rate_limit_error", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            job = engine.start(prompt_ids, params)
        except ValueError as e:
            engine.release()
            msg = str(e)
            raise APIError(400, msg, param=prompt_field if "prompt" in msg else msg.split(" ")[0]) from None
        request.state.log.update(prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens, temperature=params.temperature)
        self.metrics.request_started()
        return job

    def record(self, job: Job, request: Request) -> None:
        """Put what the generation did into the request log."""
        stats = job.stream.session.stats
        result = job.stream.result
        finish = result.finish_reason if result is not None else ("error" if job.failed else "disconnected")
        request.state.log.update(completion_tokens=len(job.new_tokens), finish_reason=finish, **job.timing(),
                                 draft_tokens=self.engine.draft_tokens,
                                 mean_accepted_length=round(stats.mean_accepted_length, 4),
                                 acceptance_per_position=[round(a, 4) for a in stats.acceptance_per_position])

    def count_finished(self, job: Job) -> None:
        """Metrics for a job that ended (once per job): its outcome, tokens and latency. (Rounds, batch sizes and the
        running / waiting gauges are the engine's to count, as they happen.)"""
        if job in self._counted:
            return
        self._counted.add(job)
        result, timing = job.stream.result, job.timing()
        self.metrics.request_finished(finished_reason(result.finish_reason if result is not None else None, job.failed),
                                      job.prompt_tokens, len(job.new_tokens), timing["generation_s"],
                                      timing["time_to_first_token_s"])

    def finish_job(self, job: Job, request: Request) -> None:
        job.finish()
        self.record(job, request)
        self.count_finished(job)

    def result_text(self, job: Job) -> tuple[str, str, dict]:
        r = job.stream.result
        text = final_text(self.tok.decode, r.tokens, r.finish_reason, r.text, self.engine.eos_token_ids)
        return text, P.FINISH_REASONS[r.finish_reason], P.usage(job.prompt_tokens, len(r.tokens),
                                                                 self.engine.speculative_stats(r.stats))

    async def run_to_end(self, job: Job, request: Request) -> bool:
        """Generate a whole answer; False if the client went away first (the generation is then stopped)."""
        try:
            async with aclosing(job.steps()) as steps:
                async for _ in steps:
                    if await request.is_disconnected():
                        return False
        except Exception as e:
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}", type_="server_error") from e
        finally:
            self.finish_job(job, request)
        return True

    # ---- streaming ---------------------------------------------------------------------------------------
    async def deltas(self, job: Job, stop: list[str] | None) -> AsyncIterator[tuple[str, str | None, dict | None]]:
        """(text delta, finish reason, usage) per step of a stream; the finish reason and usage come last."""
        ts = TextStream(self.tok.decode, stop, self.engine.eos_token_ids)
        async with aclosing(job.steps()) as steps:
            async for _ in steps:
                delta = ts.push(job.new_tokens)
                if delta:
                    yield delta, None, None
        text, finish, usage = self.result_text(job)
        yield ts.finish(text), finish, usage

    async def event_stream(self, job: Job, request: Request, chunks) -> AsyncIterator[str]:
        """SSE around `chunks` (the endpoint's chunk formatter); errors become an error event, then [DONE]."""
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except Exception as e:  # a failed generation: tell the client in-band, the server stays up
            request.state.log["error"] = f"{type(e).__name__}: {e}"
            yield sse(P.error_body(f"generation failed: {type(e).__name__}: {e}", type_="server_error"))
        finally:
            self.finish_job(job, request)
        yield sse("[DONE]")

    def streaming_response(self, job: Job, request: Request, chunks) -> StreamingResponse:
        return StreamingResponse(self.event_stream(job, request, chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(self.finish_job, job, request))

    # ---- the two generation endpoints --------------------------------------------------------------------
    async def completions(self, body: P.CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        request.state.log["stream"] = body.stream
        ids = self.completion_prompt(body)
        job = self.admit(request, ids, self.generation_params(body, len(ids), body.max_tokens, "prompt"), "prompt")
        rid, t = P.new_id("cmpl"), int(time.time())
        if body.stream:
            async def chunks():
                async for delta, finish, usage in self.deltas(job, body.stop):
                    if delta or finish:
                        yield P.completion(rid, body.model, delta, finish, None, t, chunk=True)
                    if usage is not None and body.include_usage:
                        yield {**P.completion(rid, body.model, "", None, usage, t, chunk=True), "choices": []}
            return self.streaming_response(job, request, chunks())
        if not await self.run_to_end(job, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, finish, usage = self.result_text(job)
        return JSONResponse(P.completion(rid, body.model, text, finish, usage, t))

    async def chat_completions(self, body: P.ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        request.state.log["stream"] = body.stream
        ids = self.chat_prompt(body)
        params = self.generation_params(body, len(ids), body.requested_max_tokens, "messages")
        job = self.admit(request, ids, params, "messages")
        rid, t = P.new_id("chatcmpl"), int(time.time())
        if body.stream:
            async def chunks():
                yield P.chat_chunk(rid, body.model, t, {"role": "assistant", "content": ""})
                async for delta, finish, usage in self.deltas(job, body.stop):
                    if delta:
                        yield P.chat_chunk(rid, body.model, t, {"content": delta})
                    if finish:
                        yield P.chat_chunk(rid, body.model, t, {}, finish)
                    if usage is not None and body.include_usage:
                        yield P.chat_chunk(rid, body.model, t, None, usage_=usage)
            return self.streaming_response(job, request, chunks())
        if not await self.run_to_end(job, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, finish, usage = self.result_text(job)
        return JSONResponse(P.chat_completion(rid, body.model, text, finish, usage))


def create_app(engine: Engine, model_name: str, api_key: str | None = None, default_max_tokens: int = 256,
               metrics: Metrics | None = None) -> FastAPI:
    """The ASGI app serving `engine` under the name `model_name`; `api_key` set = Bearer auth on /v1; `metrics`:
    where to count (None: a new Metrics, reachable as `app.state.metrics`)."""
    metrics = metrics if metrics is not None else Metrics()
    engine.metrics = metrics  # the engine counts rounds, batch sizes, running and waiting requests
    server = Server(engine, model_name, api_key, default_max_tokens, metrics)
    app = FastAPI(title="mtp serve", version=__version__, docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.add_middleware(RequestLogMiddleware, metrics=metrics)
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.check_api_key)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "active": engine.active, "max_concurrency": engine.max_concurrency,
                "served": engine.served, "draft_tokens": engine.draft_tokens, "context": engine.context}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:  # no API key, as vLLM: scrapers rarely send one
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        server.check_model(model_id)
        return server.model_card

    @v1.post("/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        return await server.chat_completions(body, request)

    app.include_router(v1)
    return app
