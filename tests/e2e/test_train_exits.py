"""`adaptive-rollout train` as its own process, ended every way it can end early: each exit
leaves a checkpoint and the command that resumes from it, and Ctrl-C finishes the step
under way and exits 130 without a traceback. Also: the trainer says once when it trains
far off-policy."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import perturbed_file, train_command

pytestmark = pytest.mark.timeout(600)

#: Unbounded buffering, so that a trainer can be made to train on old groups.
CONFIG = {
    "rule": "fixed",
    "group_size": 2,
    "n_max": 2,
    "wave_size": 2,
    "max_tokens": 4,
    "max_staleness": None,
}


@pytest.fixture(scope="module")
def server(make_module_server: Any) -> Any:
    return make_module_server(CONFIG)


def _steps_logged(out: Path) -> int:
    log = out / "train_log.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _start(cmd: list[str], tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    err = tmp_path / "train.err"
    with err.open("w") as fh:  # the child writes to its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, text=True)
    return proc, err


def _wait_steps(proc: subprocess.Popen[str], out: Path, n: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while _steps_logged(out) < n:
        assert proc.poll() is None, f"the trainer exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{n} steps not logged in {timeout_s:.0f} s"
        time.sleep(0.2)


def _resume_command(stderr: str) -> list[str]:
    line = stderr.split("resume with:\n", 1)[1].splitlines()[0].strip()
    assert line.startswith("adaptive-rollout train "), line
    return shlex.split(line)[2:]


def _checkpoint(out: Path, stderr: str) -> dict[str, Any]:
    saved = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert saved, f"no checkpoint in {out}: {stderr}"
    assert f"saved checkpoint {saved[-1]}" in stderr, stderr
    return json.loads((saved[-1] / "trainer_state.json").read_text())


def test_a_trainer_far_behind_the_weights_says_so_once(server: Any, toy: Any, tmp_path: Path):
    with httpx.Client(base_url=server.url) as c:  # a buffer of groups made at v0
        while c.get("/v1/stats").json()["queue"]["ready"] < 24:
            time.sleep(0.2)
    out = tmp_path / "run"
    cmd = train_command(server.url, toy.model_dir, out, 5, "--lag-warning", "0.5", "--no-progress")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert max(r["version_lag_mean"] for r in log) > 0.5  # it did train on old groups
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "max_staleness" in warnings[0], done.stderr


def test_ctrl_c_finishes_the_step_saves_and_exits_130_without_a_traceback(
    server: Any, toy: Any, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    cmd = train_command(server.url, toy.model_dir, out, 1000, "--no-progress")
    proc, err = _start(cmd, tmp_path)
    _wait_steps(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    stderr = err.read_text()
    assert "Traceback" not in stderr, stderr
    state = _checkpoint(out, stderr)
    # The step under way when the signal came was finished: logged and in the checkpoint.
    assert state["step"] == _steps_logged(out) >= 2
    with httpx.Client(base_url=server.url) as c:
        assert c.get("/health").json()["policy_version"] >= state["policy_version"]

    # The printed command resumes from the checkpoint (one more step here).
    resume = [sys.executable, "-m", "sampler_service", "train", *_resume_command(stderr)]
    done = subprocess.run(
        [*resume, "--steps", str(state["step"] + 1)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    last = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])
    assert last["step"] == state["step"] + 1


def test_a_version_pushed_by_someone_else_saves_a_checkpoint(
    server: Any, toy: Any, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc, err = _start(
        train_command(server.url, toy.model_dir, out, 1000, "--no-progress"), tmp_path
    )
    _wait_steps(proc, out, 1)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.put(
            "/v1/weights", params={"version": 1_000_000}, content=perturbed_file(toy.model_dir, 0)
        )
        assert r.status_code == 200, r.text
    assert proc.wait(timeout=120) == 1
    stderr = err.read_text()
    assert "409 stale_version" in stderr, stderr
    assert _checkpoint(out, stderr)["step"] >= 1
    assert "resume with:" in stderr


def test_a_sampler_gone_past_the_watchdog_saves_a_checkpoint(
    make_server: Any, toy: Any, tmp_path: Path
) -> None:
    sampler = make_server(CONFIG)
    out = tmp_path / "run"
    cmd = train_command(sampler.url, toy.model_dir, out, 1000, "--no-progress", "--watchdog-s", "5")
    proc, err = _start(cmd, tmp_path)
    _wait_steps(proc, out, 1)
    sampler.kill()
    assert proc.wait(timeout=3 * 5 + 30 + 60) == 1
    stderr = err.read_text()
    assert "unavailable" in stderr and "Traceback" not in stderr, stderr
    assert _checkpoint(out, stderr)["step"] >= 1


def test_a_rerun_after_kill_9_resumes_and_says_which_versions_it_rolls_back(
    make_server: Any, toy: Any, tmp_path: Path
) -> None:
    # Periodic checkpoints are on by default (every 10 pushes; 3 here, to be quick). A
    # trainer killed between two of them is run again with the same command: it must go
    # on from the newest checkpoint, not from --model, push that checkpoint's weights as a
    # new version with one loud line naming what it rolls back, and log each step once.
    sampler = make_server(CONFIG)
    out = tmp_path / "run"
    steps = 40
    cmd = train_command(
        sampler.url, toy.model_dir, out, steps, "--no-progress", "--save-every", "3"
    )
    proc, _ = _start(cmd, tmp_path)
    _wait_steps(proc, out, 7)
    # Frozen (SIGSTOP) where the sampler serves weights newer than the newest checkpoint
    # (right after a checkpoint there is nothing to roll back), and killed there.
    deadline = time.monotonic() + 120
    while True:
        proc.send_signal(signal.SIGSTOP)
        with httpx.Client(base_url=sampler.url) as c:
            served = c.get("/health").json()["policy_version"]
        newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
        if served > newest:
            break
        assert time.monotonic() < deadline, "no moment with weights newer than a checkpoint"
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=60)
    killed_at = _steps_logged(out)
    assert killed_at < steps, "the run ended before it was killed"
    # One push per step, made before the step is logged.
    assert served in (killed_at, killed_at + 1)
    assert newest == killed_at // 3 * 3 and len(list(out.glob("checkpoint-*"))) <= 2

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr  # --no-progress: no bar of transformers' either
    assert f"resuming from {out / f'checkpoint-{newest}'} (step {newest}" in done.stderr
    rolled_back = [line for line in done.stderr.splitlines() if "rolls back" in line]
    assert len(rolled_back) == 1, done.stderr
    assert f"v{served}, newer than this trainer's v{newest}" in rolled_back[0]
    assert f"as v{served + 1} rolls back what v{newest + 1}..v{served}" in rolled_back[0]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1)), "a step logged twice or missing"
    # The steps after the checkpoint were trained on the checkpoint's weights, served anew.
    assert log[newest]["policy_version"] == served + 2


def test_a_rerun_that_would_log_steps_again_is_refused_naming_fresh_and_resume(
    server: Any, toy: Any, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    cmd = train_command(server.url, toy.model_dir, out, 2, "--no-progress", "--save-every", "0")
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    shutil.rmtree(out / "final")  # as a run killed with no checkpoint leaves it
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2, again.stderr
    assert again.stderr.count("\n") == 1 and "--fresh" in again.stderr, again.stderr
    assert "--resume" in again.stderr and "Traceback" not in again.stderr
    fresh = subprocess.run([*cmd, "--fresh"], capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    log = (out / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1, 2]
    assert len(list(tmp_path.glob("run.*"))) == 1  # the old run, moved aside
