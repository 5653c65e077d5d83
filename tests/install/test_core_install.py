"""The project installed alone, with no extra, into a fresh venv: a trainer node's install.

`pip install .` must give a trainer that brings its own torch (a verl node) the contract,
the clients and the policy math, and nothing of the server (FastAPI, uvicorn, engines) or
of the reference trainer (torch, transformers, matplotlib). There, the trainer side
imports and talks to a live sampler started from the project's venv, and the console
script runs the trainer's subcommands and names the extra a server command needs.

Needs the package index (or pip's cache) for the core dependencies; the project itself
is built from a copy of its sources.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from support import Server

pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
#: What the core install must not bring: the server's and the reference trainer's stacks.
NOT_CORE = {"torch", "transformers", "fastapi", "uvicorn", "starlette", "matplotlib", "rich"}

TRAINER_SIDE = """
import json, sys
from trainer_client import SamplerClient
from trainer_client.contract import dtypes, flags, protocol, wire
import trainer_client.client, trainer_client.exceptions, trainer_client.nccl, trainer_client.verl.settings

url = sys.argv[1]
with SamplerClient(url, consumer="core-install", watchdog_s=60) as client:
    health = client.health()
    lease = client.lease(2, wait_s=30.0)
    while not lease.groups:
        lease = client.lease(2, wait_s=30.0)
    acked = client.ack(lease.groups)
    stats = client.stats()
packed = wire.pack_group(lease.groups[0])
print(json.dumps({
    "status": health.status,
    "groups": len(lease.groups),
    "acked": acked.acked,
    "trained_groups": stats["trained_groups"],
    "round_trip": wire.unpack_group(packed) == lease.groups[0].model_copy(update={"delivery_id": None}),
    "loaded": sorted({m.split(".")[0] for m in sys.modules}),
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `make wheel` builds, as the README says to install it, from a copy of the
    sources (the build writes its scratch files beside them)."""
    root = tmp_path_factory.mktemp("wheel")
    sources = root / "src"
    sources.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "Makefile"):
        shutil.copy2(REPO / name, sources / name)
    for folder in ("make", "strategies", "sampler_service", "trainer_client"):
        shutil.copytree(
            REPO / folder, sources / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    done = subprocess.run(
        ["make", "-C", str(sources), "wheel", f"PYTHON={sys._base_executable}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    [built] = (sources / "dist").glob("adaptive_rollout-*.whl")
    return built


@pytest.fixture(scope="module")
def core_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding `pip install <the wheel>` and nothing else."""
    venv = tmp_path_factory.mktemp("core-install") / "venv"
    base_python = str(Path(sys._base_executable))
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    done = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--progress-bar", "off", str(wheel)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return venv


def test_the_wheel_carries_the_license_it_declares(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [license_file] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert "Apache License" in archive.read(license_file).decode()
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License: Apache-2.0" in metadata or "License-Expression: Apache-2.0" in metadata


@pytest.fixture(scope="module")
def sampler(make_module_server: Callable[..., Server]) -> Server:
    return make_module_server({"rule": "fixed", "group_size": 2, "n_max": 2, "wave_size": 2})


def _run(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # Isolated (-I for python): only what the venv holds, nothing of this checkout.
    return subprocess.run(
        list(argv), capture_output=True, text=True, check=False, cwd=venv.parent, timeout=300
    )


def test_core_install_holds_no_server_or_reference_trainer_stack(core_venv: Path) -> None:
    done = _run(core_venv, str(core_venv / "bin" / "pip"), "list", "--format=json")
    installed = {d["name"].lower().replace("_", "-") for d in json.loads(done.stdout)}
    assert "adaptive-rollout" in installed
    assert {"pydantic", "numpy", "httpx", "msgpack", "orjson", "tqdm"} <= installed
    assert not installed & NOT_CORE, sorted(installed & NOT_CORE)


def test_trainer_side_imports_and_leases_from_a_live_sampler(
    core_venv: Path, sampler: Server
) -> None:
    python = str(core_venv / "bin" / "python")
    done = _run(core_venv, python, "-I", "-c", TRAINER_SIDE, sampler.url)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["status"] == "ok"
    assert result["groups"] >= 1 and result["acked"] == result["groups"]
    assert result["trained_groups"] >= result["groups"]
    assert result["round_trip"] is True
    assert not set(result["loaded"]) & (NOT_CORE | {"sampler_service"}), result["loaded"]


def test_console_script_runs_trainer_commands_and_names_missing_extras(
    core_venv: Path, sampler: Server
) -> None:
    script = str(core_venv / "bin" / "adaptive-rollout")
    events = _run(core_venv, script, "events", "--url", sampler.url)
    assert events.returncode == 0, events.stderr
    config = _run(core_venv, script, "config", "get", "--url", sampler.url)
    assert config.returncode == 0, config.stderr
    assert json.loads(config.stdout)["rule"] == "fixed"
    for argv, extra in (
        (["stats", "--url", sampler.url], "ops"),
        (["serve", "--model", str(core_venv), "--data", "d.jsonl"], "server"),
        (["train", "--url", sampler.url, "--model", str(core_venv)], "trainer"),
    ):
        done = _run(core_venv, script, *argv)
        assert done.returncode != 0
        assert f"pip install 'adaptive-rollout[{extra}]'" in done.stderr, (argv, done.stderr)


NCCL_WITHOUT_TORCH = """
from trainer_client.nccl import NCCLTransferError, NCCLWeightSender

sender = NCCLWeightSender("http://127.0.0.1:9", master_address="127.0.0.1", master_port=1)
try:
    sender.connect(object())
except NCCLTransferError as exc:
    print(exc)
"""


def test_the_nccl_sender_names_what_to_install_on_a_core_install(core_venv: Path) -> None:
    """The core install has neither torch nor vLLM: connecting fails with the install to
    make, not an ImportError from inside the module."""
    python = str(core_venv / "bin" / "python")
    done = _run(core_venv, python, "-I", "-c", NCCL_WITHOUT_TORCH)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "pip install 'adaptive-rollout[vllm]'" in done.stdout
    assert "No module named 'torch'" in done.stdout
