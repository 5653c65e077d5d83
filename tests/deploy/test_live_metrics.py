"""Every metric the Grafana dashboard and the alert rules query exists on a live toy
sampler's /metrics, after one group was delivered and one weight push was served."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from deployfiles import (
    METRIC_PREFIX,
    Query,
    alert_queries,
    dashboard_queries,
    selectors,
)
from prometheus_client.parser import text_string_to_metric_families

from trainer_client.launch import SamplerProcess

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(600)]

CONFIG = {
    "rule": "fixed",
    "group_size": 2,
    "n_max": 4,
    "wave_size": 2,
    "max_tokens": 8,
    "max_active_prompts": 4,
    "max_buffered_groups": 8,
    "max_staleness": None,  # groups are leased without training on them
}
# Series the sampler exports only with engine replicas (--replicas N).
REPLICA_METRICS = (METRIC_PREFIX + "replica_", METRIC_PREFIX + "route_")

Series = dict[str, list[dict[str, str]]]  # sample name -> label sets


def _is_replica_metric(name: str) -> bool:
    return name.startswith(REPLICA_METRICS)


def _missing(queries: list[Query], series: Series, *, replicas: bool) -> list[str]:
    """Each selector of our metrics that matches no exposed series, with where it is used."""
    out = []
    for query in queries:
        for sel in selectors(query.expr):
            if _is_replica_metric(sel.name) and not replicas:
                continue
            label_sets = series.get(sel.name)
            if not label_sets:
                out.append(f"{query.where}: {sel.name} is not exported")
                continue
            if not any(_matches(labels, sel.matchers) for labels in label_sets):
                out.append(f"{query.where}: no {sel.name} series matches {sel.matchers}")
    return out


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        ok = {
            "=": have == value,
            "!=": have != value,
            "=~": re.fullmatch(value, have) is not None,
            "!~": re.fullmatch(value, have) is None,
        }[op]
        if not ok:
            return False
    return True


def _scrape(client: httpx.Client) -> Series:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    series: Series = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


@pytest.fixture
def start_sampler(toy: Any, tmp_path: Path) -> Iterator[Any]:
    servers: list[SamplerProcess] = []

    def start(extra: list[str]) -> SamplerProcess:
        server = SamplerProcess(
            toy.model_dir,
            toy.data_files,
            tmp_path / "state",
            CONFIG,
            tmp_path / "sampler.log",
            heartbeat_s=0.5,
            extra=extra,
        )
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


def _one_group_and_one_weight_push(server: SamplerProcess, model_dir: Path) -> Series:
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        r = c.post("/v1/groups/lease", json={"max_groups": 1, "wait_s": 120, "consumer": "deploy"})
        assert r.status_code == 200, r.text
        (group,) = r.json()["groups"]
        r = c.post("/v1/groups/ack", json={"delivery_ids": [group["delivery_id"]]})
        assert r.status_code == 200, r.text
        # The model's own checkpoint is a valid update: every tensor, right names and shapes.
        weights = (model_dir / "model.safetensors").read_bytes()
        r = c.put("/v1/weights", params={"version": 1}, content=weights)
        assert r.status_code == 200, r.text
        return _scrape(c)


def test_the_checker_finds_a_missing_metric_and_a_wrong_label() -> None:
    series: Series = {"adaptive_rollout_queue_depth": [{"state": "ready"}]}
    queries = [
        Query("ok", 'max(adaptive_rollout_queue_depth{state="ready"})'),
        Query("label", 'max(adaptive_rollout_queue_depth{state="readdy"})'),
        Query("name", "rate(adaptive_rollout_no_such_total[5m])"),
    ]
    assert [m.split(":")[0] for m in _missing(queries, series, replicas=False)] == [
        "label",
        "name",
    ]


def test_dashboard_and_alert_metrics_exist_on_a_live_sampler(
    start_sampler, toy, promtool: str
) -> None:
    queries = dashboard_queries() + alert_queries()
    server = start_sampler([])
    series = _one_group_and_one_weight_push(server, toy.model_dir)
    missing = _missing(queries, series, replicas=False)
    assert not missing, "\n".join(missing)
    # What the check covered: the dashboard and the rules use most of the exported names.
    used = {s.name for q in queries for s in selectors(q.expr)}
    assert len([n for n in used if not _is_replica_metric(n)]) >= 15, used
    # The failed-update alert counts: a version that does not increase is refused.
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        assert c.put("/v1/weights", params={"version": 1}, content=b"x").status_code == 409
        r = c.get("/metrics")
    failures = "adaptive_rollout_weight_update_failures_total"
    assert f'{failures}{{reason="stale_version"}} 1.0' in r.text
    assert f'{failures}{{reason="rejected"}} 0.0' in r.text
    assert "adaptive_rollout_engine_failed 0.0" in r.text
    # The exposition itself passes Prometheus' own linter.
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=r.text, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_replica_metrics_exist_on_a_live_sampler_with_two_replicas(
    start_sampler, toy, tmp_path: Path
) -> None:
    queries = dashboard_queries() + alert_queries()
    server = start_sampler(["--replicas", "2"])
    series = _one_group_and_one_weight_push(server, toy.model_dir)
    missing = _missing(queries, series, replicas=True)
    assert not missing, "\n".join(missing)
    # /health names the engine as the start-up log does: Ray replicas (of hf engines).
    assert httpx.get(f"{server.url}/health", timeout=60).json()["backend"] == "ray"
    assert "sampler ready: backend=ray" in (tmp_path / "sampler.log").read_text()
    # SIGTERM is a clean stop: its summary, and no stack dump from Ray's core.
    server.stop()
    log = (tmp_path / "sampler.log").read_text()
    assert "adaptive-rollout sampler stopped: 1 groups delivered and 1 acked" in log
    assert "SIGTERM received" not in log and "Traceback" not in log, log[-3000:]
