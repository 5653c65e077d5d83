"""`weight_update_mode: continue` through the real server (hf engine): a weight push lands
while long answers decode, none is aborted, and each answer that ran across it carries
its version spans on the wire, to a consumer that declared them; one that did not is
refused. `max_versions_per_answer` then cuts the answers an update would carry too far,
and they are drawn again."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import endless, perturbed_file
from trainer_client.contract.features import VERSION_SPANS

pytestmark = pytest.mark.timeout(600)

#: Four answers of 40 tokens per prompt, every one to max_tokens (the endless model):
#: a push always finds answers decoding.
CONFIG = {
    "rule": "fixed",
    "n_max": 4,
    "wave_size": 4,
    "group_size": 4,
    "max_tokens": 40,
    "max_active_prompts": 8,
    "weight_update_mode": "continue",
}


def _lease(c: httpx.Client, features: str | None, wait_s: float = 60.0) -> httpx.Response:
    params = {"features": features} if features else {}
    body = {"max_groups": 4, "wait_s": wait_s, "consumer": "t"}
    return c.post("/v1/groups/lease", params=params, json=body)


def _stats(c: httpx.Client) -> dict[str, Any]:
    return c.get("/v1/stats").json()


class _Consumer(threading.Thread):
    """Leases (declaring version_spans) and acks until stopped, so sampling never waits
    for the buffer; keeps every sample that ran across an update."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.spanning = url, threading.Event(), []
        self.groups = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.stop.is_set():
                r = _lease(c, VERSION_SPANS, wait_s=1.0)
                assert r.status_code == 200, r.text
                groups = r.json()["groups"]
                self.groups += len(groups)
                self.spanning += [s for g in groups for s in g["samples"] if s["version_spans"]]
                ids = [g["delivery_id"] for g in groups]
                if ids:
                    c.post("/v1/groups/ack", json={"delivery_ids": ids})


def _push(c: httpx.Client, model: Path, version: int) -> None:
    r = c.put(
        "/v1/weights",
        params={"version": version},
        content=perturbed_file(model, 0.05, seed=version),
    )
    assert r.status_code == 200, r.text


def _wait(what: str, done: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_an_update_runs_across_answers_that_say_so(make_server, toy, tmp_path: Path) -> None:
    model = endless(toy.model_dir, tmp_path / "endless")
    server = make_server(CONFIG, model=model)
    with server.client() as c:
        refused = _lease(c, None, wait_s=0.0)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "feature_required" and VERSION_SPANS in error["message"]

        consumer = _Consumer(server.url)
        consumer.start()
        try:
            _wait("no group came", lambda: consumer.groups >= 8)
            # A push that lands between two batches runs across nothing: push again.
            version = 0
            while not consumer.spanning:
                assert version < 20, "no answer ran across 20 updates"
                version += 1
                _push(c, model, version)
                with contextlib.suppress(AssertionError):
                    _wait("", lambda: consumer.spanning, timeout_s=2.0)
            stats = _stats(c)
            # At most one version per answer: what the next push would carry over is cut.
            r = c.patch("/v1/config", json={"max_versions_per_answer": 1})
            assert r.status_code == 200, r.text
            _wait("no group after the patch", lambda: consumer.groups >= 16)
            while not _stats(c)["waste"]["redrawn"].get("version_cap"):
                assert version < 40, "no answer was cut by the version cap"
                version += 1
                _push(c, model, version)
                with contextlib.suppress(AssertionError):
                    _wait("", lambda: _stats(c)["waste"]["redrawn"].get("version_cap"), 2.0)
            capped = _stats(c)
        finally:
            consumer.stop.set()
            consumer.join()
        for s in consumer.spanning:
            [(first, zero), (second, start)] = s["version_spans"]
            assert (zero, second) == (0, first + 1) and s["policy_version"] == first
            assert 0 < start < len(s["response_token_ids"]) == CONFIG["max_tokens"]
        assert stats["continue"]["spanning_answers"] >= 1
        assert stats["continue"]["continued_tokens"] > 0
        assert stats["waste"]["waste"]["aborted"] == 0 and not stats["waste"]["redrawn"]
        [line] = [
            line
            for line in c.get("/metrics").text.splitlines()
            if line.startswith("adaptive_rollout_spanning_answers_total ")
        ]
        assert float(line.split()[1]) == _stats(c)["continue"]["spanning_answers"]
        assert capped["waste"]["waste"]["aborted"] > 0
        assert capped["continue"]["spanning_answers"] == _stats(c)["continue"]["spanning_answers"]
        # The default kv, recompute: the hf engine rebuilds the running answers' cache
        # under the new weights; it keeps the old one when asked to, and warns of neither.
        assert capped["weight_updates"] == {
            "mode": "continue",
            "kv": "recompute",
            "engine_continues": ["keep", "recompute"],
            "drains_instead": None,
        }
        r = c.patch("/v1/config", json={"weight_update_kv": "keep"})
        assert r.status_code == 200, r.text
        assert _stats(c)["weight_updates"]["drains_instead"] is None
        assert not c.get("/health").json()["warnings"] and not _stats(c)["warnings"]
