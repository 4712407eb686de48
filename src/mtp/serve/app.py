"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, and Prometheus
metrics on /metrics (metrics.py).

Request flow: API key -> the body (body.py: size limit, JSON, valid text, strict types) -> the prompt's token ids
(prompts.py: chat template in a worker process, tokenizer in a thread, limits) -> admission (429 + Retry-After when
`--max-concurrency` requests are in flight) -> generation on the engine's worker thread, streamed as Server-Sent
Events or returned whole. The event loop itself only moves bytes and small objects. Every failure is an OpenAI
error object (errors.py) and leaves the server serving.

Shutdown (shutdown.py calls `begin_drain`): /health answers 503, the requests in flight run on for the grace
period, then `abort_in_flight` ends the rest - a whole answer becomes a 503 error object, a stream gets an error
event and `data: [DONE]` - and every one of them is in the request log.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from ..io.generation_config import sampling_defaults
from ..io.template_worker import DEFAULT_TIMEOUT_S
from . import protocol as P
from .body import parse
from .engine import Aborted, Engine, GenerationParams, Job
from .errors import CLIENT_CLOSED_REQUEST, APIError, AsciiJSONResponse, install_error_handlers
from .metrics import Metrics, finished_reason
from .prompts import Prompts
from .requestlog import RequestLogMiddleware
from .textstream import TextStream

RETRY_AFTER_S = 1
MIN_REQUEST_BYTES = 1 << 20
REQUEST_BYTES_PER_TOKEN = 32  # a context's worth of text, JSON-escaped (\uXXXX is 6 bytes), with room to spare


def default_max_request_bytes(context: int) -> int:
    """The default body limit: what a prompt filling the context can take, at least 1 MiB."""
    return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * context)


@dataclass
class Limits:
    """What one request may cost the server. max_request_bytes None: `default_max_request_bytes(context)`."""

    max_request_bytes: int | None = None
    chat_template_timeout_s: float = DEFAULT_TIMEOUT_S


