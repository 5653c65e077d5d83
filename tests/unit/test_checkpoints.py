"""Where a training run starts from: a rerun after a crash continues from its newest
checkpoint, an explicit checkpoint is honoured, `--fresh` and `--resume` do what they say,
and a start that would log a step twice is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_client import checkpoints
from trainer_client.checkpoints import StartError, choose_start, prune, trim_log


def _checkpoint(path: Path, step: int, version: int) -> Path:
    path.mkdir(parents=True)
    (path / checkpoints.STATE_FILE).write_text(
        json.dumps({"step": step, "policy_version": version})
    )
    return path


def _log(out: Path, steps: range) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 0.0}) for s in steps]
    (out / checkpoints.LOG_FILE).write_text("".join(f"{line}\n" for line in lines))


def test_a_rerun_continues_from_the_newest_checkpoint(tmp_path: Path) -> None:
    base, out = tmp_path / "model", tmp_path / "run"
    base.mkdir()
    _checkpoint(out / "checkpoint-70", 70, 70)
    newest = _checkpoint(out / "checkpoint-80", 80, 80)
    _log(out, range(1, 90))  # killed at step 89, after the checkpoint at 80
    assert choose_start(base, out, resume=False, fresh=False) == newest
    assert choose_start(base, out, resume=True, fresh=False) == newest
    assert choose_start(base, out, resume=False, fresh=True) == base
    # An explicit checkpoint as --model is honoured, even an older one.
    older = out / "checkpoint-70"
    assert choose_start(older, out, resume=False, fresh=False) == older


def test_a_start_that_would_log_steps_twice_is_refused(tmp_path: Path) -> None:
    base, out = tmp_path / "model", tmp_path / "run"
    base.mkdir()
    _log(out, range(1, 90))  # a run with no checkpoint (--save-every 0)
    with pytest.raises(StartError, match=r"steps up to 89.*--fresh.*--resume"):
        choose_start(base, out, resume=False, fresh=False)
    with pytest.raises(StartError, match="--resume: .* no checkpoint"):
        choose_start(base, out, resume=True, fresh=False)
    assert choose_start(base, tmp_path / "new", resume=False, fresh=False) == base


def test_the_log_keeps_each_step_once_and_rolled_back_records_are_kept_aside(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    _log(out, range(1, 90))
    assert trim_log(out, 80) == 9
    assert checkpoints.logged_steps(out) == list(range(1, 81))
    aside = (out / checkpoints.ROLLED_BACK_LOG).read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside] == list(range(81, 90))


def test_periodic_checkpoints_are_pruned_to_the_newest_and_final_stays(tmp_path: Path) -> None:
    out = tmp_path / "run"
    for step in (10, 20, 30):
        _checkpoint(out / f"checkpoint-{step}", step, step)
    _checkpoint(out / "final", 35, 35)
    removed = prune(out, 2)
    assert [p.name for p in removed] == ["checkpoint-10"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-20", "checkpoint-30", "final"]
    assert checkpoints.move_aside(out) is not None and not out.exists()
