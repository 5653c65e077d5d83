"""The deploy files pass the validators of their formats, offline: hadolint, the
compose specification's schema, Kubernetes' schemas and promtool."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from deployfiles import (
    ALERT_RULES,
    COMPOSE,
    DOCKERFILES,
    PROMETHEUS_CONFIG,
    as_promql,
    dashboard_queries,
    http_fleet_files,
    k8s_files,
    pod_templates,
    run_tool,
    tool,
    yaml_documents,
)

pytestmark = pytest.mark.deploy


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    done = run_tool([tool("hadolint"), "--no-color", str(dockerfile)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_file_follows_the_compose_specification() -> None:
    done = run_tool(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)]
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_objects_and_pod_templates_validate(tmp_path: Path) -> None:
    """Native objects as they are; each RayCluster pod template as a v1 PodTemplate (the
    RayCluster itself is a custom resource, which Kubernetes' schemas do not cover)."""
    files = [*k8s_files(), *http_fleet_files()]
    docs = [d for f in files for d in yaml_documents(f) if d["kind"] != "RayCluster"]
    for where, template in pod_templates():
        name = where.split()[-1].lower()
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"raycluster-{name}"},
                "template": template,
            }
        )
    manifest = tmp_path / "objects.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    done = run_tool([tool("kubernetes-validate"), "--strict", str(manifest)])
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # A kind it has no schema for is only a warning: every object must have been checked.
    assert output.count(" passed ") == len(docs), output
    assert {d["kind"] for d in docs} >= {"PersistentVolumeClaim", "Service", "PodTemplate"}


def test_promtool_checks_the_prometheus_config_and_rules(promtool: str) -> None:
    done = run_tool([promtool, "check", "config", str(PROMETHEUS_CONFIG)])
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_tool([promtool, "check", "rules", str(ALERT_RULES)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout, done.stdout


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """promtool parses each dashboard query as the expression of a recording rule."""
    queries = dashboard_queries()
    assert queries, "the dashboard has no queries"
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": as_promql(q.expr)}
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = run_tool([promtool, "check", "rules", str(path)])
    legend = "\n".join(f"query_{i}: {q.where}" for i, q in enumerate(queries))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{legend}"
