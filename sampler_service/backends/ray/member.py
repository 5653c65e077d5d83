"""One engine replica, a detached named Ray actor (`replica.py`), as the fleet's member
for `--replicas N` (the replicas together, and the fleet around them: `transport.py`).

- Waves go through the replica's channel (`channel.py`): those asked for, and the
  cancels made, in one event-loop turn share one Ray call, and answers come back one by
  one as each finishes (those finished together in one call). A cancel reaches the
  replica's wave: what its engine decoded of a cancelled answer comes back, aborted.
- A dead process makes its calls raise (`MemberDown`, reason `died`); a fresh
  incarnation that was not started yet answers `NotStarted` (`restarted`). The fleet
  restarts a failed replica (`recover`): the old process is killed if it may still run,
  Ray starts a new one, and it is started (its engine loaded) before the fleet resyncs
  it with the committed weights. An actor Ray gave up on is gone for good.
- Weights: the replica reads the tensors from Ray's object store, or weight files from
  a path it can read; its engine labels what it loads itself. The base model comes back
  only with a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from sampler_service.backends.base import ContinueKV, PauseMode, Wave, WaveRequest
from sampler_service.backends.ray.channel import ReplicaChannel
from sampler_service.backends.ray.replica import NotStarted
from sampler_service.errors import NotSupported
from sampler_service.fleet.member import Attached, MemberDown, MemberGone, Probe, Source
from sampler_service.weights.types import NCCLDescription, NCCLUnavailable

#: How long a replica's engine may take to start (load the model) before it counts as failed.
START_TIMEOUT_S = 600.0
#: Seconds an actor may answer "died" after a failure before it counts as gone for good.
_DEATH_SETTLE_S = 15.0


class _KillPending(RuntimeError):
    """The process asked to die still answers: `ray.kill` has not landed yet."""


def _down(error: BaseException) -> BaseException:
    """A wave's error as the fleet reads it: a dead process, or a fresh incarnation not
    started yet, is the member down; anything else is the engine's own."""
    if isinstance(error, NotStarted):
        return MemberDown(repr(error), "restarted")
    if isinstance(error, RayActorError):
        return MemberDown(repr(error), "died")
    return error


class RayMember:
    """One replica actor: see the module docstring."""

    restartable = True
    address = None

    def __init__(
        self, index: int, actor_name: str, handle: Any, *, orphan_s: float, on_exit: str
    ) -> None:
        self.name = f"replica {index}"
        self.actor_name = actor_name
        self.handle = handle
        self.channel = ReplicaChannel(handle, _down)
        self.pid: int | None = None
        #: Its engine's waves cancel single answers (as it said when it was attached).
        self.cancels_answers = False
        #: What its engine continues under across a weight load (likewise).
        self.continues: frozenset[ContinueKV] = frozenset()
        #: Its engine serves queued answers by priority (likewise).
        self.orders_by_priority = False
        #: The process this member asked Ray to kill: until Ray's kill lands, calls may
        #: still reach it, and it is not a new incarnation.
        self._killed_pid: int | None = None
        self._orphan_s = orphan_s
        self._on_exit = on_exit

    def describe(self) -> dict[str, Any]:
        return {"name": self.actor_name, "pid": self.pid}

    async def _call(self, method: str, *args: Any) -> Any:
        """An actor call, its process's death or a fresh incarnation as MemberDown."""
        try:
            return await getattr(self.handle, method).remote(*args)
        except (NotStarted, RayActorError) as exc:
            raise _down(exc) from exc

    async def attach(self) -> Attached:
        """Start the replica's engine once; a replica already running (a new sampler
        taking it over) has whatever the old sampler asked of it aborted."""
        info = await asyncio.wait_for(
            self.handle.start.remote(self._orphan_s, self.channel.session), START_TIMEOUT_S
        )
        if info["attached"]:
            await self.handle.abort_all.remote()
        if self._killed_pid is not None and info["pid"] == self._killed_pid:
            raise _KillPending(f"{self.name}: pid {self._killed_pid} is not dead yet")
        self._killed_pid, self.pid = None, info["pid"]
        self.cancels_answers = bool(info["cancels_answers"])
        self.continues = frozenset(info.get("continues", ()))
        self.orders_by_priority = bool(info.get("orders_by_priority", False))
        return Attached(
            version=int(info["policy_version"]),
            identity=self.pid,
            model_name=info["model_name"],
            specs=info["specs"],
        )

    async def recover(self, kill: bool) -> Attached:
        """Wait for Ray's restart of the actor (killing the old process first if it may
        still run), then start it."""
        self.channel.fail_all(MemberDown(f"{self.name} failed", "died"))
        if kill:
            self._killed_pid = self.pid
            with contextlib.suppress(Exception):
                ray.kill(self.handle, no_restart=False)
        began = time.monotonic()
        while True:
            try:
                return await self.attach()
            # Ray is still restarting it, or the killed process still answers
            except (ActorUnavailableError, _KillPending):
                if time.monotonic() > began + START_TIMEOUT_S:
                    raise
                await asyncio.sleep(0.5)
            except ActorDiedError as exc:
                # Right after a death a call may still see the old incarnation's error;
                # an actor Ray gave up on keeps answering it.
                if time.monotonic() > began + _DEATH_SETTLE_S:
                    raise MemberGone(repr(exc)) from exc
                await asyncio.sleep(1.0)

    async def probe(self) -> Probe:
        result = await self._call("health")
        return Probe(
            ok=bool(result["ok"]),
            version=result.get("policy_version"),
            identity=result["pid"] if result["started"] else None,
            detail=result.get("detail"),
        )

    def generate(self, request: WaveRequest, version: int) -> Wave:
        return self.channel.wave(request, self.cancels_answers)

    async def abort(self) -> int:
        return int(await self._call("abort_all"))

    async def pause(self, mode: PauseMode) -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def load(self, source: Source | None, version: int) -> None:
        if source is None:
            raise NotSupported("a replica serves the base model again only by restarting")
        kind, payload = source.payload
        await self._call(
            "load_weight_files" if kind == "files" else "load_weights", payload, version
        )

    async def label(self) -> int | None:
        return int(await self._call("policy_version"))

    async def set_label(self, version: int) -> None:
        """The replica's engine labels what it loads itself."""

    async def checksum(self) -> str:
        raise NotSupported("replicas are not compared by weight checksums")

    async def nccl_ranks(self) -> NCCLDescription:
        described: NCCLDescription | None = await self._call("nccl_describe")
        if described is None:
            raise NCCLUnavailable("NCCL weight transfer needs --backend vllm")
        return described

    async def nccl_join(self, init_info: dict[str, Any]) -> None:
        await self._call("nccl_init", init_info)

    async def nccl_receive(self, update_info: dict[str, Any], version: int) -> None:
        await self._call("nccl_update", update_info, version)

    async def nccl_leave(self) -> None:
        await self._call("nccl_shutdown")

    async def close(self) -> None:
        await self.channel.close()
        if self._on_exit == "kill":
            with contextlib.suppress(Exception):
                ray.kill(self.handle, no_restart=True)

    async def replica_health(self) -> dict[str, Any]:
        """The replica's own answer to a health probe (with its call counters)."""
        return dict(await self.handle.health.remote())
