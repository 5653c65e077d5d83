"""Episodes on two hf replicas (`serve --replicas 2`): a replica killed during a later turn.

The environment (`episode_envs.held_retell`, three turns) holds every episode between its
first and second turn until the test opens a gate file. Once every episode of the two
prompts admitted waits there, no wave is in flight: the test stops both replicas
(SIGSTOP) and opens the gate, so the waves then in flight are second turns, and they
stay in flight. It kills a replica holding some of them (SIGKILL) and resumes the other.
The pool must re-issue each of those turns whole to the live replica while the episodes
keep their first turn and environment (they live in the sampler): each episode finishes
once, with its three turns, and no turn is counted twice. Timing decides nothing here.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from ray_helpers import ENV, ROOT, Consumer, check_conservation, quiesce, wait_for
from support import rows_with, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

HELD = "python:episode_envs:held_retell"
#: Episodes per prompt: one wave of four, one group of four.
EPISODES = 4
PROMPTS = 2
CONFIG: dict[str, Any] = {
    "rule": "fixed",
    "n_max": EPISODES,
    "wave_size": EPISODES,
    "group_size": EPISODES,
    "max_active_prompts": PROMPTS,
    "max_buffered_groups": 6,
    # The held episodes wait on the test, not on a tool that hangs; a turn of at most 8
    # tokens leaves every episode room for its three turns in the toy's context.
    "episode": {"env_timeout_s": 600.0, "max_tokens_per_turn": 8},
}


def _runs(mask: list[int]) -> list[int]:
    """One value per run of equal values: [1, 0, 1] for 1 1 0 0 0 1."""
    return [v for i, v in enumerate(mask) if i == 0 or mask[i - 1] != v]


def _check_episode(sample: dict[str, Any], equals: int) -> None:
    """Three sampled turns (mask 1) around two observations (mask 0, logprob 0.0), each
    observation ending with "=" as `Retell` writes them."""
    mask, ids, logprobs = sample["loss_mask"], sample["response_token_ids"], sample["logprobs"]
    assert sample["num_turns"] == 3
    assert len(mask) == len(ids) == len(logprobs)
    assert _runs(mask) == [1, 0, 1, 0, 1], mask
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
    ends = [ids[i] for i in range(len(mask) - 1) if (mask[i], mask[i + 1]) == (0, 1)]
    assert ends == [equals, equals], (ids, mask)


def test_a_replica_killed_in_a_later_turn_reissues_that_turn(
    make_sampler: Any, toy: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    rows = rows_with(toy.data_files[1], env=HELD, metadata={"gate": str(gate)})
    sampler = make_sampler(
        ["--replicas", "2", "--replica-probe-timeout-s", "600"],
        CONFIG,
        data=[write_jsonl(tmp_path / "held.jsonl", rows)],
        # The sampler imports the environment from tests/service.
        env={"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "service"), ENV["PYTHONPATH"]])},
    )
    held = PROMPTS * EPISODES

    def waiting() -> bool:
        idle = all(r["inflight_samples"] == 0 for r in sampler.replicas())
        return idle and len(list(gate.glob("held-*"))) == held

    wait_for(f"{held} episodes held after their first turn", waiting, 600)
    pids = [r["pid"] for r in sampler.replicas()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        (gate / "open").touch()

        def second_turns() -> list[dict[str, Any]] | None:
            reps = sampler.replicas()
            return reps if sum(r["inflight_samples"] for r in reps) == held else None

        reps = wait_for("every second turn in flight", second_turns, 300)
        victim = max(reps, key=lambda r: r["inflight_samples"])
        os.kill(victim["pid"], signal.SIGKILL)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    with sampler.client() as client:
        consumer = Consumer(client, features="loss_mask")
        consumer.take(6)  # the two held prompts' groups and four more
    stats = quiesce(sampler)

    # Each second turn the dead replica held was re-issued once, and nothing else was.
    lost = victim["inflight_samples"]
    assert sampler.metric("replica_reissued_waves_total", replica=str(victim["replica"])) == lost
    assert sampler.metric("replica_reissued_waves_total") == lost
    # Each group delivered once, each episode whole.
    assert consumer.deliveries == len(consumer.groups) == 6
    for group in consumer.groups.values():
        assert len(group["samples"]) == group["stats"]["n_generated"] == EPISODES
        for sample in group["samples"]:
            _check_episode(sample, equals=group["prompt_token_ids"][-1])
    # Each episode counted once, and each turn a replica answered is in exactly one of them:
    # had a lost turn been answered twice, or an episode restarted, replicas would have
    # generated more tokens than the episodes hold.
    check_conservation(stats)
    assert not stats["dropped"], stats["dropped"]
    episodes = stats["episodes"]
    assert episodes["episodes"] == stats["samples"] >= 6 * EPISODES
    assert episodes["turns"] == {"3": episodes["episodes"]} and episodes["env_errors"] == 0
    assert sampler.metric("replica_generated_tokens_total") == episodes["model_tokens"]
