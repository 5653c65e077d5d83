"""An engine in the sampler's process (hf, vLLM, the hf engine's child process) as a fleet
of one.

The fleet's weight barrier (pause, load, label, confirm, resume) and its wave handles
are the same as for a fleet of many; what a fleet of one leaves out is what only many
need. No probes and no restarts: the engine reports its own health, and its failure is
the sampler's. Like any member it serves only the committed version: after a failed NCCL
round it waits, at the file weights it restored, for the trainer's next round. No rollback across members: an engine-level reload after a failed load
stays inside the engine (vLLM reloads what it served before), and the member reports
it as a load that failed and restored itself. Nothing is kept to load again: no member
ever comes back to be resynced, so the committed tensors are not held in memory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sampler_service.backends.base import (
    Backend,
    BackendHealth,
    ContinueKV,
    PauseMode,
    Wave,
    WaveRequest,
)
from sampler_service.config import ReplicaSettings
from sampler_service.errors import NotSupported
from sampler_service.fleet.member import Attached, Member, Probe, Source, Transport
from sampler_service.fleet.pool import Fleet
from sampler_service.metrics import Metrics
from sampler_service.weights.types import NCCLDescription, WeightsNotServed, WeightsRejected


class LocalMember:
    """The in-process engine as the fleet's one member."""

    restartable = False
    address = None

    def __init__(self, engine: Backend) -> None:
        self.engine = engine
        self.name = f"the {engine.name} engine"

    @property
    def cancels_answers(self) -> bool:
        return self.engine.cancels_answers

    @property
    def continues(self) -> frozenset[ContinueKV]:
        return self.engine.continues

    @property
    def orders_by_priority(self) -> bool:
        return self.engine.orders_by_priority

    def describe(self) -> dict[str, Any]:
        return {}

    async def attach(self) -> Attached:
        return Attached(
            version=self.engine.policy_version,
            identity=os.getpid(),
            model_name=self.engine.model_name,
            specs=self.engine.weight_specs(),
        )

    async def recover(self, kill: bool) -> Attached:
        raise NotSupported("an engine in the sampler's process is not restarted")

    async def probe(self) -> Probe:
        health = self.engine.health()
        return Probe(health.ok, self.engine.policy_version, os.getpid(), detail=health.detail)

    def generate(self, request: WaveRequest, version: int) -> Wave:
        return self.engine.issue(request)

    async def abort(self) -> int:
        return await self.engine.abort_all()

    async def pause(self, mode: PauseMode) -> None:
        await self.engine.pause_for_load(mode)

    async def resume(self) -> None:
        await self.engine.resume_after_load()

    async def load(self, source: Source | None, version: int) -> None:
        if source is None or source.payload is None:
            raise NotSupported("an in-process engine loads only the tensors it is given")
        try:
            await self.engine.load_weights(source.payload, version)
        except (WeightsRejected, WeightsNotServed, NotSupported):
            raise
        except Exception as exc:
            raise WeightsNotServed(f"{exc} (serving v{self.engine.policy_version})") from exc

    async def label(self) -> int | None:
        return self.engine.policy_version

    async def set_label(self, version: int) -> None:
        """The engine labels what it loads itself."""

    async def checksum(self) -> str:
        raise NotSupported("one engine has no other to compare its weights with")

    async def nccl_ranks(self) -> NCCLDescription:
        return await self.engine.nccl_describe()

    async def nccl_join(self, init_info: dict[str, Any]) -> None:
        await self.engine.nccl_init(init_info)

    async def nccl_receive(self, update_info: dict[str, Any], version: int) -> None:
        await self.engine.nccl_update(update_info, version)

    async def nccl_leave(self) -> None:
        await self.engine.nccl_shutdown()

    async def close(self) -> None:
        await self.engine.close()


class LocalTransport(Transport):
    """A fleet of one's wire: nothing between the fleet and its engine."""

    reads_weight_files = False
    noun = "engine"
    row_key = "engine"
    rows_key = "engines"
    nccl_hint = "set the vLLM engine's weight_transfer_config (on by default on GPUs)"

    def __init__(self, engine: Backend) -> None:
        self.engine = engine

    @property
    def name(self) -> str:
        return self.engine.name

    async def open(self) -> list[Member]:
        return [LocalMember(self.engine)]

    async def close(self) -> None:
        """The engine closed with its member."""

    async def stage_tensors(self, tensors: Mapping[str, Any], version: int) -> Source:
        return Source(version, frozenset(tensors), tensors)

    async def stage_files(self, files: Sequence[str], version: int, names: Sequence[str]) -> Source:
        raise NotSupported(f"the {self.name} engine does not read weight files from a path")

    def retain(self, source: Source) -> Source:
        return replace(source, payload=None)


#: A fleet of one engine caps nothing: the scheduler's admission bounds its load.
_UNCAPPED = sys.maxsize


class LocalFleet(Fleet):
    """One in-process engine behind the fleet (see the module docstring)."""

    def __init__(
        self,
        engine: Backend,
        *,
        metrics: Metrics | None = None,
        on_state_change: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(
            LocalTransport(engine),
            ReplicaSettings(max_inflight=_UNCAPPED),
            metrics=metrics,
            on_state_change=on_state_change,
            probes=False,
        )
        self.engine = engine

    async def start(self) -> None:
        """The engine starts first: a failure to start is the sampler's own, as it is."""
        await self.engine.start()
        await super().start()

    def health(self) -> BackendHealth:
        """The engine's own (it knows its health without probes, and callers read its
        detail: its dtype, device, process), but `degraded` while the fleet routes nothing
        to a healthy engine: an NCCL round that failed left it at older weights than the
        committed ones, and it waits for the trainer's next round or file push."""
        health = self.engine.health()
        if health.ok and not super().health().ok:
            waiting = (
                f"serves v{self.engine.policy_version}, not the committed v{self.policy_version}"
            )
            return BackendHealth(False, {**health.detail, "error": waiting}, "degraded")
        return health
