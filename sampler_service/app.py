"""HTTP routes of the sampler. Thin by rule: parse, call the service, map errors.

Every route declares its request and response models and each status it answers, so
the OpenAPI document (/docs) is the reference of the API."""

from __future__ import annotations

import contextlib
import gc
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from sampler_service import package_version
from sampler_service.api_docs import create_docs_router
from sampler_service.config import MAX_PROMPTS, ConfigPatch, ConfigView, ServeSettings
from sampler_service.dashboard import create_dashboard_router
from sampler_service.encoding import negotiate
from sampler_service.errors import ServiceError
from sampler_service.health import starting_health
from sampler_service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sampler_service.nccl_routes import create_nccl_router
from sampler_service.request_body import parse_body, read_body
from sampler_service.service import SamplerService
from sampler_service.sessions.chat import (
    ChatRequest,
    ClaimRequest,
    ClaimResponse,
    EndRequest,
    EndResponse,
)
from sampler_service.store import EventKind
from trainer_client.contract import features as wire_features
from trainer_client.contract.protocol import (
    AckRequest,
    AckResponse,
    ErrorResponse,
    Health,
    LeaseRequest,
    LeaseResponse,
    WeightsLoadRequest,
    WeightsResponse,
)

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


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of the JSON error body for each status."""
    return {
        status: {"model": ErrorResponse, "description": _REASONS[status]} for status in statuses
    }


_REASONS = {
    400: "the body is not valid JSON",
    401: "missing or wrong API key",
    404: "no such session (or this sampler serves none)",
    409: "a conflict: a stale version, or a name already in use",
    413: "the body is over its size limit",
    422: "a value is out of range, of the wrong type, unknown or inconsistent",
    503: "the sampler is starting, or its engine failed",
}
#: Every /v1 route can answer these (readiness, parameters), and 401 when a key is set.
_V1_ERRORS = (422, 503)


def _json_route(model: type[BaseModel], *statuses: int) -> dict[str, Any]:
    """The OpenAPI declarations of a route that reads a JSON `model` body itself (the
    routes read bodies themselves to enforce size limits before parsing): the body, and
    its errors 400 (not JSON) and 413 (too large) besides `statuses`."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {
        "responses": _errors(*sorted({400, 413, *statuses})),
        "openapi_extra": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}
        },
    }


#: A query parameter, not a body field: lease bodies refuse unknown keys, so a new client
#: sending it in the body would fail against an older server.
_GroupsPerStep = Annotated[
    int | None,
    Query(
        ge=1,
        le=MAX_PROMPTS,
        description="groups the consumer trains on per step: max_staleness counts in steps",
    ),
]

#: A query parameter for the same reason: what the consumer handles (comma-separated).
_Features = Annotated[
    list[str] | None,
    Query(
        max_length=16,
        description="wire features the consumer handles, comma-separated: "
        + ", ".join(sorted(wire_features.FEATURES))
        + " (no_text: groups without answer and prompt texts; loss_mask: the consumer trains "
        "on Sample.loss_mask, required while multi-turn episodes are served); unknown names "
        "are a 422",
    ),
]


def _features(values: list[str] | None) -> frozenset[str]:
    try:
        return wire_features.parse(values or ())
    except wire_features.UnknownFeatures as exc:
        raise ServiceError(422, "unknown_feature", str(exc), wire_features.QUERY_PARAM) from exc


def _serving(app: FastAPI) -> SamplerService | None:
    """The app's service once built and while it serves (not while it stops)."""
    service: SamplerService | None = app.state.service
    return service if service is not None and service.ready else None


def _require_ready(request: Request) -> SamplerService:
    if (service := _serving(request.app)) is None:
        raise ServiceError(503, "not_ready", "the sampler is still starting")
    return service


#: The service, for a /v1 route (the router checked it is ready).
_Service = Annotated[SamplerService, Depends(_require_ready)]

_BEARER = HTTPBearer(auto_error=False, description="the API key, when one is configured")

#: Request models declared through `_json_body`, added to the document's components.
_BODY_MODELS: tuple[type[BaseModel], ...] = (
    ChatRequest,
    ClaimRequest,
    EndRequest,
    ConfigPatch,
    AckRequest,
    LeaseRequest,
    WeightsLoadRequest,
)


