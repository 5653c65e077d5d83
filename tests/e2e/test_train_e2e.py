"""Sampler and trainer as two processes over loopback HTTP: weights flow back, acks land,
and `adaptive-rollout train` with stderr piped to a file draws its progress bar a few
times, not once per step (a log of tens of KB of redrawn bars)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time

import pytest
import torch
from support import train_command
from transformers import AutoModelForCausalLM

from bench.common import fixed_groups
from trainer_client.batch import collate
from trainer_client.client import SamplerClient
from trainer_client.grpo import token_logprobs
from trainer_client.launch import SamplerProcess

pytestmark = pytest.mark.timeout(600)

TEMPERATURE = 0.9  # not 1, so a trainer that ignored the sampler's temperature would show
STEPS = 3
PIPED_STEPS = 12
#: A piped log gets at most one bar per this many seconds (plus the first and last).
PIPED_INTERVAL_S = 30.0


def max_logprob_gap(model, groups) -> float:
    """Max |trainer logprob - sampler logprob| over the response tokens of `groups`."""
    batch = collate(groups, pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(
            model, batch.input_ids, batch.attention_mask, torch.full((batch.size,), TEMPERATURE)
        )
    mask = batch.response_mask.bool()
    return (lp[mask] - batch.behaviour_logprobs[mask]).abs().max().item()


def lease_until(client: SamplerClient, want, n: int, timeout_s: float = 120.0):
    """Lease (and ack) groups until `n` satisfy `want`; returns (matching, all leased ids)."""
    found, seen = [], set()
    deadline = time.monotonic() + timeout_s
    while len(found) < n:
        assert time.monotonic() < deadline, (
            f"only {len(found)} of {n} wanted groups in {timeout_s}s"
        )
        lease = client.lease(max_groups=8, wait_s=10.0)
        client.ack(lease.groups)
        seen.update(g.group_id for g in lease.groups)
        found += [g for g in lease.groups if want(g)]
    return found, seen


def test_trainer_process_pushes_weights_the_sampler_serves_and_acks_what_it_used(
    toy, tmp_path
) -> None:
    config = {
        "rule": "fixed",
        "group_size": 4,
        "n_max": 4,
        "wave_size": 4,
        "advantage": "grpo",
        "temperature": TEMPERATURE,
        "max_tokens": 6,
        "max_active_prompts": 8,
        "max_buffered_groups": 8,
    }
    sampler = SamplerProcess(
        toy.model_dir,
        toy.data_files,
        tmp_path / "state",
        config,
        tmp_path / "sampler.log",
        heartbeat_s=0.5,
    )
    base = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32).eval()
    with sampler, SamplerClient(sampler.url, consumer="probe", watchdog_s=60) as client:
        # Before: the sampler's logprobs are the base model's (so the comparison below means something).
        before, _ = lease_until(client, lambda g: g.policy_version_max == 0, 2)
        gap = max_logprob_gap(base, before)
        assert gap < 1e-4, gap

        run = tmp_path / "run"

        def train(model, out, steps: int) -> None:
            """`adaptive-rollout train` as its own process, against the sampler."""
            cmd = train_command(
                sampler.url, model, out, steps,
                "--lr", "3e-3", "--consumer", "e2e-trainer", "--no-progress",
            )  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stdout + done.stderr

        train(toy.model_dir, run, STEPS)

        # The policy version rose with every push.
        assert client.health().policy_version == STEPS
        log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        assert [r["policy_version"] for r in log] == list(range(1, STEPS + 1))
        used = {gid for r in log for gid in r["group_ids"]}
        assert (
            len(used) == sum(r["groups"] for r in log) == sum(r["acked"] for r in log) >= 4 * STEPS
        )
        assert all(r["version_lag_max"] <= 2 for r in log)

        # After: samples made with the last version are scored by the trainer's final weights,
        # not by the base model: the sampler's logprob of the same tokens changed.
        after, leased = lease_until(client, lambda g: g.policy_version_min == STEPS, 2)
        final = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval()
        gaps = {
            "final vs sampler after": max_logprob_gap(final, after),
            "base vs sampler after": max_logprob_gap(base, after),
            # a fixed answer the sampler gave before training now gets another logprob
            "final vs sampler before": max_logprob_gap(final, before),
        }
        print(f"logprob gaps: before/base {gap:.2e}", {k: f"{v:.2e}" for k, v in gaps.items()})
        assert gaps["final vs sampler after"] < 1e-4, gaps
        assert gaps["base vs sampler after"] > 1e-3, gaps
        assert gaps["final vs sampler before"] > 1e-3, gaps

        # Every group the trainer used was acked: none comes back (redeliveries come first).
        assert not used & leased
        offered = client.lease(max_groups=64, wait_s=2.0).groups
        assert not used & {g.group_id for g in offered}
        client.ack(offered)  # leased groups count against the buffer the next trainer needs

        # Resuming from the final checkpoint goes on from its step and policy version
        # (a restarted trainer must not push a version the sampler already has: 409).
        resumed = tmp_path / "resumed"
        train(run / "final", resumed, STEPS + 2)
        log = [json.loads(line) for line in (resumed / "train_log.jsonl").read_text().splitlines()]
        assert [(r["step"], r["policy_version"]) for r in log] == [
            (STEPS + 1, STEPS + 1),
            (STEPS + 2, STEPS + 2),
        ]
        assert client.health().policy_version == STEPS + 2
        state = json.loads((resumed / "final" / "trainer_state.json").read_text())
        assert (state["step"], state["policy_version"]) == (STEPS + 2, STEPS + 2)


def test_a_piped_progress_bar_draws_a_few_frames_not_one_per_step(
    make_server, toy, tmp_path
) -> None:
    server = make_server(fixed_groups(2, max_tokens=4))
    stderr = tmp_path / "train.err"
    cmd = train_command(server.url, toy.model_dir, tmp_path / "run", PIPED_STEPS)
    started = time.monotonic()
    with stderr.open("w") as err:
        done = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=3 * 240 + 30
        )
    wall_s = time.monotonic() - started
    text = stderr.read_text()
    assert done.returncode == 0, done.stdout + text
    # A frame is one draw of the bar: "\r"-separated on a terminal, one line in a file.
    frames = [f for f in re.split(r"[\r\n]", text) if f.startswith("train:")]
    assert frames, text  # the bar is on (stderr is no terminal, progress is not disabled)
    assert f"{PIPED_STEPS}/{PIPED_STEPS}" in frames[-1], frames[-1]
    # The first and the closing draw, plus one per interval the run lasted.
    assert len(frames) <= 2 + math.ceil(wall_s / PIPED_INTERVAL_S), frames
