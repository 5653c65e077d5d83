"""Build the wheel bundle the GPU check installs on a machine without network.

    python deploy/gpu_checks/bundle.py [--out .gpu-bundle] [--python 3.12]

Fetches every pin of deploy/gpu_checks/bundle.txt as a wheel for CPython `--python` on
manylinux x86-64 (``pip download --no-deps --only-binary=:all:``) into
``OUT/cp312`` (or ``cp311``, the twin the CPU test installs), builds a wheel for a pin that
PyPI has only as an sdist, repacks Ray without ``ray/jars`` and the dashboard's web client,
and writes ``manifest.json`` (name, version, file, bytes). Wheels already there are kept,
so a rerun is a no-op. Fails when the cp312 bundle is over its size limit.

On the GPU machine: ``pip install --no-index --no-deps --target DIR OUT/cp312/*.whl``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PINS = HERE / "bundle.txt"
LIMIT_BYTES = 60 * 1024 * 1024
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
#: What the check never uses of Ray: the Java worker jar, the dashboard's web client and
#: the libraries on top of Ray core (RLlib, Data, Serve, Tune, Train, LLM).
RAY_STRIP = (
    "ray/jars/",
    "ray/dashboard/client/",
    "ray/rllib/",
    "ray/data/",
    "ray/serve/",
    "ray/tune/",
    "ray/train/",
    "ray/llm/",
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = PINS) -> dict[str, str]:
    """{canonical name: version} from the pin file; a name twice is an error."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        key = canonical(name)
        if not version or key in pins:
            raise SystemExit(f"{path}: {line!r}: need one name==version per package")
        pins[key] = version
    return pins


def wheel_of(directory: Path, name: str, version: str) -> Path | None:
    """The wheel of name==version in `directory`, if one is there."""
    stem = canonical(name).replace("-", "_")
    for path in directory.glob("*.whl"):
        dist, ver = path.name.split("-")[:2]
        if canonical(dist).replace("-", "_") == stem and ver == version:
            return path
    return None


def platform_args(python: str) -> list[str]:
    args = ["--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def fetch(name: str, version: str, dest: Path, python: str) -> Path:
    """A wheel of name==version for `python` in `dest` (downloaded, or built from its sdist)."""
    found = wheel_of(dest, name, version)
    if found is not None:
        return found
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    spec = f"{name}=={version}"
    got = subprocess.run(
        [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            *platform_args(python),
            "-d",
            str(dest),
            spec,
        ],
        capture_output=True,
        text=True,
    )
    if got.returncode != 0:
        if "No matching distribution" not in got.stderr and "from versions: none" not in got.stderr:
            raise SystemExit(f"pip download {spec} failed:\n{got.stderr}")
        # Only an sdist: build a wheel (pure Python ones are py3-none-any, fit for any CPython 3).
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [*pip, "wheel", "--no-deps", "--no-binary", name, "-w", tmp, spec], check=True
            )
            (built,) = Path(tmp).glob("*.whl")
            if (
                not built.name.endswith("-py3-none-any.whl")
                and "-py2.py3-none-any" not in built.name
            ):
                raise SystemExit(f"{spec} has no wheel and builds a platform wheel: {built.name}")
            built.rename(dest / built.name)
    found = wheel_of(dest, name, version)
    if found is None:
        raise SystemExit(f"no wheel of {spec} in {dest} after fetching it")
    return found


def strip_ray(wheel: Path) -> None:
    """Rewrite Ray's wheel without RAY_STRIP, its RECORD updated (idempotent).

    Members over 1 MB (the raylet, the GCS server, the core library) are stored with LZMA,
    which pip unpacks like any zip member: 37 -> 28 MiB.
    """
    with zipfile.ZipFile(wheel) as src:
        if not any(n.startswith(RAY_STRIP) for n in src.namelist()):
            return
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w") as out:
            for info in src.infolist():
                if info.filename.startswith(RAY_STRIP):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    rows = data.decode().splitlines()
                    data = (
                        "\n".join(r for r in rows if not r.startswith(RAY_STRIP)) + "\n"
                    ).encode()
                info.compress_type = (
                    zipfile.ZIP_LZMA if info.file_size > 1_000_000 else zipfile.ZIP_DEFLATED
                )
                out.writestr(info, data)
    tmp.replace(wheel)


def build(out: Path, python: str) -> dict[str, object]:
    tag = "cp" + python.replace(".", "")
    dest = out / tag
    dest.mkdir(parents=True, exist_ok=True)
    pins = read_pins()
    wheels = {}
    for name, version in pins.items():
        wheel = fetch(name, version, dest, python)
        if name == "ray":
            strip_ray(wheel)
        wheels[name] = wheel
    stray = sorted(set(dest.glob("*.whl")) - set(wheels.values()))
    for path in stray:  # an older pin's wheel: one version of each
        path.unlink()
    entries = [
        {"name": n, "version": pins[n], "file": w.name, "bytes": w.stat().st_size}
        for n, w in sorted(wheels.items())
    ]
    total = sum(e["bytes"] for e in entries)
    manifest = {
        "python": python,
        "total_bytes": total,
        "limit_bytes": LIMIT_BYTES,
        "wheels": entries,
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"{dest}: {len(entries)} wheels, {total / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f})"
    )
    if tag == "cp312" and total > LIMIT_BYTES:
        big = sorted(entries, key=lambda e: -e["bytes"])[:5]
        raise SystemExit(
            f"the cp312 bundle is {total / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f} MiB; largest: "
            + ", ".join(f"{e['file']} {e['bytes'] / 2**20:.1f} MiB" for e in big)
        )
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu-bundle"))
    parser.add_argument(
        "--python", default="3.12", help="target CPython version (3.12; 3.11 for the twin)"
    )
    args = parser.parse_args(argv)
    build(args.out, args.python)


if __name__ == "__main__":
    main()
