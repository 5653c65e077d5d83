"""Off-policy lag as the trainer gets it: bounded by default, counted in the trainer's
steps, reported for what is delivered, and enforced on what is already buffered. The real
server on the toy model; weights are pushed as a trainer would."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import httpx
import orjson
import pytest
from support import perturbed_file, stream_groups

from bench.common import fixed_groups
from trainer_client.client import SamplerClient
from trainer_client.demo import SEQ_BALANCE
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


def test_prompts_served_again_after_a_restart_reach_the_engine_tokenized(
    make_server: Any, toy: Any
) -> None:
    # A run whose config was saved (any PATCH: the trainer's always does) starts again
    # without fitting max_tokens to its prompts, and so without tokenizing them all. The
    # groups a trainer held are READY again after the restart and too stale for the
    # weights restored: their prompts are served again, before any other. They must
    # reach the engine tokenized, not fail there and be dropped as engine errors.
    server = make_server({**QUICK, "max_staleness": 1})
    weights = perturbed_file(toy.model_dir, 0.0)
    with server.client() as c:
        assert c.patch("/v1/config", json={"temperature": 0.9}).status_code == 200
        held = _lease(c, 2, "trainer")
        for version in (1, 2, 3):
            _push(c, weights, version)
    server.stop()  # SIGTERM: the held groups go back to READY in the store
    server.start()
    with server.client() as c:
        # The held groups were made at v0 and the restored weights are v3: dropped.
        _wait_for("the stale drop", lambda: c.get("/v1/stats").json()["dropped"].get("stale"))
        again: list[dict] = []
        while not {g["prompt_id"] for g in held} <= {g["prompt_id"] for g in again}:
            dropped = c.get("/v1/stats").json()["dropped"]
            assert "engine_error" not in dropped, f"served again, failed in the engine: {dropped}"
            assert len(again) < 48, "the held prompts were not served again"
            got = _lease(c, 4, "trainer", groups_per_step=4)
            _ack(c, got)
            again += got
        stats = c.get("/v1/stats").json()
        assert "engine_error" not in stats["dropped"], stats["dropped"]
        assert not [w for w in stats["warnings"] if w.startswith("engine")], stats["warnings"]


def _collect(url: str, n: int, timeout_s: float, **client_options: Any) -> list[Any]:
    """Up to n groups from a `SamplerClient(url).groups()` that does not ack, whatever
    came by `timeout_s` (a consumer that waits for n before it trains); the client is
    closed after."""
    got: list[Any] = []
    stopped = threading.Event()
    client = SamplerClient(url, **client_options)

    def read() -> None:
        try:
            for group in client.groups():
                got.append(group)
                if len(got) >= n:
                    return
        except Exception:
            if not stopped.is_set():  # closing the client under it ends it
                raise

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    stopped.set()
    client.close()
    reader.join(30)
    return list(got)


def test_a_consumer_that_batches_without_declaring_its_step_is_not_left_waiting(
    make_server: Any,
) -> None:
    # The sampler's default bound (max_staleness 1) and batch_groups 1: a consumer that
    # collects 4 groups before it acks, and says nothing of its step, must get its 4.
    server = make_server(QUICK, base={"max_tokens": 8, "max_active_prompts": 16})
    got = _collect(server.url, 4, timeout_s=90.0, consumer="batcher")
    assert len(got) == 4, f"an undeclared batching consumer got {len(got)} of 4 groups"
    with server.client() as c:
        # Its step is the most it held unacked: 4 (nothing was declared, batch_groups 1).
        assert c.get("/v1/stats").json()["staleness"]["step_groups"] >= 4


def test_admission_says_what_it_waits_on_and_the_client_warns_once(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(QUICK, base={"max_tokens": 8, "max_active_prompts": 16})
    with server.client() as c:
        # Nobody consumes: two steps of one group are made, then admission waits on the bound.
        admission = _wait_for(
            "admission to wait", lambda: c.get("/v1/stats").json()["admission"]["blocked_by"]
        )
        assert admission == "max_staleness"
        stats = c.get("/v1/stats").json()["admission"]
        assert stats["since"] <= time.time() and "max_staleness" in stats["detail"]
    # A consumer that declares a step of 1 but waits for 3 groups before it acks waits
    # forever: the client says so once, naming the bound and the knob.
    with caplog.at_level(logging.WARNING, logger="trainer_client"):
        got = _collect(
            server.url, 3, timeout_s=8.0, consumer="waiter", groups_per_step=1, heartbeat_s=0.3
        )
    assert len(got) == 2
    warnings = [r.getMessage() for r in caplog.records if "max_staleness" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "groups_per_step" in warnings[0]
    # The stream's heartbeats say it too.
    with server.client() as c:
        params = {"consumer": "peek", "groups_per_step": 1}
        with c.stream("GET", "/v1/groups/stream", params=params) as r:
            beat = orjson.loads(next(r.iter_lines()))
    assert beat["type"] == "heartbeat" and beat["admission"]["blocked_by"] == "max_staleness"


def test_a_large_lease_widens_the_step_only_while_its_consumer_is_seen(make_server: Any) -> None:
    server = make_server({**QUICK, "max_staleness": 1, "lease_ttl_s": 3.0, "max_tokens": 4})
    with server.client() as c:
        _wait_for("two groups", lambda: c.get("/v1/stats").json()["queue"]["ready"] >= 2)
        # An evaluation takes what there is, then more as it comes, holding it all.
        held = _lease(c, 2, "eval")
        held += _lease(c, 2, "eval", wait_s=30)
        assert len(held) == 4
        assert c.get("/v1/stats").json()["staleness"]["step_groups"] == 4
        _ack(c, held)
        # Acked and gone for a lease TTL: the step is one frame again.
        _wait_for(
            "the step to decay",
            lambda: c.get("/v1/stats").json()["staleness"]["step_groups"] == 1,
            timeout_s=30,
        )


def test_every_decoded_token_has_one_fate_live(make_server: Any, toy: Any) -> None:
    """decoded = trained + downsampled + waste + pending, where pending is what the
    sampler still holds (prompts sampling, groups not acked): checked once admission has
    settled (the buffer full), and again after a trainer acked some and a lowered
    staleness bound dropped others."""
    config = {**QUICK, "rule": "balanced", "k_pos": 1, "k_neg": 1, "n_max": 8, "wave_size": 4,
              "group_size": 2, "max_buffered_groups": 24, "stopping": "exact"}  # fmt: skip
    server = make_server(config)
    with server.client() as c:

        def settled() -> dict[str, Any] | None:
            stats = c.get("/v1/stats").json()
            queue = stats["queue"]
            quiet = not queue["active_prompts"] and not queue["finalizing"]
            return stats if quiet and stats["admission"]["blocked_by"] else None

        def check(stats: dict[str, Any]) -> dict[str, Any]:
            w = stats["waste"]
            assert w["decoded"] > 0 and w["pending"] == stats["held_tokens"], (w, stats)
            fates = w["trained"] + w["downsampled"] + sum(w["waste"].values()) + w["pending"]
            assert fates == w["decoded"]
            return w

        first = check(_wait_for("a full buffer", settled))
        assert first["waste"]["surplus"] > 0 and first["downsampled"] > 0
        got = _lease(c, 6, "trainer")
        _ack(c, got)
        weights = perturbed_file(toy.model_dir, 0.0)
        _push(c, weights, 1)
        _push(c, weights, 2)
        assert c.patch("/v1/config", json={"max_staleness": 0}).status_code == 200
        later = check(_wait_for("admission to settle again", settled))
        assert later["trained"] > 0 and later["waste"]["stale"] > 0


def _lease_train_push(server: Any, toy: Any, versions: int = 30) -> dict[str, Any]:
    """A trainer that leases a frame of 8, trains briefly, pushes its weights and acks,
    `versions` times; nothing it gets is past the bound (`max_staleness` 1). Returns the
    sampler's /v1/stats."""
    weights = perturbed_file(toy.model_dir, 0.0)
    with server.client() as c:
        for version in range(1, versions + 1):
            got = _lease(c, 8, "trainer", groups_per_step=8)
            assert len(got) == 8, version
            lags = [version - 1 - g["policy_version_min"] for g in got]
            assert max(lags) <= 1, (version, lags)
            time.sleep(0.05)  # the trainer's step
            _push(c, weights, version)
            _ack(c, got)
        return c.get("/v1/stats").json()


