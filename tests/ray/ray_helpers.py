"""Helpers of the Ray suite: a sampler subprocess with replicas, a consumer, the checks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from trainer_client.launch import SamplerProcess

ROOT = Path(__file__).resolve().parents[2]
#: Small prompts, short answers: a wave of the toy model takes milliseconds.
BASE_CONFIG: dict[str, Any] = {
    "max_tokens": 8,
    "rule": "balanced",
    "k_pos": 2,
    "k_neg": 2,
    "n_max": 32,
    "wave_size": 8,
    "group_size": 4,
    "max_active_prompts": 8,
    "max_buffered_groups": 24,
    # The tests take groups without training on them: nothing to bound.
    "max_staleness": None,
}
ENV = {
    "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    "RAY_USAGE_STATS_ENABLED": "0",
    "OMP_NUM_THREADS": "1",
}


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


class Sampler(SamplerProcess):
    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0)

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=60.0).json()

    def replicas(self) -> list[dict[str, Any]]:
        return self.health()["replicas"]

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/stats", timeout=60.0).json()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of one metric whose labels include `labels`."""
        text = httpx.get(f"{self.url}/metrics", timeout=60.0).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(f"adaptive_rollout_{name}"):
                continue
            series, _, value = line.rpartition(" ")
            head, _, label_text = series.partition("{")
            if head != f"adaptive_rollout_{name}":
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total

    def instance_id(self) -> str:
        return (self.state_dir / "instance_id").read_text().strip()


class Consumer:
    """Leases and acks groups, deduplicating by group id as a trainer does.

    `features`: what it declares on each lease (`loss_mask` to be given episodes)."""

    def __init__(self, client: httpx.Client, features: str | None = None) -> None:
        self.client = client
        self.params = {"features": features} if features else {}
        self.groups: dict[str, dict[str, Any]] = {}
        self.deliveries = 0

    def take(self, n: int, timeout_s: float = 600.0) -> None:
        """Lease and ack until n more distinct groups arrived."""
        target = len(self.groups) + n
        deadline = time.monotonic() + timeout_s
        while len(self.groups) < target:
            assert time.monotonic() < deadline, f"{timeout_s:.0f}s without {n} groups"
            r = self.client.post(
                "/v1/groups/lease",
                params=self.params,
                json={"max_groups": target - len(self.groups), "wait_s": 5.0, "consumer": "t"},
            )
            assert r.status_code == 200, r.text
            got = r.json()["groups"]
            if not got:
                continue
            r = self.client.post(
                "/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]}
            )
            assert r.status_code == 200, r.text
            self.deliveries += len(got)
            for g in got:
                self.groups.setdefault(g["group_id"], g)


def check_group_rules(group: dict[str, Any], config: dict[str, Any]) -> None:
    """A balanced-rule group as the scheduler must form it, whichever replica answered."""
    st = group["stats"]
    assert st["n_pos"] + st["n_neg"] == st["n_generated"], group["group_id"]
    assert 0 < st["n_generated"] <= config["n_max"]
    if group["stop_reason"] == "rule":
        assert st["n_pos"] >= config["k_pos"] and st["n_neg"] >= config["k_neg"]
    else:
        assert group["stop_reason"] == "n_max" and st["n_generated"] == config["n_max"]
    assert 2 <= len(group["samples"]) <= config["group_size"]
    versions = {s["policy_version"] for s in group["samples"]}
    assert min(versions) == group["policy_version_min"]
    assert max(versions) == group["policy_version_max"]


def quiesce(sampler: Sampler, timeout_s: float = 300.0) -> dict[str, Any]:
    """Stats once nothing is generating (the buffer is full, so admission has stopped)."""

    def idle() -> dict[str, Any] | None:
        first = sampler.stats()
        q = first["queue"]
        if q["active_prompts"] or q["finalizing"]:
            return None
        time.sleep(1.0)
        second = sampler.stats()
        return second if second["samples"] == first["samples"] else None

    return wait_for("the sampler to stop generating", idle, timeout_s)


def check_conservation(stats: dict[str, Any]) -> None:
    """Every admitted prompt is accounted for, every verified sample belongs to one."""
    admitted = sum(d["admitted"] for d in stats["domains"].values())
    dropped = sum(stats["dropped"].values())
    q = stats["queue"]
    assert admitted == stats["groups_emitted"] + dropped + q["active_prompts"] + q["finalizing"]
    finished = sum(int(k) * v for k, v in stats["samples_per_group"].items())
    assert stats["samples"] == finished, (stats["samples"], finished)
