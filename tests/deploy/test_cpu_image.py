"""The CPU image's pip steps, run as written in a fresh venv here (no Docker daemon).

The Dockerfile is replayed in order: ARG and ENV build the environment the steps see,
WORKDIR and COPY lay the copied sources into a scratch root, and each RUN step that
installs with pip runs under bash. Two values are overridden the way `docker build` can
override them: the venv's location (ENV VIRTUAL_ENV, here a scratch directory) and the
torch index (ARG TORCH_INDEX_URL, here PyPI, where pip also sees the CPU torch wheel this
machine provides; DEPLOY_TORCH_INDEX_URL picks another).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deployfiles import (
    DOCKERFILES,
    REPO,
    docker_assignments,
    dockerfile_arg,
    dockerfile_instructions,
    pyproject_ray_pin,
)

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1200)]

TORCH_INDEX_URL = os.environ.get("DEPLOY_TORCH_INDEX_URL", "https://pypi.org/simple")


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def _copy(sources: list[str], dest: Path, into_directory: bool) -> None:
    """COPY: a directory's contents go into dest; a file goes to dest, or into it when
    dest is a directory (it ends with / or several sources are copied)."""
    for src in sources:
        path = REPO / src
        if path.is_dir():
            shutil.copytree(
                path, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            target = dest / path.name if into_directory else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def test_cpu_image_pip_steps_install_in_a_fresh_venv(tmp_path: Path) -> None:
    dockerfile = DOCKERFILES[0]
    root, venv = tmp_path / "root", tmp_path / "venv"
    # The image's PATH: its python first (python:3.11 here is this interpreter's base).
    base_bin = str(Path(sys._base_executable).parent)
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "PATH": f"{base_bin}{os.pathsep}{os.environ['PATH']}",
    }
    build_args = {"TORCH_INDEX_URL": TORCH_INDEX_URL}
    overrides = {"VIRTUAL_ENV": str(venv)}
    workdir = root
    root.mkdir()
    ran = []
    for ins in dockerfile_instructions(dockerfile):
        if ins.keyword == "ARG":
            for key, default in docker_assignments(ins.args).items():
                env[key] = build_args.get(key, default)
        elif ins.keyword == "ENV":
            for key, value in docker_assignments(ins.args).items():
                env[key] = overrides.get(key, _expand(value, env))
        elif ins.keyword == "WORKDIR":
            workdir = root / ins.args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "COPY":
            *sources, dest = ins.args.split()
            assert not any(s.startswith("--") for s in sources), ins
            target = root / dest.lstrip("/") if dest.startswith("/") else workdir / dest
            _copy(sources, target, dest.endswith("/") or len(sources) > 1)
        elif ins.keyword == "RUN" and "pip install" in ins.args:
            done = subprocess.run(
                ["bash", "-o", "pipefail", "-c", ins.args],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            tail = (done.stdout + done.stderr)[-6000:]
            assert done.returncode == 0, f"{dockerfile.name}:{ins.line} RUN {ins.args}\n{tail}"
            ran.append(ins.line)
    assert len(ran) == 2, f"expected the torch and the project pip steps, ran lines {ran}"

    python = venv / "bin" / "python"
    check = (
        "import ray, torch, sampler_service.app, trainer_client.grpo; "
        "print(ray.__version__, torch.__version__)"
    )
    done = subprocess.run(
        # Isolated: only what the venv holds, nothing from PYTHONPATH or this checkout.
        [str(python), "-I", "-c", check],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    ray_version, torch_version = done.stdout.split()
    assert ray_version == pyproject_ray_pin()
    assert torch_version.split("+")[0] == dockerfile_arg(dockerfile, "TORCH_VERSION")
    assert torch_version.endswith("+cpu"), f"not the CPU build of torch: {torch_version}"
    # The console script the image's CMD runs.
    done = subprocess.run(
        [str(venv / "bin" / "adaptive-rollout"), "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0 and "--state-dir" in done.stdout, done.stderr
