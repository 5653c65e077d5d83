"""Reading the files under deploy/: Dockerfiles, the compose file, the Kubernetes
manifests, the Prometheus rules and the Grafana dashboard.

Each reader returns what the checks need (command lines, images, pod templates, PromQL
expressions, metric selectors) and names where each item came from, so a failing check
points at the file and the place in it.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from sampler_service.cli import command_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILES = [DEPLOY / "docker" / "Dockerfile.cpu", DEPLOY / "docker" / "Dockerfile.cuda"]
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
K8S = DEPLOY / "k8s"
RAYCLUSTER = K8S / "raycluster.yaml"
#: The variant in front of a vLLM Deployment the user runs (`--backend http`).
HTTP_FLEET = K8S / "http-fleet"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
METRIC_PREFIX = "adaptive_rollout_"
CONSOLE_SCRIPT = "adaptive-rollout"


def tool(name: str) -> str:
    """A checker installed beside this interpreter (the core venv) or on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed; `make test-deploy` installs it")
    return found


def run_tool(argv: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def serve_parser() -> argparse.ArgumentParser:
    """The `serve` subcommand's parser, as the console script builds it."""
    return command_parser("serve")


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# -- Dockerfiles ------------------------------------------------------------------------
@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    args: str  # the rest of the logical line, continuations joined
    line: int


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """Logical instructions: comments dropped, backslash continuations joined."""
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


def docker_assignments(args: str) -> dict[str, str]:
    """`ENV A=1 B="x y"` or `ARG A=1` as a dict (a bare `ARG A` maps to "")."""
    out = {}
    for token in shlex.split(args):
        key, _, value = token.partition("=")
        out[key] = value
    return out


def docker_exec_form(args: str) -> list[str] | None:
    """The argv of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD (a JSON array), else None."""
    text = args.strip()
    if not text.startswith("[") and " CMD " in f" {text}":  # HEALTHCHECK [options] CMD ...
        text = f" {text}".split(" CMD ", 1)[1].strip()
    return json.loads(text) if text.startswith("[") else None


def dockerfile_arg(path: Path, name: str) -> str:
    for ins in dockerfile_instructions(path):
        if ins.keyword == "ARG" and name in docker_assignments(ins.args):
            return docker_assignments(ins.args)[name]
    raise AssertionError(f"{path.name} declares no ARG {name}")


# -- command lines ----------------------------------------------------------------------
@dataclass
class CommandLine:
    where: str
    argv: list[str]  # the arguments after `adaptive-rollout`


def _from_argv(argv: list[str], where: str) -> list[CommandLine]:
    """`adaptive-rollout ...` inside an argv; a shell script (`sh -c`) is searched line by line."""
    if argv and argv[0] == CONSOLE_SCRIPT:
        return [CommandLine(where, argv[1:])]
    out = []
    for arg in argv:
        out.extend(_from_shell(arg, where))
    return out


def _from_shell(script: str, where: str) -> list[CommandLine]:
    """Every `adaptive-rollout` invocation in a shell script, up to the next operator."""
    out = []
    lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    tokens = list(lexer)
    for i, token in enumerate(tokens):
        if token != CONSOLE_SCRIPT:
            continue
        argv = []
        for arg in tokens[i + 1 :]:
            if arg and set(arg) <= set(";&|()"):
                break
            argv.append(arg)
        out.append(CommandLine(where, argv))
    return out


def command_lines() -> list[CommandLine]:
    """Every `adaptive-rollout` command line the deploy files run."""
    out: list[CommandLine] = []
    for path in DOCKERFILES:
        for ins in dockerfile_instructions(path):
            where = f"{path.relative_to(REPO)}:{ins.line} {ins.keyword}"
            if ins.keyword in ("CMD", "ENTRYPOINT"):
                argv = docker_exec_form(ins.args)
                out.extend(_from_argv(argv, where) if argv else _from_shell(ins.args, where))
            elif ins.keyword == "RUN":
                out.extend(_from_shell(ins.args, where))
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        cmd = service.get("command")
        if cmd:
            where = f"{COMPOSE.relative_to(REPO)} service {name}"
            out.extend(_from_argv(cmd, where) if isinstance(cmd, list) else _from_shell(cmd, where))
    for where, template in pod_templates():
        for container in template["spec"].get("containers", []):
            argv = [*container.get("command", []), *container.get("args", [])]
            out.extend(_from_argv(argv, f"{where} container {container['name']}"))
    return out


# -- Kubernetes -------------------------------------------------------------------------
def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) for the head and every worker group of the RayCluster."""
    cluster = ray_cluster()
    out = [("RayCluster headGroupSpec", cluster["spec"]["headGroupSpec"]["template"])]
    for group in cluster["spec"].get("workerGroupSpecs", []):
        out.append((f"RayCluster workerGroup {group['groupName']}", group["template"]))
    return out


def http_fleet_files() -> list[Path]:
    return sorted(p for p in HTTP_FLEET.glob("*.yaml") if p.name != "kustomization.yaml")


def ray_cluster() -> dict[str, Any]:
    (cluster,) = [d for d in yaml_documents(RAYCLUSTER) if d["kind"] == "RayCluster"]
    return cluster


def images() -> list[tuple[str, str]]:
    """(where, image reference) for every image the compose file and manifests run."""
    out = []
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        out.append((f"compose service {name}", service["image"]))
    for where, template in pod_templates():
        for container in template["spec"].get("containers", []):
            out.append((f"{where} container {container['name']}", container["image"]))
    return out


# -- PromQL -----------------------------------------------------------------------------
@dataclass
class Query:
    where: str
    expr: str


def alert_queries() -> list[Query]:
    out = []
    for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            out.append(Query(f"{ALERT_RULES.name} {name}", rule["expr"]))
    return out


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def dashboard_queries() -> list[Query]:
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in _panels(dashboard["panels"]):
            for target in panel.get("targets", []):
                where = f"{path.name} panel {panel['title']!r} target {target['refId']}"
                out.append(Query(where, target["expr"]))
    return out


# Grafana replaces these before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def as_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # label, op, value


_SELECTOR = re.compile(rf"\b({METRIC_PREFIX}[A-Za-z0-9_]*)\s*(\{{[^}}]*\}})?")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def selectors(expr: str) -> list[Selector]:
    """The metric selectors of our metrics in a PromQL expression."""
    return [
        Selector(m.group(1), _MATCHER.findall(m.group(2) or "")) for m in _SELECTOR.finditer(expr)
    ]


def pyproject_ray_pin() -> str:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (requirement,) = pyproject["project"]["optional-dependencies"]["ray"]
    match = re.fullmatch(r"ray(\[[\w,]+\])?==([\w.]+)", requirement.replace(" ", ""))
    assert match, f"the [ray] extra must pin one exact version, not {requirement!r}"
    return match.group(2)


def vllm_pin() -> str:
    """The vLLM version the vLLM suite installs (make/vllm.mk)."""
    text = (REPO / "make" / "vllm.mk").read_text()
    versions = set(re.findall(r"vllm(?:-cpu)?==([\w.]+)", text))
    assert len(versions) == 1, f"make/vllm.mk names several vLLM versions: {versions}"
    return versions.pop()