#: The demo's sampler (Seq-Balance 2/2, adaptive waves up to 16 answers) under
#: `max_staleness` 1, in frames of 8.
STRAGGLERS = {**SEQ_BALANCE, "max_tokens": 6, "batch_groups": 8, "max_active_prompts": 12,
              "max_staleness": 1}  # fmt: skip


def test_a_straggler_loses_only_its_own_group_and_its_frame_mates_are_delivered(
    make_server: Any, toy: Any
) -> None:
    """The demo's sampler under `max_staleness` 1, hand-outs not held, against a trainer
    that leases a frame of 8, trains briefly, pushes its weights and acks, 30 times: hard
    prompts sample over more than one version and miss the bound. Each such straggler is
    dropped alone; the fresh groups framed with it are framed again and delivered
    (whole-frame drops lost them too). Nothing delivered is past the bound, and the stale
    waste by pass-rate bin adds up to the stale waste, which holds every answer of a
    dropped group (those down-sampling left out too)."""
    server = make_server({**STRAGGLERS, "handout_hold_s": 0})
    stats = _lease_train_push(server, toy)
    splits = [
        (int(m[1]), int(m[2]))
        for m in re.finditer(
            r"dropped (\d+) READY groups .*?; (\d+) fresh groups of their frames are framed",
            server.log_path.read_text(),
        )
    ]
    assert any(dropped and fresh for dropped, fresh in splits), splits
    assert sum(d for d, _ in splits) <= stats["dropped"]["stale"]
    by_bin = stats["waste_by_quartile"]
    assert sum(b["stale"] for b in by_bin.values()) == stats["waste"]["waste"]["stale"] > 0
    # A dropped group's left-out answers moved into the stale waste once, not twice:
    # the fates still add up to what was decoded.
    assert stats["waste"]["pending"] >= 0, stats["waste"]


def test_a_held_hand_out_takes_the_stragglers_the_next_push_would_drop(
    make_server: Any, toy: Any
) -> None:
    """The same sampler and trainer with hand-outs held (`handout_hold_s` auto: 300 s
    under the default `weight_update_mode` wait):
    a lease waits for the prompts still running whose kept answers are a version behind
    the served weights, and frames take the groups the next push would drop first, so theirs go out
    in it, ahead of newer ones. No group is dropped stale (the unheld run above drops some; 30-43 before
    hand-outs were held), nothing delivered is past the bound, and /v1/stats says how
    long hand-outs waited."""
    stats = _lease_train_push(make_server(STRAGGLERS), toy)
    assert stats["dropped"].get("stale", 0) == 0, stats["staleness"]
    assert stats["waste"]["waste"]["stale"] == 0
    assert stats["staleness"]["handout_hold_s"] == 300  # auto, under weight_update_mode wait
    hold = stats["staleness"]["hold"]
    assert set(hold) == {"handouts", "seconds", "late_groups_framed"}
    assert hold["seconds"] <= 30 * hold["handouts"]  # a lease holds no longer than it waits
