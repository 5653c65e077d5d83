"""A fleet of engines behind the one `Backend` interface the scheduler uses.

The members are Ray replicas, `vllm serve` servers, or the in-process engine of a fleet
of one (`fleet.member`: what the fleet asks of each); everything between them and the
scheduler is here, written once:

- Routing is sticky least-outstanding with an in-flight cap per member, and re-issued
  waves go first (`routing.py`). Only a member that is up, serves the committed version,
  is trusted and passed its last probe is routed to, and none while weights load.
- Waves stream (`wave`): each answer is passed on by its index as the member hands it
  over, and a cancel by index goes to the member's wave (the member's in-flight count
  drops by the cancelled answers at once). `generate` reads a member's wave whole.
- A member fault never reaches the scheduler. A member that does not answer a wave is
  taken out and what it did not answer is re-issued on another member: the whole wave
  for `generate` (its partial answers never reach the scheduler, so nothing is counted
  twice), the indices not yet passed on for a streamed wave (the answers passed on
  stay; the re-issued ones are new draws); so are the waves of a member a probe finds
  failed. Probes, restarts, resyncs and the roster of members that come and go:
  `upkeep.py`.
- Weights, versions and the NCCL group: `weights.py` and `nccl.py`.

Health: `ok` while a member is routable; `degraded` while none is but one may come back
(waves park, admission stops); `failed` once every member was given up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sampler_service.aio import TaskSet
from sampler_service.backends.base import (
    Backend,
    BackendHealth,
    Completion,
    ContinueKV,
    GenerationAborted,
    HealthState,
    PauseMode,
    StreamedWave,
    Wave,
    WaveRequest,
    WholeWave,
    aborted,
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

_T = TypeVar("_T")


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

    @property
    def whole_waves_cheaper(self) -> bool:
        return self.transport.whole_waves_cheaper

    @property
    def cancels_answers(self) -> bool:
        """Every member's waves cancel single answers (a wave may land on any of them)."""
        seats = self.table.seats
        return bool(seats) and all(s.member.cancels_answers for s in seats)

    @property
    def orders_by_priority(self) -> bool:
        """Every member orders its queue (a wave may land on any of them)."""
        seats = self.table.seats
        return bool(seats) and all(s.member.orders_by_priority for s in seats)

    @property
    def continues(self) -> frozenset[ContinueKV]:
        """What every member continues under (an update pauses them all)."""
        seats = [s for s in self.table.seats if s.state != "gone"]
        if not seats:
            return frozenset()
        return frozenset.intersection(*(s.member.continues for s in seats))

    @property
    def update_pause(self) -> PauseMode:
        return self.weights.pause_mode

    @update_pause.setter
    def update_pause(self, mode: PauseMode) -> None:
        self.weights.pause_mode = mode

    def issue(self, request: WaveRequest) -> Wave:
        """A wave read whole goes to one member as it is (a member may answer it as one
        request); a streamed one is driven answer by answer, what a lost member did not
        answer issued again elsewhere."""
        self.upkeep.serving = True
        if request.whole:
            return WholeWave(self._whole(request), request.n)
        run = _Run(request, affinity(request.prompt_token_ids, request.affinity_key))
        run.wave = StreamedWave(
            request.n,
            lambda indices: self._cancel(run, indices),
            run.drop,
            cancels_answers=self.cancels_answers,
        )
        run.driver = self._tasks.spawn(self._drive(run), "fleet-wave")
        return run.wave

    async def _whole(self, request: WaveRequest) -> list[Completion]:
        n, key, reissue = request.n, affinity(request.prompt_token_ids, request.affinity_key), False
        while True:
            seat = await self._router.acquire(key, n, reissue)
            epoch, started = seat.epoch, time.monotonic()
            # A weight update's abort raises GenerationAborted out of here: the scheduler
            # re-issues the wave after the update.
            try:
                wave = seat.member.generate(request, self.weights.committed)
                out = await self._read(seat, wave, wave.answers())
            except (ForeignWeights, MemberDown) as exc:
                self._lost(seat, epoch, exc, n)
                reissue = True
                continue
            finally:
                self._router.release(seat, n)
            self.table.finished(seat, started, sum(len(c.token_ids) for c in out))
            return out

    async def _drive(self, run: _Run) -> None:
        """A streamed wave from issue to its last answer: routed to a member, its answers
        passed on as they finish, what a failed member did not answer issued again."""
        wave, reissue = run.wave, False
        try:
            while todo := self._unissued(run):
                seat = await self._router.acquire(run.key, len(todo), reissue)
                epoch, started = seat.epoch, time.monotonic()
                issue = _Issue(seat, todo, charged=set(todo))
                try:
                    # Answers cancelled while it waited are answered already: not issued.
                    self._uncharge(issue, set(todo) - wave.missing)
                    issue.indices = sorted(issue.charged)
                    if not issue.indices:
                        continue
                    request = run.request
                    part = replace(
                        request,
                        n=len(issue.indices),
                        priorities=tuple(map(request.priority, issue.indices))
                        if request.priorities
                        else (),
                    )
                    issue.wave = seat.member.generate(part, self.weights.committed)
                    run.issue = issue
                    try:
                        await self._read(seat, issue.wave, self._pass_on(run, issue))
                    except (ForeignWeights, MemberDown) as exc:
                        self._lost(seat, epoch, exc, len(wave.missing.intersection(issue.indices)))
                        reissue = True
                    else:
                        self.table.finished(seat, started, issue.tokens)
                finally:
                    run.issue = None
                    self._uncharge(issue, issue.charged)
        except asyncio.CancelledError:
            wave.fail(
                GenerationAborted("the wave was dropped: its reader left, or the fleet closed")
            )
            raise
        except Exception as exc:  # noqa: BLE001 - the wave's reader gets it
            wave.fail(exc)

    def _unissued(self, run: _Run) -> list[int]:
        """The indices to issue: those not answered, less the cancelled ones, which are
        answered as aborted with nothing decoded (their member was lost with them)."""
        wave = run.wave
        for index in sorted(wave.missing & wave.cancelled):
            wave.put(index, aborted(self.weights.committed))
        return sorted(wave.missing)

    async def _pass_on(self, run: _Run, issue: _Issue) -> None:
        try:
            assert issue.wave is not None
            async for j, answer in issue.wave:
                index = issue.indices[j]
                self._uncharge(issue, {index})
                issue.tokens += len(answer.token_ids)
                run.wave.put(index, answer)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            # a member's whole wave, cancelled whole: its answers are the aborted ones

    async def _cancel(self, run: _Run, indices: list[int]) -> None:
        """Forward a cancel to the member's wave, and free the member's charge for those
        answers at once; answers no member runs now are answered as aborted here."""
        issue = run.issue
        held = issue.positions(indices) if issue is not None and issue.wave is not None else {}
        for index in indices:
            if index not in held:
                run.wave.put(index, aborted(self.weights.committed))
        if issue is None or issue.wave is None or not held:
            return
        self._uncharge(issue, set(held))
        await issue.wave.cancel(list(held.values()))
        if not issue.wave.cancels_answers:  # cancelled whole: it answers nothing
            for index in held:
                run.wave.put(index, aborted(self.weights.committed))

    def _uncharge(self, issue: _Issue, indices: set[int]) -> None:
        """The member no longer runs these answers: the router may route more to it."""
        freed = issue.charged & indices
        if freed:
            issue.charged -= freed
            self._router.release(issue.seat, len(freed))

    async def _read(self, seat: Seat, wave: Wave, reading: Awaitable[_T]) -> _T:
        """What `reading` (of the member's `wave`) returns, unless the member is found
        failed first: the wave is then dropped and MemberDown raised. A whole wave is
        read as its engine call, with no task or wait of its own: a toy wave lasts
        milliseconds, and the front's CPU per wave is what bounds it."""
        down = seat.down
        assert down is not None
        task = asyncio.ensure_future(reading)

        def lost(_: asyncio.Future[None]) -> None:
            task.cancel()

        down.add_done_callback(lost)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not down.done() or (current is not None and current.cancelling()):
                raise  # the caller gave up (the engine call went with it)
        finally:
            down.remove_done_callback(lost)
        wave.close()
        raise MemberDown(f"{seat.member.name} failed during the wave", seat.reason)

    def _lost(self, seat: Seat, epoch: int, error: ForeignWeights | MemberDown, n: int) -> None:
        """A member lost a wave: distrusted (foreign weights) or failed, and its `n`
        answers not back counted as re-issued."""
        if isinstance(error, ForeignWeights):
            self.table.distrust(seat, str(error))
            self.upkeep.weights_moved(seat)
            reason = "foreign_weights"
        else:
            self.table.fail(seat, epoch, error.reason, repr(error))
            reason = seat.reason or error.reason
        self.table.reissued(seat, n, reason)

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


@dataclass(eq=False)
class _Issue:
    """The part of a streamed wave one member runs: its wave, and where answers go."""

    seat: Seat
    #: The fleet wave's index of each answer of the member's wave.
    indices: list[int]
    #: The indices the member is still charged with in the router.
    charged: set[int]
    wave: Wave | None = None
    tokens: int = 0

    def positions(self, indices: list[int]) -> dict[int, int]:
        """Of `indices`, those the member runs, each with its index in the member's wave."""
        where = {index: j for j, index in enumerate(self.indices)}
        return {i: where[i] for i in indices if i in where}


@dataclass(eq=False)
class _Run:
    """A streamed wave of the fleet: what it asks, its handle, its driver task and the
    part of it a member runs now."""

    request: WaveRequest
    key: int
    wave: StreamedWave = field(init=False)
    driver: asyncio.Task[None] | None = None
    issue: _Issue | None = None

    def drop(self) -> None:
        """Its reader left: the driver stops, and the member's wave with it."""
        if self.driver is not None:
            self.driver.cancel()
