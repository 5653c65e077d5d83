"""The HTTP-hop benchmark's parts that need no engine (bench/http_hop.py): the model copy
whose answers run to max_tokens, and the summary and targets of alternating windows.
Its windows on real engines run in the vLLM suite (tests/vllm_backend/test_http_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import http_hop


def test_the_copy_ends_answers_at_the_pad_token_only(toy: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    copy, stop = http_hop.without_eos(toy.model_dir, tmp_path / "copy")
    original = AutoTokenizer.from_pretrained(str(toy.model_dir))
    assert stop == original.eos_token_id != original.pad_token_id
    tokenizer = AutoTokenizer.from_pretrained(str(copy))
    assert tokenizer.eos_token_id == original.pad_token_id
    for name in ("config.json", "generation_config.json"):
        assert json.loads((copy / name).read_text())["eos_token_id"] == original.pad_token_id
    # the original is untouched
    assert json.loads((toy.model_dir / "config.json").read_text())["eos_token_id"] == stop


def _run(kind: str, arm: str, tokens: int, seconds: float) -> dict[str, Any]:
    """A window of 10-token answers, 4 to a wave, 1 ms of driver CPU per 100 tokens."""
    return {
        "kind": kind,
        "arm": arm,
        "admission": 64,
        "seconds": seconds,
        "tokens": tokens,
        "answers": tokens // 10,
        "waves": tokens // 40,
        "tokens_per_s": tokens / seconds,
        "driver_cpu_s": tokens / 100_000,
        "engine_cpu_s": tokens / 10_000,
    }


def test_the_summary_pairs_windows_and_judges_the_goal() -> None:
    runs = [
        _run(kind, arm, round(4000 * (share if arm == "http" else 1.0)), seconds)
        for kind, share in (("long", 0.97), ("toy", 0.5))
        for seconds in (10.0, 20.0)
        for arm in http_hop.ARMS
    ]
    rows = {r["answers"]: r for r in http_hop.summarize(runs)}
    assert rows["long"]["ratio"] == pytest.approx(0.97, abs=1e-3)
    assert rows["long"]["pair_ratios"] == pytest.approx([0.97, 0.97], abs=1e-3)
    assert rows["toy"]["ratio"] == pytest.approx(0.5)
    assert rows["toy"]["tokens_per_answer"] == pytest.approx(10)
    assert rows["long"]["http_driver_ms_per_wave"] == pytest.approx(0.4, rel=0.01)
    assert rows["long"]["in_process_engine_ms_per_wave"] == pytest.approx(4, rel=0.01)
    targets = http_hop.targets(list(rows.values()))
    assert targets["tokens_per_s/long"]["met"] and not targets["tokens_per_s/toy"]["met"]
    assert {"target", "measured", "goal", "met"} <= set(targets["tokens_per_s/toy"])
