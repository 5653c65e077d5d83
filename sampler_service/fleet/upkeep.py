"""How a fleet keeps its members serving: it attaches them at start-up, probes them,
brings back the ones that failed, resyncs the ones whose weights moved, and follows the
roster of members that come and go.

- A member that does not answer a probe, hangs, restarts or reports itself unhealthy
  fails (`Table.fail`). A restartable member (a Ray actor) is restarted here, up to
  `max_restarts`, its next incarnation started; another (a server its owner runs) is
  probed until it answers again, then attached.
- Either way it is resynced with the committed weights (`FleetWeights.resync`) and
  resumed if a weight update it dropped out of left it paused, before it is routed to.
- A probe that finds a member's weights moved behind the fleet's back (another label, or
  none of ours), or a wave sampled under a label the fleet did not set, resyncs it; one
  that joined after start-up is synced the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from sampler_service.aio import TaskSet
from sampler_service.config import ReplicaSettings
from sampler_service.fleet.member import Attached, MemberDown, MemberGone, Misconfigured
from sampler_service.fleet.table import Seat, Table
from sampler_service.fleet.weights import FleetWeights
from sampler_service.weights.types import TensorSpec

log = logging.getLogger(__name__)


class Upkeep:
    """See the module docstring."""

    def __init__(
        self,
        table: Table,
        weights: FleetWeights,
        settings: ReplicaSettings,
        tasks: TaskSet,
        *,
        probes: bool,
        start_wait_s: float,
        roster_s: float | None,
    ) -> None:
        self.table = table
        self.transport = table.transport
        self.weights = weights
        self.settings = settings
        self.metrics = table.metrics
        self._tasks = tasks
        self.probes = probes
        self._start_wait_s = start_wait_s
        self._roster_s = roster_s
        self._started = False
        #: What the first member that answered told of the model.
        self.model_name = ""
        self.specs: Mapping[str, TensorSpec] = {}
        #: Set by the first wave or load: until then the sampler restores its weights, and
        #: members at other versions of ours are left as they are.
        self.serving = False

    async def start(self) -> None:
        """Attach the members (waiting up to `start_wait_s` for a first one); Misconfigured
        at once if one is unusable. Those not up are brought back as they fail."""
        deadline = time.monotonic() + self._start_wait_s
        seats = self.table.seats
        while True:
            await self.discover()
            pending = [s for s in seats if s.state in ("starting", "down")]
            results = await asyncio.gather(
                *(self._attach(s) for s in pending), return_exceptions=True
            )
            refused = [r for r in results if isinstance(r, Misconfigured)]
            if refused:  # misconfigured, not merely late: say so at once
                raise refused[0]
            if any(s.up for s in seats) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        noun = self.transport.noun
        if not any(s.up for s in seats):
            raise RuntimeError(
                f"no {noun} answered within {self._start_wait_s:.0f}s: "
                + "; ".join(f"{s.member.name}: {s.error}" for s in seats)
            )
        for seat in seats:
            if seat.state == "starting":
                self.table.fail(seat, seat.epoch, "start", str(seat.error), kill=True)
        self._started = True
        if self.probes:
            self._tasks.spawn(self._probe_loop(), "fleet-probes")
        if self._roster_s is not None:
            self._tasks.spawn(self._roster_loop(self._roster_s), "fleet-roster")
        log.info(
            "%d of %d %ss up: %s",
            sum(s.up for s in seats),
            len(seats),
            noun,
            ", ".join(f"{s.member.name} ({s.state}, v{s.version})" for s in seats),
        )

    async def _attach(self, seat: Seat) -> None:
        try:
            await self._adopt(seat, await seat.member.attach())
        except Misconfigured:
            raise
        except Exception as exc:  # noqa: BLE001 - brought back by the probes or a restart
            seat.error = repr(exc)
            self.table.set_state(seat, "starting" if seat.member.restartable else "down")

    async def _adopt(self, seat: Seat, attached: Attached) -> None:
        """Take in a member that answered: its weights as it says, resynced (after
        start-up) or labelled (a fresh one at start-up: the weights it was started
        with are version 0), resumed if a load left it paused, then routed to."""
        if attached.identity != seat.identity:
            seat.distrusted = False  # a new process: whatever was wrong with the old is gone
        seat.identity, seat.version, seat.paused = (
            attached.identity,
            attached.version,
            attached.paused,
        )
        if not self.specs and attached.specs:
            self.model_name, self.specs = attached.model_name, attached.specs
        if not self._started and attached.fresh:
            await seat.member.set_label(0)
            seat.version = 0
        elif self._started or attached.version is None:
            async with self.weights.lock:
                await self.weights.resync(seat)
        await self._route(seat)

    async def _route(self, seat: Seat) -> None:
        """Route to a member again. The fleet pauses members only inside a barrier,
        which is not running now: one still paused dropped out of a barrier before its
        resume, and would hold every wave routed to it."""
        if seat.paused:
            log.warning("%s is still paused from a weight update: resuming it", seat.member.name)
            await seat.member.resume()
            seat.paused = False
        self.table.set_state(seat, "ok")

    # -- failure, probes and recovery --------------------------------------------------
    def failed(self, seat: Seat) -> None:
        if seat.member.restartable:
            self.spawn_recovery(seat)

    def spawn_recovery(self, seat: Seat) -> None:
        if not seat.recovering:
            seat.recovering = True
            self._tasks.spawn(self._recover(seat), f"recover-{seat.index}")

    async def _recover(self, seat: Seat) -> None:
        """Bring a failed member back (restart it, or attach it once it answers again)
        and resync it, or resync one whose weights moved; then route to it."""
        member, epoch = seat.member, seat.epoch
        try:
            while True:
                try:
                    if seat.state not in ("recovering", "down"):
                        async with self.weights.lock:
                            await self.weights.resync(seat)
                        await self._route(seat)
                        return
                    if member.restartable:
                        seat.counts.restarts += 1
                        self.metrics.replica_restarts.labels(str(seat.index)).inc()
                        if seat.counts.restarts > self.settings.max_restarts:
                            log.error("%s used up its restarts", member.name)
                            self.table.set_state(seat, "failed")
                            return
                    attached = await member.recover(seat.kill)
                    seat.kill = False
                    await self._adopt(seat, attached)
                    log.info("%s back at v%s", member.name, seat.version)
                    return
                except MemberGone as exc:
                    seat.error = repr(exc)
                    log.error("%s is gone for good: %r", member.name, exc)
                    self.table.set_state(seat, "failed")
                    return
                except Exception as exc:  # noqa: BLE001 - any failure to come back
                    seat.error = repr(exc)
                    if not member.restartable:
                        self.table.fail(seat, epoch, "sync", repr(exc))
                        return
                    log.warning("%s did not come back: %r", member.name, exc)
                    seat.kill = True
                    self.table.set_state(seat, "recovering")
                    await asyncio.sleep(1.0)
        finally:
            seat.recovering = False

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.probe_s)
            for seat in self.table.seats:
                if not (seat.probing or seat.recovering or seat.state in ("gone", "failed")):
                    seat.probing = True
                    self._tasks.spawn(self._probe(seat), f"probe-{seat.index}")

    async def _probe(self, seat: Seat) -> None:
        epoch, seen, timeout = seat.epoch, seat.version, self.settings.probe_timeout_s
        try:
            probe = await asyncio.wait_for(seat.member.probe(), timeout)
        except (TimeoutError, MemberDown) as exc:
            hung = isinstance(exc, TimeoutError)
            error = f"no probe answer in {timeout}s" if hung else repr(exc)
            if seat.state == "down":
                seat.error = error
            else:
                reason = "hung" if hung else getattr(exc, "reason", "down")
                self.table.fail(seat, epoch, reason, error, kill=hung)
            return
        finally:
            seat.probing = False
        if seat.state == "down":  # answers again (its owner brought it back)
            self.spawn_recovery(seat)
        elif probe.identity != seat.identity:
            self.table.fail(seat, epoch, "restarted", f"new process {probe.identity}")
        elif not probe.ok:
            self.table.fail(seat, epoch, "unhealthy", str(probe.detail), kill=True)
        elif seat.epoch == epoch:
            seat.last_ok = time.monotonic()
            if not (self.weights.lock.locked() or seat.state == "syncing" or seat.version != seen):
                self._watch(seat, probe.version, probe.paused)

    def _watch(self, seat: Seat, version: int | None, paused: bool) -> None:
        """What a probe found, while no weight update or sync owns the member."""
        if seat.version is not None and version != seat.version:
            seat.incarnation += 1  # its weights moved behind the fleet's back
        seat.version, seat.paused = version, paused
        behind = self.serving and version != self.weights.committed
        if (version is None or seat.distrusted or behind) and not self.weights.awaits_nccl(seat):
            self._sync(seat, f"serves v{version}")
        elif paused != (seat.state == "paused"):
            self.table.set_state(seat, "paused" if paused else "ok")

    def weights_moved(self, seat: Seat) -> None:
        """A wave found the member's weights changed behind the fleet's back: resynced
        now, not a probe interval later, since it is out of routing until then. While a
        weight update or a sync owns the members, that load (or the next probe) does it."""
        if seat.state in ("ok", "paused") and not self.weights.lock.locked():
            self._sync(seat, "sampled under weights the fleet did not load")

    def _sync(self, seat: Seat, why: str) -> None:
        log.warning("%s %s: syncing it", seat.member.name, why)
        self.table.set_state(seat, "syncing")
        self.spawn_recovery(seat)

    # -- the roster -------------------------------------------------------------------
    async def discover(self) -> None:
        """Members that joined are synced before they are routed to (by their recovery);
        those that left are `gone` (their waves re-issue elsewhere)."""
        present = [s.member.name for s in self.table.seats if s.state != "gone"]
        change = await self.transport.roster(present)
        if change is None:
            return
        added, retired = change
        by_name = {s.member.name: s for s in self.table.seats}
        for name in retired:
            seat = by_name[name]
            self.table.fail(seat, seat.epoch, "gone", "left the roster")
            self.table.set_state(seat, "gone")
        for name in added:
            seat = by_name.get(name) or self.table.add(self.transport.member(name))
            seat.version = None
            self.table.set_state(seat, "down")
            if self._started:
                self.spawn_recovery(seat)

    async def _roster_loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self.discover()
