"""The wheel bundle of the GPU check (`make gpu-bundle`), tested where no GPU is.

- it fits what travels to the GPU machine and holds each pinned package once;
- its cp312 wheels install for CPython 3.12 on manylinux x86-64 (pip's own tag check);
- its cp311 twin (same names and versions) installed over a venv that holds only the CPU
  torch and the GPU image's packages gives every module the check imports, from the
  bundle where the image has another version;
- the check itself runs there: ``deploy/gpu_checks/run.sh --cpu-dry-run``.

`make test-gpu-bundle` builds both bundles and the twin venv before running these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / ".gpu-bundle"
TWIN = BUNDLE / "twin" / "bin" / "python"
sys.path.insert(0, str(REPO / "deploy" / "gpu_checks"))
import bundle  # noqa: E402

pytestmark = [
    pytest.mark.gpu_bundle,
    pytest.mark.skipif(
        not (BUNDLE / "cp311" / "manifest.json").is_file() or not TWIN.is_file(),
        reason="run `make test-gpu-bundle` (it builds the bundles and the twin venv)",
    ),
]

#: What the check imports, directly or through verl's trainer and the sampler.
CHECK_IMPORTS = [
    "verl",
    "verl.trainer.main_ppo",
    "verl.trainer.ppo.v1",
    "verl.checkpoint_engine",
    "verl.workers.rollout.llm_server",
    "verl.workers.engine_workers",
    "ray",
    "transfer_queue",
    "tensordict",
    "hydra",
    "omegaconf",
    "datasets",
    "fastapi",
    "uvicorn",
    "pydantic",
    "orjson",
    "math_verify",
    "sampler_service.app",
    "sampler_service.cli",
    "trainer_client.verl.v1",
    "trainer_client.verl.weights",
]


def _manifest(tag: str) -> dict:
    return json.loads((BUNDLE / tag / "manifest.json").read_text())


def _installed_site() -> Path:
    """The cp311 twin installed as run.sh installs a bundle (once per manifest)."""
    site = BUNDLE / "cp311.site"
    stamp = site / ".installed"
    manifest = BUNDLE / "cp311" / "manifest.json"
    if not stamp.is_file() or stamp.stat().st_mtime < manifest.stat().st_mtime:
        subprocess.run(["rm", "-rf", str(site)], check=True)
        wheels = sorted(str(p) for p in (BUNDLE / "cp311").glob("*.whl"))
        subprocess.run(
            [
                str(TWIN),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--target",
                str(site),
                *wheels,
            ],
            check=True,
        )
        stamp.touch()
    return site


def test_bundle_fits_and_holds_each_pin_once() -> None:
    manifest = _manifest("cp312")
    pins = bundle.read_pins()
    assert {e["name"]: e["version"] for e in manifest["wheels"]} == pins
    files = sorted(p.name for p in (BUNDLE / "cp312").glob("*.whl"))
    assert files == sorted(e["file"] for e in manifest["wheels"])  # one wheel per package
    total = sum((BUNDLE / "cp312" / f).stat().st_size for f in files)
    assert total <= bundle.LIMIT_BYTES, f"{total / 2**20:.1f} MiB"
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    repo = sum((REPO / f).stat().st_size for f in listed if f and (REPO / f).is_file())
    print(f"bundle {total / 2**20:.1f} MiB + repository {repo / 2**20:.1f} MiB")
    assert total + repo <= 63 * 2**20, "bundle + repository files must fit one call's carry"


def test_ray_is_repacked_without_what_the_check_never_uses() -> None:
    (ray,) = (BUNDLE / "cp312").glob("ray-*.whl")
    with zipfile.ZipFile(ray) as z:
        names = z.namelist()
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    assert not [n for n in names if n.startswith(bundle.RAY_STRIP)]
    assert not [r for r in record.splitlines() if r.startswith(bundle.RAY_STRIP)]
    assert "ray/_raylet.so" in names and "ray/core/src/ray/gcs/gcs_server" in names


def test_cp312_wheels_install_for_python_312(tmp_path: Path) -> None:
    wheels = sorted(str(p) for p in (BUNDLE / "cp312").glob("*.whl"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-deps",
            "--only-binary=:all:",
            *bundle.platform_args("3.12"),
            "--target",
            str(tmp_path),
            *wheels,
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "Would install" in out.stdout


def test_twin_has_the_same_names_and_versions() -> None:
    twin = {(e["name"], e["version"]) for e in _manifest("cp311")["wheels"]}
    assert twin == {(e["name"], e["version"]) for e in _manifest("cp312")["wheels"]}


def test_twin_gives_what_the_check_imports() -> None:
    site = _installed_site()
    code = (
        "import importlib, json, transformers, tokenizers\n"
        f"for m in {CHECK_IMPORTS!r}: importlib.import_module(m)\n"
        "print(json.dumps({'transformers': [transformers.__version__, transformers.__file__],"
        " 'tokenizers': [tokenizers.__version__, tokenizers.__file__]}))\n"
    )
    out = subprocess.run(
        [str(TWIN), "-c", code],
        env={**os.environ, "PYTHONPATH": f"{site}:{REPO}", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    pins = bundle.read_pins()
    for name in ("transformers", "tokenizers"):  # the bundle's, not the image's
        version, path = got[name]
        assert version == pins[name] and path.startswith(str(site)), got


def test_cpu_dry_run_of_the_gpu_check(tmp_path: Path) -> None:
    _installed_site()
    out = subprocess.run(
        [str(REPO / "deploy" / "gpu_checks" / "run.sh"), "--cpu-dry-run", "--out", str(tmp_path)],
        env={**os.environ, "PYTHON": str(TWIN), "BUNDLE": str(BUNDLE / "cp311")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert out.returncode == 0 and summary["passed"], out.stdout[-4000:] + out.stderr[-2000:]
    assert summary["mode"] == "cpu-dry-run"
    assert {
        "sampler",
        "trainer built through the rollout manager",
        "TransferQueue write/read of leased groups",
        "weight push through the checkpoint engine",
    } <= set(summary["stages"])
    assert any("FSDP" in s for s in summary["skipped"])
    assert (tmp_path / "run.log").is_file()
    print(f"dry run: {summary['wall_s']} s")
