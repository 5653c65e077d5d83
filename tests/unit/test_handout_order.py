"""Frames put the groups the next weight push would drop first, oldest first, and the rest
in the order they finished; before a hand-out such a group that finished after the
frames formed takes the place of a member the push would not drop (`Finalizer.frame_late_groups`), with every group still stored once,
counted once and never lost. The finalizer runs for real over an in-memory sink that
records what it was asked to store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from support import group

from sampler_service.config import SamplerConfig
from sampler_service.finalize import Finalizer, MemorySink
from sampler_service.live_config import LiveConfig
from sampler_service.outbox import framing_rank, out_of_order
from sampler_service.replay import ReplayStore
from sampler_service.tally import Tally
from trainer_client.contract.protocol import Group


@pytest.mark.parametrize(
    ("version", "max_staleness", "rank"),
    [
        (1, 2, 1),  # served 3, bound 2: v1 is dropped at the next push, so it ranks by version
        (0, 2, 0),
        (2, 2, 2),  # v2 and v3 survive the next push: one rank, finish order
        (3, 2, 2),
        (2, 1, 2),  # bound 1: v2 would lag 2 after the push
        (3, 1, 3),
        (0, None, 0),  # no bound: one rank for all
        (3, None, 0),
    ],
)
def test_framing_rank(version: int, max_staleness: int | None, rank: int) -> None:
    assert framing_rank(version, 3, max_staleness) == rank


@pytest.mark.parametrize(
    ("frames", "oldest_waiting", "unordered"),
    [
        ([[1, 1], [2, 2]], None, False),
        ([[1, 1], [2, 2]], 2, False),  # a tie is in order
        ([[1, 2], [1, 1]], None, True),  # a later frame holds an older member
        ([[1, 2], [2, 2]], 1, True),  # a waiting group is older than a framed one
        ([[3]], 1, True),
        ([], 0, False),  # nothing framed: nothing to reorder
        ([[2, 1], []], None, False),  # members' order within a frame does not matter
    ],
)
def test_out_of_order(frames: list[list[int]], oldest_waiting: int | None, unordered: bool) -> None:
    assert out_of_order(frames, oldest_waiting) is unordered


class _RecordingSink(MemorySink):
    """What the finalizer stores: groups written as pending, and the frames offered."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[str] = []
        #: While set and not open, a write of frames waits for it (`blocked` says so).
        self.gate: asyncio.Event | None = None
        self.blocked = asyncio.Event()

    async def add_frames(self, frames: Any, state: dict[str, Any] | None = None) -> None:
        if self.gate is not None:
            self.blocked.set()
            await self.gate.wait()
        await super().add_frames(frames, state)

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        self.pending.append(group.group_id)

    def take_out_unordered(
        self, rank: Callable[[int], int], waiting: int | None
    ) -> list[list[Group]]:
        """`Outbox.take_out_unordered` over the frames offered here (none handed out)."""
        ranks = [[rank(g.policy_version_min) for g in frame] for frame in self.frames]
        if not out_of_order(ranks, waiting):
            return []
        taken, self.frames = self.frames, []
        return taken


def _group(gid: str, version: int) -> Group:
    return Group.model_validate(group(gid, policy_version_min=version, policy_version_max=version))


def _finalizer(
    batch_groups: int, max_staleness: int = 1, served: int = 2
) -> tuple[Finalizer, _RecordingSink, Tally]:
    cfg = SamplerConfig(batch_groups=batch_groups, max_staleness=max_staleness)
    sink, tally = _RecordingSink(), Tally(["d"], lambda: 0.0)
    finalizer = Finalizer(
        live=LiveConfig(cfg, 0, ["d"], []),
        sink=sink,
        tally=tally,
        replay=ReplayStore(),
        served_version=lambda: served,
        saved_state=dict,
        clock=lambda: 0.0,
        on_error=lambda message: None,
    )
    return finalizer, sink, tally


def _ids(frames: list[list[Group]]) -> list[list[str]]:
    return [[g.group_id for g in frame] for frame in frames]


def test_a_late_older_group_is_framed_before_newer_ones_and_the_rest_wait_stored() -> None:
    """Frames of 2: v2 group a waits; then v1 group c and v2 group d finish together.
    The frame formed holds c (oldest) and a (first of v2); d waits. a and d were written
    as pending while they waited (a restart finds them), c never was (it went straight
    into a frame)."""
    finalizer, sink, _ = _finalizer(batch_groups=2)

    async def run() -> None:
        await finalizer._store([_group("a", 2)])
        await finalizer._store([_group("c", 1), _group("d", 2)])

    asyncio.run(run())
    assert _ids(sink.frames) == [["c", "a"]]
    assert [g.group_id for g in finalizer.unframed] == ["d"]
    assert sink.pending == ["a", "d"]


