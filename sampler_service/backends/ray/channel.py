"""Waves to one replica actor in batched Ray calls, each answer still passed on as it
finishes.

A Ray actor call costs the driver (the sampler's front) about 1 ms of CPU, and that CPU
is what also verifies answers and schedules waves. On 2 cores, a burst of 16 concurrent
waves of the toy model cost the driver 16-17 ms of CPU as one Ray call per wave and 5 ms
through this channel (`python -m bench.scaleout --quick --only calls`). A toy model's
wave lasts a few milliseconds, so one call per wave cost the front about a sixth of its
throughput.

So the channel sends every wave asked for and every cancel made in one event-loop turn
as one `submit_waves` call, and keeps one long-poll `collect_waves` call open that
returns every answer finished since the previous one, as `(call_id, index, answer)` (an
index of None: the error that ends the rest of that wave). No wave waits for another: an
answer comes back with the first collect after it finished. A cancelled answer comes
back the same way, aborted, with what the replica's engine had decoded of it.

Failure: a submit call that fails (the actor is dead, or restarted and not started yet)
fails the waves it carried; a collect call that fails fails every wave still waiting (its
actor died, none of them will finish); the fleet's member calls `fail_all` when the
fleet found a failure by other means (a hung probe, a restarted process). Every failure
starts a new generation: the collect loop of an earlier one can still deliver answers,
but its error never fails the waves sent since. Errors reach a wave as `translate` makes
them (the member's own failure types).

Sessions: the replica keeps finished answers for the session `start` gave it (one per
channel, so per sampler): a collect call still open from a sampler that died cannot take
the answers of the sampler that took its replicas over.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Any

from sampler_service.aio import TaskSet, TurnBatch
from sampler_service.backends.base import SamplingParams, StreamedWave, WaveRequest

#: Seconds a collect call waits on the replica for a finished answer before it returns
#: empty and is sent again (a hung replica is the health probe's to find).
COLLECT_POLL_S = 5.0

#: One wave as sent: (call id, prompt token ids, n, sampling, the answers' priorities).
SentWave = tuple[int, list[int], int, SamplingParams, tuple[int, ...]]
#: One cancel as sent: (call id, the answers to stop, or None: its reader left, stop all).
SentCancel = tuple[int, list[int] | None]
#: One answer as returned: (call id, index, the answer; or None and the wave's error).
Finished = tuple[int, int | None, Any]


class ReplicaChannel:
    """See the module docstring. `handle` is the replica's Ray actor handle; `translate`
    turns an error of the wire or the replica into the one its waves raise."""

    def __init__(
        self,
        handle: Any,
        translate: Callable[[BaseException], BaseException],
        poll_s: float = COLLECT_POLL_S,
    ) -> None:
        self.session = uuid.uuid4().hex
        self._handle = handle
        self._translate = translate
        self._poll_s = poll_s
        self._ids = itertools.count()
        self._generation = 0
        self._collecting = False
        self._outbox: TurnBatch[SentWave | SentCancel] = TurnBatch(self._flush)
        # call id -> (generation it was sent in, its wave)
        self._waiting: dict[int, tuple[int, StreamedWave]] = {}
        self._tasks = TaskSet()

    def wave(self, request: WaveRequest, cancels_answers: bool) -> StreamedWave:
        call_id = next(self._ids)

        async def cancel(indices: list[int]) -> None:
            self._outbox.add((call_id, indices))

        def drop() -> None:
            if self._waiting.pop(call_id, None) is not None:
                self._outbox.add((call_id, None))

        wave = StreamedWave(request.n, cancel, drop, cancels_answers=cancels_answers)
        self._waiting[call_id] = (self._generation, wave)
        sent = (call_id, request.prompt_token_ids, request.n, request.sampling, request.priorities)
        self._outbox.add(sent)
        if not self._collecting:
            self._collecting = True
            self._tasks.spawn(self._collect(self._generation), "replica-channel")
        return wave

    def fail_all(self, error: BaseException) -> None:
        """Fail every wave waiting (the fleet found the replica failed); a new generation."""
        self._fail_generation(self._generation, error)

    async def close(self) -> None:
        await self._tasks.cancel()

    def _flush(self, sent: list[SentWave | SentCancel]) -> None:
        waves = [s for s in sent if len(s) == 5]  # the rest are cancels, (call id, indices)
        cancels = [s for s in sent if len(s) == 2]
        ref = self._handle.submit_waves.remote(self.session, waves, cancels)
        self._tasks.spawn(self._check_submit(ref, [wave[0] for wave in waves]), "replica-channel")

    async def _check_submit(self, ref: Any, call_ids: list[int]) -> None:
        try:
            await ref
        except Exception as exc:  # noqa: BLE001 - the waves' readers get it
            for call_id in call_ids:
                self._end(call_id, exc)

    async def _collect(self, generation: int) -> None:
        try:
            while any(g == generation for g, _ in self._waiting.values()):
                try:
                    finished: list[Finished] = await self._handle.collect_waves.remote(
                        self.session, self._poll_s
                    )
                except Exception as exc:  # noqa: BLE001 - the waves' readers get it
                    self._fail_generation(generation, exc)
                    return
                for call_id, index, value in finished:
                    entry = self._waiting.get(call_id)
                    if entry is None:
                        continue  # its reader left
                    if index is None:
                        self._end(call_id, value)
                        continue
                    entry[1].put(index, value)
                    if not entry[1].missing:
                        del self._waiting[call_id]
        finally:
            if generation == self._generation:
                self._collecting = False

    def _end(self, call_id: int, error: BaseException) -> None:
        """The rest of a wave will not come."""
        entry = self._waiting.pop(call_id, None)
        if entry is not None:
            entry[1].fail(self._translate(error))

    def _fail_generation(self, generation: int, error: BaseException) -> None:
        for call_id, (g, _) in list(self._waiting.items()):
            if g == generation:
                self._end(call_id, error)
        if generation == self._generation:
            self._generation += 1
            self._collecting = False
