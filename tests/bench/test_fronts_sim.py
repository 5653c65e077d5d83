"""Several fronts sharing one prompt set and one trainer (bench/scaleout.py, simulated
time): shards partition the prompts, and the staleness bound holds only when each front's
batch is the trainer's batch divided among the fronts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import scaleout, virtual_clock


def test_shards_split_the_prompts_once_each_and_stably() -> None:
    ids = [f"p{i}" for i in range(1000)]
    owners = [scaleout.shard_of(pid, 4) for pid in ids]
    assert set(owners) == {0, 1, 2, 3}
    assert owners == [scaleout.shard_of(pid, 4) for pid in ids]  # stable across calls
    assert all(150 < owners.count(i) < 350 for i in range(4))


def test_the_staleness_bound_holds_across_fronts_only_with_a_shared_batch(tmp_path: Path) -> None:
    def run(batch_groups: int) -> dict:
        return virtual_clock.run(
            scaleout.simulate_fronts(tmp_path, 2, batch_groups, 1.0, steps=4, warmup=1)
        )

    shared = run(scaleout.FRONT_BATCH // 2)
    assert shared["max_lag"] <= 1 and shared["beyond_bound_share"] == 0.0
    assert sum(shared["front_shares"]) == pytest.approx(1.0)
    whole = run(scaleout.FRONT_BATCH)  # each front framing the trainer's whole batch
    assert whole["max_lag"] > 1 and whole["beyond_bound_share"] > 0.5