def test_before_a_hand_out_a_late_group_takes_the_newest_members_place() -> None:
    """Frames of 2 hold v1+v2 and v2+v2 when a v1 group finishes late and waits alone.
    Before the hand-out the frames are formed again oldest first: both v1 groups go out in
    the first frame, a v2 group waits in its place (stored as pending by the sink's
    unframe), nothing is lost or counted twice as emitted, and the count of waiting
    groups moved to an earlier frame is 1 (b and c moved back)."""
    finalizer, sink, tally = _finalizer(batch_groups=2)

    async def run() -> tuple[int, int]:
        await finalizer._store([_group("a", 1), _group("b", 2)])
        await finalizer._store([_group("c", 2), _group("d", 2)])
        await finalizer._store([_group("late", 1)])
        assert _ids(sink.frames) == [["a", "b"], ["c", "d"]]
        joined = await finalizer.frame_late_groups(sink.take_out_unordered)
        # In order now: nothing is taken out again.
        return joined, await finalizer.frame_late_groups(sink.take_out_unordered)

    assert asyncio.run(run()) == (1, 0)
    assert _ids(sink.frames) == [["a", "late"], ["b", "c"]]
    assert [g.group_id for g in finalizer.unframed] == ["d"]
    assert tally.groups_emitted == 5  # a b c d once each, late once: none twice
    # The first call took a late group (counted), the second neither waited nor took one.
    assert (tally.handout_holds, tally.late_groups_framed, tally.handout_hold_s) == (1, 1, 0.0)


def test_only_groups_the_next_push_would_drop_go_first() -> None:
    """Bound 2, served v3, frames of 3: v3 a, v2 b and v3 c form a frame in the order
    they finished (none is dropped at the next push; oldest first would have put b
    first and handed the trainer older samples). A v2 group d finishing late waits and
    displaces nobody; a v1 group finishing late (the push would drop it) takes c's place
    before the hand-out."""
    finalizer, sink, tally = _finalizer(batch_groups=3, max_staleness=2, served=3)

    async def run() -> tuple[int, int]:
        await finalizer._store([_group("a", 3), _group("b", 2), _group("c", 3)])
        await finalizer._store([_group("d", 2)])
        unmoved = await finalizer.frame_late_groups(sink.take_out_unordered)
        assert _ids(sink.frames) == [["a", "b", "c"]]
        await finalizer._store([_group("v1", 1)])
        return unmoved, await finalizer.frame_late_groups(sink.take_out_unordered)

    assert asyncio.run(run()) == (0, 1)
    assert _ids(sink.frames) == [["v1", "a", "b"]]
    assert [g.group_id for g in finalizer.unframed] == ["c", "d"]
    assert tally.late_groups_framed == 1


def test_a_frame_formed_while_the_hand_out_waits_for_the_frame_lock_is_judged_too() -> None:
    """Frames of 2, bound 1, served v2: a1+b2 is framed and late1 waits. The finalizer
    frames late1 with d2 and is still writing that frame when the hand-out's framing
    starts. The framing waits for the write and judges both frames: the v1 groups go out
    in one frame. (Judged before the write, it moved a1+b2 behind late1+d2, so each
    frame held a v1 group and the next push dropped one.)"""
    finalizer, sink, tally = _finalizer(batch_groups=2)

    async def run() -> int:
        await finalizer._store([_group("a", 1), _group("b", 2)])
        await finalizer._store([_group("late", 1)])
        sink.gate = asyncio.Event()
        storing = asyncio.create_task(finalizer._store([_group("d", 2)]))
        await sink.blocked.wait()
        framing = asyncio.create_task(finalizer.frame_late_groups(sink.take_out_unordered))
        for _ in range(10):
            await asyncio.sleep(0)
        sink.gate.set()
        await storing
        return await framing

    assert asyncio.run(run()) == 1  # late1 moved from the second frame to the first
    assert _ids(sink.frames) == [["a", "late"], ["b", "d"]]
    assert finalizer.unframed == []
    assert tally.groups_emitted == 4


@pytest.mark.parametrize(
    ("knobs", "hold_s"),
    [
        ({}, 300.0),  # auto under wait: the engine idles at a push anyway
        ({"weight_update_mode": "continue"}, 0.0),  # auto: a held trainer stalls the engine
        ({"weight_update_mode": "abort"}, 0.0),
        ({"handout_hold_s": 12.5, "weight_update_mode": "continue"}, 12.5),
        ({"handout_hold_s": 0}, 0.0),
    ],
)
def test_the_hold_resolves_by_weight_update_mode(knobs: dict[str, Any], hold_s: float) -> None:
    assert SamplerConfig(**knobs).handout_hold == hold_s


@pytest.mark.parametrize("bad", [-1, "soon", 86_401])
def test_a_bad_hold_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="handout_hold_s"):
        SamplerConfig(handout_hold_s=bad)
