"""Where a training run starts from, and what its output directory keeps of it.

A run's `--out` holds its checkpoints (`checkpoint-N`, `final`: model directories with a
`trainer_state.json`) and its log (`train_log.jsonl`, one record per step). A rerun of
the same command after a crash must neither start over from the base model (its first
pushes would roll the sampler's policy back to weights trained a few steps) nor log a
step twice. This module decides the start and keeps the directory consistent with it;
it needs no torch, so the decisions are tested without a model.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

STATE_FILE = "trainer_state.json"
LOG_FILE = "train_log.jsonl"
#: Log records of steps a resumed run trains again are moved here, not deleted.
ROLLED_BACK_LOG = "train_log.rolled_back.jsonl"


class StartError(ValueError):
    """`--out` holds a run this start cannot continue consistently; the message says how."""


@dataclass(frozen=True)
class Checkpoint:
    """A model directory written by the trainer, with the step and policy version its
    weights were trained to."""

    path: Path
    step: int
    policy_version: int


def read_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint at `path`, or None if it is a plain model directory."""
    state = path / STATE_FILE
    if not state.is_file():
        return None
    saved = json.loads(state.read_text())
    return Checkpoint(path, int(saved["step"]), int(saved["policy_version"]))


def checkpoints(out_dir: Path) -> list[Checkpoint]:
    """The checkpoints in `out_dir`, oldest step first."""
    if not out_dir.is_dir():
        return []
    found = [read_checkpoint(p) for p in out_dir.iterdir() if p.is_dir()]
    return sorted((c for c in found if c is not None), key=lambda c: (c.step, c.path.name))


def logged_steps(out_dir: Path) -> list[int]:
    """The step numbers `out_dir`'s training log holds, in order."""
    log = out_dir / LOG_FILE
    if not log.is_file():
        return []
    return [int(json.loads(line)["step"]) for line in log.read_text().splitlines() if line.strip()]


def choose_start(model: Path, out_dir: Path, *, resume: bool, fresh: bool) -> Path:
    """The model directory training starts from.

    `fresh`: `model`, whatever `out_dir` holds (the caller moves it aside). `resume`: the
    newest checkpoint in `out_dir`, which must hold one. Neither: `model` when it is one of
    our checkpoints (an explicit choice), else the newest checkpoint in `out_dir` when
    there is one (a rerun after a crash continues), else `model`. A start whose step the
    log has passed without a checkpoint to continue from is refused: it would log those
    steps a second time.
    """
    if fresh:
        return model
    saved = checkpoints(out_dir)
    if resume:
        if not saved:
            raise StartError(
                f"--resume: {out_dir} holds no checkpoint to resume from (a directory with "
                f"{STATE_FILE}); --fresh starts from --model {model}"
            )
        return saved[-1].path
    own = read_checkpoint(model)
    start = model if own is not None or not saved else saved[-1].path
    step = own.step if own is not None else saved[-1].step if saved else 0
    last_logged = max(logged_steps(out_dir), default=0)
    if last_logged > step and not saved:
        raise StartError(
            f"{out_dir / LOG_FILE} holds steps up to {last_logged} and {out_dir} no checkpoint "
            f"to continue from: --fresh moves {out_dir} aside and starts from --model {model}; "
            "--resume continues a run from its newest checkpoint"
        )
    return start


def move_aside(out_dir: Path) -> Path | None:
    """Rename a non-empty `out_dir` to `<out_dir>.<time>` (never deleted); its new path."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = out_dir.with_name(f"{out_dir.name}.{stamp}"), 1
    while target.exists():
        target, n = out_dir.with_name(f"{out_dir.name}.{stamp}-{n}"), n + 1
    out_dir.rename(target)
    return target


def trim_log(out_dir: Path, step: int) -> int:
    """Keep the log's records up to `step` (the run goes on from there); the later ones
    go to `ROLLED_BACK_LOG`. Returns how many moved."""
    log = out_dir / LOG_FILE
    if not log.is_file():
        return 0
    keep: list[str] = []
    later: list[str] = []
    for line in log.read_text().splitlines():
        if line.strip():
            (keep if int(json.loads(line)["step"]) <= step else later).append(line)
    if later:
        with (out_dir / ROLLED_BACK_LOG).open("a") as fh:
            fh.write("\n".join(later) + "\n")
        tmp = log.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in keep))
        tmp.replace(log)
    return len(later)


def prune(out_dir: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` periodic checkpoints (`checkpoint-N`; `final`
    stays); 0 keeps every one. Returns what was removed."""
    if keep <= 0:
        return []
    periodic = [c for c in checkpoints(out_dir) if c.path.name.startswith("checkpoint-")]
    removed = [c.path for c in periodic[:-keep]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
