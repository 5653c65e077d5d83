"""HTTP routes of the NCCL weight transfer (vLLM backend on GPUs): thin, like the rest of the API.

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
the served one: `backends.vllm_nccl`), because a receiver that refuses after the trainer
started broadcasting would leave the trainer blocked in NCCL; the trainer client runs the
same checks first. Bodies are read with the API's bounded reader (`request_body`).

Weights received this way exist only in the engine: after a restart the sampler serves
the last file-based weights (and version) again until the trainer sends a newer version.

With engine replicas (`serve --replicas N`, vLLM on each) the group spans every replica:
world size = 1 (the trainer) + the sum of the replicas' workers, which GET reports as
`inference_ranks` (with each replica's `rank_offset` under `replicas`). The trainer sends
one init as for a single engine (rank offset 1); the pool gives each replica its own
offset (`backends.vllm_nccl.nccl_replica_init_infos`) and fans init, update and shutdown out to all
of them. A replica that restarts (or comes up) after the group was formed makes it
stale (`"group": "stale"` in GET): the next update answers 409 `nccl_group_stale` before
any transfer, and the trainer forms the group again (`NCCLWeightSender.connect`); the
restarted replica serves the last file weights, is not routed to, and joins at that init.
hf replicas answer 409 `nccl_unavailable`, as a single hf engine does.

Mounting (sampler_service/app.py, inside the authenticated /v1 router):
    `v1.include_router(create_nccl_router(service))`
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from sampler_service.backends.vllm_nccl import NCCLInitRequest, NCCLUpdateRequest, vet_update_info
from sampler_service.request_body import parse_body, read_body
from sampler_service.service import SamplerService, ServiceError

M = TypeVar("M", bound=BaseModel)
#: An update's metadata names every tensor of the model: a few MB for the largest.
MAX_BODY = 64 * 1024 * 1024


def create_nccl_router(service: SamplerService) -> APIRouter:
    """Routes under /weights/nccl; include them in the service's authenticated /v1 router."""
    router = APIRouter(prefix="/weights/nccl")

    def backend() -> Any:
        from sampler_service.backends.vllm import VLLMBackend

        engine = service.backend
        if not (isinstance(engine, VLLMBackend) or fans_out(engine)):
            raise ServiceError(
                409,
                "nccl_unavailable",
                f"NCCL weight transfer needs --backend vllm (not {engine.name})",
            )
        return engine

    def fans_out(engine: Any) -> bool:
        """A pool of engine replicas (`RayPoolBackend`): every call goes to each replica."""
        return hasattr(engine, "nccl_group_state")

    async def pool_call(call: Any) -> Any:
        from sampler_service.backends.base import NCCLGroupStale, NCCLUnavailable

        try:
            return await call
        except NCCLUnavailable as exc:
            raise ServiceError(409, "nccl_unavailable", str(exc)) from exc
        except NCCLGroupStale as exc:
            raise ServiceError(409, "nccl_group_stale", str(exc)) from exc

    async def specs_of(engine: Any) -> tuple[dict[str, Any], set[str]]:
        if fans_out(engine):
            info = await pool_call(engine.nccl_info())
            return info["specs"], info["required"]
        return engine.nccl_specs()

    def cause(exc: BaseException) -> str:
        """The message of an error raised in a replica actor, without Ray's traceback."""
        return str(getattr(exc, "cause", None) or exc)

    async def body(request: Request, model: type[M]) -> M:
        return parse_body(model, await read_body(request, MAX_BODY))

    def json(content: Any) -> Response:
        import orjson

        return Response(orjson.dumps(content), media_type="application/json")

    @router.get("")
    async def info() -> Response:
        engine = backend()
        if fans_out(engine):
            pool = await pool_call(engine.nccl_info())
            return json(
                {
                    "enabled": pool["enabled"],
                    "inference_ranks": pool["inference_ranks"],
                    "policy_version": engine.policy_version,
                    "tensors": {n: [list(s.shape), s.dtype] for n, s in pool["specs"].items()},
                    "required": sorted(pool["required"]),
                    "group": pool["group"],
                    "replicas": pool["replicas"],
                }
            )
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
            if fans_out(engine):
                await pool_call(engine.nccl_init(req.init_info))
                ranks = (await pool_call(engine.nccl_info()))["inference_ranks"]
            else:
                await engine.nccl_init(req.init_info)
                ranks = engine.nccl_workers()
        except (ValueError, TypeError) as exc:
            raise ServiceError(422, "invalid_init_info", cause(exc), "init_info") from exc
        except RuntimeError as exc:
            raise ServiceError(409, "nccl_unavailable", cause(exc)) from exc
        return json({"status": "connected", "inference_ranks": ranks})

    @router.post("/update")
    async def update(request: Request) -> Response:
        engine = backend()
        req = await body(request, NCCLUpdateRequest)
        specs, required = await specs_of(engine)
        if fans_out(engine):
            # a stale group is refused before the pause and any transfer (and checked
            # again, under the pool's weights lock, before the replicas receive)
            await pool_call(engine.nccl_check_group())
        problem = vet_update_info(req.update_info, specs, required)
        if problem is not None:
            raise ServiceError(422, "weights_rejected", problem, "update_info")
        service.check_version(req.version)
        started = time.monotonic()
        async with service.scheduler.paused_for_weights():
            service.check_version(req.version)
            try:
                await pool_call(engine.nccl_update(req.update_info.model_dump(), req.version))
            except RuntimeError as exc:
                # the engine reloaded whole weights; the message says which version it serves
                raise ServiceError(409, "nccl_update_failed", cause(exc), "update_info") from exc
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
        engine = backend()
        await (pool_call(engine.nccl_shutdown()) if fans_out(engine) else engine.nccl_shutdown())
        return json({"status": "closed"})

    return router
