"""The NCCL weight-transfer control plane without GPUs: vetting and the HTTP round.

The transfer itself needs two GPUs (tests/vllm_backend/test_nccl_gpu.py); here a stub vLLM
backend records what the routes ask of it, so the checks that must run before any NCCL
call (a refusal mid-broadcast would block the trainer) are covered on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from sampler_service.backends.checkpoint import Checkpoint
from sampler_service.backends.vllm import VLLMBackend
from sampler_service.fleet.nccl import replica_init_infos
from sampler_service.nccl_routes import create_nccl_router
from sampler_service.store import AsyncStore, Store
from sampler_service.weights.manager import WeightPlaces, WeightsManager
from sampler_service.weights.types import NCCLDescription, NCCLGroupStale, TensorSpec
from trainer_client.nccl import (
    NCCLTransferError,
    NCCLWeightSender,
    ServiceWeightSyncClient,
    check_metadata,
)

pytestmark = pytest.mark.vllm

SPECS = {"a.weight": TensorSpec((4, 2), "F32"), "b.weight": TensorSpec((3,), "BF16")}


class StubBackend(VLLMBackend):
    def __init__(self) -> None:  # no engine: only what the routes touch
        self.calls: list[tuple[str, Any]] = []
        self._version = 0
        self._nccl_ready = True
        self._checkpoint = Checkpoint(list(SPECS), dict(SPECS), {}, {})

    def nccl_workers(self) -> int:
        return 2

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        self.calls.append(("update", (update_info, version)))
        self._version = version


class StubService:
    """The service's part around the weights manager: the pause and what follows an install."""

    def __init__(self, backend: Any, tmp_path: Path) -> None:
        from sampler_service.metrics import Metrics

        self.backend = backend
        self.paused = 0
        self.installed: list[tuple[int, str]] = []
        store = AsyncStore(Store(tmp_path / "sampler.sqlite", None))
        self.weights = WeightsManager(
            backend,
            WeightPlaces(tmp_path),
            store,
            Metrics(),
            pause=self.paused_for_weights,
            engine_error=lambda: None,
            installed=self.weights_installed,
        )

    @contextlib.asynccontextmanager
    async def paused_for_weights(self):  # type: ignore[no-untyped-def]
        self.paused += 1
        yield

    async def weights_installed(
        self, version: int, transport: str, seconds: float, paused_s: float
    ) -> None:
        self.installed.append((version, transport))


def _app(service: StubService) -> FastAPI:
    from sampler_service.errors import ServiceError

    app = FastAPI()
    app.include_router(create_nccl_router(lambda: service.weights), prefix="/v1")

    @app.exception_handler(ServiceError)
    async def _err(_: Any, exc: ServiceError) -> JSONResponse:
        return JSONResponse(
            {"error": {"code": exc.code, "message": exc.message}}, status_code=exc.status
        )

    return app


def _client(app: FastAPI) -> ServiceWeightSyncClient:
    """The trainer-side client, its HTTP calls served in-process by the app."""
    client = ServiceWeightSyncClient("http://sampler")

    def handle(request: httpx.Request) -> httpx.Response:
        async def call() -> httpx.Response:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://sampler"
            ) as c:
                r = await c.request(
                    request.method,
                    request.url.path,
                    content=request.content,
                    headers=dict(request.headers),
                )
                return httpx.Response(r.status_code, content=r.content, headers=r.headers)

        return asyncio.run(call())

    client._http = httpx.Client(transport=httpx.MockTransport(handle), base_url="http://sampler")
    return client


def test_trainer_side_check_metadata() -> None:
    info = {
        "tensors": {n: [list(s.shape), s.dtype] for n, s in SPECS.items()},
        "required": sorted(SPECS),
    }
    check_metadata([("a.weight", "float32", (4, 2)), ("b.weight", "float32", (3,))], info)
    for bad in (
        [("a.weight", "float32", (4, 2))],
        [("a.weight", "float32", (4, 2)), ("b.weight", "float32", (4,))],
        [("a.weight", "float32", (4, 2)), ("b.weight", "int64", (3,))],
        [("a.weight", "float32", (4, 2)), ("b.weight", "float32", (3,)), ("zz", "float32", (1,))],
    ):
        with pytest.raises(NCCLTransferError):
            check_metadata(bad, info)


