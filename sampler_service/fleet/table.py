"""The fleet's table of members: each one's seat (state, version, load, epoch), its
state changes with their metrics and events, and the two ways the fleet stops trusting
one: it failed (out of routing until it is back) or it is distrusted (answering, but
not routed to until it is loaded again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from sampler_service.fleet.member import Member, MemberDown, Transport
from sampler_service.metrics import Metrics

log = logging.getLogger(__name__)

#: `starting` (not reached yet), `ok`, `syncing` (being loaded with the committed
#: weights), `paused` (by someone else), `recovering` (the fleet is restarting it),
#: `down` (not answering; its owner brings it back), `gone` (left the roster), `failed`
#: (given up).
MemberState = Literal["starting", "ok", "syncing", "paused", "recovering", "down", "gone", "failed"]
STATES: tuple[MemberState, ...] = get_args(MemberState)
#: Why a member's waves were re-issued (label `reason`).
REISSUE_REASONS = (
    "died",
    "down",
    "hung",
    "restarted",
    "unhealthy",
    "weights",
    "rollback",
    "start",
    "foreign_weights",
)


@dataclass
class SeatCounts:
    """What a member's row counts: its restarts, its waves sent again elsewhere because
    it failed under them, and the waves it finished with the seconds they took."""

    restarts: int = 0
    reissued: int = 0
    waves: int = 0
    wave_seconds: float = 0.0


@dataclass(eq=False)
class Seat:
    """What the fleet knows of one member."""

    index: int
    member: Member
    state: MemberState = "starting"
    #: The weights it serves, as the fleet numbers them (None: unknown, resynced).
    version: int | None = None
    #: Its process as it last said (see `Attached.identity`).
    identity: Hashable = None
    #: Moves whenever it may have lost its NCCL group: it failed, or its weights moved
    #: behind the fleet's back. A group member whose lineage moved has left the group.
    incarnation: int = 0
    #: Moves at every failure: a call that started in an older epoch reports its error
    #: without failing the member a second time.
    epoch: int = 0
    #: Samples in flight on it (its load, as the router counts it).
    inflight: int = 0
    counts: SeatCounts = field(default_factory=SeatCounts)
    #: When it last answered a probe or a wave (routed to only while that is recent).
    last_ok: float = 0.0
    #: Why it last failed, and what it last answered wrong.
    reason: str = ""
    error: str | None = None
    #: Answering, but not routed to until a load makes it serve what the others do.
    distrusted: bool = False
    paused: bool = False
    #: Its next recovery makes sure the old process is gone first.
    kill: bool = False
    probing: bool = False
    recovering: bool = False
    #: Set when it fails: the waves it runs stop waiting for it and are re-issued.
    down: asyncio.Future[None] | None = None
    #: Its per-wave metric series, looked up once (toy waves take milliseconds).
    series: tuple[Any, Any, Any] | None = field(default=None, repr=False)

    @property
    def up(self) -> bool:
        return self.state in ("ok", "paused")

    @property
    def lineage(self) -> Hashable:
        return (self.identity, self.incarnation)


class Table:
    """The seats, in member order (a member's index is its position, which the router
    keys on; a member that leaves keeps its seat as `gone`)."""

    def __init__(
        self,
        transport: Transport,
        metrics: Metrics,
        *,
        changed: Callable[[], None],
        failed: Callable[[Seat], None],
        on_state_change: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.transport = transport
        self.metrics = metrics
        self.seats: list[Seat] = []
        #: Members' routability may have changed: let waiting waves in.
        self.changed = changed
        self._failed = failed
        self._on_state_change = on_state_change

    def add(self, member: Member) -> Seat:
        seat = Seat(len(self.seats), member)
        self.seats.append(seat)
        label, m = str(seat.index), self.metrics
        for series in (m.replica_generated_tokens, m.replica_restarts, m.replica_wasted_samples):
            series.labels(label)
        for reason in REISSUE_REASONS:
            m.replica_reissued_waves.labels(label, reason)
        return seat

    def row(self, seat: Seat) -> dict[str, Any]:
        counts = seat.counts
        return {
            self.transport.row_key: seat.index,
            **seat.member.describe(),
            "state": seat.state,
            "policy_version": seat.version,
            "inflight_samples": seat.inflight,
            "restarts": counts.restarts,
            "waves": counts.waves,
            "mean_wave_s": round(counts.wave_seconds / counts.waves, 3) if counts.waves else None,
            "reissued_waves": counts.reissued,
            "weights_mismatch": seat.distrusted,
            "error": seat.error,
        }

    def rows(self) -> list[dict[str, Any]]:
        return [self.row(s) for s in self.seats]

    def set_state(self, seat: Seat, state: MemberState) -> None:
        previous, seat.state = seat.state, state
        if state in ("ok", "paused"):
            seat.last_ok = time.monotonic()
            seat.error = None if state == "ok" else seat.error
            if seat.down is None or seat.down.done():
                seat.down = asyncio.get_running_loop().create_future()
        label = str(seat.index)
        for name in STATES:
            self.metrics.replica_state.labels(label, name).set(1.0 if name == state else 0.0)
        self.show_version(seat)
        if previous != state:
            log.info("%s: %s -> %s", seat.member.name, previous, state)
            if self._on_state_change is not None:
                self._on_state_change({**self.row(seat), "previous": previous})
        self.changed()

    def show_version(self, seat: Seat) -> None:
        version = -1 if seat.version is None else seat.version
        self.metrics.replica_policy_version.labels(str(seat.index)).set(version)

    def fail(self, seat: Seat, epoch: int, reason: str, error: str, *, kill: bool = False) -> None:
        """Take a member out of routing once per failure; its waves are re-issued, and it
        is brought back: by the fleet (restartable) or once it answers again."""
        if epoch != seat.epoch or seat.state in ("recovering", "down", "gone", "failed"):
            return
        seat.epoch += 1
        seat.incarnation += 1
        seat.reason, seat.error, seat.kill = reason, error, kill
        if seat.down is not None and not seat.down.done():
            seat.down.set_result(None)
        log.warning("%s failed (%s): %s", seat.member.name, reason, error)
        self.set_state(seat, "recovering" if seat.member.restartable else "down")
        self._failed(seat)

    def distrust(self, seat: Seat, why: str) -> None:
        """Out of routing until a load makes it serve the committed weights."""
        log.warning("%s is out of routing until it is loaded again: %s", seat.member.name, why)
        seat.distrusted, seat.error = True, why
        self.changed()

    def unknown(self, seat: Seat, error: BaseException) -> None:
        """It answered a weight call with an error: what it serves is unknown, so the
        probes resync it."""
        log.warning("%s: %r", seat.member.name, error)
        seat.error, seat.version = repr(error), None

    async def each(
        self,
        seats: Sequence[Seat],
        epochs: dict[int, int],
        call: Callable[[Seat], Awaitable[Any]],
    ) -> list[Any]:
        """`call(seat)` on each at once; its results, errors included. One that does not
        answer is failed."""
        results = await asyncio.gather(*(call(s) for s in seats), return_exceptions=True)
        for seat, result in zip(seats, results, strict=True):
            if isinstance(result, MemberDown):
                self.fail(seat, epochs[seat.index], result.reason, repr(result))
        return results

    def charge(self, seat: Seat, n: int) -> None:
        seat.inflight += n
        self.series(seat)[0].set(seat.inflight)

    def series(self, seat: Seat) -> tuple[Any, Any, Any]:
        if seat.series is None:
            m, label = self.metrics, str(seat.index)
            seat.series = (
                m.replica_inflight_samples.labels(label),
                m.replica_wave_seconds.labels(label),
                m.replica_generated_tokens.labels(label),
            )
        return seat.series

    def finished(self, seat: Seat, started: float, tokens: int) -> None:
        """A wave of the member came back whole at its last answer."""
        seat.last_ok = time.monotonic()
        seat.counts.waves += 1
        seat.counts.wave_seconds += seat.last_ok - started
        _, wave_seconds, generated_tokens = self.series(seat)
        wave_seconds.observe(seat.last_ok - started)
        generated_tokens.inc(tokens)

    def reissued(self, seat: Seat, n: int, reason: str) -> None:
        seat.counts.reissued += 1
        label = str(seat.index)
        self.metrics.replica_reissued_waves.labels(label, reason).inc()
        self.metrics.replica_wasted_samples.labels(label).inc(n)
