"""HTTP routes (DESIGN.md section 4). Thin by rule: parse, call the service, map errors."""

from __future__ import annotations

import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sampler_service.backends.vllm_nccl import create_nccl_router
from sampler_service.encoding import negotiate
from sampler_service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sampler_service.service import SamplerService, ServiceError
from trainer_client.protocol import AckRequest, LeaseRequest, WeightsLoadRequest

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def _json(content: Any, status: int = 200) -> Response:
    if isinstance(content, BaseModel):
        content = content.model_dump(mode="json")
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def _error(
    status: int, code: str, message: str, field: str | None = None, headers: dict | None = None
) -> Response:
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    response = _json({"error": body}, status)
    response.headers.update(headers or {})
    return response


async def _read_body(request: Request, limit: int) -> bytes:
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


def _parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ServiceError(
                400, "invalid_json", f"body is not valid JSON: {first['msg']}"
            ) from exc
        field = ".".join(str(p) for p in first["loc"]) or None
        raise ServiceError(422, "invalid_request", f"{field}: {first['msg']}", field) from exc


def create_app(service: SamplerService) -> FastAPI:
    settings = service.settings

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="adaptive-rollout sampler", lifespan=lifespan)
    app.state.service = service

    def require_key(authorization: Annotated[str | None, Header()] = None) -> None:
        if settings.api_key is None:
            return
        presented = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(presented.encode(), settings.api_key.encode()):
            raise ServiceError(
                401, "unauthorized", "missing or wrong API key (Authorization: Bearer <key>)"
            )

    def require_ready() -> None:
        if not service.ready:
            raise ServiceError(503, "not_ready", "the sampler is still starting")

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.code, exc.message, exc.field, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0]
        field = ".".join(
            str(p) for p in first["loc"] if p not in ("query", "header", "body", "path")
        )
        return _error(422, "invalid_request", f"{field}: {first['msg']}", field or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, "http_error", str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        return _json(service.health())

    @app.get("/ready")
    async def ready() -> Response:
        if not service.ready:
            return _error(503, "not_ready", "the engine or dataset is still loading")
        if error := service.engine_error():
            return _error(503, "engine_failed", f"the engine failed and generates nothing: {error}")
        return _json({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key), Depends(require_ready)])

    @v1.get("/config")
    async def get_config() -> Response:
        return _json(service.get_config())

    @v1.patch("/config")
    async def patch_config(request: Request) -> Response:
        body = await _read_body(request, settings.max_request_bytes)
        try:
            patch = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ServiceError(400, "invalid_json", f"body is not valid JSON: {exc}") from exc
        return _json(await service.patch_config(patch))

    @v1.get("/groups/stream")
    async def stream(
        consumer: Annotated[str, Query(min_length=1, max_length=200)] = "default",
        max_unacked: Annotated[int, Query(ge=1, le=100_000)] = 8,
        heartbeat_s: Annotated[float | None, Query(gt=0, le=300)] = None,
        accept: Annotated[str | None, Header()] = None,
    ) -> StreamingResponse:
        encoding = negotiate(accept)
        messages = service.open_stream(
            consumer, max_unacked, heartbeat_s or settings.heartbeat_s, encoding
        )
        return StreamingResponse(messages, media_type=encoding.stream_media_type)

    @v1.post("/groups/ack")
    async def ack(request: Request) -> Response:
        body = _parse(AckRequest, await _read_body(request, settings.max_request_bytes * 8))
        return _json(await service.ack(body.delivery_ids))

    @v1.post("/groups/lease")
    async def lease(request: Request, accept: Annotated[str | None, Header()] = None) -> Response:
        body = _parse(LeaseRequest, await _read_body(request, settings.max_request_bytes))
        encoding = negotiate(accept)
        payload = await service.lease(body.consumer, body.max_groups, body.wait_s, encoding)
        return Response(payload, media_type=encoding.lease_media_type)

    @v1.put("/weights")
    async def put_weights(
        request: Request,
        version: Annotated[int | None, Query(ge=0)] = None,
        x_policy_version: Annotated[int | None, Header(ge=0)] = None,
    ) -> Response:
        version = version if version is not None else x_policy_version
        if version is None:
            raise ServiceError(
                422, "missing_version", "give the new policy version as ?version=N", "version"
            )
        service.check_version(version)
        limit = service.weights_size_limit()
        incoming = settings.state_dir / "weights" / f"incoming-{uuid.uuid4().hex}.safetensors"
        incoming.parent.mkdir(parents=True, exist_ok=True)
        try:
            await _stream_to_file(request, incoming, limit)
            return _json(await service.put_weights(incoming, version))
        finally:
            incoming.unlink(missing_ok=True)

    @v1.post("/weights/load")
    async def load_weights(request: Request) -> Response:
        body = _parse(WeightsLoadRequest, await _read_body(request, settings.max_request_bytes))
        return _json(await service.load_weights(body.path, body.version))

    @v1.get("/stats")
    async def stats() -> Response:
        return _json(service.stats())

    v1.include_router(create_nccl_router(service))
    app.include_router(v1)
    return app


async def _stream_to_file(request: Request, path: Path, limit: int) -> None:
    """Spool an upload to disk without holding it in memory; 413 past `limit`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ServiceError(
            413, "body_too_large", f"weight file over the {limit}-byte limit (2x the model)"
        )
    size = 0
    with path.open("wb") as fh:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ServiceError(
                    413, "body_too_large", f"weight file over the {limit}-byte limit (2x the model)"
                )
            fh.write(chunk)
    if size == 0:
        raise ServiceError(422, "weights_rejected", "empty weight file")
