"""Two hf replicas on a local Ray (`serve --replicas 2`): a killed and a hung replica.

One sampler, one run: groups obey the rule throughout; a replica killed with SIGKILL
mid-run and another stopped with SIGSTOP are failed over, their waves re-issued whole,
and both come back; at the end every admitted prompt and every sample is accounted for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import pytest
from ray_helpers import (
    BASE_CONFIG,
    Consumer,
    check_conservation,
    check_group_rules,
    quiesce,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1500)]

PROBE_S = 1.0
PROBE_TIMEOUT_S = 10.0


def _busy_replica(sampler: Any, consumer: Consumer, skip: int | None = None) -> dict[str, Any]:
    """A replica with waves in flight right now (so its death loses some).

    Each try takes a group first: its ack makes room, so new prompts are admitted.
    """

    def busy() -> dict[str, Any] | None:
        consumer.take(1)
        for rep in sampler.replicas():
            if rep["state"] == "ok" and rep["inflight_samples"] > 0 and rep["replica"] != skip:
                return rep
        return None

    return wait_for("a replica with waves in flight", busy, 300, every_s=0.0)


def _back(sampler: Any, index: int, old_pid: int) -> dict[str, Any]:
    def back() -> dict[str, Any] | None:
        health = sampler.health()
        rep = health["replicas"][index]
        ok = rep["state"] == "ok" and rep["pid"] != old_pid
        return rep if ok and rep["policy_version"] == health["policy_version"] else None

    return wait_for(f"replica {index} to come back", back, 600)


def test_kill_and_hang_of_a_replica_lose_nothing(make_sampler) -> None:
    sampler = make_sampler(
        [
            "--replicas",
            "2",
            "--replica-probe-s",
            str(PROBE_S),
            "--replica-probe-timeout-s",
            str(PROBE_TIMEOUT_S),
        ]
    )
    assert sampler.health()["status"] == "ok"
    assert len({r["pid"] for r in sampler.replicas()}) == 2
    with sampler.client() as client:
        consumer = Consumer(client)
        consumer.take(20)

        # kill -9 one replica while it has waves in flight.
        victim = _busy_replica(sampler, consumer)
        os.kill(victim["pid"], signal.SIGKILL)
        consumer.take(80)
        back = _back(sampler, victim["replica"], victim["pid"])
        assert back["restarts"] == 1
        assert sampler.metric("replica_reissued_waves_total", replica=str(victim["replica"])) >= 1

        # SIGSTOP the other: only the health probe can tell it hangs.
        hung = _busy_replica(sampler, consumer, skip=victim["replica"])
        os.kill(hung["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(
                "the hung replica to be failed over",
                lambda: sampler.replicas()[hung["replica"]]["state"] != "ok",
                3 * (PROBE_TIMEOUT_S + PROBE_S) + 30,
                every_s=0.2,
            )
            assert time.monotonic() - stopped <= 3 * (PROBE_TIMEOUT_S + PROBE_S) + 30
            consumer.take(20)
        finally:
            # Ray kills the stopped process; resume it if it somehow lives on.
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung["pid"], signal.SIGCONT)
        _back(sampler, hung["replica"], hung["pid"])
        reissued_hung = sampler.metric(
            "replica_reissued_waves_total", replica=str(hung["replica"]), reason="hung"
        )
        assert reissued_hung >= 1

    # Each group delivered once to a consumer that acks; every group follows the rule.
    assert consumer.deliveries == len(consumer.groups) >= 120
    for group in consumer.groups.values():
        check_group_rules(group, BASE_CONFIG)
    stats = quiesce(sampler)
    assert "engine_error" not in stats["dropped"], stats["dropped"]
    check_conservation(stats)
    # What replicas returned is what the scheduler counted as decoded (the answers it
    # verified, and the surplus ones it cancelled or discarded): no wave counted twice.
    decoded = stats["waste"]["decoded"]
    assert sampler.metric("replica_generated_tokens_total") == decoded >= stats["tokens"]
    reissued = sampler.metric("replica_reissued_waves_total")
    wasted = sampler.metric("replica_wasted_samples_total")
    assert reissued >= 2 and wasted >= reissued
    assert sampler.health()["status"] == "ok"
    # The event log tells each replica's way down and back up.
    with sampler.client() as http:
        events = http.get("/v1/events", params={"limit": 10000}).json()["events"]
    for rep in (victim, hung):
        changes = [
            (e["data"]["previous"], e["data"]["state"])
            for e in events
            if e["kind"] == "replica" and e["data"]["replica"] == rep["replica"]
        ]
        assert any(old == "ok" and new != "ok" for old, new in changes), changes
        assert changes and changes[-1][1] == "ok", changes
