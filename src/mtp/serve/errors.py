"""Every failure as an OpenAI error object with the right status, naming the field when there is one.

Validation errors are answered 400 as the OpenAI API answers them: `param` is the offending top-level field, the
message gives its full path (`messages[0].role`) and, for a wrong type, what was expected and what came
("Invalid type for 'max_tokens': expected an integer, but got a string instead."). Error bodies are written
ASCII-only, so that no text a client sent (a lone surrogate, say) can break the answer.
"""

from __future__ import annotations

import json
import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .protocol import error_body

log = logging.getLogger("mtp.serve")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"
# Names pydantic puts in an error location for the member of a union type, not for a field.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# What a pydantic type error expected, in the OpenAI API's words.
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object"}
_MEMBERS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "none": "null",
            "list[int]": "an array of integers", "list[str]": "an array of strings",
            "list[list[int]]": "an array of arrays of integers", "list[TextPart]": "an array of content parts"}


class APIError(Exception):
    """An error answered to the client (never a crash): status, message, field, optional headers."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(error_body(self.message, self.param, self.type, self.code), self.status, self.headers)


class AsciiJSONResponse(JSONResponse):
    """JSON written ASCII-only (non-ASCII characters as \\u escapes): nothing a client sent can make it unencodable."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _is_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS or part[:1].isupper())


def _path(loc) -> str:
    """('messages', 0, 'role') -> 'messages[0].role' (union member tags dropped)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):
            out += f".{part}" if out else part
    return out


def _got(value) -> str:
    """The JSON type of what a client sent, as the OpenAI API names it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number" if math.isfinite(value) else str(value).replace("inf", "Infinity").replace("nan", "NaN")
    return {str: "a string", list: "an array", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _describe(err: dict) -> tuple[str, str, str | None]:
    """(path, message, code) of one pydantic error that is not about a union."""
    path, kind = _path(err.get("loc", ())) or "body", err.get("type", "")
    if kind == "extra_forbidden":
        return path, f"Unrecognized request argument supplied: {path}", None
    if kind == "missing":
        return path, f"Missing required parameter: '{path}'.", "missing_required_parameter"
    if kind in _EXPECTED:
        return path, f"Invalid type for '{path}': expected {_EXPECTED[kind]}, but got {_got(err.get('input'))} instead.", \
            "invalid_type"
    if kind == "finite_number":
        return path, f"Invalid value for '{path}': expected a finite number, but got {_got(err.get('input'))}.", "invalid_value"
    return path, f"{path}: {err.get('msg', 'invalid').removeprefix('Value error, ')}", None


def _union(errors: list[dict], at: int) -> tuple[str, str, str | None]:
    """One message for the errors of one union-typed field (their location has a member tag at index `at`): a member
    that matched the outer shape but failed inside (an array with a wrong element) speaks for itself; otherwise
    'expected A or B, but got C'."""
    for err in errors:
        if len(err["loc"]) > at + 1:
            return _describe(err)
    path = _path(errors[0]["loc"])
    members = list(dict.fromkeys(_MEMBERS.get(e["loc"][at], e["loc"][at]) for e in errors))
    return path, f"Invalid type for '{path}': expected {' or '.join(members)}, but got {_got(errors[0].get('input'))} " \
                 "instead.", "invalid_type"


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', '')})")
    described, unions = [], {}
    for err in errors:
        loc = tuple(err.get("loc", ()))
        at = next((i for i, part in enumerate(loc) if _is_tag(part)), None)
        if at is None:
            described.append(_describe(err))
        else:
            unions.setdefault(loc[:at], (at, []))[1].append(err)
    described += [_union(errs, at) for at, errs in unions.values()]
    path, _, code = described[0]
    message = "; ".join(dict.fromkeys(m for _, m, _ in described))
    return APIError(400, message, path.split("[")[0].split(".")[0], code=code if len(described) == 1 else None)


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

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:  # went away while sending its body
        request.state.log["error"] = "the client disconnected before its request body was complete"
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()
