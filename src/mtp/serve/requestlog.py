"""Structured request log: one JSON line per request, written when its response has been sent (for a
stream: when the stream ended or the client went away), with timing and, for generations, acceptance.

Handlers add their fields to `request.state.log` (a dict); this ASGI middleware adds method, path,
status, request id and duration. Each response carries the id in an `x-request-id` header. Given a
`Metrics`, it also counts every response by route and status (`mtp:http_requests_total`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from datetime import UTC, datetime

from .metrics import Metrics

log = logging.getLogger("mtp.serve.requests")


def setup_request_log(stream=None) -> None:
    """Send the request log, bare JSON lines, to stderr (or `stream`)."""
    if log.handlers:
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class RequestLogMiddleware:
    def __init__(self, app, metrics: Metrics | None = None):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["log"] = fields = {}
        status = None
        t0 = time.perf_counter()

        async def send_and_watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException as e:
            fields.setdefault("error", f"{type(e).__name__}: {e}")
            raise
        finally:
            line = {"event": "request", "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
                    "request_id": request_id, "method": scope.get("method"), "path": scope.get("path"),
                    "status": status or 500, "duration_s": round(time.perf_counter() - t0, 5), **fields}
            log.info(_json_line(line))
            if self.metrics is not None:
                # the matched route's template ("/v1/models/{model_id:path}"), so that label values stay bounded
                route = getattr(scope.get("route"), "path", None)
                self.metrics.http_request(route or "unmatched", line["status"])


def _json_line(fields: dict) -> str:
    """One JSON line, readable (non-ASCII text as itself) unless some text in it cannot be written as UTF-8."""
    text = json.dumps(fields, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(fields, ensure_ascii=True, default=str)
    return text
