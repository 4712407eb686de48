"""A request body, from bytes to a validated protocol object: at most `max_bytes` (413), JSON, every string valid
Unicode text (a lone surrogate such as "\\ud800" is legal JSON but not text: 400 naming where it is), then the
protocol's strict types (protocol.py; 400 naming the field).
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)
DRAIN_BYTES = 64 << 20  # an oversized body is still read (and dropped) up to this size before the 413 goes out


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or a 413 once it passes `max_bytes`. An oversized body is read to its end all the same (up to
    DRAIN_BYTES or 4x the limit, nothing kept): a client still sending when the server closes the connection sees
    a reset instead of the 413."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > max_bytes
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        too_big = too_big or n > max_bytes
        if not too_big:
            chunks.append(chunk)
        elif n > max(DRAIN_BYTES, 4 * max_bytes):
            break
    if not too_big:
        return b"".join(chunks)
    size = f"{declared} bytes" if declared.isdigit() else f"more than {max_bytes} bytes"
    raise APIError(413, f"the request body ({size}) exceeds the limit of {max_bytes} bytes (--max-request-bytes)",
                   code="request_too_large", headers={"Connection": "close"})


def unencodable(obj, path: str = "") -> tuple[str, str] | None:
    """(where, what) of the first string in a parsed JSON value (keys included) that is not valid Unicode text,
    or None. `where` is the field path ("messages[0].content")."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, f"{obj[e.start]!a} at character {e.start}"
        return None
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            if (bad := unencodable(v, f"{path}[{i}]")) is not None:
                return bad
    elif isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            if (bad := unencodable(k, path or "body")) is not None or (bad := unencodable(v, sub)) is not None:
                return bad
    return None


async def parse(request: Request, model: type[M], max_bytes: int) -> M:
    """The body as a `model` (see the module docstring); every failure is an APIError naming what is wrong."""
    raw = await read_body(request, max_bytes)
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    bad = unencodable(obj)
    if bad is not None:
        where, what = bad
        raise APIError(400, f"'{where}' is not valid Unicode text: it holds the lone surrogate {what} "
                            "(send UTF-8 text)", param=where.split("[")[0].split(".")[0], code="invalid_value")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
