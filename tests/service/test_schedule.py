"""Config schedules and the event log: validation, application during a toy run, and
crash safety (a kill -9 and restart never applies a step twice)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_service.config import ConfigError, check_consistency, validate_config
from sampler_service.store import EVENTS_KEPT, Store

pytestmark = pytest.mark.timeout(600)

DOMAINS = ["add", "mul"]


def step(at: dict[str, int], **knobs: Any) -> dict[str, Any]:
    return {"at": at, "set": knobs}


def schedule_error(schedule: list[dict[str, Any]], **base: Any) -> str | None:
    """The field a config with this schedule is refused for, or None if it is accepted."""
    try:
        check_consistency(validate_config({**base, "schedule": schedule}), DOMAINS)
    except ConfigError as exc:
        return exc.field
    return None


def test_schedule_validation_names_the_step() -> None:
    tg = {"trained_groups": 10}
    assert schedule_error([step(tg, k_pos=1), step({"trained_groups": 20}, k_pos=4)]) is None
    # Steps apply on top of each other: n_max 8 first, then k_pos 8 breaks k_pos + k_neg <= n_max.
    assert (
        schedule_error([step(tg, n_max=8), step({"trained_groups": 20}, k_pos=8)])
        == "schedule[1].set.k_pos"
    )
    assert schedule_error([step(tg, k_pos=-1)]) == "schedule[0].set.k_pos"
    assert schedule_error([step(tg, no_such_knob=1)]) == "schedule[0].set.no_such_knob"
    assert schedule_error([step(tg, config_version=3)]) == "schedule[0].set.config_version"
    assert schedule_error([step(tg, schedule=[])]) == "schedule[0].set.schedule"
    assert schedule_error([step(tg, k_pos=1), step(tg, k_pos=2)]) == "schedule[1].at.trained_groups"
    assert (
        schedule_error([step(tg, k_pos=1), step({"policy_version": 20}, k_pos=2)])
        == "schedule[1].at.policy_version"
    )
    assert schedule_error([{"at": {}, "set": {"k_pos": 1}}]) == "schedule[0].at"
    assert schedule_error([{"at": tg, "set": {}}]) == "schedule[0].set"


def test_shipped_example_schedule_is_valid() -> None:
    example = json.loads((Path(__file__).parents[2] / "docs" / "k_schedule.json").read_text())
    cfg = validate_config(example)
    check_consistency(cfg, DOMAINS)
    assert [s.set["k_pos"] for s in cfg.schedule] == [4, 8]


def test_event_log_is_bounded_and_ordered(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", None)
    try:
        for i in range(EVENTS_KEPT + 5):
            store.add_event("config", "api", {"i": i})
        events = store.events(0, EVENTS_KEPT + 100)
        assert len(events) == EVENTS_KEPT
        assert [e["data"]["i"] for e in events[:2]] == [5, 6]
        assert store.last_event_seq() == EVENTS_KEPT + 5 == events[-1]["seq"]
        assert [e["seq"] for e in store.events(EVENTS_KEPT + 3, 10)] == [
            EVENTS_KEPT + 4,
            EVENTS_KEPT + 5,
        ]
        store.add_event("weights", "api", {"version": 1}, {"weights": {"version": 1}})
        assert store.get("weights") == {"version": 1}
    finally:
        store.close()


def _ack_until(c: httpx.Client, trained: int) -> None:
    """Lease and ack groups one at a time until `trained` groups were acked in all."""
    while (done := c.get("/v1/stats").json()["trained_groups"]) < trained:
        r = c.post("/v1/groups/lease", json={"max_groups": 1, "wait_s": 60, "consumer": "t"})
        assert r.status_code == 200, r.text
        groups = r.json()["groups"]
        assert len(groups) <= trained - done  # batch_groups 1: one group per frame
        c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in groups]})


def _config_events(c: httpx.Client) -> list[dict[str, Any]]:
    events = c.get("/v1/events", params={"since": 0}).json()["events"]
    return [e for e in events if e["kind"] == "config"]


def test_schedule_on_trained_groups_survives_kill(make_server: Any) -> None:
    schedule = [step({"trained_groups": 2}, k_pos=1), step({"trained_groups": 4}, k_pos=3)]
    server = make_server({"schedule": schedule})
    with server.client() as c:
        bad = c.patch("/v1/config", json={"schedule": [step({"trained_groups": 1}, k_pos=99)]})
        assert bad.status_code == 422
        assert bad.json()["error"]["field"] == "schedule[0].set.k_pos"
        assert c.get("/v1/config").json()["config_version"] == 0

        _ack_until(c, 1)
        assert c.get("/v1/config").json()["k_pos"] == 2
        _ack_until(c, 2)
        cfg = c.get("/v1/config").json()
        assert (cfg["k_pos"], cfg["config_version"]) == (1, 1)
        _ack_until(c, 4)
        cfg = c.get("/v1/config").json()
        assert (cfg["k_pos"], cfg["config_version"]) == (3, 2)
        stats = c.get("/v1/stats").json()
        assert stats["schedule"] == {"steps": 2, "applied": 2}
        assert stats["rates"]["window_s"] > 0 and stats["rates"]["samples_per_s"] > 0
        assert stats["staleness"]["last"] == 0 and stats["staleness"]["max_staleness"] is None

    server.kill()
    server = make_server({"schedule": schedule})
    with server.client() as c:
        cfg = c.get("/v1/config").json()
        assert (cfg["k_pos"], cfg["config_version"]) == (3, 2)
        _ack_until(c, 5)
        assert c.get("/v1/config").json()["config_version"] == 2
        events = _config_events(c)
        assert [(e["source"], e["data"]["step"], e["data"]["diff"]) for e in events] == [
            ("schedule", 0, {"k_pos": [2, 1]}),
            ("schedule", 1, {"k_pos": [1, 3]}),
        ]
        assert [e["data"]["config_version"] for e in events] == [1, 2]


def test_schedule_replaced_and_keyed_on_policy_version(make_server: Any, toy: Any) -> None:
    server = make_server()
    with server.client() as c:
        _ack_until(c, 1)
        # A new schedule applies at once every step whose condition already holds.
        r = c.patch(
            "/v1/config",
            json={
                "config_version": 0,
                "schedule": [
                    step({"trained_groups": 1}, k_neg=1),
                    step({"trained_groups": 9}, k_neg=3),
                ],
            },
        )
        assert r.status_code == 200, r.text
        assert (r.json()["k_neg"], r.json()["config_version"]) == (1, 2)
        stale = c.patch("/v1/config", json={"config_version": 0, "k_pos": 3})
        assert stale.status_code == 409
        assert stale.json()["error"]["field"] == "config_version"

        r = c.patch("/v1/config", json={"schedule": [step({"policy_version": 1}, n_max=16)]})
        assert (r.json()["n_max"], r.json()["config_version"]) == (32, 3)
        weights = toy.model_dir / "model.safetensors"
        put = c.put("/v1/weights", params={"version": 1}, content=weights.read_bytes())
        assert put.status_code == 200, put.text
        cfg = c.get("/v1/config").json()
        assert (cfg["n_max"], cfg["config_version"]) == (16, 4)

        log = c.get("/v1/events", params={"since": 0}).json()
        kinds = [(e["kind"], e["source"]) for e in log["events"]]
        assert kinds == [
            ("config", "api"),
            ("config", "schedule"),
            ("config", "api"),
            ("weights", "api"),
            ("config", "schedule"),
        ]
        assert log["events"][3]["data"]["version"] == 1
        assert log["events"][3]["data"]["transport"] == "upload"
        assert log["events"][4]["data"]["diff"] == {"n_max": [32, 16]}
        assert log["last_seq"] == log["events"][-1]["seq"]
        later = c.get("/v1/events", params={"since": log["events"][2]["seq"], "limit": 1}).json()
        assert [e["kind"] for e in later["events"]] == ["weights"]
        assert c.get("/v1/events", params={"since": -1}).status_code == 422
