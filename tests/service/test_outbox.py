"""The outbox's running counts (READY, LEASED, each consumer's unacked) stay what a count
over its frames gives, through every move a frame makes."""

from __future__ import annotations

from pathlib import Path

from sampler_service.outbox import Outbox
from sampler_service.store import AsyncStore, FrameRows, Store, StoredFrame, StoredGroup


def _recount(outbox: Outbox) -> tuple[int, int, dict[str, int]]:
    frames = outbox._frames.values()
    per: dict[str, int] = {}
    for f in frames:
        if f.consumer is not None:
            per[f.consumer] = per.get(f.consumer, 0) + len(f.members)
    ready = sum(len(f.members) for f in frames if f.consumer is None)
    return ready, sum(per.values()), per


def _check(outbox: Outbox) -> None:
    ready, leased, per = _recount(outbox)
    assert (outbox.ready_groups, outbox.leased_groups) == (ready, leased)
    for consumer in {*per, "a", "b"}:
        assert outbox.unacked(consumer) == per.get(consumer, 0)


async def test_running_counts_match_a_recount_through_every_move(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=None)
    sync = AsyncStore(store)
    clock = [0.0]
    outbox = Outbox(sync, clock=lambda: clock[0])
    seq = 0
    for b in range(6):
        members = []
        for i in range(3):
            seq += 1
            gid = f"g{b}.{i}"
            store.add_pending(gid, b"x")
            members.append(StoredGroup(seq, gid, b"x", policy_version_min=b))
        store.frame([FrameRows(f"b{b}", [(m.group_id, b"x") for m in members])])
        outbox.offer(StoredFrame(f"b{b}", members))
        _check(outbox)
    a = outbox.take("a", ttl_s=10, max_groups=6)
    b = outbox.take("b", ttl_s=1)
    _check(outbox)
    assert outbox.unacked("a") == 6 and outbox.unacked("b") == 3
    await outbox.ack([a[0].delivery_id, a[4].delivery_id, "unknown"])  # parts of two frames
    _check(outbox)
    clock[0] = 5.0
    assert outbox.expire() == 3  # b's lease ran out
    _check(outbox)
    assert outbox.release_consumer("a") == 4
    _check(outbox)
    dropped, again = outbox.drop_stale(served_version=5, max_staleness=2, split=True)
    assert dropped
    _check(outbox)
    again = outbox.take("b", ttl_s=10, max_groups=100)
    await outbox.ack([d.delivery_id for d in again])
    _check(outbox)
    await sync.close()


async def test_ready_frames_go_out_oldest_version_first_then_redeliveries_then_in_order(
    tmp_path: Path,
) -> None:
    """A hard prompt's frame is framed late but holds old samples: it leaves before the
    fresher frames framed ahead of it, so the staleness bound does not drop it first. A
    frame given back goes out before fresh frames of its version."""
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=None)
    sync = AsyncStore(store)
    outbox = Outbox(sync)
    # framed in this order, their oldest samples of these versions
    for seq, (batch, version) in enumerate([("b0", 2), ("b1", 3), ("b2", 0), ("b3", 2)]):
        store.add_pending(batch, b"x")
        member = StoredGroup(seq, batch, b"x", policy_version_min=version)
        store.frame([FrameRows(batch, [(batch, b"x")])])
        outbox.offer(StoredFrame(batch, [member]))
    first = outbox.take("a", ttl_s=10)
    assert [d.group.group_id for d in first] == ["b2"]
    second = outbox.take("a", ttl_s=10)
    assert [d.group.group_id for d in second] == ["b0"]
    outbox.release_consumer("a")  # b2 and b0 come back: redeliveries
    order = [d.group.group_id for d in outbox.take("b", ttl_s=10, max_groups=100)]
    assert order == ["b2", "b0", "b3", "b1"]
    await sync.close()


async def test_a_stale_frame_never_handed_out_is_split_and_one_handed_out_is_dropped_whole(
    tmp_path: Path,
) -> None:
    """One straggler must not take its fresh frame-mates down: a READY frame never handed
    out loses only its members past the bound, and the rest are stored pending again to
    be framed anew. A frame a consumer held once stays whole (it is dropped whole), and
    so does every frame when batch selections ran on it (`split` False)."""
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=None)
    sync = AsyncStore(store)
    outbox = Outbox(sync)

    def offer(batch: str, versions: list[int]) -> None:
        members = []
        for i, version in enumerate(versions):
            gid = f"{batch}.{i}"
            store.add_pending(gid, b"x")
            members.append(StoredGroup(0, gid, b"x", policy_version_min=version))
        store.frame([FrameRows(batch, [(m.group_id, b"x") for m in members])])
        outbox.offer(StoredFrame(batch, members))

    offer("held", [1, 3])
    outbox.take("c", ttl_s=10)
    assert outbox.release_consumer("c") == 2  # handed out once, READY again
    offer("fresh", [1, 3, 3])
    dropped, again = outbox.drop_stale(served_version=4, max_staleness=2, split=True)
    assert sorted(m.group_id for m in dropped) == ["fresh.0", "held.0", "held.1"]
    assert [m.group_id for m in again] == ["fresh.1", "fresh.2"]
    assert outbox.ready_groups == 0
    store.unframe([m.group_id for m in again])
    assert [g.group_id for g in store.pending()] == ["fresh.1", "fresh.2"]
    assert not {m.group_id for f in store.frames() for m in f.members} & {"fresh.1", "fresh.2"}
    offer("selected", [1, 3])
    dropped, again = outbox.drop_stale(served_version=4, max_staleness=2, split=False)
    assert len(dropped) == 2 and again == []
    _check(outbox)
    await sync.close()
