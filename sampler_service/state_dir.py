"""The state directory: one sampler at a time, and one experiment per directory.

A state dir holds a run's finished groups, config, schedule progress and accepted
weights, and a sampler started on it serves them. Two guards keep that from going wrong
silently:

- a lock: an OS advisory lock (`flock`) on `lock` in the directory, held for the process's
  life, with the holder's pid written in the file. A second sampler on the same directory
  would deliver the same stored groups to another trainer; it refuses to start instead,
  naming the pid. The kernel drops the lock with the process (a kill -9 included), so a
  stale lock cannot exist.
- a fingerprint: what the directory was created for, by content (`fingerprint.json`): the
  data files' hashes, the model's config and a sample of its weight files (each
  safetensors header and the first and last MiB of every weight file: a fine-tune of the
  same architecture differs, a copy with new mtimes does not), and the backend. A start
  with other inputs would serve the old run's weights and groups as if they were the new
  one's; it refuses, listing each difference and the ways out: `--resume` (continue the
  stored run as it is), another `--state-dir`, or `--fresh` (the old directory is renamed
  aside, never deleted).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
FINGERPRINT_FILE = "fingerprint.json"
#: Bytes hashed at each end of a weight file: enough to tell trained weights apart
#: without reading a multi-GB checkpoint at every start.
_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class StateDirError(RuntimeError):
    """The state dir cannot be used by this sampler (held by another, or another run's)."""


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _model_digest(model_dir: Path) -> str:
    """The model's identity by content: config.json, then per weight file its name, size,
    safetensors header and first and last MiB."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as fh:
            if path.suffix == ".safetensors" and size >= 8:
                header_len = int.from_bytes(fh.read(8), "little")
                digest.update(fh.read(min(header_len, size - 8)))
            fh.seek(0)
            digest.update(fh.read(_SAMPLE_BYTES))
            fh.seek(max(size - _SAMPLE_BYTES, 0))
            digest.update(fh.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def fingerprint(model: Path, data: list[Path], backend: str) -> dict[str, Any]:
    """What a state dir is created for (see the module docstring)."""
    return {
        "model": {"path": str(model), "sha256": _model_digest(model)},
        "data": [{"file": str(path), "sha256": _sha256_file(path)} for path in data],
        "backend": backend,
    }


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each way `current` differs from `recorded`, as a line for the user. Data files
    compare by content: the same file under another path is no difference."""
    out = []
    if recorded.get("model", {}).get("sha256") != current["model"]["sha256"]:
        out.append(
            f"model: {current['model']['path']} is not the recorded model "
            f"({recorded.get('model', {}).get('path')}): its config or weights differ"
        )
    old = {d["sha256"]: d["file"] for d in recorded.get("data", [])}
    new = {d["sha256"]: d["file"] for d in current["data"]}
    added = [new[h] for h in new if h not in old]
    missing = [old[h] for h in old if h not in new]
    changed = [f for f in added if f in missing]  # the same path, another content
    parts = [f"{f} changed since the state dir was created" for f in changed]
    parts += [f"{f} is new" for f in added if f not in changed]
    parts += [f"{f} (recorded) is not given" for f in missing if f not in changed]
    if parts:
        out.append("data: " + "; ".join(parts))
    if recorded.get("backend") != current["backend"]:
        out.append(f"backend: {current['backend']} given, {recorded.get('backend')} recorded")
    return out


@dataclass
class StateDir:
    """A locked state dir; the lock lasts until `release()` or the process's end."""

    path: Path
    _fd: int

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1


def _holder(path: Path) -> str:
    with contextlib.suppress(OSError):
        return (path / LOCK_FILE).read_text().strip() or "unknown"
    return "unknown"


def _lock(path: Path) -> int:
    # Python opens descriptors non-inheritable: the engine and verifier processes this
    # sampler starts do not hold the lock after it dies.
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirError(
            f"state dir {path} is in use by another sampler (pid {_holder(path)}); stop it, "
            "or give this one its own --state-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _in_use(path: Path) -> bool:
    """Whether `path` holds anything of a run (more than a lock file)."""
    return path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir())


def _move_aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.{stamp}")
    n = 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.{stamp}-{n}"), n + 1
    fd = _lock(path)  # refuses while a sampler still runs on it
    try:
        path.rename(target)
    finally:
        os.close(fd)
    return target


def open_state_dir(
    path: Path, current: dict[str, Any], *, resume: bool = False, fresh: bool = False
) -> StateDir:
    """Create or reopen the state dir for the run `current` describes, locked.

    Raises StateDirError while another sampler holds it, or when it was created for other
    inputs and neither `resume` nor `fresh` says what to do.
    """
    if fresh and _in_use(path):
        log.warning("--fresh: moved the old state dir %s aside to %s", path, _move_aside(path))
    existing = _in_use(path)
    path.mkdir(parents=True, exist_ok=True)
    state = StateDir(path, _lock(path))
    try:
        _check_fingerprint(path, current, existing=existing, resume=resume)
    except BaseException:
        state.release()
        raise
    return state


def _check_fingerprint(
    path: Path, current: dict[str, Any], *, existing: bool, resume: bool
) -> None:
    record = path / FINGERPRINT_FILE
    if not record.is_file():
        if existing:
            log.warning(
                "state dir %s has no record of what it was created for (an older version "
                "wrote it): adopting it for model %s, data %s, backend %s",
                path,
                current["model"]["path"],
                ", ".join(d["file"] for d in current["data"]),
                current["backend"],
            )
        _write(record, current)
        return
    diffs = differences(json.loads(record.read_text()), current)
    if not diffs:
        return
    if not resume:
        raise StateDirError(
            f"state dir {path} was created for another run:\n  "
            + "\n  ".join(diffs)
            + "\ncontinue the stored run as it is with --resume, start a new one with another "
            "--state-dir, or move this one aside with --fresh (renamed, never deleted)"
        )
    log.warning(
        "--resume: continuing the run stored in %s (its weights, groups and config) "
        "although %s; the state dir now records these inputs",
        path,
        "; ".join(diffs),
    )
    _write(record, current)


def _write(record: Path, current: dict[str, Any]) -> None:
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(current, indent=1) + "\n")
    os.replace(tmp, record)
