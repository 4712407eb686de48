"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health.

Request flow: API key -> body validation (protocol.py) -> prompt tokens and limits -> admission
(429 + Retry-After when `--max-concurrency` requests are in flight) -> generation on the engine's worker
thread, streamed as Server-Sent Events or returned whole. Every failure is an OpenAI error object
(errors.py) and leaves the server serving.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .. import __version__
from . import protocol as P
from .engine import Engine, GenerationParams, Job
from .errors import APIError, install_error_handlers
from .requestlog import RequestLogMiddleware
from .textstream import TextStream, final_text

RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"


def sse(obj: dict | str) -> str:
    """One Server-Sent Event carrying a JSON object (or the literal `[DONE]`)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, model_name: str, api_key: str | None = None, default_max_tokens: int = 256) -> FastAPI:
    """The ASGI app serving `engine` under the name `model_name`; `api_key` set = Bearer auth on /v1."""
    app = FastAPI(title="mtp serve", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(RequestLogMiddleware)
    install_error_handlers(app)
    tok = engine.tokenizer
    created = int(time.time())

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    # ---- from request to job -------------------------------------------------------------------------

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"model {name!r} is not served here (this server serves {model_name!r})",
                           param="model", code="model_not_found")

    def generation_params(body: P.SamplingFields, n_prompt: int, max_tokens: int | None, prompt_field: str) -> GenerationParams:
        """Limits checked against the context: an over-long prompt or max_tokens is a 400, never a crash."""
        room = engine.context - n_prompt
        if room < 1:
            raise APIError(400, f"the prompt has {n_prompt} tokens, which does not fit the context of "
                                f"{engine.context} tokens (room is needed for at least one new token)", param=prompt_field)
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens exceeds the context of "
                                f"{engine.context} tokens (at most {room} new tokens fit)", param="max_tokens")
        return GenerationParams(max_tokens=max_tokens, temperature=body.temperature,
                                top_p=None if body.top_p >= 1.0 else body.top_p, top_k=body.top_k,
                                repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop,
                                ignore_eos=body.ignore_eos)

    def admit(request: Request, prompt_ids: list[int], params: GenerationParams, prompt_field: str) -> Job:
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
        return job

    def record(job: Job, request: Request) -> None:
        """Put what the generation did into the request log."""
        stats = job.stream.session.stats
        result = job.stream.result
        finish = result.finish_reason if result is not None else ("error" if job.failed else "disconnected")
        request.state.log.update(completion_tokens=len(job.new_tokens), finish_reason=finish, **job.timing(),
                                 draft_tokens=engine.draft_tokens, mean_accepted_length=round(stats.mean_accepted_length, 4),
                                 acceptance_per_position=[round(a, 4) for a in stats.acceptance_per_position])

    def finish_job(job: Job, request: Request) -> None:
        job.finish()
        record(job, request)

    def result_text(job: Job) -> tuple[str, str, dict]:
        r = job.stream.result
        text = final_text(tok.decode, r.tokens, r.finish_reason, r.text, engine.eos_token_ids)
        return text, P.FINISH_REASONS[r.finish_reason], P.usage(job.prompt_tokens, len(r.tokens),
                                                                 engine.speculative_stats(r.stats))

    async def run_to_end(job: Job, request: Request) -> bool:
        """Generate a whole answer; False if the client went away first (the generation is then stopped)."""
        try:
            async with aclosing(job.steps()) as steps:
                async for _ in steps:
                    if await request.is_disconnected():
                        return False
        except Exception as e:
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}", type_="server_error") from e
        finally:
            finish_job(job, request)
        return True

    async def deltas(job: Job, stop: list[str] | None) -> AsyncIterator[tuple[str, str | None, dict | None]]:
        """(text delta, finish reason, usage) per step of a stream; the finish reason and usage come last."""
        ts = TextStream(tok.decode, stop, engine.eos_token_ids)
        async with aclosing(job.steps()) as steps:
            async for _ in steps:
                delta = ts.push(job.new_tokens)
                if delta:
                    yield delta, None, None
        text, finish, usage = result_text(job)
        yield ts.finish(text), finish, usage

    async def event_stream(job: Job, request: Request, chunks) -> AsyncIterator[str]:
        """SSE around `chunks` (the endpoint's chunk formatter); errors become an error event, then [DONE]."""
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except Exception as e:  # a failed generation: tell the client in-band, the server stays up
            request.state.log["error"] = f"{type(e).__name__}: {e}"
            yield sse(P.error_body(f"generation failed: {type(e).__name__}: {e}", type_="server_error"))
        finally:
            finish_job(job, request)
        yield sse("[DONE]")

    def streaming_response(job: Job, request: Request, chunks) -> StreamingResponse:
        return StreamingResponse(event_stream(job, request, chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(finish_job, job, request))

    # ---- endpoints -----------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "active": engine.active, "max_concurrency": engine.max_concurrency,
                "served": engine.served, "draft_tokens": engine.draft_tokens, "context": engine.context}

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "mtp",
                  "max_model_len": engine.context, "draft_tokens": engine.draft_tokens}

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return model_card

    @v1.post("/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        request.state.log["stream"] = body.stream
        if isinstance(body.prompt, str):
            ids = tok.encode(body.prompt)
        else:
            ids = list(body.prompt)
            bad = [t for t in ids if not 0 <= t < engine.model.config.vocab_size]
            if bad:
                raise APIError(400, f"token ids out of the vocabulary [0, {engine.model.config.vocab_size}): {bad[:5]}",
                               param="prompt")
        if not ids:
            raise APIError(400, "the prompt must hold at least one token", param="prompt")
        job = admit(request, ids, generation_params(body, len(ids), body.max_tokens, "prompt"), "prompt")
        rid, t = P.new_id("cmpl"), int(time.time())
        if body.stream:
            async def chunks():
                async for delta, finish, usage in deltas(job, body.stop):
                    if delta or finish:
                        yield P.completion(rid, body.model, delta, finish, None, t, chunk=True)
                    if usage is not None and body.include_usage:
                        yield {**P.completion(rid, body.model, "", None, usage, t, chunk=True), "choices": []}
            return streaming_response(job, request, chunks())
        if not await run_to_end(job, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, finish, usage = result_text(job)
        return JSONResponse(P.completion(rid, body.model, text, finish, usage, t))

    @v1.post("/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        request.state.log["stream"] = body.stream
        try:
            prompt = tok.apply_chat_template([m.as_template_dict() for m in body.messages], add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception() (e.g. wrong role order) or a Jinja error
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = tok.encode(prompt)
        job = admit(request, ids, generation_params(body, len(ids), body.requested_max_tokens, "messages"), "messages")
        rid, t = P.new_id("chatcmpl"), int(time.time())
        if body.stream:
            async def chunks():
                yield P.chat_chunk(rid, body.model, t, {"role": "assistant", "content": ""})
                async for delta, finish, usage in deltas(job, body.stop):
                    if delta:
                        yield P.chat_chunk(rid, body.model, t, {"content": delta})
                    if finish:
                        yield P.chat_chunk(rid, body.model, t, {}, finish)
                    if usage is not None and body.include_usage:
                        yield P.chat_chunk(rid, body.model, t, None, usage_=usage)
            return streaming_response(job, request, chunks())
        if not await run_to_end(job, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, finish, usage = result_text(job)
        return JSONResponse(P.chat_completion(rid, body.model, text, finish, usage))

    app.include_router(v1)
    return app
