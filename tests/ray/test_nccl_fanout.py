"""NCCL weight transfer fanned out to every replica's ranks, and the stale group.

The fleet runs in this process against a real Ray head; each replica is a real actor
whose engine is `fake_nccl.FakeNCCLEngine` (an hf engine answering the vLLM backend's
NCCL calls without a transfer: no GPU here). What is checked is the fleet's part: the
rank offsets each replica is given, the fan-out of init and update, and that a replica
restart makes the next update fail with NCCLGroupStale before any replica is asked to
receive, the restarted replica serving the last file weights (unrouted, not recycled)
until the trainer forms the group again.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from fake_nccl import FakeNCCLEngine
from ray_helpers import ROOT

from sampler_service.backends.base import SamplingParams
from sampler_service.backends.ray.transport import build_ray_fleet
from sampler_service.config import ReplicaSettings
from sampler_service.weights.types import NCCLGroupStale

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

#: The replica actors import `fake_nccl` from this directory.
RAY_HEAD_ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'ray'}"}

UPDATE = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}


async def _until(what: str, check, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.25)


def _inits(record_dir: Path) -> dict[int, dict]:
    """pid -> the init info its engine got last."""
    out: dict[int, dict] = {}
    for path in sorted(record_dir.glob("init-*.json"), key=lambda p: p.stat().st_mtime):
        record = json.loads(path.read_text())
        out[record["pid"]] = record["init_info"]
    return out


def test_nccl_fans_out_to_every_replica_and_a_restart_makes_the_group_stale(
    ray_cluster, toy, tmp_path: Path
) -> None:
    records = tmp_path / "records"
    records.mkdir()
    factory = functools.partial(FakeNCCLEngine, toy.model_dir, records, workers=2)
    settings = ReplicaSettings(count=2, probe_s=0.5, probe_timeout_s=30.0)
    trainer_init = {"master_address": "127.0.0.1", "master_port": 29600, "rank_offset": 1}

    async def run() -> None:
        pool = build_ray_fleet(factory, settings, instance_id=uuid.uuid4().hex[:8])
        await pool.start()
        try:
            reps = pool.health().detail["replicas"]
            pids = [r["pid"] for r in reps]
            info = await pool.nccl_describe()
            assert info.inference_ranks == 4 and info.group == "none"
            assert info.replicas == [
                {"replica": 0, "workers": 2, "rank_offset": 1},
                {"replica": 1, "workers": 2, "rank_offset": 3},
            ]
            with pytest.raises(NCCLGroupStale, match="init first"):
                await pool.nccl_update(UPDATE, 1)
            with pytest.raises(ValueError, match="world_size 3 does not match"):
                await pool.nccl_init({**trainer_init, "world_size": 3})

            await pool.nccl_init({**trainer_init, "world_size": 5})
            got = _inits(records)
            assert [got[p]["rank_offset"] for p in pids] == [1, 3]
            assert all(got[p]["world_size"] == 5 for p in pids)
            assert pool.nccl_group_state() == "ok"
            await pool.nccl_update(UPDATE, 1)
            assert pool.policy_version == 1
            assert [r["policy_version"] for r in pool.health().detail["replicas"]] == [1, 1]

            # Replica 1 dies: Ray restarts it, the pool brings it back at the last file
            # weights (the base model, v0) and does not route to it; the group is stale.
            os.kill(pids[1], signal.SIGKILL)

            def restarted() -> bool:
                rep = pool.health().detail["replicas"][1]
                return rep["state"] == "ok" and rep["pid"] != pids[1]

            await _until("replica 1 to come back", restarted)
            assert pool.health().detail["replicas"][1]["policy_version"] == 0
            assert pool.nccl_group_state() == "stale"
            # Waves go to replica 0 only, at the committed version.
            for _ in range(4):
                out = await pool.generate([1, 2, 3], 2, SamplingParams(max_tokens=2))
                assert {c.policy_version for c in out} == {1}
            await asyncio.sleep(3.0)  # probes see it at v0: waiting for NCCL, not recycled
            rep1 = pool.health().detail["replicas"][1]
            assert rep1["state"] == "ok" and rep1["restarts"] == 1
            new_pid = rep1["pid"]

            with pytest.raises(NCCLGroupStale, match="replica 1 restarted"):
                await pool.nccl_update(UPDATE, 2)
            assert pool.policy_version == 1
            assert [r["policy_version"] for r in pool.health().detail["replicas"]] == [1, 0]

            # The trainer forms the group again; the restarted replica joins at its offset.
            await pool.nccl_init({**trainer_init, "world_size": 5})
            got = _inits(records)
            assert got[new_pid]["rank_offset"] == 3 and got[pids[0]]["rank_offset"] == 1
            await pool.nccl_update(UPDATE, 2)
            assert [r["policy_version"] for r in pool.health().detail["replicas"]] == [2, 2]
            await pool.nccl_shutdown()
            assert pool.nccl_group_state() == "none"
        finally:
            await pool.close()

    asyncio.run(run())
