"""Faults a reliability review found: each test drives the real server as a subprocess
(toy model, real SQLite) through the input or failure that once froze or misled it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from bench.common import fixed_groups
from trainer_client.client import SamplerClient
from trainer_client.exceptions import ConflictError, EngineFailed

pytestmark = pytest.mark.timeout(300)

FIXED = fixed_groups(2)


def _lease(c: httpx.Client, n: int, consumer: str, wait_s: float = 30.0) -> list[dict]:
    r = c.post("/v1/groups/lease", json={"max_groups": n, "wait_s": wait_s, "consumer": consumer})
    assert r.status_code == 200, r.text
    return r.json()["groups"]


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


def _engine_pid(c: httpx.Client) -> int:
    return c.get("/v1/stats").json()["engine"]["engine_pid"]


def _wait_for(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


def test_unbounded_and_non_finite_config_is_refused(make_server) -> None:
    """A billion active prompts once froze the event loop (PATCH never answered); lax
    parsing let "nan", "inf", true and "3" in. Each now gets 422 naming the field, and
    the config that serves is unchanged."""
    server = make_server()
    with server.client(timeout=30.0) as c:
        before = c.get("/v1/config").json()
        refused = {
            "max_active_prompts": 1_000_000_000,
            "cohort_size": 1_000_000_000,
            "n_max": 100_000,
            "positive_threshold": "nan",
            "temperature": "inf",
            "lease_ttl_s": "inf",
            "k_pos": True,
            "max_tokens": 100_000,  # the toy model's context is 64 tokens
            "top_p": "1",
            "wave_min_need": 1.5,  # a chance
            "max_delay_versions": 5_000,  # a value or "auto": the knob is named, not the member
        }
        for key, value in refused.items():
            err = _error(c.patch("/v1/config", json={key: value}), 422)
            assert err["field"] == key, (key, err)
        err = _error(c.patch("/v1/config", json={"config_version": None, "k_pos": 1}), 422)
        assert err["field"] == "config_version"
        # The event loop keeps answering while admission fills a large window.
        r = c.patch("/v1/config", json={"max_active_prompts": 4096, "wave_min_need": 0.6})
        assert r.status_code == 200, r.text
        assert c.get("/health").json()["status"] == "ok"
        after = c.get("/v1/config").json()
        assert after["positive_threshold"] == before["positive_threshold"]
        assert after["lease_ttl_s"] == before["lease_ttl_s"]
        assert after["wave_min_need"] == 0.6
        # /metrics has no doubled _created series, and passes promtool where it is installed
        # (Debian's prometheus package).
        metrics = c.get("/metrics").text
        assert "_created" not in metrics
        promtool = shutil.which("promtool")
        if promtool:
            lint = subprocess.run(
                [promtool, "check", "metrics"], input=metrics, capture_output=True, text=True
            )
            assert lint.returncode == 0, lint.stdout + lint.stderr
        # Request bodies: unknown keys and coerced types are refused too.
        for path, body, field in (
            ("/v1/groups/lease", {"max_groups": "3"}, "max_groups"),
            ("/v1/groups/lease", {"max_groups": 1, "bogus": 1}, "bogus"),
            ("/v1/groups/lease", {"wait_s": True}, "wait_s"),
            ("/v1/groups/ack", {"delivery_ids": [], "extra": 1}, "extra"),
            ("/v1/weights/load", {"path": "x", "version": 1, "force": True}, "force"),
            ("/v1/weights/load", {"path": "x", "version": "7"}, "version"),
        ):
            err = _error(c.post(path, json=body), 422)
            assert err["field"] == field, (path, body, err)


def test_one_live_stream_per_name_and_lease_names_apart(make_server) -> None:
    """Two streams under one name once replaced each other (both trained on the same
    groups), and a stream under a lease caller's name released that caller's lease."""
    server = make_server(FIXED)
    with server.client() as c:
        held = _lease(c, 2, consumer="shared")
        assert held
        params = {"consumer": "shared", "max_unacked": 1}
        with c.stream("GET", "/v1/groups/stream", params=params) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: dropping the iterator closes the stream
            next(lines)  # the first heartbeat: the stream is live
            err = _error(c.get("/v1/groups/stream", params=params), 409)
            assert err["code"] == "consumer_busy"
            # The client retries consumer_busy briefly, then reports the conflict.
            with (
                SamplerClient(server.url, consumer="shared", heartbeat_s=0.5) as client,
                pytest.raises(ConflictError, match="live stream"),
            ):
                next(client.groups())
        # The stream named "shared" came and went: the lease of that name still holds.
        others = _lease(c, 4, consumer="other")
        assert {g["group_id"] for g in others}.isdisjoint(g["group_id"] for g in held)
        stats = c.get("/v1/stats").json()["queue"]
        assert stats["leased"] >= len(held)
    names = {SamplerClient(server.url).consumer for _ in range(3)}
    assert len(names) == 3
    assert all(re.fullmatch(rf".+-{os.getpid()}-[0-9a-f]{{6}}", n) for n in names)


def test_a_bad_verifier_spec_stops_start_up(make_server, toy, tmp_path: Path) -> None:
    """A verifier that cannot be imported once started ready and scored every answer 0."""
    with pytest.raises(RuntimeError, match="nonexistent_mod") as info:
        make_server(extra=["--verifier", "python:nonexistent_mod:fn"], name="flag")
    assert "--verifier" in str(info.value)
    rows = [json.loads(line) for line in toy.data_files[0].read_text().splitlines()[:3]]
    rows[1]["verifier"] = "python:flaky_verifiers:no_such_function"
    data = tmp_path / "named.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RuntimeError, match="no_such_function") as info:
        make_server(data=[data], name="row")
    assert "prompt" in str(info.value)


def _toy_weights(toy: Any, scale: float | None) -> bytes:
    model = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if scale is None:
        for tensor in tensors.values():
            tensor.fill_(float("nan"))
    return save(tensors)


def test_non_finite_weights_and_a_dead_engine(make_server, toy) -> None:
    """All-NaN weights were accepted (200); with a dead engine weight calls answered 500
    and reset the connection; EngineFailed waited for other consumers' leases to expire."""
    server = make_server({**FIXED, "lease_ttl_s": 600.0}, engine="process")
    with server.client() as c:
        err = _error(c.put("/v1/weights?version=1", content=_toy_weights(toy, None)), 422)
        assert err["code"] == "weights_rejected" and "NaN" in err["message"]
        assert c.get("/health").json()["policy_version"] == 0
        hog = _lease(c, 2, consumer="hog")  # held, never acked, for 600 s
        assert hog
        os.kill(_engine_pid(c), signal.SIGKILL)
        _wait_for(lambda: c.get("/health").json()["status"] == "engine_failed", "engine_failed")
        weights = _toy_weights(toy, 1.0)
        for _ in range(2):  # the keep-alive connection survives the refusal
            err = _error(c.put("/v1/weights?version=2", content=weights), 503)
            assert err["code"] == "engine_failed"
        err = _error(
            c.post("/v1/weights/load", json={"path": str(toy.model_dir), "version": 2}), 503
        )
        assert err["code"] == "engine_failed"
        assert c.get("/health").status_code == 200
    outcome: list[BaseException | None] = []

    def consume() -> None:
        with SamplerClient(server.url, consumer="after", heartbeat_s=0.5, watchdog_s=60) as cl:
            try:
                for group in cl.groups():
                    cl.ack([group])
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                outcome.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(timeout=3 * 60 + 30)  # the client's watchdog is 60 s
    assert outcome, "the client kept waiting on another consumer's lease"
    assert isinstance(outcome[0], EngineFailed), repr(outcome[0])


