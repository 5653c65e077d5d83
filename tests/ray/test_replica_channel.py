"""The fleet's waves to a replica: batched Ray calls, each wave still answered on its own,
each answer passed on by index as it finishes, and cancels that reach the replica's rows.

The fleet runs in this process against a real Ray head; the replica is a real actor whose
engine is `gated_engine.GatedEngine` (the toy hf model, holding back waves for one prompt
until the test opens a file gate), so which wave is done when is decided by the test,
not by timing; or the hf engine on a copy of the toy that never ends an answer.
"""

from __future__ import annotations

import asyncio
import functools
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from gated_engine import GATED_TOKEN, GatedEngine
from ray_helpers import ROOT
from support import endless

from sampler_service.backends.base import GenerationAborted, SamplingParams, as_list
from sampler_service.backends.hf import HFBackend
from sampler_service.backends.ray.member import RayMember
from sampler_service.backends.ray.replica import NotStarted, Replica
from sampler_service.backends.ray.transport import build_ray_fleet
from sampler_service.config import ReplicaSettings
from sampler_service.fleet.pool import Fleet

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

#: The replica actor imports `gated_engine` from this directory.
RAY_HEAD_ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'ray'}"}

SAMPLING = SamplingParams(temperature=1.0, max_tokens=4)


def _on_a_fleet(
    factory: Callable[[], Any], settings: ReplicaSettings, check: Callable[[Fleet], Awaitable[None]]
) -> None:
    """Run `check` against a started fleet of Ray replicas, closed after it."""

    async def run() -> None:
        pool = build_ray_fleet(factory, settings, instance_id=uuid.uuid4().hex[:8])
        await pool.start()
        try:
            await check(pool)
        finally:
            await pool.close()

    asyncio.run(run())


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0.02)


def test_waves_of_one_loop_turn_share_a_call_and_each_returns_when_done(
    ray_cluster, toy, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    factory = functools.partial(GatedEngine, toy.model_dir, gate)
    settings = ReplicaSettings(count=1, probe_s=60.0)

    async def check(pool: Fleet) -> None:
        replica = pool.table.seats[0].member
        assert isinstance(replica, RayMember)
        before = await replica.replica_health()

        # Eight waves asked for in one loop turn: one submit call carries them all.
        waves = [
            asyncio.ensure_future(pool.generate([GATED_TOKEN, 1, 2], 2, SAMPLING)),
            *(asyncio.ensure_future(pool.generate([8 + i, 1, 2], 2, SAMPLING)) for i in range(7)),
        ]
        held, free = waves[0], waves[1:]
        # The seven free waves come back while the held one (same call) cannot finish.
        for out in await asyncio.wait_for(asyncio.gather(*free), 300):
            assert len(out) == 2 and all(len(c.token_ids) for c in out)
        await _settle()
        assert not held.done()
        after = await replica.replica_health()
        assert after["submit_calls"] - before["submit_calls"] == 1
        assert after["submitted_waves"] - before["submitted_waves"] == 8

        gate.touch()
        assert len(await held) == 2

        # An abort reaches the held wave's own caller as GenerationAborted; the free
        # wave sent with it in the same call is answered normally.
        gate.unlink()
        held = asyncio.ensure_future(pool.generate([GATED_TOKEN, 3], 1, SAMPLING))
        free_one = asyncio.ensure_future(pool.generate([12, 3], 1, SAMPLING))
        assert len(await asyncio.wait_for(free_one, 300)) == 1
        await _settle()
        await pool.abort_all()
        with pytest.raises(GenerationAborted, match="held at the gate"):
            await held

    _on_a_fleet(factory, settings, check)


def test_a_cancel_reaches_the_replicas_rows_and_answers_come_back_by_index(
    ray_cluster, toy, tmp_path: Path
) -> None:
    """Greedy twins on a replica that runs two rows at a time: the third answer, cancelled
    while queued, comes back first with nothing decoded; the second, cancelled while it
    runs, comes back with what it decoded, a prefix of the first's."""
    factory = functools.partial(HFBackend, endless(toy.model_dir, tmp_path / "m"), max_batch_rows=2)
    settings = ReplicaSettings(count=1, probe_s=60.0)

    async def check(pool: Fleet) -> None:
        assert pool.cancels_answers
        wave = pool.wave([3, 4, 5], 3, SamplingParams(temperature=0, max_tokens=4000))
        assert wave.cancels_answers
        reading = aiter(wave)
        await asyncio.sleep(3.0)  # rows 0 and 1 run on the replica, row 2 waits
        await wave.cancel([1, 2])
        assert pool.members()[0]["inflight_samples"] == 1  # freed at the cancel
        index, queued = await asyncio.wait_for(anext(reading), 300)
        assert (index, queued.finish_reason, len(queued.token_ids)) == (2, "abort", 0)
        rest = {i: answer async for i, answer in reading}
        cut, twin = as_list(rest[1].token_ids), as_list(rest[0].token_ids)
        assert rest[1].finish_reason == "abort" and rest[0].finish_reason == "length"
        assert 0 < len(cut) < len(twin) == 4000 and cut == twin[: len(cut)]
        assert pool.members()[0]["inflight_samples"] == 0

    _on_a_fleet(factory, settings, check)


def test_finished_waves_are_kept_for_the_session_that_started_the_replica(
    ray_cluster, toy, tmp_path: Path
) -> None:
    """A collect call of a sampler whose replica was taken over gets an error, not waves."""
    actor = (
        ray.remote(max_concurrency=100)(Replica)
        .options(namespace="adaptive-rollout")
        .remote(functools.partial(GatedEngine, toy.model_dir, tmp_path / "gate"), 0)
    )
    try:
        with pytest.raises(NotStarted, match="no engine loaded"):
            ray.get(
                actor.submit_waves.remote("first", [(0, [1, 2], 1, SAMPLING, ())], []), timeout=60
            )
        ray.get(actor.start.remote(None, "first"), timeout=300)
        ray.get(actor.submit_waves.remote("first", [(0, [1, 2], 1, SAMPLING, ())], []), timeout=60)
        finished = ray.get(actor.collect_waves.remote("first", 60.0), timeout=120)
        assert [(call_id, index) for call_id, index, _ in finished] == [(0, 0)]  # its answer

        ray.get(actor.start.remote(None, "second"), timeout=60)  # another sampler attaches
        with pytest.raises(NotStarted, match="another sampler session"):
            ray.get(actor.collect_waves.remote("first", 0.1), timeout=60)
        ray.get(actor.submit_waves.remote("second", [(5, [1, 2], 1, SAMPLING, ())], []), timeout=60)
        finished = ray.get(actor.collect_waves.remote("second", 60.0), timeout=120)
        assert [(call_id, index) for call_id, index, _ in finished] == [(5, 0)]
    finally:
        ray.kill(actor)
