"""The NCCL weight transfer over a fleet: one group spanning every member's ranks, the
trainer's calls fanned out to each, and the group going stale.

The trainer is rank 0 and each member's workers follow in member order (world size = 1 +
the sum of their ranks). The trainer sends one init as for a single engine (rank offset
1); the fleet gives each member its own offset (`replica_init_infos`) and remembers who
joined (`NCCLGroup`). A member that restarts, fails or comes up after the group was
formed makes the group stale: the next update is refused before any transfer, and the
trainer forms the group again.

An update is a barrier like a file load (`FleetWeights`): every member is paused, all
receive at once (each call returns once the trainer's broadcast arrived), are read back
and resumed. The version is committed if any member installed it; a member whose receive
failed is read back for what it serves (or distrusted, where it may hold part of the
round), and the group is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sampler_service.fleet.member import MemberDown, PartialWeights
from sampler_service.fleet.table import Seat, Table
from sampler_service.fleet.weights import FleetWeights
from sampler_service.weights.types import (
    NCCLDescription,
    NCCLGroupStale,
    NCCLUnavailable,
    WeightsNotServed,
)

log = logging.getLogger(__name__)

#: Why an update is refused when no group was formed.
NO_NCCL_GROUP = "no NCCL group is formed: POST /v1/weights/nccl/init first"


def rank_offsets(workers: Sequence[int]) -> list[int]:
    """Each member's first rank in the trainer's NCCL group: the trainer is rank 0, then
    each member's workers in member order (world size = 1 + sum(workers))."""
    offsets, rank = [], 1
    for count in workers:
        if count < 1:
            raise ValueError(f"a replica needs at least one NCCL rank, got {count}")
        offsets.append(rank)
        rank += count
    return offsets


def replica_init_infos(init_info: Mapping[str, Any], workers: Sequence[int]) -> list[dict]:
    """The trainer's worker init info (vLLM `NCCLWeightTransferInitInfo` fields, written
    for one engine at rank offset 1) as each member must get it: its own rank offset,
    the whole group's world size. ValueError when the trainer sized the group otherwise.
    """
    world = 1 + sum(workers)
    if init_info.get("world_size") != world:
        raise ValueError(
            f"world_size {init_info.get('world_size')!r} does not match the sampler's group: "
            f"1 trainer rank + {sum(workers)} replica ranks = {world} (GET /v1/weights/nccl "
            "again: a replica may have restarted)"
        )
    if init_info.get("rank_offset", 1) != 1:
        raise ValueError(
            f"rank_offset must be 1 (the trainer is rank 0 and the sampler lays out its "
            f"replicas' ranks after it), got {init_info.get('rank_offset')!r}"
        )
    return [{**init_info, "rank_offset": offset} for offset in rank_offsets(workers)]


def replica_rows(engines: Sequence[Mapping[str, Any]], workers: Sequence[int]) -> list[dict]:
    """The `replicas` rows of GET /v1/weights/nccl: each member (as `engines` names it),
    its ranks and its first rank in the group."""
    offsets = rank_offsets(workers)
    return [
        {**engine, "workers": count, "rank_offset": offset}
        for engine, count, offset in zip(engines, workers, offsets, strict=True)
    ]


@dataclass(frozen=True)
class NCCLGroup:
    """A formed group: each member's lineage when it joined (by index; anything a
    restart or failure changes) and their ranks."""

    members: dict[int, Hashable]
    workers: list[int]

    def __str__(self) -> str:
        return f"trainer + {self.workers} ranks at offsets {rank_offsets(self.workers)}"

    def stale_reason(self, engines: Iterable[tuple[int, str, bool, Hashable]]) -> str | None:
        """Why the group no longer spans the fleet, or None; `engines` are every member's
        (index, name for the message, up now, lineage now)."""
        for index, name, up, lineage in engines:
            joined = self.members.get(index)
            if joined is None:
                if up:
                    return f"{name} came up after the NCCL group was formed"
            elif not up or lineage != joined:
                return f"{name} restarted or failed since the NCCL group was formed"
        return None


