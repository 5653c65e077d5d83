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
the served one: `sampler_service.weights`), because a receiver that refuses after the trainer
started broadcasting would leave the trainer blocked in NCCL; the trainer client runs the
same checks first. Bodies are read with the API's bounded reader (`request_body`).

Weights received this way exist only in the engine: after a restart the sampler serves
the last file-based weights (and version) again until the trainer sends a newer version.

With engine replicas (`serve --replicas N`, vLLM on each) the group spans every replica:
world size = 1 (the trainer) + the sum of the replicas' workers, which GET reports as
`inference_ranks` (with each replica's `rank_offset` under `replicas`). The trainer sends
one init as for a single engine (rank offset 1); the fleet gives each replica its own
offset (`fleet.nccl.replica_init_infos`) and fans init, update and shutdown out to all
of them. A replica that restarts (or comes up) after the group was formed makes it
stale (`"group": "stale"` in GET): the next update answers 409 `nccl_group_stale` before
any transfer, and the trainer forms the group again (`NCCLWeightSender.connect`); the
restarted replica serves the last file weights, is not routed to, and joins at that init.
hf replicas answer 409 `nccl_unavailable`, as a single hf engine does. `--backend http`
lays out and fans out the same way over the `vllm serve` servers it drives, through their
own weight-transfer endpoints (`backends/http/member.py`).

Mounting (sampler_service/app.py, inside the authenticated /v1 router):
    `v1.include_router(create_nccl_router(lambda: service.weights))`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from sampler_service.request_body import parse_body, read_body
from sampler_service.weights.manager import WeightsManager
from sampler_service.weights.nccl import NCCLInitRequest, NCCLUpdateRequest

#: An update's metadata names every tensor of the model: a few MB for the largest.
MAX_BODY = 64 * 1024 * 1024


def create_nccl_router(weights: Callable[[], WeightsManager]) -> APIRouter:
    """Routes under /weights/nccl; include them in the service's authenticated /v1 router.
    `weights` returns the service's weights manager (there once the service started)."""
    router = APIRouter(prefix="/weights/nccl")

    def json(content: Any) -> Response:
        return Response(orjson.dumps(content), media_type="application/json")

    @router.get("")
    async def info() -> Response:
        manager = weights()
        described = await manager.nccl_describe()
        content = {
            "enabled": described.enabled,
            "inference_ranks": described.inference_ranks,
            "policy_version": manager.backend.policy_version,
            "tensors": {n: [list(s.shape), s.dtype] for n, s in described.specs.items()},
            "required": sorted(described.required),
        }
        if described.group is not None:  # a pool of replicas
            content.update(group=described.group, replicas=described.replicas)
        return json(content)

    @router.post("/init")
    async def init(request: Request) -> Response:
        req = parse_body(NCCLInitRequest, await read_body(request, MAX_BODY))
        ranks = await weights().nccl_init(req.init_info)
        return json({"status": "connected", "inference_ranks": ranks})

    @router.post("/update")
    async def update(request: Request) -> Response:
        req = parse_body(NCCLUpdateRequest, await read_body(request, MAX_BODY))
        return json((await weights().nccl_update(req)).model_dump())

    @router.post("/shutdown")
    async def shutdown() -> Response:
        await weights().nccl_shutdown()
        return json({"status": "closed"})

    return router
