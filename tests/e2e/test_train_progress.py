"""`adaptive-rollout train` with stderr piped to a file: the progress bar is a few frames,
not one per step (a log of tens of KB of redrawn bars)."""

from __future__ import annotations

import math
import re
import subprocess
import time

import pytest
from support import train_command

from bench.common import fixed_groups

pytestmark = pytest.mark.timeout(600)

STEPS = 12
#: A piped log gets at most one bar per this many seconds (plus the first and last).
PIPED_INTERVAL_S = 30.0


def test_a_piped_progress_bar_draws_a_few_frames_not_one_per_step(
    make_server, toy, tmp_path
) -> None:
    server = make_server(fixed_groups(2, max_tokens=4))
    stderr = tmp_path / "train.err"
    cmd = train_command(server.url, toy.model_dir, tmp_path / "run", STEPS)
    started = time.monotonic()
    with stderr.open("w") as err:
        done = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=3 * 240 + 30
        )
    wall_s = time.monotonic() - started
    text = stderr.read_text()
    assert done.returncode == 0, done.stdout + text
    # A frame is one draw of the bar: "\r"-separated on a terminal, one line in a file.
    frames = [f for f in re.split(r"[\r\n]", text) if f.startswith("train:")]
    assert frames, text  # the bar is on (stderr is no terminal, progress is not disabled)
    assert f"{STEPS}/{STEPS}" in frames[-1], frames[-1]
    # The first and the closing draw, plus one per interval the run lasted.
    assert len(frames) <= 2 + math.ceil(wall_s / PIPED_INTERVAL_S), frames
