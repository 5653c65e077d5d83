"""Project checks on the deploy files: command lines parse with the real argument parser,
Ray and vLLM versions agree everywhere, probes and grace periods fit the sampler."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import yaml
from deployfiles import (
    COMPOSE,
    DASHBOARDS,
    DOCKERFILES,
    HTTP_FLEET,
    K8S,
    PROMETHEUS_CONFIG,
    REPO,
    CommandLine,
    command_lines,
    docker_exec_form,
    dockerfile_arg,
    dockerfile_instructions,
    http_fleet_files,
    images,
    k8s_files,
    pod_templates,
    pyproject_ray_pin,
    ray_cluster,
    serve_parser,
    vllm_pin,
    yaml_documents,
)

from sampler_service.cli import build_parser

pytestmark = pytest.mark.deploy

# serve's options for engine replicas on Ray; a command line using one needs a parser
# that has them.
RAY_FLAGS = {
    "--replicas",
    "--ray-address",
    "--replica-gpus",
    "--replica-cpus",
    "--replica-max-restarts",
    "--replica-max-inflight",
    "--route",
    "--weights-dir",
    "--replica-probe-s",
    "--replica-probe-timeout-s",
    "--replica-wait-s",
    "--replicas-on-exit",
    "--replica-orphan-s",
}
# How long the sampler may take to shut down when its default is not a serve option.
SHUTDOWN_BOUND_S = 30.0


def _uses_ray_flags(line: CommandLine) -> bool:
    return any(arg.split("=", 1)[0] in RAY_FLAGS for arg in line.argv)


def _parse_errors(lines: list[CommandLine]) -> list[str]:
    errors = []
    for line in lines:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(line.argv)
        except SystemExit as exc:
            if exc.code == 0:  # --help: valid, it printed and stopped
                continue
            errors.append(
                f"{line.where}: adaptive-rollout {' '.join(line.argv)}\n{stderr.getvalue()}"
            )
    return errors


def test_command_lines_parse_with_the_real_parser() -> None:
    lines = command_lines()
    wheres = " ".join(line.where for line in lines)
    # The places that run the sampler or the trainer are all found.
    for expected in ("Dockerfile.cpu", "service sampler ", "service trainer", "sampler-gpu"):
        assert expected in wheres + " ", f"no command line found in {expected}: {wheres}"
    plain = [line for line in lines if not _uses_ray_flags(line)]
    assert not _parse_errors(plain), "\n".join(_parse_errors(plain))


def test_replica_command_lines_parse_with_the_real_parser() -> None:
    lines = [line for line in command_lines() if _uses_ray_flags(line)]
    assert any("workerGroup front" in line.where for line in lines), "the front runs no replicas"
    assert not _parse_errors(lines), "\n".join(_parse_errors(lines))


def test_the_parser_refuses_a_wrong_command_line() -> None:
    """The check above can fail: an unknown option and a missing --model are errors."""
    bad = [
        CommandLine("unknown option", ["serve", "--model", "m", "--data", "d", "--no-such"]),
        CommandLine("missing --model", ["serve", "--data", "d"]),
    ]
    assert len(_parse_errors(bad)) == 2


# -- versions ---------------------------------------------------------------------------
_OUR_IMAGE = re.compile(r"\badaptive-rollout-(cpu|cuda):([\w.-]+)")


def _our_image_tags() -> list[tuple[str, str, str]]:
    """(where, flavour, tag) of our images in the compose file, manifests and docs."""
    out = [
        (where, *m.groups()) for where, image in images() for m in [_OUR_IMAGE.search(image)] if m
    ]
    texts = [
        *DOCKERFILES,
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),  # docs/deploy.md: which image for which hardware
        K8S / "README.md",
        COMPOSE,
        K8S / "kustomization.yaml",
    ]
    for path in texts:
        for m in _OUR_IMAGE.finditer(path.read_text()):
            out.append((str(path.relative_to(REPO)), *m.groups()))
    return out


def test_ray_version_agrees_across_pin_images_and_raycluster() -> None:
    pin = pyproject_ray_pin()
    assert ray_cluster()["spec"]["rayVersion"] == pin
    for dockerfile in DOCKERFILES:
        assert dockerfile_arg(dockerfile, "RAY_VERSION") == pin, dockerfile.name
    tags = _our_image_tags()
    assert {flavour for _, flavour, _ in tags} == {"cpu", "cuda"}
    wrong = [(where, tag) for where, _, tag in tags if not tag.endswith(f"-ray{pin}")]
    assert not wrong, f"image tags not on Ray {pin}: {wrong}"


def test_cuda_image_is_built_on_the_tested_vllm_version() -> None:
    pin = vllm_pin()
    cuda = DOCKERFILES[1]
    assert dockerfile_arg(cuda, "VLLM_VERSION") == pin
    (base,) = [i.args for i in dockerfile_instructions(cuda) if i.keyword == "FROM"]
    assert base == "vllm/vllm-openai:v${VLLM_VERSION}"
    wrong = [(w, t) for w, f, t in _our_image_tags() if f == "cuda" and f"-vllm{pin}-" not in t]
    assert not wrong, f"CUDA image tags not on vLLM {pin}: {wrong}"


def test_cpu_image_uses_the_torch_of_the_core_environment() -> None:
    makefile = (REPO / "Makefile").read_text()
    (torch,) = re.findall(r"^CPU_TORCH := torch==([\w.]+)$", makefile, re.M)
    assert dockerfile_arg(DOCKERFILES[0], "TORCH_VERSION") == torch


# -- probes, users, state ---------------------------------------------------------------
def _shutdown_bound_s() -> float:
    action = serve_parser()._option_string_actions.get("--shutdown-timeout-s")
    return float(action.default) if action else SHUTDOWN_BOUND_S


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([smh])", text))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_user_check_ready_and_keep_state_in_a_volume(dockerfile) -> None:
    by_kw: dict[str, list[str]] = {}
    for ins in dockerfile_instructions(dockerfile):
        by_kw.setdefault(ins.keyword, []).append(ins.args)
    (user,) = by_kw["USER"]
    assert user.isdigit() and int(user) != 0, f"USER {user}: numeric and not root"
    (check,) = by_kw["HEALTHCHECK"]
    argv = docker_exec_form(check)
    assert argv and any("/ready" in a for a in argv), check
    assert by_kw["VOLUME"] == ['["/state"]']


def test_compose_samplers_check_ready_and_outlast_the_shutdown_bound() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    samplers = {n: s for n, s in services.items() if "serve" in s.get("command", [])}
    assert set(samplers) == {"sampler", "sampler-gpu"}
    for name, service in samplers.items():
        assert any("/ready" in part for part in service["healthcheck"]["test"]), name
        assert _seconds(service["stop_grace_period"]) > _shutdown_bound_s(), name
        assert any(v.endswith(":/state") for v in service["volumes"]), name
    assert services["trainer"]["depends_on"]["sampler"]["condition"] == "service_healthy"
    gpu = samplers["sampler-gpu"]
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]


def _front() -> tuple[dict, dict]:
    (template,) = [t for w, t in pod_templates() if w.endswith("workerGroup front")]
    (container,) = template["spec"]["containers"]
    return template, container


def test_kubernetes_probes_and_grace_periods() -> None:
    _, front = _front()
    assert front["startupProbe"]["httpGet"]["path"] == "/ready"
    assert front["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert front["livenessProbe"]["httpGet"]["path"] == "/health"
    for where, template in pod_templates():
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace > _shutdown_bound_s(), f"{where}: {grace} s"


def test_raycluster_head_front_and_gpu_groups() -> None:
    cluster = ray_cluster()
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    front = groups["front"]
    assert front["replicas"] == front["minReplicas"] == front["maxReplicas"] == 1
    template, container = _front()
    (serve,) = [line for line in command_lines() if line.where.endswith("container sampler")]
    state_dir = serve.argv[serve.argv.index("--state-dir") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert "persistentVolumeClaim" in volumes[mounts[state_dir]], "state is not on a PVC"
    # ray start must return so that the sampler runs after it.
    assert "${KUBERAY_GEN_RAY_START_CMD//--block/}" in container["args"][0]
    gpu_limits = [
        c["resources"]["limits"].get("nvidia.com/gpu")
        for g in groups.values()
        for c in g["template"]["spec"]["containers"]
    ]
    assert any(gpu_limits), "no worker group requests GPUs"


def test_kustomization_service_and_claims_fit_together() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in k8s_files())
    objects = [d for p in k8s_files() for d in yaml_documents(p)]
    claims = {d["metadata"]["name"] for d in objects if d["kind"] == "PersistentVolumeClaim"}
    for where, template in pod_templates():
        for volume in template["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, where
    (service,) = [d for d in objects if d["kind"] == "Service"]
    front, container = _front()
    labels = front["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    # Selects the front only: no other pod template carries all the selector's labels.
    others = [w for w, t in pod_templates() if not w.endswith("front")]
    for where in others:
        (template,) = [t for w, t in pod_templates() if w == where]
        assert not service["spec"]["selector"].items() <= template["metadata"]["labels"].items()


def test_the_http_fleet_variant_finds_the_vllm_pods_behind_a_headless_service() -> None:
    """The front's command line parses, names the headless Service at its port, and the
    Services and claims it uses are in the kustomization."""
    kustomization = yaml.safe_load((HTTP_FLEET / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in http_fleet_files())
    objects = [d for p in http_fleet_files() for d in yaml_documents(p)]
    (front,) = [d for d in objects if d["kind"] == "Deployment"]
    template = front["spec"]["template"]
    (container,) = template["spec"]["containers"]
    line = CommandLine("http-fleet front", container["args"])
    assert container["command"] == ["adaptive-rollout"] and not _parse_errors([line])
    args = container["args"]
    assert args[args.index("--backend") + 1] == "http"
    name, port = args[args.index("--engine-service") + 1].split(":")
    services = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Service"}
    engines = services[name]
    assert engines["spec"]["clusterIP"] == "None"  # headless: one A record per pod
    assert int(port) in {p["port"] for p in engines["spec"]["ports"]}
    assert not engines["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    fronts = [s for s in services.values() if s is not engines]
    assert all(
        s["spec"]["selector"].items() <= template["metadata"]["labels"].items() for s in fronts
    )
    claims = {d["metadata"]["name"] for d in objects if d["kind"] == "PersistentVolumeClaim"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for volume in template["spec"]["volumes"]:
        assert volume["persistentVolumeClaim"]["claimName"] in claims
    weights = args[args.index("--weights-dir") + 1]
    assert any(weights.startswith(path + "/") for path in mounts.values())


def test_compose_mounts_provisioning_that_matches_the_dashboard() -> None:
    """Grafana finds the dashboard and the datasource it names; Prometheus its rules."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    mounts = {}
    for name in ("grafana", "prometheus"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source} does not exist"
                mounts[target] = (COMPOSE.parent / source).resolve()
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    (provider,) = yaml.safe_load(
        (provisioning / "dashboards" / "adaptive-rollout.yml").read_text()
    )["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert sorted(dashboards.glob("*.json")) == DASHBOARDS
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]
        assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
        for panel in panels:
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, panel["title"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for rule_file in config["rule_files"]:
        assert f"/etc/prometheus/{rule_file}" in mounts, rule_file
        assert mounts[f"/etc/prometheus/{rule_file}"] == (PROMETHEUS_CONFIG.parent / rule_file)
