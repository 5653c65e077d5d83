"""Inference servers the HTTP engine backend drives, as small aiohttp apps on loopback that
answer with the servers' own request and response shapes (recorded from their sources);
every POST is logged as (path, body). Served by the `serve` fixture (tests/unit/conftest.py).

- `FakeSGLang`: SGLang's http_server.py and io_struct.py (`/generate` with `input_ids`
  and `sampling_params`, `meta_info.output_token_logprobs` triples,
  `/update_weights_from_disk`, `/pause_generation`, `/continue_generation`,
  `/get_weight_version`, `/update_weight_version`).
- `FakeVLLM`: `vllm serve` 0.32 with VLLM_SERVER_DEV_MODE=1: what the backend's start-up
  reads (`/v1/models`, `/server_info`, `/weight_info`), `/v1/completions` with token ids,
  `/pause`, `/resume`, `/collective_rpc`, `/reset_prefix_cache`, and the NCCL weight
  transfer of vllm/entrypoints/rl/online/api_router.py (`/get_world_size`,
  `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
  `/finish_weight_update`, `/shutdown_weight_transfer_engine`), with the worker's session
  rules (gpu_worker.py): start twice is refused, a failed update ends the session, finish
  without a session is refused and then sets no label. The transfer itself is a
  `Rendezvous` of the servers in one round, as the trainer's broadcast is: a receive
  returns once every rank of the round arrived.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web


class FakeSGLang:
    """SGLang's answers, recorded: every call is logged as (path, body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.version = "default"
        self.refuse_loads = False
        self.paused = False  # for a dialect that reads /is_paused
        #: What /weight_checker answers (vLLM's shape), for a dialect that names it.
        self.checksums = {"model.layers.0.qkv_proj.weight": "00ff"}

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.post("/update_weight_version", self.set_version),
                web.get("/is_paused", self.is_paused),
                web.post("/weight_checker", self.weight_checker),
                *self.routes(),
            ]
        )
        return app

    def routes(self) -> list[web.RouteDef]:
        """The server kind's own paths (the rest are alike)."""
        return [
            web.get("/get_weight_version", self.get_version),
            web.post("/generate", self.generate),
            web.post("/pause_generation", self.pause),
            web.post("/continue_generation", self.resume),
            web.post("/update_weights_from_disk", self.load),
        ]

    async def _log(self, request: web.Request) -> Any:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.path, body))
        return body

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "toy", "root": "toy", "max_model_len": 64}]}
        )

    async def get_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def set_version(self, request: web.Request) -> web.Response:
        body = await self._log(request)
        self.version = body["new_version"]
        return web.json_response(
            {"success": True, "message": "ok", "new_version": body["new_version"]}
        )

    async def ok(self, request: web.Request) -> web.Response:
        await self._log(request)
        return web.json_response({"message": "done", "status": "ok"})

    async def pause(self, request: web.Request) -> web.Response:
        self.paused = True
        return await self.ok(request)

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        return await self.ok(request)

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def load(self, request: web.Request) -> web.Response:
        await self._log(request)
        if self.refuse_loads:
            return web.json_response(
                {"success": False, "message": "shape mismatch", "num_paused_requests": 0},
                status=400,
            )
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def weight_checker(self, request: web.Request) -> web.Response:
        assert (await self._log(request)) == {"action": "checksum"}
        return web.json_response({"checksums": dict(self.checksums)})

    async def generate(self, request: web.Request) -> web.Response:
        body = await self._log(request)
        params = body["sampling_params"]
        n = params.get("n", 1)
        answers = []
        for i in range(n):
            # what a sample draws moves with its seed, as a real server's draws do
            shift = i + params.get("sampling_seed", 0)
            ids = [5 + shift, 6, 7][: params["max_new_tokens"]]
            answers.append(
                {
                    "text": "x",
                    "output_ids": ids,
                    "meta_info": {
                        "id": f"{body['rid']}_{i}",
                        "finish_reason": {"type": "length", "length": len(ids)},
                        "prompt_tokens": len(body["input_ids"]),
                        "completion_tokens": len(ids),
                        "cached_tokens": 0,
                        "weight_version": self.version,
                        "output_token_logprobs": [[-0.5 - shift, t, None] for t in ids],
                    },
                }
            )
        return web.json_response(answers if n > 1 else answers[0])


class Rendezvous:
    """The trainer's side of one collective (init or broadcast): each rank's call returns
    once `parties` ranks arrived. A rank left waiting (a backend that calls the servers
    one after another) answers an error after `wait_s` instead of hanging the test."""

    def __init__(self, parties: int, wait_s: float = 30.0) -> None:
        self.parties = parties
        self.arrived = 0
        self.wait_s = wait_s
        self._all = asyncio.Event()

    async def arrive(self) -> bool:
        self.arrived += 1
        if self.arrived >= self.parties:
            self._all.set()
        try:
            await asyncio.wait_for(self._all.wait(), self.wait_s)
        except TimeoutError:
            return False
        return True


