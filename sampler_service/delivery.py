"""Delivery to trainers: streams, leases, acks and heartbeats over the outbox.

A stream sends whole frames as its consumer's credit allows and a heartbeat when there
is nothing to send; a lease hands out whole frames with a deadline. Both note the step
size their consumer trains on, since admission under max_staleness counts in steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sampler_service.aio import wait_event
from sampler_service.backends.base import Backend
from sampler_service.consumers import ConsumerSteps
from sampler_service.dataset import Dataset
from sampler_service.encoding import Encoding
from sampler_service.errors import ServiceError
from sampler_service.live_config import LiveConfig
from sampler_service.outbox import Delivered, Outbox, lease_consumer, stream_consumer
from sampler_service.scheduler import Scheduler
from sampler_service.store import AsyncStore, StoredGroup
from sampler_service.tally import Tally
from trainer_client.contract import features as wire_features
from trainer_client.contract.protocol import AckResponse, Group, Heartbeat
from trainer_client.contract.wire import unpack_group

log = logging.getLogger(__name__)

#: While a hand-out waits for late prompts (`handout_hold_s`), how often it looks again.
HOLD_POLL_S = 0.25


@dataclass
class _Hold:
    """The wait of the next hand-out for late prompts (`handout_hold_s`)."""

    #: When it began (None: not yet), and whether it has waited at all.
    since: float | None = None
    waited: bool = False
    #: The late prompts' groups were framed: the frame goes out now.
    framed: bool = False

    def wait_s(self, otherwise: float) -> float:
        """How long to sleep for a change: briefly while holding (the late prompts'
        ends are looked for, not signalled)."""
        return min(otherwise, HOLD_POLL_S) if self.since is not None else otherwise


@dataclass(eq=False)
class Delivery:
    """Streams, leases and acks; the groups delivered and their lag behind the weights."""

    outbox: Outbox
    scheduler: Scheduler
    live: LiveConfig
    #: The step consumers show (declared or held), which admission counts in.
    consumers: ConsumerSteps
    backend: Backend
    store: AsyncStore
    dataset: Dataset
    tally: Tally
    #: What heartbeats report as the engine's failure.
    engine_error: Callable[[], str | None]
    #: A lease waits at most this long for a frame.
    max_lease_wait_s: float
    #: Rows name environments: groups hold episodes with observation tokens.
    serves_episodes: bool = False
    _closing: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    # Live streams: token -> (consumer, heartbeat_s, when its socket last took a message).
    _streams: dict[object, tuple[str, float, float]] = field(default_factory=dict, init=False)
    #: The wire features each live stream declared (token -> names).
    _stream_features: dict[object, frozenset[str]] = field(default_factory=dict, init=False)

    def close(self) -> None:
        """Stop serving: open streams end (with a `closing` heartbeat), lease waits return."""
        self._closing.set()
        self.outbox.wake()

    def tend(self) -> None:
        """Once a second: expire stale leases, free stalled streams' names, forget step
        sizes no consumer declares any more and the holdings of consumers gone."""
        if self.outbox.expire():
            self.scheduler.poke()
        self._drop_stalled_streams()
        until = time.monotonic() + self.live.config.lease_ttl_s
        for consumer, _, _ in self._streams.values():  # a live stream is seen
            self.consumers.seen(consumer, until)
        self.consumers.refresh()

    def _heartbeat(self, consumer: str, closing: bool = False) -> dict[str, Any]:
        return Heartbeat(
            time=time.time(),
            policy_version=self.backend.policy_version,
            config_version=self.live.version,
            ready=self.outbox.ready_groups,
            leased=self.outbox.leased_groups,
            active_prompts=self.scheduler.active_prompts + self.scheduler.finalizing,
            unacked=self.outbox.unacked(consumer),
            engine_error=self.engine_error(),
            closing=closing,
            engine_state=self.backend.health().state,
            admission=self.scheduler.admission.wait,
        ).model_dump()

    def _check_step(self, groups_per_step: int | None) -> None:
        limit = self.live.config.max_buffered_groups
        if groups_per_step is not None and groups_per_step > limit:
            raise ServiceError(
                422,
                "invalid_request",
                f"groups_per_step ({groups_per_step}) exceeds max_buffered_groups ({limit}): "
                "such a step could never fill; raise max_buffered_groups",
                "groups_per_step",
            )

    def _note_holding(self, consumer: str) -> None:
        """After a hand-out: what the consumer now holds (its step, if it declared none)."""
        until = time.monotonic() + self.live.config.lease_ttl_s
        self.consumers.holding(consumer, self.outbox.unacked(consumer), until)

    def _delivered(self, delivered: list[Delivered]) -> list[Delivered]:
        """Record each delivered group's lag behind the served weights."""
        served = self.backend.policy_version
        self.tally.delivered(served - item.group.policy_version_min for item in delivered)
        return delivered

    async def drop_stale_frames(self) -> None:
        """Drop READY groups more than max_staleness versions behind the served weights;
        their prompts are served again. Checked at every weight commit and config change,
        and before every hand-out (a group finished after the check, or one given back by
        a consumer, is checked then)."""
        while (stale := self._take_out_stale()) != ([], []):
            await self._discard_stale(*stale)

    def _take_out_stale(self) -> tuple[list[StoredGroup], list[StoredGroup]]:
        """Take stale frames out of the outbox now, with no await between this and a
        hand-out; returns the groups to drop and those to frame again
        (`Outbox.drop_stale`), for `_discard_stale`."""
        bound = self.live.config.max_staleness
        if bound is None:
            return [], []
        served = self.backend.policy_version
        dropped, again = self.outbox.drop_stale(
            served, bound, split=not self.live.policies.selections
        )
        if dropped or again:
            for member in dropped:
                self.dataset.serve_again(member.domain, member.prompt_id)
                quartile = self.live.quartile(member.prompt_id)
                self.tally.dropped_group(
                    "stale", member.tokens, member.domain, quartile, member.downsampled
                )
            self.scheduler.poke()
            log.info(
                "dropped %d READY groups more than %d versions behind v%d (their prompts "
                "are served again); %d fresh groups of their frames are framed again",
                len(dropped),
                bound,
                served,
                len(again),
            )
        return dropped, again

    async def _discard_stale(self, dropped: list[StoredGroup], again: list[StoredGroup]) -> None:
        """Delete dropped groups from the store and frame the others again (a crash
        between the two only means their frame is restored READY and split again)."""
        await self.store.call(self.store.sync.discard, [m.group_id for m in dropped])
        await self.scheduler.finalizer.take_back([unpack_group(m.payload) for m in again])

    def _holding(self, hold: _Hold) -> bool:
        """Whether the frame about to go out waits on for late prompts
        (`Scheduler.holds_handout`); starts the hold's clock."""
        now = time.monotonic()
        hold.since = hold.since or now
        newest = self.outbox.next_frame_newest()
        holding = self.scheduler.holds_handout(newest, now - hold.since)
        hold.waited |= holding
        hold.framed &= not holding  # groups that end this wait are framed at its end
        return holding

    async def _frame_late_groups(self, hold: _Hold) -> None:
        """After a hold: the late prompts' groups take the places of newer members of
        the frames never handed out (`Finalizer.frame_late_groups`)."""
        hold.framed = True
        assert hold.since is not None

        def take_out_unordered(
            rank: Callable[[int], int], waiting: int | None
        ) -> list[list[Group]]:
            taken = self.outbox.take_out_unordered(rank, waiting)
            return [[unpack_group(m.payload) for m in frame] for frame in taken]

        held_s = time.monotonic() - hold.since if hold.waited else 0.0
        finalizer = self.scheduler.finalizer
        if (joined := await finalizer.frame_late_groups(take_out_unordered, held_s)) or held_s:
            log.info(
                "a hand-out waited %.1f s for prompts the next weight push would make too "
                "stale; %d groups moved to an earlier frame",
                held_s,
                joined,
            )

    def required_features(self) -> dict[str, str]:
        """Wire features a consumer must declare, each with what it must do about them:
        `loss_mask` while episodes are served (their observation tokens must not be
        trained on), `replayed` while replay is on (a replayed answer is off-policy),
        `version_spans` while weight updates continue running answers."""
        required = {}
        if self.serves_episodes:
            required[wire_features.LOSS_MASK] = "train on Sample.loss_mask == 1 tokens only"
        if self.live.config.replay is not None:
            required[wire_features.REPLAYED] = (
                "treat Sample.replayed answers as off-policy (clip their importance ratio or "
                "drop them)"
            )
        if self.live.config.weight_update_mode == "continue":
            required[wire_features.VERSION_SPANS] = (
                "weigh the tokens of each Sample.version_spans span by the importance ratio "
                "of the version that decoded them (truncated importance sampling)"
            )
        return required

    def check_features(self, declared: frozenset[str]) -> None:
        """409 `feature_required` for a consumer that would mistrain on these groups."""
        required = self.required_features()
        if missing := sorted(set(required) - declared):
            raise ServiceError(
                409,
                "feature_required",
                f"this sampler's groups need the feature{'s' if len(missing) > 1 else ''} "
                f"{', '.join(missing)}: declare {'them' if len(missing) > 1 else 'it'} "
                f"(?{wire_features.QUERY_PARAM}={','.join(missing)}) and "
                + "; ".join(required[name] for name in missing),
                wire_features.QUERY_PARAM,
            )

    async def config_changed(self) -> None:
        """After a config or weight change: READY frames now too stale are dropped, and
        live streams that did not declare a feature the groups now need (replay switched
        on) are ended; their consumers reconnect and are told (409 `feature_required`),
        and what they held is READY again for the others."""
        required = set(self.required_features())
        for token, declared in list(self._stream_features.items()):
            if required - declared and token in self._streams:
                consumer = self._streams[token][0]
                log.warning("stream %s lacks features %s: ended", consumer, required - declared)
                self.outbox.disconnect(consumer, token)
        await self.drop_stale_frames()

    def open_stream(
        self,
        name: str,
        max_unacked: int,
        heartbeat_s: float,
        encoding: Encoding,
        groups_per_step: int | None = None,
        features: frozenset[str] = frozenset(),
    ) -> AsyncIterator[bytes]:
        """Claim the stream name `name` (409 while another live stream holds it);
        `features` are those the consumer declared (checked by `check_features`)."""
        self._check_step(groups_per_step)
        consumer = stream_consumer(name)
        token = self.outbox.connect(consumer)
        if token is None:
            raise ServiceError(
                409,
                "consumer_busy",
                f"consumer {name!r} already has a live stream; give each trainer its own name",
                "consumer",
            )
        self._streams[token] = (consumer, heartbeat_s, time.monotonic())
        self._stream_features[token] = features
        self.consumers.declare(consumer, groups_per_step, math.inf)
        return self._stream(consumer, token, max_unacked, heartbeat_s, encoding)

    async def _stream(
        self,
        consumer: str,
        token: object,
        max_unacked: int,
        heartbeat_s: float,
        encoding: Encoding,
    ) -> AsyncIterator[bytes]:
        """Messages for one consumer: whole frames as credit allows, else heartbeats."""
        outbox = self.outbox

        def sending() -> None:  # a yield returns once the socket has taken the message
            self._streams[token] = (consumer, heartbeat_s, time.monotonic())

        try:
            sending()
            yield encoding.message(self._heartbeat(consumer))
            next_beat = time.monotonic() + heartbeat_s
            hold = _Hold()
            while outbox.is_current(consumer, token) and not self._closing.is_set():
                self._streams[token] = (consumer, heartbeat_s, math.inf)
                if (stale := self._take_out_stale()) != ([], []):
                    await self._discard_stale(*stale)
                    continue
                changed = outbox.changed()
                size = outbox.next_frame_size()
                unacked = outbox.unacked(consumer)
                if size is None or (unacked + size > max_unacked and unacked > 0):
                    hold = _Hold()  # nothing to hand out yet
                elif not self._holding(hold):
                    if not hold.framed:
                        await self._frame_late_groups(hold)
                        continue  # check again: weights may have moved meanwhile
                    hold = _Hold()
                    ttl = self.live.config.lease_ttl_s
                    sending()
                    # Every READY frame the credit allows goes out in one write: a
                    # finalizer's burst of frames costs the loop one socket send, not one
                    # per frame.
                    taken = outbox.take(consumer, ttl, max_groups=max_unacked - unacked)
                    self._note_holding(consumer)
                    yield b"".join(map(encoding.group_message, self._delivered(taken)))
                    continue
                now = time.monotonic()
                if now >= next_beat:
                    sending()
                    yield encoding.message(self._heartbeat(consumer))
                    next_beat = now + heartbeat_s
                await wait_event(changed, hold.wait_s(next_beat - now))
            if self._closing.is_set():
                yield encoding.message(self._heartbeat(consumer, closing=True))
        finally:
            self._streams.pop(token, None)
            self._stream_features.pop(token, None)
            outbox.disconnect(consumer, token)
            self.consumers.forget(consumer)
            self.scheduler.poke()

    def _drop_stalled_streams(self) -> None:
        """Free the name of a stream whose socket has not taken a message in 2 heartbeats.

        A consumer that vanished without closing its connection would otherwise hold its
        name (409 to its own reconnect) and its groups until their lease expires.
        """
        now = time.monotonic()
        for token, (consumer, heartbeat_s, since) in list(self._streams.items()):
            if now - since > 2 * heartbeat_s:
                log.warning("stream %s took no message for %.0f s: dropped", consumer, now - since)
                del self._streams[token]
                self._stream_features.pop(token, None)
                self.outbox.disconnect(consumer, token)
                self.scheduler.poke()

    async def ack(self, delivery_ids: list[str]) -> AckResponse:
        mistaken = self.outbox.group_ids_among(delivery_ids)
        acked, unknown, tokens = await self.outbox.ack(delivery_ids)
        self.tally.acked(acked, tokens)
        self.scheduler.poke()
        hint = None
        if mistaken:
            hint = (
                f"{mistaken} of the ids are group_id values: ack each group by its "
                "delivery_id (a group delivered again has a new one)"
            )
        elif unknown:
            hint = "unknown ids: not delivered by this sampler, or already acked"
        return AckResponse(acked=acked, unknown=unknown, hint=hint)

    async def lease(
        self,
        consumer: str,
        max_groups: int,
        wait_s: float,
        encoding: Encoding,
        groups_per_step: int | None = None,
    ) -> bytes:
        """An encoded LeaseResponse, built from the stored group bytes."""
        self._check_step(groups_per_step)
        ttl = self.live.config.lease_ttl_s
        self.consumers.declare(lease_consumer(consumer), groups_per_step, time.monotonic() + ttl)
        deadline = time.monotonic() + min(wait_s, self.max_lease_wait_s)
        hold = _Hold()
        while True:
            await self.drop_stale_frames()
            if time.monotonic() >= deadline or self._closing.is_set():
                break
            if self.outbox.next_frame_size() is None:
                hold = _Hold()
            elif not self._holding(hold):
                if hold.framed:
                    break
                await self._frame_late_groups(hold)
                continue  # check again: weights may have moved meanwhile
            await wait_event(self.outbox.changed(), hold.wait_s(deadline - time.monotonic()))
        ttl = self.live.config.lease_ttl_s
        delivered = self._delivered(
            self.outbox.take(lease_consumer(consumer), ttl, max_groups=max_groups)
        )
        self._note_holding(lease_consumer(consumer))
        return encoding.lease(
            {"lease_id": uuid.uuid4().hex, "expires_at": time.time() + ttl}, delivered
        )