def sse(obj: dict | str) -> str:
    """One Server-Sent Event carrying a JSON object (or the literal `[DONE]`)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A streamed response that always closes its generator when the response ends, the client gone or not: the
    generator's `finally` (where a request's end is recorded, `Server.event_stream`) then runs exactly once, at
    once. (Starlette leaves a generator that was waiting at a `yield` when the client went away to the garbage
    collector.)"""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class Server:
    """The steps from an HTTP request to a generation and back; `create_app` routes the endpoints here."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None, default_max_tokens: int, metrics: Metrics,
                 limits: Limits):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self.max_request_bytes = limits.max_request_bytes or default_max_request_bytes(engine.context)
        self.tok = engine.tokenizer
        self.prompts = Prompts(self.tok, engine.context, engine.model.config.vocab_size, self.max_request_bytes,
                               limits.chat_template_timeout_s)
        # what a request leaves out comes from the model's generation_config.json, as in vLLM
        self.sampling_defaults = sampling_defaults(getattr(engine.model, "source_path", None))
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "mtp",
                           "max_model_len": engine.context, "draft_tokens": engine.draft_tokens}
        self.draining = False  # shutting down: /health says so; requests in flight still run
        self.stopping: str | None = None  # the grace period is over: why nothing more is admitted

    def close(self) -> None:
        self.prompts.close()

    # ---- shutdown ----------------------------------------------------------------------------------------
    def begin_drain(self, grace_s: float) -> None:
        """On the event loop, when the server stops accepting connections: the requests in flight get `grace_s`
        seconds, then `abort_in_flight`."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace_s, self.abort_in_flight, grace_s)

    def abort_in_flight(self, grace_s: float) -> None:
        self.stopping = f"the server is shutting down (requests still running after the {grace_s:g} s grace period are stopped)"
        self.engine.abort_all(self.stopping)

    def shutdown_error(self, message: str) -> APIError:
        return APIError(503, message, type_="server_error", code="server_shutdown", headers={"Connection": "close"})

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

    def generation_params(self, body: P.SamplingFields, n_prompt: int, max_tokens: int | None,
                          prompt_field: str) -> GenerationParams:
        """Limits checked against the context: an over-long prompt or max_tokens is a 400, never a crash."""
        room = self.engine.context - n_prompt
        if room < 1:
            raise APIError(400, f"the prompt has {n_prompt} tokens, which does not fit the context of "
                                f"{self.engine.context} tokens (room is needed for at least one new token)",
                           param=prompt_field, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens exceeds the context of "
                                f"{self.engine.context} tokens (at most {room} new tokens fit)", param="max_tokens",
                           code="context_length_exceeded")
        s = body.sampling(self.sampling_defaults)
        return GenerationParams(max_tokens=max_tokens, temperature=s["temperature"],
                                top_p=None if s["top_p"] >= 1.0 else s["top_p"], top_k=s["top_k"],
                                repetition_penalty=s["repetition_penalty"], seed=body.seed, stop=body.stop,
                                ignore_eos=bool(body.ignore_eos))

    # ---- admission and the job's life --------------------------------------------------------------------
    def admit(self, request: Request, prompt_ids: list[int], params: GenerationParams) -> Job:
        engine = self.engine
        if self.stopping:
            raise self.shutdown_error(self.stopping)
        if not engine.try_admit():
            raise APIError(429, f"server busy: {engine.active} requests in flight (--max-concurrency "
                                f"{engine.max_concurrency}); retry after {RETRY_AFTER_S}s",
                           type_="rate_limit_error", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            job = engine.start(prompt_ids, params)
        except BaseException:
            engine.release()
            raise
        request.state.log.update(prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens, temperature=params.temperature)
        return job

    def finish_job(self, job: Job, request: Request) -> None:
        """The one place where a request's generation ends (called once per job, from `run_to_end` or
        `event_stream`): stop it if it still runs, then the request log and the metrics."""
        job.finish()
        stats, result, timing = job.stream.session.stats, job.stream.result, job.timing()
        finish = result.finish_reason if result is not None else job.stopped
        request.state.log.update(completion_tokens=len(job.new_tokens), cached_tokens=stats.prompt_cached,
                                 finish_reason=finish, **timing,
                                 draft_tokens=self.engine.draft_tokens,
                                 mean_accepted_length=round(stats.mean_accepted_length, 4),
                                 acceptance_per_position=[round(a, 4) for a in stats.acceptance_per_position])
        self.metrics.request_finished(finished_reason(result.finish_reason if result is not None else None,
                                                      job.stopped == "error"),
                                      job.prompt_tokens, len(job.new_tokens), timing["generation_s"],
                                      timing["time_to_first_token_s"], stats.prompt_cached)

    def result_text(self, job: Job) -> tuple[str, str, dict]:
        r = job.stream.result
        return r.text, P.FINISH_REASONS[r.finish_reason], P.usage(job.prompt_tokens, len(r.tokens),
                                                                  self.engine.speculative_stats(r.stats),
                                                                  r.stats.prompt_cached)

    async def run_to_end(self, job: Job, request: Request) -> bool:
        """Generate a whole answer; False if the client went away first (the generation is then stopped)."""
        try:
            async with aclosing(job.steps()) as steps:
                async for _ in steps:
                    if await request.is_disconnected():
                        return False
        except Aborted as e:
            raise self.shutdown_error(str(e)) from None
        except Exception as e:
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}", type_="server_error") from e
        finally:
            self.finish_job(job, request)
        return True

    # ---- streaming ---------------------------------------------------------------------------------------
    async def deltas(self, job: Job, stop: list[str] | None) -> AsyncIterator[tuple[str, str | None, dict | None]]:
        """(text delta, finish reason, usage) per step of a stream; the finish reason and usage come last."""
        ts = TextStream(self.tok.decode, stop)
        async with aclosing(job.steps()) as steps:
            async for _ in steps:
                delta = ts.push(job.stream.session.text_tokens)
                if delta:
                    yield delta, None, None
        text, finish, usage = self.result_text(job)
        yield ts.finish(text), finish, usage

    async def event_stream(self, job: Job, request: Request, chunks) -> AsyncIterator[str]:
        """SSE around `chunks` (the endpoint's chunk formatter); errors become an error event, then [DONE]."""
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield sse(chunk)
        except Aborted as e:  # shutdown: the same error object a whole answer gets, in-band
            request.state.log["error"] = str(e)
            yield sse(P.error_body(str(e), type_="server_error", code="server_shutdown"))
        except Exception as e:  # a failed generation: tell the client in-band, the server stays up
            request.state.log["error"] = f"{type(e).__name__}: {e}"
            yield sse(P.error_body(f"generation failed: {type(e).__name__}: {e}", type_="server_error"))
        finally:
            self.finish_job(job, request)
        yield sse("[DONE]")

    def streaming_response(self, job: Job, request: Request, chunks) -> StreamingResponse:
        return EventStream(self.event_stream(job, request, chunks), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- the two generation endpoints --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await parse(request, P.CompletionRequest, self.max_request_bytes)
        self.check_model(body.model)
        request.state.log["stream"] = bool(body.stream)
        ids = await self.prompts.completion(body)
        job = self.admit(request, ids, self.generation_params(body, len(ids), body.max_tokens, "prompt"))
        rid, t = P.new_id("cmpl"), int(time.time())
        if body.stream:
            async def chunks():
                async with aclosing(self.deltas(job, body.stop)) as deltas:
                    async for delta, finish, usage in deltas:
                        if delta or finish:
                            yield P.completion(rid, body.model, delta, finish, None, t, chunk=True)
                        if usage is not None and body.include_usage:
                            yield {**P.completion(rid, body.model, "", None, usage, t, chunk=True), "choices": []}
            return self.streaming_response(job, request, chunks())
        if not await self.run_to_end(job, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, finish, usage = self.result_text(job)
        return JSONResponse(P.completion(rid, body.model, text, finish, usage, t))

    async def chat_completions(self, request: Request) -> Response:
        body = await parse(request, P.ChatCompletionRequest, self.max_request_bytes)
        self.check_model(body.model)
        request.state.log["stream"] = bool(body.stream)
        ids = await self.prompts.chat(body)
        job = self.admit(request, ids, self.generation_params(body, len(ids), body.requested_max_tokens, "messages"))
        rid, t = P.new_id("chatcmpl"), int(time.time())
        if body.stream:
            async def chunks():
                yield P.chat_chunk(rid, body.model, t, {"role": "assistant", "content": ""})
                async with aclosing(self.deltas(job, body.stop)) as deltas:
                    async for delta, finish, usage in deltas:
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
               metrics: Metrics | None = None, limits: Limits | None = None) -> FastAPI:
    """The ASGI app serving `engine` under the name `model_name`; `api_key` set = Bearer auth on /v1; `metrics`:
    where to count (None: a new Metrics, reachable as `app.state.metrics`); `limits`: see Limits. The `Server`
    behind it is `app.state.server` (its `close()` ends the chat template workers)."""
    metrics = metrics if metrics is not None else Metrics()
    engine.metrics = metrics  # the engine counts rounds, batch sizes, running and waiting requests
    server = Server(engine, model_name, api_key, default_max_tokens, metrics, limits or Limits())
    app = FastAPI(title="mtp serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics, app.state.server = metrics, server
    app.add_middleware(RequestLogMiddleware, metrics=metrics)
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.check_api_key)])

    @app.get("/health")
    async def health() -> Response:
        body = {"status": "draining" if server.draining else "ok", "model": model_name, "active": engine.active,
                "max_concurrency": engine.max_concurrency, "served": engine.served, "draft_tokens": engine.draft_tokens,
                "context": engine.context}
        return AsciiJSONResponse(body, 503 if server.draining else 200)

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
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    app.include_router(v1)
    return app
