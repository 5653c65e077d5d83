"""Finished prompts to stored groups: accounting, group building, framing, storing.

A prompt leaves its engine slot as soon as its last wave is verified and queues here, so
the next prompt is admitted at once and the engine never waits on the store. Finalizer
tasks take every prompt that finished while the last write ran (up to `STORE_BATCH`) and
store their groups in one write; while one batch is written (the store's thread) the next
is built (the event loop). Waiting prompts count as buffered for backpressure.

The `Finalizer` never references the scheduler that feeds it: it is handed the live
config, the sink, the tally and replay store, and callables for the served version and
the state to save.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sampler_service import grouping
from sampler_service.grouping import fresh_tokens
from sampler_service.journal import Journal
from sampler_service.live_config import LiveConfig
from sampler_service.outbox import framing_rank, too_stale
from sampler_service.prompt_run import PromptRun
from sampler_service.replay import Replayed, ReplayStore
from sampler_service.tally import PromptOutcome, Tally
from trainer_client.contract.protocol import Group

log = logging.getLogger(__name__)

#: Most finished prompts a finalizer stores in one write. Those that finished while
#: the last write ran share the next one: a commit per group would cap the front at one
#: store round trip per group, and a backlog would wait in line for its turn. A larger
#: batch makes the first of a burst wait for the last: a 700-token group of 4 answers
#: takes ~0.2 ms to build and ~0.3-0.6 ms to write, so 64 at once held the first ~50 ms.
STORE_BATCH = 16
#: Finalizer tasks: while one batch is written (the store's thread), the next is built
#: (the event loop), so a burst of finished prompts pays one of the two, not the sum.
#: The store's frame lock keeps writes one at a time, in the order they were built.
FINALIZERS = 2
#: Seconds between snapshots of the mixer/estimator/dataset state, which travel with the
#: next finished group into the store. By time, not by count: a snapshot of 8,192
#: prompts' estimator state takes ~27 ms of the event loop. A crash loses at most this
#: much state (a few prompts are served again), never a finished group.
STATE_EVERY_S = 1.0


class GroupSink(Protocol):
    """Where finished groups go: the durable store in the service, memory in benchmarks."""

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        """Store a group that waits for its frame, with `state` (`Scheduler.saved_state`:
        state keys and their values) when given."""
        ...

    async def add_frames(
        self, frames: Sequence[grouping.FrameResult], state: dict[str, Any] | None = None
    ) -> None:
        """Store frames together (`state`, when given, with them) and offer them in order;
        a member may not have been through `add_pending` (it completed its frame as it
        finished), and a dropped member is deleted if it was."""
        ...

    def buffered(self) -> int:
        """Framed groups not yet acked (READY + LEASED)."""
        ...

    async def unframe(self, group_ids: list[str]) -> None:
        """Stored framed groups are pending again (`Finalizer.take_back`)."""
        ...


class Finalizer:
    """Finished prompts' groups, built and stored (see the module docstring)."""

    def __init__(
        self,
        *,
        live: LiveConfig,
        sink: GroupSink,
        tally: Tally,
        replay: ReplayStore,
        served_version: Callable[[], int],
        saved_state: Callable[[], dict[str, Any]],
        clock: Callable[[], float],
        on_error: Callable[[str], None],
        serve_again: Callable[[str, str], None] = lambda domain, prompt_id: None,
        journal: Journal | None = None,
    ) -> None:
        """`serve_again(domain, prompt_id)` puts the prompt of a group dropped as stale
        back in line; the `journal` is told which prompts end, and how."""
        self.journal = journal or Journal()
        self.live, self.sink, self.tally, self.replay = live, sink, tally, replay
        self._serve_again = serve_again
        self._served_version = served_version
        self._saved_state = saved_state
        self._clock = clock
        self._on_error = on_error
        self._state_saved_at = clock()
        #: Groups stored but not yet in a frame (a frame is `batch_groups` groups).
        self.unframed: list[Group] = []
        #: Unframed groups already counted as emitted (taken back from a split frame).
        self._counted: set[str] = set()
        self._frame_lock = asyncio.Lock()
        self._queue: asyncio.Queue[PromptRun] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        #: Prompts whose answers are all in, their groups not yet stored.
        self.finalizing = 0
        #: Groups taken out of the sink's frames on their way back here (`take_back`):
        #: still buffered, for admission, while they wait for the frame lock (and,
        #: harmlessly, counted twice while they are framed again).
        self.returning = 0
        #: Of those queued (`put`), how many groups will be of each weight version.
        self._queued_versions: Counter[int] = Counter()
        #: Called after each batch: backpressure may have eased.
        self.on_stored: Callable[[], None] = lambda: None
        self._queued_tokens = 0
        #: Finished prompts whose groups a failed write lost (not offered, not dropped),
        #: and that write's error.
        self.unstored = 0
        self.unstored_error: str | None = None

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name=f"finalizer-{i}") for i in range(FINALIZERS)
        ]

    async def stop(self, drain_timeout_s: float) -> None:
        """Store what is queued (bounded wait), then stop."""
        if not self._tasks:
            return
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._queue.join()
        except TimeoutError:
            log.error("stopped with %d finished groups not stored", self.finalizing)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def put(self, run: PromptRun) -> None:
        """A prompt whose answers are all in: its group is built and stored soon (what the
        journal still holds of it is not written: its group's write ends the attempt)."""
        self.journal.finished(run)
        self.finalizing += 1
        self._queued_versions[self._queued_version(run)] += 1
        self._queued_tokens += run.recorded_tokens
        self._queue.put_nowait(run)

    @staticmethod
    def _queued_version(run: PromptRun) -> int:
        """The version a queued prompt's group will have (its answers are all in)."""
        version = run.group_version_min()
        return run.admitted_version if version is None else version

    def queued_since(self, version: int) -> int:
        """Prompts queued here (their groups not yet stored) whose groups will be of
        `version` or older."""
        return sum(n for v, n in self._queued_versions.items() if v <= version)

    def held_tokens(self) -> int:
        """Decoded tokens of prompts waiting here and of groups waiting for their frame."""
        return self._queued_tokens + sum(map(fresh_tokens, self.unframed))

    def restore_pending(self, groups: list[Group]) -> None:
        """Finished groups stored before a restart but not yet framed."""
        self.unframed.extend(groups)

    async def _run(self) -> None:
        """Store finished prompts' groups: whatever finished meanwhile goes in one write."""
        while True:
            runs = [await self._queue.get()]
            while len(runs) < STORE_BATCH and not self._queue.empty():
                runs.append(self._queue.get_nowait())
            self._queued_tokens -= sum(run.recorded_tokens for run in runs)
            try:
                await self.finalize(runs)
            except Exception as exc:  # a failed write must not stop the finalizer
                self.unstored += len(runs)
                self.unstored_error = f"storing {len(runs)} groups failed: {exc!r}"
                self._on_error(self.unstored_error)
                log.exception("storing the groups of %d prompts failed", len(runs))
            finally:
                self.finalizing -= len(runs)
                self._queued_versions.subtract(map(self._queued_version, runs))
                self._queued_versions = +self._queued_versions  # (zeros out)
                for _ in runs:
                    self._queue.task_done()
                self.on_stored()

    # -- groups -----------------------------------------------------------------------
    async def finalize(self, runs: list[PromptRun]) -> None:
        """Account for finished prompts, build their groups (`grouping`) and store them
        in one write."""
        groups = []
        for run in runs:
            self.journal.finished(run)  # (rounds come here without `put`)
            try:
                group = self._built(run)
            except Exception as exc:  # one bad group must not stop the rest
                self._on_error(f"finalizing prompt {run.row.id} failed: {exc!r}")
                log.exception("finalizing prompt %s failed", run.row.id)
                continue
            if group is not None:
                groups.append(group)
        if groups:
            await self._store(groups)

    def _built(self, run: PromptRun) -> Group | None:
        """Account for a finished prompt and build its group; None if it is dropped."""
        run.done = True
        row = run.row
        stop_reason = run.stop_reason()
        self.tally.prompt_finished(
            PromptOutcome(row.domain, run.n_generated, run.n_pos, stop_reason, run.budget, run.cut)
        )
        self.live.learned(row.id, run.n_generated, run.n_pos)
        replay = self._replay_for(run)
        result = grouping.build_group(
            row=row,
            cfg=run.plan.cfg,
            config_version=run.plan.config_version,
            group_policies=run.plan.policies.group,
            completions=run.completions,
            verdicts=run.verdicts,
            n_pos=run.n_pos,
            stop_reason=stop_reason,
            n_env_errors=run.env_errors,
            replay=replay,
            group_id=run.attempt_id,
        )
        reward_mean = sum(v.reward for v in run.verdicts) / len(run.verdicts)
        self.live.mixer.observe(row.domain, reward_mean, result.mean_abs_advantage)
        group = result.group
        counted = run.sampled_tokens()
        if group is None:
            self.tally.dropped_group(str(result.drop_reason), counted, row.domain, run.quartile())
            self.journal.ended(run)
            return None
        if too_stale(
            self._served_version(), group.policy_version_min, self.live.config.max_staleness
        ):
            # Past the bound already: it could never be handed out, and framed it would
            # take a whole frame of fresh groups down with it. Every answer it counted is
            # waste: the prompt is sampled again from scratch.
            self.tally.dropped_group("stale", counted, row.domain, run.quartile())
            self._serve_again(row.domain, row.id)
            self.journal.ended(run)
            return None
        kept = fresh_tokens(group)
        self.tally.grouped(kept, counted - kept)
        if replay is not None and any(s.replayed for s in group.samples):
            self.tally.replayed_answer()
        return group

    def _replay_for(self, run: PromptRun) -> Replayed | None:
        """An earlier right answer for a prompt whose answers are all wrong (config
        `replay`), or None; a prompt with right answers has them kept for later."""
        knobs = run.plan.cfg.replay
        if knobs is None:
            return None
        if run.n_pos == 0:
            return self.replay.take(run.row.id, self._served_version(), knobs.max_version_lag)
        rewards = [v.reward for v in run.verdicts]
        threshold = run.plan.cfg.positive_threshold
        self.replay.remember(run.row.id, run.completions, rewards, threshold, knobs.per_prompt)
        return None

    async def _store(self, groups: list[Group]) -> None:
        """Store finished groups: those that complete frames framed, in one write (so
        each is written once), and those that wait for the rest of their frame as
        pending, so a restart still finds them."""
        async with self._frame_lock:
            state = None
            if self._clock() - self._state_saved_at >= STATE_EVERY_S:
                state, self._state_saved_at = self._saved_state(), self._clock()
            self.unframed.extend(groups)
            self._in_framing_order()
            size = self.live.config.batch_groups
            waiting = {g.group_id for g in self.unframed[len(self.unframed) // size * size :]}
            for group in groups:
                if group.group_id in waiting:
                    await self.sink.add_pending(group, state)
                    state = None
            await self._form_frames(state)

    def _framing_rank(self) -> Callable[[int], int]:
        """`outbox.framing_rank` under the served version and the bound in force now
        (read once for a whole pass over the groups)."""
        served, bound = self._served_version(), self.live.config.max_staleness
        return lambda policy_version_min: framing_rank(policy_version_min, served, bound)

    def _in_framing_order(self) -> None:
        """Frames take first the groups the next weight push would make too stale, oldest
        first (stable: the rest in the order they came), so a slow prompt's group does
        not wait behind newer ones for a later frame, which the bound would drop."""
        rank = self._framing_rank()
        self.unframed.sort(key=lambda g: rank(g.policy_version_min))

    async def take_back(self, groups: list[Group]) -> None:
        """Frame again the members of frames never handed out (the fresh members of a
        frame split by the staleness bound, or a frame that older groups join before its
        hand-out): first in line among groups of their framing rank, already counted as
        emitted."""
        if not groups:
            return
        self.returning += len(groups)
        try:
            async with self._frame_lock:
                await self._frame_again(groups)
        finally:
            self.returning -= len(groups)

    async def _frame_again(self, groups: list[Group]) -> list[grouping.FrameResult]:
        """`take_back`, the frame lock held; returns the frames formed. The groups are
        unframed here before the store hears of it: out of the sink's frames, they must
        count as buffered at once, or admission sees room they take."""
        if not groups:
            return []
        self._counted.update(g.group_id for g in groups)
        self.unframed[:0] = groups
        await self.sink.unframe([g.group_id for g in groups])
        return await self._form_frames()

    async def frame_late_groups(
        self,
        take_out_unordered: Callable[[Callable[[int], int], int | None], list[list[Group]]],
        held_s: float = 0.0,
    ) -> int:
        """Before a hand-out: a group that finished after the frames formed and that the
        next weight push would make too stale (a slow prompt's) takes the place of a
        member it would not, which waits for a later frame, within the bound.
        `take_out_unordered(rank, first waiting rank)` takes the frames never handed out
        out of the sink, in hand-out order, if their members are not in framing order
        (`out_of_order` over `rank`, this finalizer's `framing_rank`); their members are
        framed again with the groups waiting. `held_s`: how long the hand-out waited for
        late prompts (`Scheduler.holds_handout`); the tally counts a hand-out that waited
        or moved groups ahead. Returns how many groups were framed earlier than before (a
        waiting group framed, or a framed one moved to an earlier frame). Not
        with batch selections (a frame is selected once)."""
        joined = 0
        if not self.live.policies.selections:
            # Judged and framed again under the frame lock: a frame formed while this
            # waited for the lock (the late group's own, say) is judged with the rest, not
            # left behind the frame about to go out.
            async with self._frame_lock:
                rank = self._framing_rank()
                waiting = min((rank(g.policy_version_min) for g in self.unframed), default=None)
                taken = take_out_unordered(rank, waiting)
                place = dict.fromkeys((g.group_id for g in self.unframed), len(taken))
                place.update((g.group_id, i) for i, frame in enumerate(taken) for g in frame)
                frames = await self._frame_again([g for frame in taken for g in frame])
                joined = sum(
                    place[g.group_id] > i for i, frame in enumerate(frames) for g in frame.kept
                )
        if held_s or joined:
            self.tally.handout_held(held_s, joined)
        return joined

    async def form_frames(self) -> None:
        """Re-check framing (e.g. after batch_groups was lowered by a PATCH)."""
        async with self._frame_lock:
            await self._form_frames()

    async def _form_frames(self, state: dict[str, Any] | None = None) -> list[grouping.FrameResult]:
        """Frame what is unframed, every frame in one write; `state` is stored with them.
        Returns the frames, in the order they were formed."""
        size = self.live.config.batch_groups
        count = len(self.unframed) // size * size
        if not count:
            return []
        self._in_framing_order()
        frames = []
        policies = self.live.policies
        for start in range(0, count, size):
            frame = grouping.apply_batch_policies(
                self.unframed[start : start + size],
                policies.selections,
                policies.weightings,
                batch_id=grouping.new_id(),
            )
            for group, reason in frame.dropped:
                self.tally.dropped_group(
                    reason,
                    fresh_tokens(group),
                    group.domain,
                    self.live.quartile(group.prompt_id),
                    grouping.downsampled_tokens(group),
                )
            for group in frame.kept:
                if group.group_id in self._counted:
                    self._counted.discard(group.group_id)
                else:
                    self.tally.emitted(group.domain)
            frames.append(frame)
        # The members stay in `unframed` until the sink has offered them: while their
        # frames are written they must still count as buffered, or admission
        # (max_staleness) would see room that the frames are about to take.
        try:
            await self.sink.add_frames(frames, state)
        finally:
            del self.unframed[:count]
        return frames


class VolatileSink:
    """Base of the in-memory sinks (benchmarks, tests): nothing is stored, so a group that
    waits for the rest of its frame needs no write, and frames need no shared one: each
    subclass takes them one at a time (`add_frame`)."""

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        return None

    async def unframe(self, group_ids: list[str]) -> None:
        return None

    async def add_frames(
        self, frames: Sequence[grouping.FrameResult], state: dict[str, Any] | None = None
    ) -> None:
        """Each frame to `add_frame` in turn; `state` with the first."""
        for frame in frames:
            await self.add_frame(frame.kept, [g.group_id for g, _ in frame.dropped], state)
            state = None

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        """One frame's kept groups and the ids of the members dropped from it."""
        raise NotImplementedError


class MemorySink(VolatileSink):
    """In-memory sink for benchmarks and tests: frames are 'acked' by popping them."""

    def __init__(self) -> None:
        self.frames: list[list[Group]] = []
        self.dropped: list[str] = []

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        if groups:
            self.frames.append(groups)
        self.dropped.extend(dropped)

    def buffered(self) -> int:
        return sum(len(f) for f in self.frames)

    def groups(self) -> list[Group]:
        return [g for frame in self.frames for g in frame]