class FakeVLLM(FakeSGLang):
    """`vllm serve` 0.32's answers (see the module docstring); `world_size` ranks, NCCL
    weight transfer configured unless `transfer` is None, started with
    `--scheduling-policy` `scheduling_policy` (which only /server_info shows: a request's
    priority changes nothing in a fake)."""

    def __init__(
        self, world_size: int = 1, transfer: str | None = "nccl", scheduling_policy: str = "fcfs"
    ) -> None:
        super().__init__()
        self.world_size = world_size
        self.transfer = transfer
        self.scheduling_policy = scheduling_policy
        self.healthy = True
        self.transfer_ready = False  # the worker's weight_transfer_engine joined a group
        self.updating = False  # the worker's _weight_update_active
        self.refuse_updates = False
        #: The collective this server's next init or update joins.
        self.trainer = Rendezvous(1)

    def routes(self) -> list[web.RouteDef]:
        posts = {
            "/v1/completions": self.completions,
            "/pause": self.pause,
            "/resume": self.resume,
            "/collective_rpc": self.collective_rpc,
            "/reset_prefix_cache": self.reset_cache,
            "/init_weight_transfer_engine": self.init_transfer,
            "/start_weight_update": self.start_update,
            "/update_weights": self.update_weights,
            "/finish_weight_update": self.finish_update,
            "/shutdown_weight_transfer_engine": self.shutdown_transfer,
        }
        return [
            web.get("/server_info", self.server_info),
            web.get("/weight_info", self.get_version),
            web.get("/get_world_size", self.get_world_size),
            *(web.post(path, handler) for path, handler in posts.items()),
        ]

    def restart(self) -> None:
        """A new process at the same address: the weights it starts with, no group."""
        self.version, self.paused = "default", False
        self.transfer_ready = self.updating = False

    @staticmethod
    def failed() -> web.Response:
        """An engine error in a route without a handler of its own: FastAPI's plain 500."""
        return web.Response(status=500, text="Internal Server Error")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        assert request.query["config_format"] == "json"
        transfer = None if self.transfer is None else {"backend": self.transfer}
        config = {
            "model_config": {"logprobs_mode": "processed_logprobs", "max_model_len": 64},
            "parallel_config": {"tensor_parallel_size": self.world_size},
            "weight_transfer_config": transfer,
            "scheduler_config": {"policy": self.scheduling_policy},
        }
        return web.json_response({"vllm_config": config, "vllm_env": {}, "system_env": {}})

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._log(request)
        choices = []
        for i in range(body["n"]):
            ids = [5 + i, 6, 7][: body["max_tokens"]]
            choices.append(
                {
                    "index": i,
                    "text": "x",
                    "token_ids": ids,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in ids],
                        "token_logprobs": [-0.5 - i] * len(ids),
                    },
                    "finish_reason": "length",
                }
            )
        return web.json_response({"id": f"cmpl-{body['request_id']}", "choices": choices})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await self._log(request)
        assert body["method"] == "reload_weights" and "weights_path" in body["kwargs"]
        if self.refuse_loads:  # vLLM 0.32's engine core dies on a failed reload
            return self.failed()
        return web.json_response({"results": [None] * self.world_size})

    async def reset_cache(self, request: web.Request) -> web.Response:
        await self._log(request)
        return web.json_response({"success": True})

    async def get_world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.world_size})

    async def init_transfer(self, request: web.Request) -> web.Response:
        body = await self._log(request)
        assert set(body) == {"init_info"}
        if self.transfer is None or not await self.trainer.arrive():
            return self.failed()
        self.transfer_ready = True
        return web.json_response({"message": "Weight transfer initialized"})

    async def start_update(self, request: web.Request) -> web.Response:
        await self._log(request)
        if not self.transfer_ready or self.updating:
            return self.failed()
        self.updating = True
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await self._log(request)
        assert set(body) == {"update_info"}
        if not self.updating or self.refuse_updates or not await self.trainer.arrive():
            self.updating = False
            return self.failed()
        return web.json_response({"message": "Weights updated"})

    async def finish_update(self, request: web.Request) -> web.Response:
        body = await self._log(request)
        assert set(body) <= {"weight_version"}
        if not self.updating:
            return self.failed()
        self.updating = False
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return web.json_response({"message": "Weight update finished"})

    async def shutdown_transfer(self, request: web.Request) -> web.Response:
        await self._log(request)
        self.transfer_ready = False
        return web.json_response({"message": "Weight transfer shut down"})
