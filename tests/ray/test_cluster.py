"""Replicas on a Ray cluster that outlives the sampler: weights to every replica, re-attach.

The test process joins the cluster as a second driver to ask each replica directly what
it serves (greedy answers and their logprobs), which the sampler's API cannot tell apart.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import torch
from ray_helpers import Consumer, wait_for
from safetensors.torch import save
from support import perturbed_file
from transformers import AutoModelForCausalLM

from sampler_service.backends.base import SamplingParams, as_list

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1200)]


def _greedy(sampler: Any, prompt: list[int]) -> list[tuple[list[int], list[float]]]:
    """Each replica's greedy answer to `prompt`, asked of the actor itself."""
    out = []
    for i in range(2):
        actor = ray.get_actor(f"adaptive-rollout/{sampler.instance_id()}/replica-{i}")
        (completion,) = ray.get(
            actor.generate.remote(prompt, 1, SamplingParams(temperature=0.0, max_tokens=6)),
            timeout=300,
        )
        out.append((as_list(completion.token_ids), as_list(completion.logprobs)))
    return out


def _agreed(sampler: Any, prompt: list[int]) -> list[tuple[list[int], list[float]]]:
    """Both replicas' greedy answers to `prompt`, checked to be the same answer."""
    answers = _greedy(sampler, prompt)
    (tokens_a, lp_a), (tokens_b, lp_b) = answers
    assert tokens_a == tokens_b
    assert lp_a == pytest.approx(lp_b, abs=1e-5)
    return answers


def _at_version(sampler: Any, version: int) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        health = sampler.health()
        reps = health["replicas"]
        ok = health["policy_version"] == version and all(
            r["state"] == "ok" and r["policy_version"] == version for r in reps
        )
        return reps if ok else None

    return wait_for(f"both replicas serving v{version}", ready, 600)


def _args(cluster: Any) -> list[str]:
    return ["--replicas", "2", "--ray-address", cluster.address, "--replica-probe-s", "1"]


def test_weights_reach_every_replica(ray_cluster, make_sampler, toy) -> None:
    sampler = make_sampler(_args(ray_cluster))
    with sampler.client() as client:
        consumer = Consumer(client)
        consumer.take(4)
        prompt = next(iter(consumer.groups.values()))["prompt_token_ids"]
        base = _agreed(sampler, prompt)

        r = client.put(
            "/v1/weights", params={"version": 1}, content=perturbed_file(toy.model_dir, 0.05, 0)
        )
        assert r.status_code == 200, r.text
        _at_version(sampler, 1)
        v1 = _agreed(sampler, prompt)
        assert v1[0][1] != pytest.approx(base[0][1], abs=1e-5)  # the weights did change

        # One replica dies in the middle of loading v2 (fault hook): the update still
        # commits, and the dead one comes back at v2.
        pids = [r["pid"] for r in sampler.replicas()]
        ray_cluster.fault_file.touch()
        r = client.put(
            "/v1/weights", params={"version": 2}, content=perturbed_file(toy.model_dir, 0.05, 1)
        )
        assert r.status_code == 200, r.text
        assert not ray_cluster.fault_file.exists()  # the hook fired
        reps = _at_version(sampler, 2)
        assert sum(r["pid"] != p for r, p in zip(reps, pids, strict=True)) == 1
        assert sum(r["restarts"] for r in reps) == 1
        v2 = _agreed(sampler, prompt)
        assert v2[0][1] != pytest.approx(v1[0][1], abs=1e-5)

        # A file with a wrong shape is refused before any replica sees it.
        name, tensor = next(
            iter(AutoModelForCausalLM.from_pretrained(toy.model_dir).state_dict().items())
        )
        bad = save({name: torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:])})
        r = client.put("/v1/weights", params={"version": 3}, content=bad)
        assert r.status_code == 422, r.text
        assert [r["policy_version"] for r in _at_version(sampler, 2)] == [2, 2]
        _agreed(sampler, prompt)
        assert _greedy(sampler, prompt)[0][1] == pytest.approx(v2[0][1], abs=1e-5)

        # Groups keep coming, every sample tagged with the version that made it (groups
        # buffered before the update come first).
        def made_at_v2() -> bool:
            consumer.take(4)
            return any(g["policy_version_min"] == 2 for g in consumer.groups.values())

        wait_for("a group made entirely by v2", made_at_v2, 600, every_s=0.0)
        # A prompt whose waves straddle an update keeps samples of both versions; each is
        # tagged with a committed version and the group's bounds are its samples' bounds.
        for g in consumer.groups.values():
            versions = {s["policy_version"] for s in g["samples"]}
            assert versions <= {0, 1, 2}, versions
            bounds = (g["policy_version_min"], g["policy_version_max"])
            assert bounds == (min(versions), max(versions))