def test_http_round_versions_and_refusals(tmp_path: Path) -> None:
    service = StubService(StubBackend(), tmp_path)
    client = _client(_app(service))
    info = client.info()
    assert info["enabled"] and info["inference_ranks"] == 2 and info["policy_version"] == 0
    assert info["tensors"]["a.weight"] == [[4, 2], "F32"] and info["required"] == [
        "a.weight",
        "b.weight",
    ]
    client.init_weight_transfer_engine(
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3}
    )
    assert service.backend.calls[0][0] == "init"

    update = {
        "names": ["a.weight", "b.weight"],
        "dtype_names": ["float32", "float32"],
        "shapes": [[4, 2], [3]],
    }
    with pytest.raises(NCCLTransferError, match="version"):
        client.update_weights(update)  # no version set
    client.version = 3
    client.start_weight_update()
    client.update_weights(update)
    client.finish_weight_update()
    assert service.backend.calls[-1] == ("update", (update, 3)) and service.paused == 1
    assert service.installed == [(3, "nccl")]  # logged, and schedule steps may fire
    assert client.info()["policy_version"] == 3
    with pytest.raises(NCCLTransferError, match="409"):
        client.update_weights(update)  # version 3 again
    client.version = 4
    with pytest.raises(NCCLTransferError, match="422"):
        client.update_weights({**update, "shapes": [[4, 2], [5]]})
    assert service.paused == 1 and len(service.backend.calls) == 2  # refused before pausing


class StubPool:
    """What the routes ask of a fleet of engine replicas (`Fleet`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.policy_version = 0
        self.group = "none"

    def _stale(self) -> str | None:
        if self.group != "ok":
            return "replica 1 restarted or failed since the NCCL group was formed"
        return None

    async def nccl_describe(self) -> NCCLDescription:
        return NCCLDescription(
            enabled=True,
            inference_ranks=4,
            specs=dict(SPECS),
            required=frozenset(SPECS),
            group=self.group,
            replicas=[
                {"replica": 0, "workers": 2, "rank_offset": 1},
                {"replica": 1, "workers": 2, "rank_offset": 3},
            ],
            stale=self._stale(),
        )

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", replica_init_infos(init_info, [2, 2])))
        self.group = "ok"

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        if (reason := self._stale()) is not None:
            raise NCCLGroupStale(reason)
        self.calls.append(("update", version))
        self.policy_version = version


def test_http_round_with_replicas_and_the_stale_group(tmp_path: Path) -> None:
    pool = StubPool()
    service = StubService(pool, tmp_path)
    client = _client(_app(service))
    info = client.info()
    assert info["inference_ranks"] == 4 and info["group"] == "none"
    assert info["replicas"][1] == {"replica": 1, "workers": 2, "rank_offset": 3}
    update = {
        "names": ["a.weight", "b.weight"],
        "dtype_names": ["float32", "float32"],
        "shapes": [[4, 2], [3]],
    }
    client.version = 1
    with pytest.raises(NCCLTransferError, match="409 nccl_group_stale"):
        client.update_weights(update)  # no group yet
    with pytest.raises(NCCLTransferError, match="422 invalid_init_info.*world_size 3"):
        client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 3})
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 5})
    assert [i["rank_offset"] for i in pool.calls[0][1]] == [1, 3]
    client.update_weights(update)
    assert pool.calls[-1] == ("update", 1) and service.installed == [(1, "nccl")]
    pool.group = "stale"  # a replica restarted
    assert client.info()["group"] == "stale"
    client.version = 2
    with pytest.raises(NCCLTransferError, match="409 nccl_group_stale"):
        client.update_weights(update)
    assert service.paused == 1 and pool.calls[-1] == ("update", 1)  # refused before pausing
    # The trainer's sender asks first and refuses before it would broadcast.
    sender = NCCLWeightSender("http://sampler", master_address="127.0.0.1", master_port=1)
    sender.client = client
    sender._engine = object()  # connected (no GPU here: nothing is sent)
    with pytest.raises(NCCLTransferError, match="stale.*connect"):
        sender.send(version=2)
