"""Every benchmark writes its results through one function, which stamps the run's length
and keeps scalar arrays on one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench import common


def test_a_results_file_carries_the_environment_and_the_run_s_wall_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    data = {"rows": [1, 2]}
    path = common.write_json("sample", data, started=time.monotonic() - 42.0)
    written = json.loads(path.read_text())
    assert path == tmp_path / "sample.json"
    assert written["rows"] == [1, 2] and "cpus" in written["environment"]
    assert 42.0 <= written["real_s"] < 120.0
    assert data["real_s"] == written["real_s"]  # the caller's summary can print it too
    assert f"wrote {path}; real time 4" in capsys.readouterr().out


def test_without_a_start_time_nothing_is_stamped_or_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.write_json("sample", {"rows": []})
    assert "real_s" not in json.loads(path.read_text())
    assert capsys.readouterr().out == ""


def test_results_text_keeps_the_data_and_puts_scalar_arrays_on_one_line() -> None:
    data = {
        "steps": [1.5, -2e-05, 3],
        "names": ["a, b", "c"],
        "flags": [True, None, False],
        "runs": [{"lags": [0, 1], "note": "x"}, {"lags": []}],
        "nested": [[1, 2], [3]],
    }
    text = common.results_text(data)
    assert json.loads(text) == data
    assert '"steps": [1.5, -2e-05, 3]' in text
    assert '"names": ["a, b", "c"]' in text
    assert '"flags": [true, null, false]' in text
    assert '"lags": [0, 1]' in text
    assert '"runs": [\n' in text  # arrays of objects stay one item a line
    assert text.endswith("}\n")
