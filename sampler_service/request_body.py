"""Request bodies as every route reads them: bounded before they are buffered, parsed
into the route's model with one error shape (400 for bad JSON, 422 naming the field).

The routes read bodies themselves, not through FastAPI's body parameters, so a body over
its limit is refused (413) as soon as it passes the limit, never read whole first."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from sampler_service.errors import ServiceError

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ServiceError(413, "body_too_large", f"request body over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServiceError(413, "body_too_large", f"request body over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(model: type[M], body: bytes) -> M:
    if not body:
        raise ServiceError(422, "invalid_request", "a JSON object body is required")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ServiceError(
                400, "invalid_json", f"body is not valid JSON: {first['msg']}"
            ) from exc
        field = ".".join(str(p) for p in first["loc"]) or None
        raise ServiceError(422, "invalid_request", f"{field}: {first['msg']}", field) from exc
