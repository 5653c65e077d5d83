"""Waves to one replica actor in batched Ray calls, each wave still answered on its own.

A Ray actor call costs the driver (the sampler's front) about 1 ms of CPU, and that CPU
is what also verifies answers and schedules waves. On 2 cores, a burst of 16 concurrent
waves of the toy model cost the driver 16-17 ms of CPU as one Ray call per wave and 5 ms
through this channel (`python -m bench.scaleout --quick --only calls`). A toy model's
wave lasts a few milliseconds, so one call per wave cost the front about a sixth of its
throughput.

So the channel sends every wave asked for in one event-loop turn as one `submit_waves`
call, and keeps one long-poll `collect_waves` call open that returns every wave finished
since the previous one, as `(call_id, ok, completions or error)`. No wave waits for
another: a wave's result comes back with the first collect after it finished.

Failure: a submit call that fails (the actor is dead, or restarted and not started yet)
fails the waves it carried; a collect call that fails fails every wave still waiting (its
actor died, none of them will finish); the fleet's member calls `fail_all` when the
fleet found a failure by other means (a hung probe, a restarted process). Every failure starts a new
generation: the collect loop of an earlier one can still deliver results, but its error
never fails the waves sent since.

Sessions: the replica keeps finished waves for the session `start` gave it (one per
channel, so per sampler): a collect call still open from a sampler that died cannot take
the results of the sampler that took its replicas over.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any

from sampler_service.aio import TaskSet
from sampler_service.backends.base import Completion, SamplingParams

#: Seconds a collect call waits on the replica for a finished wave before it returns
#: empty and is sent again (a hung replica is the health probe's to find).
COLLECT_POLL_S = 5.0

#: One wave as sent: (call id, prompt token ids, n, sampling).
SentWave = tuple[int, list[int], int, SamplingParams]
#: One finished wave as returned: (call id, ok, completions if ok else the error).
Finished = tuple[int, bool, Any]


class ReplicaChannel:
    """See the module docstring. `handle` is the replica's Ray actor handle."""

    def __init__(self, handle: Any, poll_s: float = COLLECT_POLL_S) -> None:
        self.session = uuid.uuid4().hex
        self._handle = handle
        self._poll_s = poll_s
        self._ids = itertools.count()
        self._generation = 0
        self._collecting = False
        self._outbox: list[SentWave] = []
        # call id -> (generation it was sent in, the caller's future)
        self._waiting: dict[int, tuple[int, asyncio.Future[list[Completion]]]] = {}
        self._tasks = TaskSet()

    async def generate(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        future: asyncio.Future[list[Completion]] = loop.create_future()
        self._waiting[call_id] = (self._generation, future)
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append((call_id, prompt_token_ids, n, sampling))
        if not self._collecting:
            self._collecting = True
            self._tasks.spawn(self._collect(self._generation), "replica-channel")
        try:
            return await future
        finally:
            self._waiting.pop(call_id, None)

    def fail_all(self, error: BaseException) -> None:
        """Fail every wave waiting (the fleet found the replica failed); a new generation."""
        self._fail_generation(self._generation, error)

    async def close(self) -> None:
        await self._tasks.cancel()

    def _flush(self) -> None:
        waves, self._outbox = self._outbox, []
        if waves:
            ref = self._handle.submit_waves.remote(self.session, waves)
            self._tasks.spawn(
                self._check_submit(ref, [wave[0] for wave in waves]), "replica-channel"
            )

    async def _check_submit(self, ref: Any, call_ids: list[int]) -> None:
        try:
            await ref
        except Exception as exc:  # noqa: BLE001 - the waves' callers get it
            for call_id in call_ids:
                entry = self._waiting.get(call_id)
                if entry is not None and not entry[1].done():
                    entry[1].set_exception(exc)

    async def _collect(self, generation: int) -> None:
        try:
            while any(g == generation for g, _ in self._waiting.values()):
                try:
                    finished: list[Finished] = await self._handle.collect_waves.remote(
                        self.session, self._poll_s
                    )
                except Exception as exc:  # noqa: BLE001 - the waves' callers get it
                    self._fail_generation(generation, exc)
                    return
                for call_id, ok, value in finished:
                    entry = self._waiting.get(call_id)
                    if entry is None or entry[1].done():
                        continue  # its caller gave up
                    if ok:
                        entry[1].set_result(value)
                    else:
                        entry[1].set_exception(value)
        finally:
            if generation == self._generation:
                self._collecting = False

    def _fail_generation(self, generation: int, error: BaseException) -> None:
        for g, future in list(self._waiting.values()):
            if g == generation and not future.done():
                future.set_exception(error)
        if generation == self._generation:
            self._generation += 1
            self._collecting = False
