"""HTTP control plane of the NCCL weight transfer (vLLM backend on GPUs).

For large models a trainer sends weights GPU to GPU instead of uploading a file: the
trainer (rank 0) and every vLLM worker (ranks 1..W) form one NCCL group, and each update
is a broadcast from the trainer that vLLM's weight-transfer engine receives straight
into the live model. Only metadata goes over HTTP:

| method, path (under /v1)       | body -> result |
|---|---|
| GET  /weights/nccl             | -> `{"enabled", "inference_ranks", "policy_version", "tensors": {name: [shape, dtype]}, "required": [names]}` |
| POST /weights/nccl/init        | `{"init_info": {...}}` (vLLM `NCCLWeightTransferInitInfo` fields); returns once the group is formed |
| POST /weights/nccl/update      | `{"update_info": {"names", "dtype_names", "shapes"}, "version"}`; pauses sampling (wait/abort as configured), receives the broadcast, serves it as `version`; a failed receive gets 409 `nccl_update_failed` naming its cause and the version served instead |
| POST /weights/nccl/shutdown    | closes the group (sampling goes on) |

`trainer_client.nccl.NCCLWeightSender` drives these with vLLM's own trainer-side engine.
An update is vetted before any NCCL call (names, shapes, floating dtypes, a version above
the served one), because a receiver that refuses after the trainer started broadcasting
would leave the trainer blocked in NCCL; the trainer client runs the same checks first.

Weights received this way exist only in the engine: after a restart the sampler serves
the last file-based weights (and version) again until the trainer sends a newer version.

Mounting (sampler_service/app.py, inside the authenticated /v1 router):
    `v1.include_router(create_nccl_router(service))`
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from sampler_service.service import SamplerService

_FLOAT_NAMES = {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"}
_MAX_BODY = 64 * 1024 * 1024


class NCCLInitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]


class NCCLUpdateInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str] = Field(min_length=1)
    dtype_names: list[str]
    shapes: list[list[int]]


class NCCLUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: NCCLUpdateInfo
    version: int = Field(ge=0)


def vet_update_info(info: NCCLUpdateInfo, specs: dict[str, Any], required: set[str]) -> str | None:
    """Why this update cannot be received, or None when it fits the model.

    `specs` are the checkpoint tensors by their checkpoint names (the names vLLM's loader
    takes); every name in `required` must be sent: vLLM rebuilds each layer from the
    tensors it receives, so a round that leaves out part of a fused layer (q_proj
    without k_proj) would fill the rest with uninitialised memory.
    """
    if not len(info.names) == len(info.dtype_names) == len(info.shapes):
        return "names, dtype_names and shapes must have the same length"
    if len(set(info.names)) != len(info.names):
        return "a tensor is named twice"
    missing = sorted(required - set(info.names))
    if missing:
        return f"an NCCL update must send every tensor; {len(missing)} missing, e.g. {missing[:3]}"
    for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
        spec = specs.get(name)
        if spec is None:
            return f"tensor {name!r}: the model has no tensor of this name"
        if tuple(shape) != tuple(spec.shape):
            return f"tensor {name!r}: shape {shape} does not match the model's {list(spec.shape)}"
        if dtype not in _FLOAT_NAMES:
            return f"tensor {name!r}: dtype {dtype} is not a floating dtype"
    return None


def create_nccl_router(service: SamplerService) -> APIRouter:
    """Routes under /weights/nccl; include them in the service's authenticated /v1 router."""
    from sampler_service.service import ServiceError

    router = APIRouter(prefix="/weights/nccl")

    def backend() -> Any:
        from sampler_service.backends.vllm import VLLMBackend

        engine = service.backend
        if not isinstance(engine, VLLMBackend):
            raise ServiceError(409, "nccl_unavailable", "NCCL weight transfer needs --backend vllm")
        return engine

    async def body(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        if len(raw) > _MAX_BODY:
            raise ServiceError(
                413, "body_too_large", f"request body over the {_MAX_BODY}-byte limit"
            )
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            raise ServiceError(422, "invalid_request", f"{field}: {first['msg']}", field) from exc

    def json(content: Any) -> Response:
        import orjson

        return Response(orjson.dumps(content), media_type="application/json")

    @router.get("")
    async def info() -> Response:
        engine = backend()
        specs, required = engine.nccl_specs()
        return json(
            {
                "enabled": bool(engine.health().detail.get("nccl_weight_transfer")),
                "inference_ranks": engine.nccl_workers(),
                "policy_version": engine.policy_version,
                "tensors": {name: [list(s.shape), s.dtype] for name, s in specs.items()},
                "required": sorted(required),
            }
        )

    @router.post("/init")
    async def init(request: Request) -> Response:
        engine = backend()
        req = await body(request, NCCLInitRequest)
        try:
            await engine.nccl_init(req.init_info)
        except (ValueError, TypeError) as exc:
            raise ServiceError(422, "invalid_init_info", str(exc), "init_info") from exc
        except RuntimeError as exc:
            raise ServiceError(409, "nccl_unavailable", str(exc)) from exc
        return json({"status": "connected", "inference_ranks": engine.nccl_workers()})

    @router.post("/update")
    async def update(request: Request) -> Response:
        engine = backend()
        req = await body(request, NCCLUpdateRequest)
        specs, required = engine.nccl_specs()
        problem = vet_update_info(req.update_info, specs, required)
        if problem is not None:
            raise ServiceError(422, "weights_rejected", problem, "update_info")
        service.check_version(req.version)
        started = time.monotonic()
        async with service.scheduler.paused_for_weights():
            service.check_version(req.version)
            try:
                await engine.nccl_update(req.update_info.model_dump(), req.version)
            except RuntimeError as exc:
                # the engine reloaded whole weights; the message says which version it serves
                raise ServiceError(409, "nccl_update_failed", str(exc), "update_info") from exc
        elapsed = time.monotonic() - started
        service.metrics.weight_updates.inc()
        service.metrics.weight_update_seconds.observe(elapsed)
        await service.weights_installed(req.version, "nccl", elapsed, elapsed)
        return json(
            {
                "policy_version": req.version,
                "tensors": len(req.update_info.names),
                "load_s": elapsed,
            }
        )

    @router.post("/shutdown")
    async def shutdown() -> Response:
        await backend().nccl_shutdown()
        return json({"status": "closed"})

    return router