def test_restarted_sampler_reattaches_to_its_replicas(ray_cluster, make_sampler, toy) -> None:
    sampler = make_sampler(_args(ray_cluster), name="front")
    pids = [r["pid"] for r in sampler.replicas()]
    with sampler.client() as client:
        r = client.put(
            "/v1/weights", params={"version": 1}, content=perturbed_file(toy.model_dir, 0.05, 2)
        )
        assert r.status_code == 200, r.text
        consumer = Consumer(client)
        consumer.take(6)
        # Leased, not acked: these must be offered again after the crash.
        r = client.post("/v1/groups/lease", json={"max_groups": 4, "wait_s": 30.0, "consumer": "t"})
        unacked = {g["group_id"] for g in r.json()["groups"]}
        assert unacked
    sampler.kill()  # kill -9: the replicas live on in the cluster
    # ...for --replica-orphan-s (default 600 s), far longer than the restart below takes.

    again = make_sampler(_args(ray_cluster), name="front")
    reps = _at_version(again, 1)
    assert [r["pid"] for r in reps] == pids  # the same warm engines
    assert all(r["restarts"] == 0 for r in reps)
    with again.client() as client:
        consumer = Consumer(client)
        consumer.take(len(unacked) + 4)
    assert unacked <= set(consumer.groups)


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status  # exited, not yet reaped


def test_orphaned_replicas_exit_when_no_sampler_comes_back(ray_cluster, make_sampler) -> None:
    orphan_s = 8.0
    sampler = make_sampler(
        [*_args(ray_cluster), "--replica-orphan-s", str(orphan_s), "--replicas-on-exit", "keep"],
        name="orphan",
    )
    names = [r["name"] for r in sampler.replicas()]
    pids = [r["pid"] for r in sampler.replicas()]
    with sampler.client() as client:
        Consumer(client).take(2)
    # The sampler's probes (every second) keep its replicas alive past the window.
    time.sleep(3 * orphan_s)
    assert [(r["pid"], r["restarts"], r["state"]) for r in sampler.replicas()] == [
        (pid, 0, "ok") for pid in pids
    ]
    assert not any(_gone(pid) for pid in pids)

    sampler.kill()  # kill -9: nobody will call them again
    killed = time.monotonic()
    ceiling_s = 3 * orphan_s + 30
    wait_for("the orphaned replicas to exit", lambda: all(map(_gone, pids)), ceiling_s, 0.2)
    assert time.monotonic() - killed <= ceiling_s

    def unnamed() -> bool:
        for name in names:
            try:
                ray.get_actor(name)
            except ValueError:
                continue
            return False
        return True

    # Exited for good: Ray neither restarts them nor keeps their names.
    wait_for("the replica names to be freed", unnamed, 30)
    time.sleep(2 * orphan_s)
    assert unnamed()

    # Each said why, in its worker log.
    def said_why(pid: int) -> bool:
        for path in ray_cluster.temp_dir.glob(f"session_*/logs/worker-*{pid}.err"):
            if f"(pid {pid}) heard from no sampler" in path.read_text(errors="replace"):
                return True
        return False

    wait_for("each orphan's log line", lambda: all(map(said_why, pids)), 30)


def test_health_degraded_while_no_replica_serves_failed_when_restarts_are_used_up(
    ray_cluster, make_sampler
) -> None:
    sampler = make_sampler([*_args(ray_cluster), "--replica-max-restarts", "1"], name="few")
    url = sampler.url

    def kill_all() -> list[int]:
        pids = [r["pid"] for r in sampler.replicas()]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    old = kill_all()
    # Both restarting: nothing can serve, but something will again.
    wait_for("/health to say degraded", lambda: sampler.health()["status"] == "degraded", 120, 0.05)
    assert httpx.get(f"{url}/ready", timeout=60).status_code == 503
    reps = wait_for(
        "both replicas back",
        lambda: (r := sampler.replicas()) and all(x["state"] == "ok" for x in r) and r,
        600,
    )
    assert all(r["pid"] not in old for r in reps) and all(r["restarts"] == 1 for r in reps)
    assert sampler.health()["status"] == "ok"
    assert httpx.get(f"{url}/ready", timeout=60).status_code == 200

    kill_all()  # a second failure each: no restarts left
    health = wait_for(
        "/health to say engine_failed",
        lambda: (h := sampler.health())["status"] == "engine_failed" and h,
        120,
    )
    assert all(r["state"] == "failed" for r in health["replicas"])
    assert health["engine_error"]
    r = httpx.get(f"{url}/ready", timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
