"""Delivery of stored batch frames to consumers: at-least-once, nothing lost.

READY -> LEASED(consumer, delivery_id, deadline) -> deleted on ack. Frames move as a
unit: a consumer leases a whole frame, and whatever it has not acked when it
disconnects (or its lease expires) goes back to READY together and is offered again
before anything newer. READY frames go out oldest policy version first (the frame's
oldest sample), redeliveries first within a version, then in the order they were
framed: the frames nearest to the staleness bound leave before it drops them, and
those are the slow, hard prompts'. The bytes of a group never change after framing, so a
redelivered frame is byte-for-byte what was sent before (apart from the delivery id).

Consumers are named by the caller, in two namespaces (`stream_consumer`, `lease_consumer`):
a stream opening or ending never touches what a lease caller of the same name holds. One
name has at most one live stream; a second is refused while the first lives, since
replacing it would hand the first one's groups to the second while the first still
trains on them.

An ack is honoured for any delivery id of a group that still exists, even one whose
lease was already released (a trainer that lost its connection still acks what it
trained on): that only saves a redelivery the client would have deduped anyway.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sampler_service.grouping import FrameResult, downsampled_tokens, fresh_tokens, new_id
from sampler_service.store import AsyncStore, FrameRows, StoredFrame, StoredGroup
from trainer_client.contract.protocol import Group
from trainer_client.contract.wire import pack_group, unpack_group


def stream_consumer(name: str) -> str:
    """The holder key of the live stream named `name`."""
    return f"stream/{name}"


def lease_consumer(name: str) -> str:
    """The holder key of lease calls naming `name` (apart from streams of that name)."""
    return f"lease/{name}"


def too_stale(served_version: int, policy_version_min: int, max_staleness: int | None) -> bool:
    """The staleness bound: a group (or frame) whose oldest sample is more than
    `max_staleness` versions behind the served weights is never handed out."""
    return max_staleness is not None and served_version - policy_version_min > max_staleness


class _Versioned(Protocol):
    @property
    def policy_version_min(self) -> int: ...


M = TypeVar("M", bound=_Versioned)


def split_stale(
    members: Sequence[M], served_version: int, max_staleness: int | None, whole: bool
) -> tuple[list[M], list[M]]:
    """A stale frame's members: those to drop (past the bound, or all when the frame must
    stay `whole`) and those to frame again."""
    dropped: list[M] = []
    again: list[M] = []
    for member in members:
        past = too_stale(served_version, member.policy_version_min, max_staleness)
        (dropped if whole or past else again).append(member)
    return dropped, again


def framing_rank(policy_version_min: int, served_version: int, max_staleness: int | None) -> int:
    """A group's place in the framing order: a group the next weight push would make too
    stale ranks by its version, oldest first, ahead of all others; the others share one
    rank and keep the order they finished in (ordering them oldest first too hands the
    trainer older samples and saves no drop). Without a bound, every group shares one
    rank."""
    if max_staleness is None:
        return 0
    return min(policy_version_min, served_version - max_staleness + 1)


def out_of_order(frames: Sequence[Sequence[int]], oldest_waiting: int | None) -> bool:
    """Whether frames (their members' framing ranks, `framing_rank`, in the order they
    go out) hold a member ranked after one of a frame after it, or after the first group
    still waiting for a frame (`oldest_waiting`): a group the next push would drop that
    finished after the frames formed."""
    newest = -math.inf
    for versions in filter(None, frames):
        if min(versions) < newest:
            return True
        newest = max(newest, max(versions))
    return oldest_waiting is not None and oldest_waiting < newest


@dataclass
class _Frame:
    batch_id: str
    members: list[StoredGroup]
    seq: int
    consumer: str | None = None  # None while READY
    deadline: float = 0.0
    #: Whether it was ever handed out: a consumer may have seen part of it.
    handed_out: bool = False

    @property
    def policy_version_min(self) -> int:
        return min(m.policy_version_min for m in self.members)


@dataclass(frozen=True)
class Delivered:
    """One group handed to a consumer in this delivery attempt."""

    delivery_id: str
    group: StoredGroup


class Outbox:
    def __init__(self, store: AsyncStore, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self._frames: dict[str, _Frame] = {}
        # (oldest policy version, 0 redelivery | 1 fresh, seq, batch_id)
        self._ready: list[tuple[int, int, int, str]] = []
        self._by_delivery: dict[str, tuple[str, str]] = {}  # delivery_id -> (batch_id, group_id)
        self._delivery_ids: dict[str, list[str]] = {}  # group_id -> every delivery id it had
        self._streams: dict[str, object] = {}  # consumer -> token of its live stream
        self._changed = asyncio.Event()
        # Running counts (asked for on every stream turn and admission check, so not
        # recounted over every frame): READY groups and each holder's LEASED groups.
        self._ready_count = 0
        self._leased: Counter[str] = Counter()

    # -- bookkeeping ------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """Wake every waiter (e.g. so streams notice a shutdown)."""
        self._notify()

    def changed(self) -> asyncio.Event:
        """An event set at the next change (new frame, ack, release); grab before checking."""
        return self._changed

    def offer(self, frame: StoredFrame, redelivery: bool = False) -> None:
        """Make a stored frame READY (called once its rows are committed)."""
        seq = min(m.seq for m in frame.members)
        ready = self._frames[frame.batch_id] = _Frame(frame.batch_id, list(frame.members), seq)
        self._ready_count += len(frame.members)
        self._push(ready, redelivery)
        self._notify()

    async def restore(self, describe: Callable[[StoredGroup], StoredGroup]) -> int:
        """After a restart every stored frame is READY again; returns how many groups.

        `describe` fills in what the store does not keep beside the payload (its version
        and prompt), read from the payload itself.
        """
        frames = await self._store.call(self._store.sync.frames)
        for frame in frames:
            self.offer(StoredFrame(frame.batch_id, [describe(m) for m in frame.members]))
        return sum(len(f.members) for f in frames)

    @property
    def ready_groups(self) -> int:
        return self._ready_count

    @property
    def leased_groups(self) -> int:
        return self._leased.total()

    def unacked(self, consumer: str) -> int:
        return self._leased[consumer]

    def next_frame_size(self) -> int | None:
        """Size of the frame the next take() would hand out, or None if nothing is READY."""
        while self._ready:
            batch_id = self._ready[0][-1]
            frame = self._frames.get(batch_id)
            if frame is not None and frame.consumer is None and frame.members:
                return len(frame.members)
            heapq.heappop(self._ready)  # stale heap entry
        return None

    # -- leasing --------------------------------------------------------------------
    def take(self, consumer: str, ttl_s: float, max_groups: int | None = None) -> list[Delivered]:
        """Lease whole READY frames, oldest first (see the module docstring) until
        max_groups is met.

        At least one frame is handed out when any is READY, even if it is larger than
        max_groups, so a frame bigger than a consumer's credit still flows.
        """
        out: list[Delivered] = []
        while (size := self.next_frame_size()) is not None:
            if out and max_groups is not None and len(out) + size > max_groups:
                break
            batch_id = heapq.heappop(self._ready)[-1]
            frame = self._frames[batch_id]
            frame.consumer = consumer
            frame.deadline = self._clock() + ttl_s
            frame.handed_out = True
            self._ready_count -= len(frame.members)
            self._leased[consumer] += len(frame.members)
            for member in frame.members:
                delivery_id = new_id()
                self._by_delivery[delivery_id] = (batch_id, member.group_id)
                self._delivery_ids.setdefault(member.group_id, []).append(delivery_id)
                out.append(Delivered(delivery_id, member))
            if max_groups is None:
                break
        return out

    def drop_stale(
        self, served_version: int, max_staleness: int, split: bool
    ) -> tuple[list[StoredGroup], list[StoredGroup]]:
        """Take out every READY frame whose oldest sample is more than `max_staleness`
        versions behind `served_version`: returns the groups to drop and the groups to
        frame again, for the caller to delete and to hand back to framing.

        A frame never handed out is split when `split` (no batch selection ran on it, so
        framing it again is framing it once): only its members past the bound are dropped,
        and the rest go back to be framed with the next groups. A frame handed out before
        is dropped whole: a trainer's batch assembler waits for every member of a frame,
        and a redelivered frame must stay the frame it was. Leased frames stay with their
        consumer (it may be training on them); they are checked again if they come back.
        """
        stale = [
            f
            for f in self._frames.values()
            if f.consumer is None and too_stale(served_version, f.policy_version_min, max_staleness)
        ]
        dropped: list[StoredGroup] = []
        again: list[StoredGroup] = []
        for frame in stale:
            del self._frames[frame.batch_id]
            self._ready_count -= len(frame.members)
            for member in frame.members:
                for delivery_id in self._delivery_ids.pop(member.group_id, []):
                    self._by_delivery.pop(delivery_id, None)
            whole = frame.handed_out or not split
            gone, kept = split_stale(frame.members, served_version, max_staleness, whole)
            dropped += gone
            again += kept
        if stale:
            self._notify()
        return dropped, again

    def next_frame_newest(self) -> int | None:
        """The newest policy version among the members of the frame the next take()
        would hand out (None if nothing is READY)."""
        if self.next_frame_size() is None:
            return None
        frame = self._frames[self._ready[0][-1]]
        return max(m.policy_version_min for m in frame.members)

    def take_out_unordered(
        self, rank: Callable[[int], int], oldest_waiting: int | None
    ) -> list[list[StoredGroup]]:
        """Take out the READY frames never handed out if their members are not in framing
        order (`out_of_order` over `rank` of their versions, against the first group still
        waiting for a frame), and return their members frame by frame, in hand-out order,
        to be framed again with the waiting groups."""
        fresh = sorted(
            (f for f in self._frames.values() if f.consumer is None and not f.handed_out),
            key=lambda f: (f.policy_version_min, f.seq),
        )
        ranks = [[rank(m.policy_version_min) for m in f.members] for f in fresh]
        if not out_of_order(ranks, oldest_waiting):
            return []
        for frame in fresh:
            del self._frames[frame.batch_id]
            self._ready_count -= len(frame.members)
        self._notify()
        return [frame.members for frame in fresh]

    def _release(self, frame: _Frame) -> None:
        assert frame.consumer is not None
        self._leased[frame.consumer] -= len(frame.members)
        if not self._leased[frame.consumer]:
            del self._leased[frame.consumer]
        self._ready_count += len(frame.members)
        frame.consumer = None
        self._push(frame, redelivery=True)

    def _push(self, frame: _Frame, redelivery: bool) -> None:
        key = (frame.policy_version_min, 0 if redelivery else 1, frame.seq, frame.batch_id)
        heapq.heappush(self._ready, key)

    def release_consumer(self, consumer: str) -> int:
        """Put every frame leased by `consumer` back to READY at once."""
        frames = [f for f in self._frames.values() if f.consumer == consumer]
        for frame in frames:
            self._release(frame)
        if frames:
            self._notify()
        return sum(len(f.members) for f in frames)

    def expire(self) -> int:
        """Release leases past their deadline; returns how many groups came back."""
        now = self._clock()
        frames = [f for f in self._frames.values() if f.consumer is not None and f.deadline < now]
        for frame in frames:
            self._release(frame)
        if frames:
            self._notify()
        return sum(len(f.members) for f in frames)

    async def ack(self, delivery_ids: list[str]) -> tuple[int, int, int]:
        """Delete acked groups durably; unknown or already-acked ids are counted, not
        errors. Returns (acked, unknown, the acked groups' fresh tokens)."""
        acked: dict[str, set[str]] = {}  # batch_id -> group ids
        for delivery_id in dict.fromkeys(delivery_ids):
            batch_id, group_id = self._by_delivery.get(delivery_id, ("", ""))
            frame = self._frames.get(batch_id)
            if frame is not None and any(m.group_id == group_id for m in frame.members):
                acked.setdefault(batch_id, set()).add(group_id)
        await self._store.call(
            self._store.sync.delete, [g for gids in acked.values() for g in gids]
        )
        removed = tokens = 0  # counted after the await: a concurrent ack may have taken some
        for batch_id, gids in acked.items():
            frame = self._frames.get(batch_id)
            if frame is None:
                continue
            before = len(frame.members)
            tokens += sum(m.tokens for m in frame.members if m.group_id in gids)
            frame.members = [m for m in frame.members if m.group_id not in gids]
            gone = before - len(frame.members)
            removed += gone
            self._count_removed(frame, gone)
            if not frame.members:
                del self._frames[batch_id]
            for gid in gids:
                for delivery_id in self._delivery_ids.pop(gid, []):
                    self._by_delivery.pop(delivery_id, None)
        if removed:
            self._notify()
        return removed, len(delivery_ids) - removed, tokens

    def held_tokens(self) -> int:
        """Fresh tokens of the groups in frames not yet acked (READY and LEASED)."""
        return sum(m.tokens for frame in self._frames.values() for m in frame.members)

    def group_ids_among(self, ids: list[str]) -> int:
        """How many of `ids` are ids of delivered groups, not of their deliveries (an ack
        that names a group_id instead of its delivery_id)."""
        return sum(1 for i in ids if i not in self._by_delivery and i in self._delivery_ids)

    def _count_removed(self, frame: _Frame, groups: int) -> None:
        """`groups` of `frame` acked: out of the count of its state."""
        if frame.consumer is None:
            self._ready_count -= groups
            return
        self._leased[frame.consumer] -= groups
        if not self._leased[frame.consumer]:
            del self._leased[frame.consumer]

    # -- streams ----------------------------------------------------------------------
    def connect(self, consumer: str) -> object | None:
        """Register a stream, or None while another live stream holds the name."""
        if consumer in self._streams:
            return None
        token = object()
        self._streams[consumer] = token
        self._notify()
        return token

    def is_current(self, consumer: str, token: object) -> bool:
        return self._streams.get(consumer) is token

    def disconnect(self, consumer: str, token: object) -> None:
        """A stream ended: its unacked groups are READY again at once."""
        if self._streams.get(consumer) is token:
            del self._streams[consumer]
            self.release_consumer(consumer)


class StoreSink:
    """Scheduler sink that persists groups in SQLite and offers frames to the outbox.

    Each group is encoded once for its frame, and those bytes are what the store keeps
    and the stream sends. A group that completes its frame as it finishes (frames of one
    group, the default) goes to SQLite once, framed; only a group that waits for the rest
    of its frame is stored as pending first. The frames the scheduler hands over together
    (whatever finished while the last write ran) share one transaction.
    """

    def __init__(self, store: AsyncStore, outbox: Outbox) -> None:
        self._store = store
        self._outbox = outbox
        self._pending: set[str] = set()  # stored, not yet framed

    @property
    def pending(self) -> int:
        return len(self._pending)

    def remember(self, group_id: str) -> None:
        """A group stored as pending (now or before a restart)."""
        self._pending.add(group_id)

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        await self._store.call(
            self._store.sync.add_pending, group.group_id, pack_group(group), state
        )
        self.remember(group.group_id)

    async def unframe(self, group_ids: list[str]) -> None:
        await self._store.call(self._store.sync.unframe, group_ids)
        self._pending.update(group_ids)

    async def add_frames(
        self, frames: Sequence[FrameResult], state: dict[str, Any] | None = None
    ) -> None:
        rows = [
            FrameRows(
                frame.batch_id,
                [(g.group_id, pack_group(g)) for g in frame.kept],
                [g.group_id for g, _ in frame.dropped],
            )
            for frame in frames
        ]
        seqs = await self._store.call(self._store.sync.frame, rows, state)
        for frame, written, frame_seqs in zip(frames, rows, seqs, strict=True):
            self._pending.difference_update(written.dropped)
            self._pending.difference_update(gid for gid, _ in written.members)
            payloads = [payload for _, payload in written.members]
            stored = list(map(_stored, frame_seqs, frame.kept, payloads))
            if stored:
                self._outbox.offer(StoredFrame(frame.batch_id, stored))

    def buffered(self) -> int:
        return self._outbox.ready_groups + self._outbox.leased_groups


def _stored(seq: int, group: Group, payload: bytes) -> StoredGroup:
    return StoredGroup(
        seq,
        group.group_id,
        payload,
        group.policy_version_min,
        group.prompt_id,
        group.domain,
        fresh_tokens(group),
        downsampled_tokens(group),
    )


def described(stored: StoredGroup) -> StoredGroup:
    """A stored group with its version and prompt read back from its payload (a restart)."""
    return _stored(stored.seq, unpack_group(stored.payload), stored.payload)
