"""The GPU check's reading of verl's console log, on lines recorded on an H200.

`data/verl_h200_float32_steps.log` holds the ``step:N`` lines of the float32 phase of
`deploy/gpu_checks/run.sh` on one H200 (verl 0.9.1): validation's ``step:0`` line, then
three training steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "gpu_checks"))
import verl_check  # noqa: E402

pytestmark = pytest.mark.gpu_bundle

RECORDED = Path(__file__).parent / "data" / "verl_h200_float32_steps.log"


def test_validation_line_is_not_a_training_step() -> None:
    text = RECORDED.read_text()
    assert "step:0 - val-aux/" in text
    steps = verl_check.step_metrics(text)
    assert [s["step"] for s in steps] == [1.0, 2.0, 3.0]
    for s in steps:
        assert 0 <= s["training/rollout_probs_diff_max"] < verl_check.DIFF_LIMIT
        assert s["actor/perf/max_memory_allocated_gb"] > 0
