"""Every failure as an OpenAI error object with the right status, naming the field when there is one.

Validation errors (FastAPI's 422) are answered 400 like the OpenAI API does, with `param` set to the
offending top-level field and the message giving its full path (`messages[0].role`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body

log = logging.getLogger("mtp.serve")

# Names pydantic puts in an error location for the member of a union type, not for a field.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error answered to the client (never a crash): status, message, field, optional headers."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param, self.type, self.code), self.status, self.headers)


def _path(loc: tuple) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role' (union member tags dropped)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out


def validation_error(exc: RequestValidationError) -> APIError:
    messages, param = [], None
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        kind = err.get("type", "")
        if kind == "json_invalid":
            return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', '')})")
        path = _path(loc) or "body"
        param = param or path.split("[")[0].split(".")[0]
        if kind == "extra_forbidden":
            messages.append(f"Unrecognized request argument supplied: {path}")
        elif kind == "missing":
            messages.append(f"{path}: field required")
        else:
            messages.append(f"{path}: {err.get('msg', 'invalid').removeprefix('Value error, ')}")
    return APIError(400, "; ".join(dict.fromkeys(messages)), param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        request.state.log["error"] = exc.message
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        request.state.log["error"] = err.message
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        request.state.log["error"] = str(exc.detail)
        return APIError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()