def test_sigterm_with_an_open_stream_stops_within_the_bound(make_server) -> None:
    """SIGTERM once left the server running as long as a stream stayed open."""
    timeout_s = 10.0
    server = make_server(FIXED, extra=["--shutdown-timeout-s", str(timeout_s)])
    messages: list[dict] = []
    with (
        server.client() as c,
        c.stream("GET", "/v1/groups/stream", params={"consumer": "open"}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        messages.append(orjson.loads(next(lines)))
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        messages.extend(orjson.loads(line) for line in lines if line)
    assert messages[-1]["type"] == "heartbeat" and messages[-1]["closing"] is True
    try:
        server.proc.wait(timeout=3 * timeout_s + 30 - (time.monotonic() - sent))
    except subprocess.TimeoutExpired:
        pytest.fail("the server was still running past the shutdown bound")
    # uvicorn re-raises the SIGTERM it handled once it is done; 1 would be the forced exit.
    assert server.proc.returncode in (0, -signal.SIGTERM)


def test_a_hanging_verifier_is_cut_off_and_crashes_are_counted(make_server, toy, tmp_path) -> None:
    """A verifier hanging on some answers once held every worker: throughput fell ~100x.
    Its breaker opens, its prompts are dropped (not emitted as negatives), /health warns;
    a verifier that kills its worker is counted as a crash, not an error, and its prompts
    are dropped as verifier_error once the retry crashed too."""
    rows = [json.loads(line) for line in toy.data_files[0].read_text().splitlines()]
    half = len(rows) // 2
    for row in rows[:half]:
        row["verifier"] = "python:flaky_verifiers:hangs_often"
    for row in rows[half:]:
        row["verifier"] = "python:flaky_verifiers:crashes"
    data = tmp_path / "flaky.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = make_server(
        {**FIXED, "group_size": 4, "n_max": 4, "wave_size": 4},
        data=[data],
        extra=["--verifier-timeout-s", "1", "--verifier-workers", "2"],
    )
    with server.client() as c:

        def cut_off() -> bool:
            stats = c.get("/v1/stats").json()
            return stats["dropped"].get("verifier_unavailable", 0) > 0

        _wait_for(cut_off, "prompts dropped as verifier_unavailable", timeout_s=240)
        health = c.get("/health").json()
        assert any("hangs_often" in w and "time-outs" in w for w in health["warnings"])
        groups = _lease(c, 64, consumer="check", wait_s=0.0)
        for group in groups:  # what was emitted was scored: no failure became a negative
            assert [s["verifier_error"] for s in group["samples"]] == [None] * 4, group
        _wait_for(lambda: c.get("/v1/stats").json()["verifiers"]["crashes"] > 0, "a counted crash")
        _wait_for(
            lambda: c.get("/v1/stats").json()["dropped"].get("verifier_error", 0) > 0,
            "prompts dropped as verifier_error",
        )
        text = c.get("/metrics").text
        assert re.search(r'verifier_errors_total\{kind="crash"\} [1-9]', text), text


def test_engine_errors_warn_in_health_and_stats_until_they_stop(
    make_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine failing most calls once left /health `ok` with no word of it: a persistent
    error rate is a warning in /health and /v1/stats (the server stays ready, the engine
    is alive) and the warning clears once calls succeed again."""
    fault = tmp_path / "engine-errors"
    fault.touch()
    monkeypatch.setenv("ADAPTIVE_ROLLOUT_FAULT_ENGINE_ERRORS", str(fault))
    server = make_server(FIXED)
    with server.client() as c:

        def engine_warnings(body: dict[str, Any]) -> list[str]:
            return [w for w in body["warnings"] if w.startswith("engine:")]

        _wait_for(lambda: engine_warnings(c.get("/health").json()), "an engine warning")
        assert "fault hook" in engine_warnings(c.get("/health").json())[0]
        assert engine_warnings(c.get("/v1/stats").json())
        assert c.get("/ready").status_code == 200
        fault.unlink()

        def cleared() -> bool:
            # Acking keeps admission open, so successful engine calls keep coming.
            got = _lease(c, 64, consumer="t", wait_s=0.0)
            if got:
                c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]})
            return not engine_warnings(c.get("/health").json())

        _wait_for(cleared, "the engine warning to clear", timeout_s=3 * 60 + 30)
        assert not engine_warnings(c.get("/v1/stats").json())
        assert c.get("/health").json()["status"] == "ok"


def test_a_stalled_stream_is_dropped_and_its_groups_redelivered(make_server) -> None:
    """A consumer that stops reading without closing its connection would hold its name
    (409 to its own reconnect) and its groups until their leases expire: once its socket
    has taken no message for 2 heartbeats the server drops the stream, frees the name and
    makes its groups READY again."""
    heartbeat_s = 0.5
    # Large groups and room for many: the stalled socket's buffers fill quickly.
    server = make_server(
        {**FIXED, "group_size": 8, "n_max": 8, "wave_size": 8, "max_buffered_groups": 4096}
    )
    params = {"consumer": "stalled", "max_unacked": 100_000, "heartbeat_s": heartbeat_s}
    url = httpx.URL(server.url)
    with socket.socket() as stalled, server.client() as c:
        # A small receive buffer, never read: the server's writes soon block.
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect((url.host, url.port))
        query = httpx.QueryParams(params)
        stalled.sendall(
            f"GET /v1/groups/stream?{query} HTTP/1.1\r\nHost: {url.host}\r\n\r\n".encode()
        )

        def backed_up() -> bool:  # groups wait READY while the stream holds others
            queue = c.get("/v1/stats").json()["queue"]
            return queue["leased"] > 0 and queue["ready"] > 0

        _wait_for(backed_up, "the stalled stream's buffers to fill", timeout_s=120)
        deadline = time.monotonic() + 3 * (2 * heartbeat_s) + 30
        while True:
            with c.stream("GET", "/v1/groups/stream", params=params) as second:
                if second.status_code == 200:
                    stalled.setblocking(False)
                    received = b""
                    with contextlib.suppress(BlockingIOError):
                        while chunk := stalled.recv(65536):
                            received += chunk
                    held = set(re.findall(rb'"group_id":"([^"]+)"', received))
                    assert held, received[:2000]
                    for line in second.iter_lines():
                        msg = orjson.loads(line)
                        if msg["type"] == "group":
                            held.discard(msg["group"]["group_id"].encode())
                            if not held:
                                break
                    break
                second.read()
                assert _error(second, 409)["code"] == "consumer_busy"
            assert time.monotonic() < deadline, "the stalled stream still holds its name"
            time.sleep(0.2)


def test_heartbeats_keep_flowing_through_a_patch_to_the_bounds(make_server) -> None:
    """A PATCH that raised admission past what the machine could honour once stopped the
    event loop: streams went silent and /health stopped answering. Raising admission and
    the buffer to their bounds (and rebuilding the estimator for a new n_max) leaves
    heartbeats flowing and /health answering."""
    heartbeat_s = 0.5
    server = make_server(FIXED)
    beats: list[float] = []
    stop = threading.Event()

    def read() -> None:
        params = {"consumer": "watch", "max_unacked": 1, "heartbeat_s": heartbeat_s}
        with server.client() as c, c.stream("GET", "/v1/groups/stream", params=params) as r:
            assert r.status_code == 200
            for line in r.iter_lines():  # never acked: after one group, only heartbeats
                if orjson.loads(line)["type"] == "heartbeat":
                    beats.append(time.monotonic())
                if stop.is_set():
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with server.client() as c:
        _wait_for(lambda: len(beats) >= 2, "the stream's first heartbeats")
        bound = 65_536
        patch = {"max_active_prompts": bound, "max_buffered_groups": bound, "n_max": 4}
        sent = time.monotonic()
        r = c.patch("/v1/config", json=patch)
        assert r.status_code == 200, r.text
        answered = time.monotonic()
        for _ in range(5):  # and right after it, while admission fills the window
            assert c.get("/health", timeout=3 * heartbeat_s + 30).json()["status"] == "ok"
            time.sleep(heartbeat_s)
        _wait_for(lambda: beats[-1] > answered + 2 * heartbeat_s, "heartbeats after the PATCH")
    stop.set()
    reader.join(timeout=3 * heartbeat_s + 30)
    during = [t for t in beats if t >= sent]
    assert during and during[0] - sent < 3 * heartbeat_s + 30
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert max(gaps) < 3 * heartbeat_s + 30, gaps
