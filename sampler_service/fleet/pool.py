"""A fleet of engines behind the one `Backend` interface the scheduler uses.

The members are Ray replicas, `vllm serve` servers, or the in-process engine of a fleet
of one (`fleet.member`: what the fleet asks of each); everything between them and the
scheduler is here, written once:

- Routing is sticky least-outstanding with an in-flight cap per member, and re-issued
  waves go first (`routing.py`). Only a member that is up, serves the committed version,
  is trusted and passed its last probe is routed to, and none while weights load.
- A member fault never reaches the scheduler. A member that does not answer a wave is
  taken out and the wave is re-issued whole on another member (its partial answers
  never reach the scheduler, so nothing is counted twice); so are the waves of a member
  a probe finds failed. Probes, restarts, resyncs and the roster of members that come
  and go: `upkeep.py`.
- Weights, versions and the NCCL group: `weights.py` and `nccl.py`.

Health: `ok` while a member is routable; `degraded` while none is but one may come back
(waves park, admission stops); `failed` once every member was given up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sampler_service.aio import TaskSet
from sampler_service.backends.base import (
    Backend,
    BackendHealth,
    Completion,
    GenerationAborted,
    HealthState,
    SamplingParams,
    Wave,
)
from sampler_service.config import ReplicaSettings
from sampler_service.fleet.member import (
    ForeignWeights,
    MemberDown,
    Transport,
)
from sampler_service.fleet.nccl import FleetNCCL
from sampler_service.fleet.routing import DEFAULT_MAX_INFLIGHT, WaveRouter, affinity
from sampler_service.fleet.table import Seat, Table
from sampler_service.fleet.upkeep import Upkeep
from sampler_service.fleet.weights import FleetWeights
from sampler_service.metrics import Metrics
from sampler_service.weights.types import NCCLDescription, TensorSpec

log = logging.getLogger(__name__)


class Fleet(Backend):
    """See the module docstring."""

    def __init__(
        self,
        transport: Transport,
        settings: ReplicaSettings,
        *,
        metrics: Metrics | None = None,
        on_state_change: Callable[[dict[str, Any]], None] | None = None,
        probes: bool = True,
        start_wait_s: float = 0.0,
        roster_s: float | None = None,
    ) -> None:
        """`probes`: watch members with health probes (an in-process engine reports its
        own health); `start_wait_s`: how long start-up waits for a first member to
        answer; `roster_s`: seconds between roster lookups (None: a fixed fleet).
        `on_state_change` hears each member state change (its row and `previous`)."""
        self.transport = transport
        self.reads_weight_files = transport.reads_weight_files
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.table = Table(
            transport,
            self.metrics,
            changed=lambda: self._router.dispatch(),
            failed=lambda seat: self.upkeep.failed(seat),
            on_state_change=on_state_change,
        )
        self._router: WaveRouter[Seat] = WaveRouter(
            lambda: self.table.seats,
            self._routable,
            self.table.charge,
            max_inflight=settings.max_inflight or DEFAULT_MAX_INFLIGHT,
            route=settings.route,
            poll_s=settings.probe_s,
            wait_s=settings.wait_s,
            on_decision=lambda kind: self.metrics.route_decisions.labels(kind).inc(),
        )
        self.weights = FleetWeights(
            self.table,
            transport,
            compare_checksums=settings.compare_checksums,
            resync_later=lambda seat: self.upkeep.spawn_recovery(seat),
        )
        self.nccl = FleetNCCL(self.table, self.weights)
        self._tasks = TaskSet()
        self.upkeep = Upkeep(
            self.table,
            self.weights,
            settings,
            self._tasks,
            probes=probes,
            start_wait_s=start_wait_s,
            roster_s=roster_s,
        )

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.transport.name

    @property
    def policy_version(self) -> int:
        return self.weights.committed

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return self.upkeep.specs

    @property
    def model_name(self) -> str:
        return self.upkeep.model_name

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        for member in await self.transport.open():
            self.table.add(member)
        for kind in ("sticky", "moved", "new"):
            self.metrics.route_decisions.labels(kind)
        await self.upkeep.start()

    async def close(self) -> None:
        await self._tasks.cancel()
        self._router.cancel_all()
        await asyncio.gather(*(s.member.close() for s in self.table.seats), return_exceptions=True)
        await self.transport.close()

    # -- routing and waves ------------------------------------------------------------
    def _routable(self, seat: Seat) -> bool:
        fresh = not self.upkeep.probes or (
            time.monotonic() - seat.last_ok <= self.settings.probe_timeout_s + self.settings.probe_s
        )
        return (
            seat.state == "ok"
            and seat.version == self.weights.committed
            and not seat.distrusted
            and not self.weights.loading
            and fresh
        )

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        sampling: SamplingParams,
        *,
        affinity_key: str | None = None,
    ) -> list[Completion]:
        self.upkeep.serving = True
        prompt = list(prompt_token_ids)
        key = affinity(prompt, affinity_key)
        reissue = False
        while True:
            seat = await self._router.acquire(key, n, reissue)
            epoch, started = seat.epoch, time.monotonic()
            wave = seat.member.generate(prompt, n, sampling, self.weights.committed)
            try:
                out = await self._answers(seat, wave)
            except GenerationAborted:
                raise  # a weight update's abort: the scheduler re-issues it after the update
            except ForeignWeights as exc:
                self.table.distrust(seat, str(exc))
                self.table.reissued(seat, n, "foreign_weights")
                reissue = True
                continue
            except MemberDown as exc:
                self.table.fail(seat, epoch, exc.reason, repr(exc))
                self.table.reissued(seat, n, seat.reason or exc.reason)
                reissue = True
                continue
            finally:
                self._router.release(seat, n)
            self.table.finished(seat, started, sum(len(c.token_ids) for c in out))
            return out

    async def _answers(self, seat: Seat, wave: Wave) -> list[Completion]:
        """The wave's answers, unless its member is found failed first: the wave is then
        cancelled (its request ends on the member) and MemberDown raised. A whole wave
        is read as its engine call, with no task or wait of its own: a toy wave lasts
        milliseconds, and the front's CPU per wave is what bounds it."""
        down = seat.down
        assert down is not None
        reading = asyncio.ensure_future(wave.answers())

        def lost(_: asyncio.Future[None]) -> None:
            reading.cancel()

        down.add_done_callback(lost)
        try:
            return await reading
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not down.done() or (task is not None and task.cancelling()):
                raise  # the caller gave up (the engine call went with it)
        finally:
            down.remove_done_callback(lost)
        await wave.cancel(range(wave.n))
        raise MemberDown(f"{seat.member.name} failed during the wave", seat.reason)

    async def abort_all(self) -> int:
        up = [s for s in self.table.seats if s.up]
        results = await asyncio.gather(*(s.member.abort() for s in up), return_exceptions=True)
        return sum(r for r in results if isinstance(r, int))

    def health(self) -> BackendHealth:
        seats, noun = self.table.seats, self.transport.noun
        usable = any(self._routable(s) for s in seats) or (
            self.weights.loading and any(s.up for s in seats)
        )
        failed = bool(seats) and all(s.state == "failed" for s in seats)
        committed = self.weights.committed
        detail: dict[str, Any] = {
            "policy_version": committed,
            **self.transport.detail(committed),
            self.transport.rows_key: self.table.rows(),
        }
        errors = "; ".join(f"{s.member.name}: {s.error}" for s in seats)
        if failed:
            detail["error"] = f"every {noun} failed and used up its restarts: {errors}"
        elif not usable:
            detail["error"] = f"no {noun} can serve now: {errors}"
        state: HealthState = "ok" if usable else "failed" if failed else "degraded"
        return BackendHealth(ok=usable, detail=detail, state=state)

    def members(self) -> list[dict[str, Any]]:
        """Every member as /v1/stats lists it."""
        return self.table.rows()

    # -- weights ----------------------------------------------------------------------
    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        self.upkeep.serving = True
        await self.weights.load(await self.transport.stage_tensors(tensors, version), version)
        self.table.changed()

    async def load_weight_files(
        self, files: Sequence[str], version: int, names: Sequence[str]
    ) -> None:
        """Have every member read weight files itself (paths they can read)."""
        if not self.reads_weight_files:
            return await super().load_weight_files(files, version, names)
        self.upkeep.serving = True
        source = await self.transport.stage_files(files, version, names)
        await self.weights.load(source, version)
        self.table.changed()

    async def nccl_describe(self) -> NCCLDescription:
        return await self.nccl.describe()

    def nccl_group_state(self) -> str:
        return self.nccl.state()

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        await self.nccl.init(init_info)

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        self.upkeep.serving = True
        await self.nccl.update(update_info, version)

    async def nccl_shutdown(self) -> None:
        await self.nccl.leave()