def create_app(settings: ServeSettings, build: Callable[[], Awaitable[SamplerService]]) -> FastAPI:
    """The app over the service `build` returns, built when the app starts (its lifespan)
    and stopped when it ends; `app.state.service` is the service once built."""
    started_at = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = app.state.service = await build()
        # What start-up made (the tokenizer, the engine's client, every module) lives as
        # long as the service: out of the collector's sight, a full collection scans only
        # what serving made since, not ~400k objects at every one (~0.1-0.25 s each).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            await service.stop()

    # /docs is served from this package (api_docs), not from FastAPI's CDN-backed page.
    app = FastAPI(
        title="adaptive-rollout sampler",
        version=package_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.service = None

    def require_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        """`Authorization: Bearer <key>`, the scheme in any case; a bare key is refused."""
        assert settings.api_key is not None  # only a sampler with a key has this guard
        presented = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(presented.encode(), settings.api_key.encode()):
            raise ServiceError(
                401, "unauthorized", "missing or wrong API key (Authorization: Bearer <key>)"
            )

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
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not only one route's
            headers["Allow"] = ", ".join(_allowed_methods(app, request))
        return _error(exc.status_code, "http_error", str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    @app.get("/health", response_model=Health)
    async def health() -> Response:
        """Liveness, with no auth: status, backend, model, policy version, warnings."""
        service: SamplerService | None = app.state.service
        if service is None:
            return _json(starting_health(settings, started_at))
        return _json(service.health.health())

    @app.get("/ready", responses={200: {"model": dict[str, str]}, **_errors(503)})
    async def ready() -> Response:
        """200 once the engine is loaded and the dataset open and while the engine lives."""
        if (service := _serving(app)) is None:
            return _error(503, "not_ready", "the engine or dataset is still loading")
        if error := service.health.engine_error():
            return _error(503, "engine_failed", f"the engine failed and generates nothing: {error}")
        if service.health.engine_degraded():
            return _error(503, "degraded", "no engine replica can serve now; one is recovering")
        return _json({"status": "ready"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text exposition; open without a key (it carries no groups or config)."""
        service: SamplerService | None = app.state.service
        if service is None:
            return _error(503, "not_ready", "the engine or dataset is still loading")
        return Response(service.stats.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    # Without a key there is no guard, so the document declares no security scheme: a
    # client generated from it sends no header the server would ignore.
    guards = [Depends(require_key)] if settings.api_key is not None else []
    v1 = APIRouter(
        prefix="/v1",
        dependencies=[*guards, Depends(_require_ready)],
        responses=_errors(*_V1_ERRORS, *((401,) if guards else ())),
    )

    @v1.get("/config", response_model=ConfigView)
    async def get_config(service: _Service) -> Response:
        """The live sampler config with its config_version."""
        return _json(service.control.get_config())

    @v1.patch("/config", response_model=ConfigView, **_json_route(ConfigPatch, 409))
    async def patch_config(request: Request, service: _Service) -> Response:
        """A JSON merge patch of config keys; validated as a whole, persisted."""
        body = await read_body(request, settings.max_request_bytes)
        try:
            patch = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ServiceError(400, "invalid_json", f"body is not valid JSON: {exc}") from exc
        return _json(await service.control.patch_config(patch))

    @v1.get(
        "/groups/stream",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "NDJSON (or msgpack on request) group and heartbeat messages",
                "content": {"application/x-ndjson": {}, "application/x-msgpack": {}},
            },
            **_errors(409),
        },
    )
    async def stream(
        service: _Service,
        consumer: Annotated[str, Query(min_length=1, max_length=200)] = "default",
        max_unacked: Annotated[int, Query(ge=1, le=100_000)] = 8,
        heartbeat_s: Annotated[float | None, Query(gt=0, le=300)] = None,
        groups_per_step: _GroupsPerStep = None,
        features: _Features = None,
        accept: Annotated[str | None, Header(include_in_schema=False)] = None,
    ) -> StreamingResponse:
        """Finished groups for one consumer; 409 while another live stream has its name,
        or when the consumer lacks a feature these groups need (`feature_required`)."""
        declared = _features(features)
        service.delivery.check_features(declared)
        encoding = negotiate(accept, declared)
        messages = service.delivery.open_stream(
            consumer,
            max_unacked,
            heartbeat_s or settings.heartbeat_s,
            encoding,
            groups_per_step,
            declared,
        )
        return StreamingResponse(messages, media_type=encoding.stream_media_type)

    @v1.post("/groups/ack", response_model=AckResponse, **_json_route(AckRequest))
    async def ack(request: Request, service: _Service) -> Response:
        """Delete acked groups durably; unknown ids are counted, not errors."""
        body = parse_body(AckRequest, await read_body(request, settings.max_request_bytes * 8))
        return _json(await service.ack(body.delivery_ids))

    @v1.post("/groups/lease", response_model=LeaseResponse, **_json_route(LeaseRequest, 409))
    async def lease(
        request: Request,
        service: _Service,
        groups_per_step: _GroupsPerStep = None,
        features: _Features = None,
        accept: Annotated[str | None, Header(include_in_schema=False)] = None,
    ) -> Response:
        """Lease whole frames (JSON, or msgpack on request); they return if not acked.
        409 `feature_required` when the consumer lacks a feature these groups need."""
        declared = _features(features)
        service.delivery.check_features(declared)
        encoding = negotiate(accept, declared)
        body = parse_body(LeaseRequest, await read_body(request, settings.max_request_bytes))
        payload = await service.delivery.lease(
            body.consumer, body.max_groups, body.wait_s, encoding, groups_per_step
        )
        return Response(payload, media_type=encoding.lease_media_type)

    @v1.put(
        "/weights",
        response_model=WeightsResponse,
        responses=_errors(409, 413),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def put_weights(
        request: Request,
        service: _Service,
        version: Annotated[int | None, Query(ge=0)] = None,
        x_policy_version: Annotated[int | None, Header(ge=0)] = None,
    ) -> Response:
        """Upload a safetensors file; returns once the engine serves it."""
        version = version if version is not None else x_policy_version
        if version is None:
            raise ServiceError(
                422, "missing_version", "give the new policy version as ?version=N", "version"
            )
        weights = service.weights
        weights.check_version(version)
        limit = weights.size_limit()
        incoming = weights.upload_dir() / f"incoming-{uuid.uuid4().hex}.safetensors.part"
        incoming.parent.mkdir(parents=True, exist_ok=True)
        try:
            await _stream_to_file(request, incoming, limit)
            return _json(await weights.put(incoming, version))
        finally:
            incoming.unlink(missing_ok=True)

    @v1.post(
        "/weights/load", response_model=WeightsResponse, **_json_route(WeightsLoadRequest, 409)
    )
    async def load_weights(request: Request, service: _Service) -> Response:
        """Load weights from a path the server can read."""
        body = parse_body(WeightsLoadRequest, await read_body(request, settings.max_request_bytes))
        return _json(await service.weights.load(body.path, body.version))

    @v1.get("/stats", response_model=dict[str, Any])
    async def stats(service: _Service) -> Response:
        """Pass rates, mixing shares, stop reasons, queue depths, throughput, warnings."""
        return _json(service.stats.document())

    @v1.get("/events", response_model=dict[str, Any])
    async def events(
        service: _Service,
        since: Annotated[int, Query(ge=0, le=1 << 62)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
        kind: Annotated[list[EventKind] | None, Query(max_length=8)] = None,
    ) -> Response:
        """The event log after `since`, oldest first; `kind` (repeatable) keeps those kinds."""
        return _json(await service.control.events.page(since, limit, kind or ()))

    @v1.post("/sessions/claim", response_model=ClaimResponse, **_json_route(ClaimRequest, 404))
    async def claim_session(request: Request, service: _Service) -> Response:
        """A session no harness holds yet, for a harness that runs elsewhere (waits up to
        `wait_s`; `session` is null when none came)."""
        body = parse_body(ClaimRequest, await read_body(request, settings.max_request_bytes))
        return _json(await service.claim_session(body.wait_s, str(request.base_url)))

    v1.include_router(
        create_nccl_router(lambda: app.state.service.weights), responses=_errors(400, 409, 413)
    )
    app.include_router(v1)

    # A harness's session: the OpenAI base URL is /sessions/{id}/v1.
    sessions = APIRouter(
        prefix="/sessions/{session_id}",
        dependencies=[*guards, Depends(_require_ready)],
        responses=_errors(404, *_V1_ERRORS, *((401,) if guards else ())),
    )

    @sessions.post(
        "/v1/chat/completions", response_model=dict[str, Any], **_json_route(ChatRequest, 409)
    )
    async def chat_completions(session_id: str, request: Request, service: _Service) -> Response:
        """An OpenAI chat completion in the session: the model's next turn (tool calls as
        `tool_calls`). 409 `history_changed` for a call that does not continue the
        transcript or overlaps another, `session_cancelled` / `session_ended` once the
        episode is over; 400 for n > 1 or stream=true."""
        body = parse_body(ChatRequest, await read_body(request, settings.max_request_bytes))
        return _json(await service.session_hub().chat(session_id, body))

    @sessions.post("/end", response_model=EndResponse, **_json_route(EndRequest, 409))
    async def end_session(session_id: str, request: Request, service: _Service) -> Response:
        """End the session with its reward (null: the row's verifier scores the last turn)."""
        body = parse_body(EndRequest, await read_body(request, settings.max_request_bytes))
        service.session_hub().get(session_id).end(body.reward)
        return _json(EndResponse(session_id=session_id, ended=True))

    app.include_router(sessions)
    app.include_router(create_dashboard_router())
    app.include_router(create_docs_router())

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=__doc__
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _BODY_MODELS:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods some route of `request`'s path answers (a path may have several routes)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


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
