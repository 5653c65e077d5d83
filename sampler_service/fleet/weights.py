"""The fleet's weight protocol: which version is committed, which weights members can be
loaded with again, and the barrier every update of every member goes through.

- Committed vs source. `committed` is the version waves are routed under: a member is
  routed to only while it serves it, so each sample's version is exact. `source` holds
  the last weights that came as files or tensors (None: the base model): what a member
  that comes back, or one rolled back, is loaded with. Weights that came over NCCL exist
  only in the members, so after an NCCL commit the source is older than the committed
  version: a member resynced meanwhile serves the source under its own version and waits
  for the trainer's next round (`awaits_nccl`), unrouted.
- The barrier (`load`): every member up is paused, loads the weights, is labelled with
  their version, and read back (`confirm`: its label and, when compared, its checksums);
  then every member is resumed and the version committed. Nothing is routed meanwhile.
  A member that does not answer is out (and brought back later). One that refuses the
  weights before loading them (`WeightsRejected`) or fails and restores itself
  (`WeightsNotServed`) refuses the update; one that fails otherwise holds unknown
  weights: a restartable member is restarted, another refuses the update. A refused
  update rolls every member that may hold it back to the source, and commits nothing.
- Resync (`resync`): a member that came back, or whose weights moved behind the fleet's
  back, is loaded with the source before it is routed to again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from sampler_service.backends.base import PauseMode
from sampler_service.errors import NotSupported
from sampler_service.fleet.member import MemberDown, Source, Transport
from sampler_service.fleet.table import Seat, Table
from sampler_service.weights.types import WeightsNotServed, WeightsRejected

log = logging.getLogger(__name__)


def cause(error: BaseException) -> str:
    """An error's message without a transport's wrapping (Ray's traceback)."""
    return str(getattr(error, "cause", None) or error)


class FleetWeights:
    """See the module docstring."""

    def __init__(
        self,
        table: Table,
        transport: Transport,
        *,
        compare_checksums: bool,
        resync_later: Callable[[Seat], None],
    ) -> None:
        self.table = table
        self.transport = transport
        self.compare_checksums = compare_checksums
        self._resync_later = resync_later
        self.committed = 0
        self.source: Source | None = None
        #: The committed weights' checksum digest as the members agreed on it (None: not
        #: compared); a resynced member must match it.
        self.checksum: str | None = None
        #: Held by every load, NCCL round and resync: no commit lands meanwhile.
        self.lock = asyncio.Lock()
        #: A load or NCCL round is under way: no wave is routed.
        self.loading = False
        #: How the barrier pauses the members' running requests (the fleet's
        #: `update_pause`: `keep` or `recompute` under a `continue` update).
        self.pause_mode: PauseMode = "wait"

    @property
    def source_version(self) -> int:
        return self.source.version if self.source is not None else 0

    def awaits_nccl(self, seat: Seat) -> bool:
        """It serves the last file weights while newer ones came over NCCL: it waits for
        the trainer's next NCCL round (or file push), not routed to meanwhile."""
        return (
            self.source_version != self.committed
            and seat.version == self.source_version
            and not seat.distrusted
        )

    # -- the barrier ------------------------------------------------------------------
    async def load(self, source: Source, version: int) -> None:
        """Install `source` as `version` on every member up, under one barrier (see the
        module docstring); `source` is released unless it is committed."""
        async with self.lock:
            try:
                await self._load_all(source, version)
            except BaseException:
                await self.transport.release(source)
                raise
            old, self.source = self.source, self.transport.retain(source)
            self.committed = version
            if old is not None:
                await self.transport.release(old)
            for seat in self.table.seats:
                self.table.show_version(seat)
                if seat.state == "ok" and seat.version != version:
                    # came back during the load, at the old version
                    self._resync_later(seat)
        log.info("%ss serving v%d", self.transport.noun, version)

    async def _load_all(self, source: Source, version: int) -> None:
        noun, table = self.transport.noun, self.table
        targets = [s for s in table.seats if s.up]
        if not targets:
            raise WeightsNotServed(f"no {noun} is up to load the weights")
        epochs = {s.index: s.epoch for s in targets}
        self.loading = True
        try:
            await self.pause(targets, epochs)
            # a member serving `version` already (re-attached, labelled by an earlier run)
            todo = [s for s in targets if s.up and s.version != version]
            results = await table.each(todo, epochs, lambda s: self._load_one(s, source, version))
            rejected, refused, unsure = [], [], []
            for seat, result in zip(todo, results, strict=True):
                if result is None or isinstance(result, MemberDown):
                    continue
                if isinstance(result, WeightsRejected):
                    rejected.append(f"{seat.member.name}: {cause(result)}")
                elif isinstance(result, WeightsNotServed):
                    refused.append(f"{seat.member.name}: {cause(result)}")
                elif seat.member.restartable:  # restarted, it comes back at the committed
                    table.fail(seat, epochs[seat.index], "weights", repr(result), kill=True)
                else:
                    refused.append(f"{seat.member.name}: {cause(result)}")
                    unsure.append(seat)
            if rejected or refused:
                installed = [s for s, r in zip(todo, results, strict=True) if r is None]
                await self.roll_back([s for s in installed + unsure if s.up], source.names, epochs)
                if rejected:
                    raise WeightsRejected("; ".join(rejected))
                raise WeightsNotServed(
                    f"v{version} not committed ({self._back()}): " + "; ".join(refused)
                )
            installed = [s for s, r in zip(todo, results, strict=True) if r is None and s.up]
            labels = await table.each(installed, epochs, lambda s: self._label(s, version))
            self._settle(installed, labels)
            serving = [s for s in targets if s.up and s.version == version]
            if not serving:
                raise WeightsNotServed(
                    f"no {noun} installed v{version}: "
                    + "; ".join(f"{s.member.name}: {s.error}" for s in targets)
                )
            self.checksum = await self.confirm(serving, epochs, version)
        finally:
            self.loading = False
            await self.resume(targets, epochs)

    def _back(self) -> str:
        noun = self.transport.noun
        if self.source_version == self.committed:
            return f"every {noun} is back at v{self.committed}"
        return (
            f"v{self.committed} came over NCCL: the {noun}s it reached are back at the file "
            f"weights of v{self.source_version}, not routed to until the next NCCL round"
        )

    async def _load_one(self, seat: Seat, source: Source | None, version: int) -> None:
        started = time.monotonic()
        await seat.member.load(source, version)
        self.table.metrics.replica_weight_load_seconds.labels(str(seat.index)).observe(
            time.monotonic() - started
        )

    async def _label(self, seat: Seat, version: int) -> None:
        await seat.member.set_label(version)
        seat.version = version

    async def install(self, seat: Seat, source: Source | None, version: int) -> None:
        """Load `source` into one member, then label it `version`."""
        await self._load_one(seat, source, version)
        await self._label(seat, version)

    async def pause(self, seats: Sequence[Seat], epochs: dict[int, int]) -> None:
        """Every member holds its requests (those without a pause are held by the
        scheduler's gate alone), its running ones as `pause_mode` says."""
        mode = self.pause_mode
        results = await self.table.each(seats, epochs, lambda s: s.member.pause(mode))
        self._settle(seats, results)

    async def resume(self, seats: Sequence[Seat], epochs: dict[int, int]) -> None:
        """End a barrier: the members still up serve again."""
        up = [s for s in seats if s.up]
        results = await self.table.each(up, epochs, lambda s: s.member.resume())
        self._settle(up, results)

    def _settle(self, seats: Sequence[Seat], results: list[object]) -> None:
        """A member that answered a barrier call with an error serves what nobody knows;
        one that lacks the call (no pause) simply lacks it."""
        for seat, result in zip(seats, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(
                result, MemberDown | NotSupported
            ):
                self.table.unknown(seat, result)

    async def roll_back(
        self, seats: Sequence[Seat], names: frozenset[str], epochs: dict[int, int]
    ) -> None:
        """Return members that may hold refused weights to the source.

        In place when the source restores every tensor the refused update changed;
        otherwise (a partial source, or a member that loads the base model only by
        restarting) the member fails and comes back at the committed weights.
        """
        source, version = self.source, self.source_version

        async def one(seat: Seat) -> None:
            if source is None or names <= source.names:
                try:
                    await self.install(seat, source, version)
                except MemberDown as exc:
                    self.table.fail(seat, epochs[seat.index], exc.reason, repr(exc))
                    return
                except NotSupported:
                    pass
                except Exception as exc:  # noqa: BLE001 - falls back to a restart
                    log.warning("%s: in-place rollback failed: %r", seat.member.name, exc)
                else:
                    log.info("%s rolled back to v%d in place", seat.member.name, version)
                    return
            seat.version = None
            self.table.fail(seat, epochs[seat.index], "rollback", "rolled back", kill=True)

        await asyncio.gather(*(one(s) for s in seats))

    async def confirm(
        self, seats: Sequence[Seat], epochs: dict[int, int], version: int
    ) -> str | None:
        """After a load: each member's label read back and, when comparing, their
        checksums compared with each other. A member that reads back another version or
        is outside the largest group of equal checksums is distrusted (the probes reload
        it). Returns the agreed digest (None: not compared).

        WeightsNotServed when no member confirms `version`, or when the largest groups
        tie (with two members that disagree, neither can be trusted).
        """
        labels = await self.table.each(seats, epochs, lambda s: s.member.label())
        confirmed = []
        for seat, label in zip(seats, labels, strict=True):
            if isinstance(label, BaseException):
                if not isinstance(label, MemberDown):
                    self.table.distrust(seat, f"no label after loading v{version}: {label!r}")
            elif label == version:
                seat.distrusted = False
                confirmed.append(seat)
            else:
                self.table.distrust(seat, f"read back v{label} after loading v{version}")
        noun = self.transport.noun
        if not confirmed:
            raise WeightsNotServed(f"no {noun} confirmed v{version} (its label)")
        if not self.compare_checksums:
            return None
        digests = await self.table.each(confirmed, epochs, lambda s: s.member.checksum())
        groups: dict[str, list[Seat]] = {}
        for seat, digest in zip(confirmed, digests, strict=True):
            if isinstance(digest, str):
                groups.setdefault(digest, []).append(seat)
            else:
                self.table.distrust(seat, f"no checksums of v{version}: {digest!r}")
        ranked = sorted(groups.items(), key=lambda kv: len(kv[1]), reverse=True)
        tie = len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1])
        for _, members in ranked if tie else ranked[1:]:
            for seat in members:
                why = f"its checksums of v{version} differ from the other {noun}s'"
                self.table.distrust(seat, why)
        if not ranked:
            raise WeightsNotServed(f"no {noun} gave checksums of v{version}")
        if tie:
            raise WeightsNotServed(
                f"v{version} not committed: the {noun}s' weight checksums disagree "
                + ", ".join(f"{s.member.name}: {d[:16]}" for d, m in ranked for s in m)
            )
        return ranked[0][0]

    # -- resync -----------------------------------------------------------------------
    async def resync(self, seat: Seat) -> None:
        """Bring a member to the committed weights (call under `lock`); when comparing
        checksums, trusted only once its checksum is the committed weights'.

        Weights committed over NCCL exist only in the members that received them: one
        that missed them gets the source under its own version, and waits unrouted for
        the next NCCL round or file push.
        """
        if (seat.version == self.committed and not seat.distrusted) or self.awaits_nccl(seat):
            return
        version = self.source_version
        self.table.set_state(seat, "syncing")
        await self.install(seat, self.source, version)
        name = seat.member.name
        if version != self.committed:
            seat.distrusted = False  # checked against the others at the next NCCL round
            log.warning(
                "%s loaded the file weights of v%d; v%d came over NCCL: it waits for the "
                "trainer's next NCCL round",
                name,
                version,
                self.committed,
            )
        elif self.checksum is not None:
            seat.distrusted = await seat.member.checksum() != self.checksum
            if seat.distrusted:
                seat.error = f"its checksums of v{version} differ from the others'"
                log.warning("%s: %s", name, seat.error)
        else:
            seat.distrusted = False
            log.info("%s loaded v%d", name, version)
