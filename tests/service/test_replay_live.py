"""Replay through the running service: once a prompt was solved, a later all-wrong group
of it carries one earlier right answer (flagged, with its own version and logprobs); the
knob is live, validated (422 naming the field) and persisted with the store; consumers
must declare the `replayed` feature, and a stream that did not is ended when replay is
switched on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from support import rows_with, write_jsonl

pytestmark = pytest.mark.timeout(300)

#: Two answers a group, so a prompt the toy model solves about half the time gives
#: all-wrong groups often and right answers to replay often.
CONFIG = {"rule": "fixed", "n_max": 2, "wave_size": 2, "group_size": 2, "advantage": "grpo"}
REPLAY = {"per_prompt": 2, "max_version_lag": 4}


def _lease(c: httpx.Client, n: int, features: str | None) -> httpx.Response:
    return c.post(
        "/v1/groups/lease",
        params={"features": features} if features else {},
        json={"max_groups": n, "wait_s": 30, "consumer": "trainer"},
    )


def _ack(c: httpx.Client, groups: list[dict[str, Any]]) -> None:
    r = c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in groups]})
    assert r.status_code == 200, r.text


#: Exact stopping with a rule asked at the second answer (Seq-Balance 1/1 within n_max
#: 2): the same groups of two, counted in index order as the answers finish.
COUNTED = {"rule": "balanced", "k_pos": 1, "k_neg": 1, "stopping": "exact"}


# Counting in order, the default engine process streams each answer as it finishes, as
# packed arrays, and the replay store saves them in the write that stores the groups.
@pytest.mark.parametrize(
    ("knobs", "engine"), [({"stopping": "wave"}, "thread"), (COUNTED, "process")]
)
def test_replay_fills_all_wrong_groups_is_live_validated_and_persisted(
    make_server: Any, toy: Any, tmp_path: Path, knobs: dict[str, Any], engine: str
) -> None:
    # Eight add2 prompts, visited again and again: each is solved now and then.
    data = write_jsonl(tmp_path / "add2.jsonl", rows_with(toy.data_files[1])[:8])
    config = {**CONFIG, **knobs}
    server = make_server(config, data=[data], engine=engine)
    with server.client() as c, server.client() as reader:
        # A consumer that declares nothing streams as before, until replay is switched on.
        with reader.stream("GET", "/v1/groups/stream", params={"consumer": "old"}) as stream:
            lines = stream.iter_lines()
            assert orjson.loads(next(lines))["type"] == "heartbeat"
            r = c.patch("/v1/config", json={"replay": REPLAY})
            assert r.status_code == 200 and r.json()["replay"] == REPLAY, r.text
            deadline = time.monotonic() + 30
            for line in lines:  # its stream ends (within a heartbeat or two)
                assert time.monotonic() < deadline, "the undeclared stream was not ended"
                msg = orjson.loads(line)
                if msg["type"] == "group":
                    assert not any(s.get("replayed") for s in msg["group"]["samples"])
        r = reader.get("/v1/groups/stream", params={"consumer": "old"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "feature_required"
        refused = _lease(c, 1, "loss_mask")
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["field"]) == ("feature_required", "features")
        assert "replayed" in error["message"]

        for bad, field in (
            ({"per_prompt": 0}, "replay.per_prompt"),
            ({"max_version_lag": -1}, "replay.max_version_lag"),
            ({"per_prompt": 2, "keep": 3}, "replay.keep"),
        ):
            r = c.patch("/v1/config", json={"replay": bad})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["field"] == field

        replayed: list[dict[str, Any]] = []
        seen = 0
        while not replayed:
            assert seen < 600, f"no replay in {seen} groups"
            r = _lease(c, 16, "replayed")
            assert r.status_code == 200, r.text
            groups = r.json()["groups"]
            _ack(c, groups)
            seen += len(groups)
            for g in groups:
                if any(s["replayed"] for s in g["samples"]):
                    replayed.append(g)
                else:  # a group of its own answers only
                    assert g["stats"]["n_generated"] == len(g["samples"]) == 2
        for g in replayed:
            fresh = [s for s in g["samples"] if not s["replayed"]]
            [old] = [s for s in g["samples"] if s["replayed"]]
            # One answer of an all-wrong group of two made way for an earlier right one.
            assert len(g["samples"]) == 2 and g["stats"]["n_pos"] == 0
            assert [s["reward"] for s in fresh] == [0.0] and old["reward"] == 1.0
            assert old["advantage"] > 0 > fresh[0]["advantage"]
            assert len(old["logprobs"]) == len(old["response_token_ids"]) > 0
        everything = c.get("/v1/stats").json()
        stats = everything["replay"]
        assert stats["replayed"] >= len(replayed) and stats["answers"] >= 1
        # Every finished group was stored: a save that failed would lose its groups.
        assert everything["last_error"] is None, everything["last_error"]
        assert "adaptive_rollout_replayed_answers_total" in c.get("/metrics").text
        # Admission then holds while one group waits for a trainer (max_staleness 0, saved
        # with the config): the restarted sampler generates nothing, so what its replay
        # store holds is what it restored.
        assert c.patch("/v1/config", json={"max_staleness": 0}).status_code == 200
        deadline = time.monotonic() + 60
        while True:
            queue = c.get("/v1/stats").json()["queue"]
            if queue["ready"] >= 1 and not queue["active_prompts"] and not queue["finalizing"]:
                break
            assert time.monotonic() < deadline, f"admission did not settle: {queue}"
            time.sleep(0.2)
        kept = c.get("/v1/stats").json()["replay"]["answers"]

    server.stop()
    server = make_server(config, data=[data], engine=engine)
    with server.client() as c:
        assert c.get("/v1/config").json()["replay"] == REPLAY
        # The store came back with the scheduler's state (saved at shutdown).
        restored = c.get("/v1/stats").json()["replay"]
        assert restored["stored"] == 0 and restored["answers"] == kept > 0, (restored, kept)
