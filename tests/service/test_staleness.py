"""Off-policy lag as the trainer gets it: bounded by default, counted in the trainer's
steps, reported for what is delivered, and enforced on what is already buffered. The real
server on the toy model; weights are pushed as a trainer would."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from support import perturbed_file, stream_groups

from bench.common import fixed_groups
from trainer_client.client import SamplerClient
from trainer_client.verl.settings import SamplerSettings
from trainer_client.verl.source import GroupSource

pytestmark = pytest.mark.timeout(600)

QUICK = fixed_groups(2)


def _lease(c: httpx.Client, n: int, consumer: str, wait_s: float = 30.0, **params: Any) -> list:
    r = c.post(
        "/v1/groups/lease",
        params=params,
        json={"max_groups": n, "wait_s": wait_s, "consumer": consumer},
    )
    assert r.status_code == 200, r.text
    return r.json()["groups"]


def _ack(c: httpx.Client, groups: list[dict]) -> None:
    r = c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in groups]})
    assert r.status_code == 200, r.text


def _held(c: httpx.Client) -> int:
    """Groups generated and not yet acked: READY + LEASED + not yet framed + in flight."""
    q = c.get("/v1/stats").json()["queue"]
    return q["ready"] + q["leased"] + q["pending"] + q["finalizing"] + q["active_prompts"]


def _wait_for(what: str, check: Any, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.2)
    return value


def _push(c: httpx.Client, weights: bytes, version: int) -> None:
    r = c.put("/v1/weights", params={"version": version}, content=weights)
    assert r.status_code == 200, r.text


def test_by_default_the_sampler_generates_one_step_ahead_of_the_declared_step(
    make_server: Any,
) -> None:
    # The base test config says nothing about staleness: the sampler's default applies.
    server = make_server(QUICK, base={"max_tokens": 8, "max_active_prompts": 16})
    with server.client() as c:
        config = c.get("/v1/config").json()
        assert config["max_staleness"] == 1 and config["max_buffered_groups"] == 256
        # No trainer yet: one frame per step (batch_groups 1), so two groups at most are
        # made on the weights nobody has trained from (not a buffer of 256 at v0).
        _wait_for("the first groups", lambda: c.get("/v1/stats").json()["queue"]["ready"] >= 2)
        time.sleep(2.0)
        assert _held(c) <= 2
        # A consumer that trains on 4 groups a step says so: two steps' worth may be ahead.
        got = _lease(c, 4, "trainer", groups_per_step=4)
        assert c.get("/v1/stats").json()["staleness"]["step_groups"] == 4
        _ack(c, got)
        _wait_for("two steps of groups", lambda: _held(c) >= 8)
        time.sleep(2.0)
        assert _held(c) <= 8
        # The trainers declare theirs: the verl integration on each lease, SamplerClient
        # on its stream (the reference trainer passes its batch size). The largest holds.
        source = GroupSource(SamplerSettings(url=server.url, consumer="verl"))
        try:
            source.ack(source.take(6))
        finally:
            source.close()
        assert c.get("/v1/stats").json()["staleness"]["step_groups"] == 6
        with SamplerClient(server.url, groups_per_step=7) as client:
            stream = client.groups()
            client.ack([next(stream)])
            assert c.get("/v1/stats").json()["staleness"]["step_groups"] == 7
            stream.close()
        # A step larger than the buffer could never fill: refused, naming the parameter.
        r = c.post(
            "/v1/groups/lease",
            params={"groups_per_step": 257},
            json={"max_groups": 1, "wait_s": 0, "consumer": "x"},
        )
        assert r.status_code == 422 and r.json()["error"]["field"] == "groups_per_step", r.text


def test_staleness_is_reported_for_delivered_groups_and_stale_frames_are_dropped(
    make_server: Any, toy: Any
) -> None:
    # Unbounded buffering at first, as a run with max_staleness null: frames made at v0.
    server = make_server({**QUICK, "max_staleness": None})
    weights = perturbed_file(toy.model_dir, 0.0)
    with server.client() as c:
        _wait_for("a buffer at v0", lambda: c.get("/v1/stats").json()["queue"]["ready"] >= 16)
        # Nothing was pushed yet, so everything READY now was made at v0.
        ready_at_v0 = c.get("/v1/stats").json()["queue"]["ready"]
        for version in (1, 2, 3):
            _push(c, weights, version)
        # Delivered three versions after they were made: the figures say 3, not 0.
        fresh = _lease(c, 2, "trainer", wait_s=0)
        assert [g["policy_version_min"] for g in fresh] == [0, 0]
        staleness = c.get("/v1/stats").json()["staleness"]
        assert (staleness["last"], staleness["max"], staleness["mean"]) == (3, 3, 3.0)
        assert staleness["histogram"] == {"3": 2}
        metrics = c.get("/metrics").text
        assert "adaptive_rollout_staleness 3.0" in metrics
        assert 'adaptive_rollout_delivered_staleness_bucket{le="3.0"} 2.0' in metrics
        _ack(c, fresh)
        # Groups a trainer took and gave back (its stream ended) are READY again.
        taken = stream_groups(c, 4, consumer="gone")

        # Lowering the bound applies to what is buffered: READY frames over it are dropped
        # whole, counted as `stale`, and their prompts are generated again, first. The
        # groups made at v0 are all still READY but the two acked above (the stream gave
        # its four back); frames made at v3 since then are within the bound and stay.
        r = c.patch("/v1/config", json={"max_staleness": 1})
        assert r.status_code == 200, r.text
        stats = c.get("/v1/stats").json()
        assert stats["dropped"]["stale"] == stats["staleness"]["dropped_stale"] >= ready_at_v0 - 2
        # (What is READY by now was made at v3 after the drop: the leases below check that
        # nothing older than the bound is ever handed out.)
        assert 'adaptive_rollout_groups_dropped_total{reason="stale"} ' in c.get("/metrics").text
        again: list[dict] = []
        while not {g["prompt_id"] for g in taken} <= {g["prompt_id"] for g in again}:
            # Within the prompts in flight at the drop and the ones served again (the
            # next epoch of any domain is further off than this).
            assert len(again) < 48, "the dropped prompts were not served again"
            got = _lease(c, 8, "trainer", groups_per_step=8)
            assert all(3 - g["policy_version_min"] <= 1 for g in got)
            _ack(c, got)
            again += got
        # At each weight update, what is READY then is checked again.
        _wait_for("a frame at v3", lambda: c.get("/v1/stats").json()["queue"]["ready"] >= 1)
        before = c.get("/v1/stats").json()["dropped"]["stale"]
        for version in (4, 5):
            _push(c, weights, version)
        assert c.get("/v1/stats").json()["dropped"]["stale"] > before
        assert all(5 - g["policy_version_min"] <= 1 for g in _lease(c, 8, "trainer", wait_s=0))


def test_groups_given_back_after_the_bound_was_lowered_are_checked_before_they_are_handed_out(
    make_server: Any, toy: Any
) -> None:
    # A stream holds groups made at v0 while the weights move on and the bound is lowered:
    # held groups are not dropped (the consumer may be training on them), but once given
    # back they are over the bound, and no lease may hand them out again.
    server = make_server({**QUICK, "max_staleness": None})
    weights = perturbed_file(toy.model_dir, 0.0)
    with server.client() as c, SamplerClient(server.url, consumer="holder") as holder:
        stream = holder.groups()
        held = [next(stream) for _ in range(4)]
        assert {g.policy_version_min for g in held} == {0}
        for version in (1, 2, 3):
            _push(c, weights, version)
        r = c.patch("/v1/config", json={"max_staleness": 1})
        assert r.status_code == 200, r.text
        before = c.get("/v1/stats").json()["dropped"]["stale"]
        stream.close()
        _wait_for("the held groups back", lambda: c.get("/v1/stats").json()["queue"]["leased"] == 0)
        got = _lease(c, 16, "trainer", groups_per_step=8)
        assert got and all(3 - g["policy_version_min"] <= 1 for g in got)
        assert not {g["group_id"] for g in got} & {g.group_id for g in held}
        assert c.get("/v1/stats").json()["dropped"]["stale"] >= before + len(held)