class FleetNCCL:
    """The fleet's NCCL group: see the module docstring."""

    def __init__(self, table: Table, weights: FleetWeights) -> None:
        self.table = table
        self.weights = weights
        self.group: NCCLGroup | None = None

    def stale_reason(self) -> str | None:
        if self.group is None:
            return NO_NCCL_GROUP
        return self.group.stale_reason(
            (s.index, s.member.name, s.up, s.lineage) for s in self.table.seats
        )

    def state(self) -> str:
        """none (no group formed), ok, or stale (a member restarted or joined since)."""
        if self.group is None:
            return "none"
        return "stale" if self.stale_reason() else "ok"

    async def _ranks(self) -> list[tuple[Seat, NCCLDescription]]:
        """(member, its own NCCL description) for every member up now. One that does not
        answer is left out; NCCLUnavailable when none is up or one cannot say."""
        seats = [s for s in self.table.seats if s.up]
        epochs = {s.index: s.epoch for s in seats}
        described = await self.table.each(seats, epochs, lambda s: s.member.nccl_ranks())
        out = []
        for seat, d in zip(seats, described, strict=True):
            if isinstance(d, NCCLUnavailable):
                raise d
            if isinstance(d, NCCLDescription):
                out.append((seat, d))
            elif not isinstance(d, MemberDown):
                raise NCCLUnavailable(f"{seat.member.name} did not give its NCCL ranks: {d}")
        if not out:
            raise NCCLUnavailable(f"no {self.table.transport.noun} is up")
        return out

    async def describe(self) -> NCCLDescription:
        """The group over the members up now: their ranks summed, each one's offset."""
        pairs = await self._ranks()
        workers = [d.inference_ranks for _, d in pairs]
        first = pairs[0][1]
        return NCCLDescription(
            enabled=all(d.enabled for _, d in pairs),
            inference_ranks=sum(workers),
            specs=first.specs,
            required=first.required,
            group=self.state(),
            replicas=replica_rows([_place(s) for s, _ in pairs], workers),
            stale=self.stale_reason(),
        )

    async def init(self, init_info: dict[str, Any]) -> None:
        """Form the group: every member up joins at its own rank offset (trainer = 0);
        each call returns once the trainer's rank joined too."""
        self.group = None
        pairs = await self._ranks()
        off = [s.member.name for s, d in pairs if not d.enabled]
        if off:
            raise NCCLUnavailable(
                "NCCL weight transfer is off on "
                + ", ".join(off)
                + ": "
                + self.table.transport.nccl_hint
            )
        workers = [d.inference_ranks for _, d in pairs]
        infos = replica_init_infos(init_info, workers)
        seats = [s for s, _ in pairs]
        lineages = {s.index: s.lineage for s in seats}
        epochs = {s.index: s.epoch for s in seats}
        joins = dict(zip((s.index for s in seats), infos, strict=True))
        results = await self.table.each(seats, epochs, lambda s: s.member.nccl_join(joins[s.index]))
        failed = [
            f"{s.member.name}: {r!r}"
            for s, r in zip(seats, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            raise RuntimeError("NCCL group not formed: " + "; ".join(failed))
        self.group = NCCLGroup(lineages, workers)
        log.info("NCCL group formed over the %ss: %s", self.table.transport.noun, self.group)

    async def update(self, update_info: dict[str, Any], version: int) -> None:
        """Every member receives the trainer's broadcast under one barrier and serves it
        as `version` (see the module docstring). NCCLGroupStale before any transfer when
        the group no longer spans the members up."""
        weights, table = self.weights, self.table
        async with weights.lock:
            stale = self.stale_reason()
            if self.group is None or stale is not None:
                raise NCCLGroupStale(stale or NO_NCCL_GROUP)
            members = [table.seats[i] for i in self.group.members]
            epochs = {s.index: s.epoch for s in members}
            failures: list[str] = []
            weights.loading = True
            try:
                await weights.pause(members, epochs)
                results = await asyncio.gather(
                    *(self._receive(s, update_info, version) for s in members),
                    return_exceptions=True,
                )
                for seat, result in zip(members, results, strict=True):
                    if isinstance(result, BaseException):
                        failures.append(f"{seat.member.name}: {result!r}")
                        await self._after_failed_receive(seat, result, epochs, version)
                installed = [s for s, r in zip(members, results, strict=True) if r is None and s.up]
                if failures:
                    self.group = None
                if installed:
                    try:
                        checksum = await weights.confirm(installed, epochs, version)
                    except WeightsNotServed as exc:
                        failures.append(str(exc))
                    else:
                        weights.committed, weights.checksum = version, checksum
                        for seat in table.seats:
                            table.show_version(seat)
            finally:
                weights.loading = False
                await weights.resume(members, epochs)
        table.changed()
        if failures:
            raise RuntimeError(
                f"NCCL weight update to version {version} failed on "
                + "; ".join(failures)
                + f"; serving v{weights.committed}"
                + ("; form the NCCL group again" if self.group is None else "")
            )
        log.info("%ss serving v%d (NCCL)", table.transport.noun, version)

    async def _receive(self, seat: Seat, update_info: dict[str, Any], version: int) -> None:
        started = time.monotonic()
        await seat.member.nccl_receive(update_info, version)
        seat.version = version
        self.table.metrics.replica_weight_load_seconds.labels(str(seat.index)).observe(
            time.monotonic() - started
        )

    async def _after_failed_receive(
        self, seat: Seat, error: BaseException, epochs: dict[int, int], version: int
    ) -> None:
        """A member whose receive failed: lost (out, and not trusted when back), holding
        part of the round (distrusted), or restored by itself (read back)."""
        if isinstance(error, MemberDown | PartialWeights):
            seat.version = None
            if isinstance(error, MemberDown):
                self.table.fail(seat, epochs[seat.index], error.reason, repr(error))
            self.table.distrust(
                seat, f"its NCCL receive of v{version} failed (weights may be partial)"
            )
            return
        try:
            seat.version = await seat.member.label()
        except Exception as exc:  # noqa: BLE001 - unknown: resynced by the probes
            self.table.unknown(seat, exc)

    async def leave(self) -> None:
        """Every member leaves the group (sampling goes on)."""
        group, self.group = self.group, None
        if group is None:
            return
        seats = [self.table.seats[i] for i in group.members if self.table.seats[i].up]
        epochs = {s.index: s.epoch for s in seats}
        for result in await self.table.each(seats, epochs, lambda s: s.member.nccl_leave()):
            if isinstance(result, BaseException):
                log.warning("leaving the NCCL group: %r", result)


def _place(seat: Seat) -> dict[str, Any]:
    """How an NCCL row names its member: its index, and its address where it has one."""
    address = seat.member.address
    return {"replica": seat.index, **({"url": address} if address else {})}
