"""Start-up as a new user meets it: a default config that fits the model, one-line errors
for bad inputs, a state dir that never serves two samplers, and a state dir that refuses
to serve one run's weights and groups to another. The real `serve` command on the toy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from chat_tokenizers import STRIPPING, char_tokenizer
from support import collect
from transformers import AutoTokenizer

from bench.common import fixed_groups
from sampler_service.state_dir import differences, fingerprint

pytestmark = pytest.mark.timeout(600)

#: Quick groups; max_tokens is left to the sampler's default.
QUICK = fixed_groups(2, max_staleness=None)


def serve(
    toy: Any,
    state_dir: Path,
    *args: str,
    data: list[Path] | None = None,
    model: Path | None = None,
) -> Any:
    """`adaptive-rollout serve` that is expected to refuse: its exit and output."""
    data = toy.data_files if data is None else data
    model = toy.model_dir if model is None else model
    return subprocess.run(
        [sys.executable, "-m", "sampler_service", "serve", "--model", str(model)]
        + [a for f in data for a in ("--data", str(f))]
        + ["--port", "0", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_data_errors_are_one_line_naming_the_file_and_create_nothing(
    toy: Any, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    missing = tmp_path / "nope.jsonl"
    assert f"{missing}: no such data file" in one_line_error(serve(toy, state, data=[missing]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": oops}\n')
    assert f"{bad}:3: not JSON" in one_line_error(serve(toy, state, data=[bad]))
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text('{"prompt": "1+1="}\n')
    assert f"{no_answer}:1: missing required field 'answer'" in one_line_error(
        serve(toy, state, data=[no_answer])
    )
    assert not state.exists()


def test_an_empty_data_file_and_an_empty_prompt_are_refused_naming_them(
    toy: Any, tmp_path: Path
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert f"{empty}: holds no prompts" in one_line_error(serve(toy, tmp_path / "s", data=[empty]))
    blank = tmp_path / "blank.jsonl"
    blank.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n{"id": "b", "prompt": "", "answer": "0"}\n'
    )
    line = one_line_error(serve(toy, tmp_path / "s", data=[blank]))
    assert f"{blank}:2: prompt 'b' tokenizes to no tokens" in line
    assert not (tmp_path / "s").exists()


def test_an_over_long_prompt_is_one_line_creates_nothing_and_can_be_filtered(
    make_server: Any, toy: Any, tmp_path: Path
) -> None:
    """A prompt with no room for one answer token in the model's context is a start-up
    error (one line, exit 2, no state dir: the fixed data then starts); verl's
    --filter-overlong-prompts drops such prompts instead, and counts them."""
    rows = [json.loads(line) for line in toy.data_files[0].read_text().splitlines()[:8]]
    data = tmp_path / "longprompt.jsonl"
    long_row = {"id": "long", "prompt": "1+" * 101, "answer": "0", "domain": rows[0]["domain"]}
    data.write_text("".join(json.dumps(r) + "\n" for r in [*rows, long_row]))
    state = tmp_path / "run"
    line = one_line_error(serve(toy, state, data=[data]))
    assert f"{data}:9: prompt 'long' has 202 tokens" in line, line
    assert "model's context (64 tokens)" in line and "--filter-overlong-prompts" in line
    assert not state.exists()
    # The same command with the row removed starts: nothing was left to refuse it.
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = make_server(QUICK, name="run", data=[data])
    server.stop()
    # Filtered: the run starts without it and says how many it dropped.
    data.write_text("".join(json.dumps(r) + "\n" for r in [*rows, long_row]))
    server = make_server(QUICK, name="filtered", data=[data], extra=["--filter-overlong-prompts"])
    with server.client() as c:
        stats = c.get("/v1/stats").json()
        assert stats["prompts"]["filtered_overlong"] == 1
        assert stats["prompts"]["served"] == len(rows)
        assert c.get("/v1/config").json()["max_tokens"] < 64
    server.stop()
    assert "dropped 1 over-long prompt" in (tmp_path / "filtered.log").read_text()


def test_an_environment_that_cannot_load_is_refused_at_start_naming_it(
    toy: Any, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    for spec in ("python:no_such_module:make", "no-such-builtin"):
        assert spec in one_line_error(serve(toy, state, "--env", spec))
    row = tmp_path / "row.jsonl"
    row.write_text('{"prompt": "1+1=", "answer": "2", "env": "python:no_such_module:f"}\n')
    assert "python:no_such_module:f" in one_line_error(serve(toy, state, data=[row]))
    assert not state.exists()


def test_a_chat_template_that_is_not_prefix_preserving_is_refused_at_start(
    toy: Any, tmp_path: Path
) -> None:
    """Episodes append observations to what was sampled, which is the template's rendering
    only where adding a turn never rewrites earlier ones: the toy model with a template
    that strips earlier turns' reasoning is refused when an environment is configured,
    in one line naming the model and the turn that changed."""
    model = tmp_path / "stripping-model"
    shutil.copytree(toy.model_dir, model)
    char_tokenizer(STRIPPING).save_pretrained(model)
    state = tmp_path / "state"
    line = one_line_error(serve(toy, state, "--env", "calculator", model=model))
    assert f"model {str(model)!r}" in line and "not prefix-preserving" in line
    assert "adding message 4 (tool) changes the rendering" in line
    assert not state.exists()


def test_a_harness_without_sessions_or_that_cannot_run_is_refused_at_start(
    toy: Any, tmp_path: Path
) -> None:
    """A harness spec runs code, so it is checked before anything starts: one line naming
    what is wrong, and no state dir."""
    state = tmp_path / "state"
    line = one_line_error(serve(toy, state, "--harness", "python:os:getcwd"))
    assert "--harness drives sessions, but no row names the environment 'session'" in line
    line = one_line_error(serve(toy, state, "--env", "session", "--harness", "no-such-harness"))
    assert "'no-such-harness' is not an executable on PATH" in line
    line = one_line_error(serve(toy, state, "--env", "session", "--harness", "python:nope:run"))
    assert "harness 'python:nope:run' cannot be loaded" in line
    assert not state.exists()


def test_a_max_tokens_past_the_context_is_refused_at_start_naming_the_flag(
    toy: Any, tmp_path: Path
) -> None:
    line = one_line_error(serve(toy, tmp_path / "state", "--set", "max_tokens=1024"))
    assert "max_tokens (1024) exceeds the model's context (64 tokens)" in line
    assert "--set max_tokens=N" in line
    assert not (tmp_path / "state").exists()


def test_the_default_fits_the_model_and_a_patch_is_judged_on_what_it_changes(
    make_server: Any, toy: Any
) -> None:
    server = make_server(QUICK, base={})
    with server.client() as c:
        config = c.get("/v1/config").json()
        tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)
        longest = max(
            len(tokenizer(json.loads(line)["prompt"])["input_ids"])
            for f in toy.data_files
            for line in f.read_text().splitlines()
        )
        # The toy's 64 tokens of context, less its longest prompt.
        assert config["max_tokens"] == 64 - longest
        # The README's PATCH, the ops CLI and the trainer's start-up PATCH all change
        # knobs other than max_tokens: none is held to a value it did not send.
        r = c.patch("/v1/config", json={"rule": "positive", "k_pos": 1})
        assert r.status_code == 200, r.text
        r = c.patch("/v1/config", json={"batch_groups": 4})
        assert r.status_code == 200, r.text
        r = c.patch("/v1/config", json={"max_tokens": 65})
        assert r.status_code == 422 and r.json()["error"]["field"] == "max_tokens", r.text
        r = c.patch("/v1/config", json={"max_tokens": 64})
        assert r.status_code == 200, r.text
    done = subprocess.run(
        [sys.executable, "-m", "sampler_service", "config", "set", "k_pos=2"],
        env={**os.environ, "ADAPTIVE_ROLLOUT_URL": server.url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "k_pos: 1 -> 2" in done.stdout


def test_a_state_dir_serves_one_sampler_and_a_killed_one_leaves_no_lock(
    make_server: Any, toy: Any, tmp_path: Path
) -> None:
    first = make_server(QUICK, name="shared")
    state = tmp_path / "shared"
    line = one_line_error(serve(toy, state))
    assert f"state dir {state} is in use by another sampler (pid {first.pid})" in line
    with first.client() as c:
        held = {g["group_id"] for g in collect(c, 2, ack=False, consumer="a")}
    first.kill()  # SIGKILL: the kernel drops the lock with the process
    second = make_server(QUICK, name="shared")
    with second.client() as c:
        again = {g["group_id"] for g in collect(c, 2, ack=False, consumer="b")}
    assert again == held  # the stored groups come back (oldest first), to one sampler


def test_a_state_dir_refuses_another_run_and_names_the_ways_out(
    make_server: Any, toy: Any, tmp_path: Path
) -> None:
    first = make_server(QUICK, name="run")
    with first.client() as c:
        collect(c, 2, ack=False)
    first.stop()
    state = tmp_path / "run"
    stored = json.loads((state / "fingerprint.json").read_text())
    assert stored["backend"] == "hf" and len(stored["data"]) == len(toy.data_files)

    # Other data (a file left out): refused, each difference named, and the ways out.
    result = serve(toy, state, data=toy.data_files[:1])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    for missing in toy.data_files[1:]:
        assert f"{missing} (recorded) is not given" in result.stderr
    for way_out in ("--resume", "--state-dir", "--fresh"):
        assert way_out in result.stderr
    # Another model of the same architecture (other weights): refused too.
    other_model = tmp_path / "other_model"
    shutil.copytree(toy.model_dir, other_model)
    weights = other_model / "model.safetensors"
    payload = bytearray(weights.read_bytes())
    payload[-1] ^= 0xFF
    weights.write_bytes(bytes(payload))
    done = subprocess.run(
        [sys.executable, "-m", "sampler_service", "serve", "--model", str(other_model)]
        + [a for f in toy.data_files for a in ("--data", str(f))]
        + ["--port", "0", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and f"model: {other_model} is not the recorded model" in (
        done.stderr
    ), done.stderr

    # --resume continues the stored run (its groups) with the new inputs.
    resumed = make_server(QUICK, name="run", data=toy.data_files[:1], extra=["--resume"])
    with resumed.client() as c:
        assert c.get("/v1/stats").json()["queue"]["ready"] >= 2
    resumed.stop()
    # --fresh moves it aside, never deletes it, and starts empty.
    fresh = make_server(QUICK, name="run", data=toy.data_files[:1], extra=["--fresh"])
    aside = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("run.")]
    assert len(aside) == 1 and (aside[0] / "sampler.sqlite").is_file()
    with fresh.client() as c:
        assert c.get("/v1/stats").json()["groups_emitted"] >= 0
        assert c.get("/v1/events").json()["events"] == []
    fresh.stop()

    # A state dir written before fingerprints existed is adopted, with a warning.
    (state / "fingerprint.json").unlink()
    adopted = make_server(QUICK, name="run", data=toy.data_files[:1])
    adopted.stop()
    assert "has no record of what it was created for" in (tmp_path / "run.log").read_text()
    assert (state / "fingerprint.json").is_file()


def test_the_fingerprint_is_by_content(toy: Any, tmp_path: Path) -> None:
    """A copy with new mtimes (a rebuilt image) is the same model; changed weights are not."""
    recorded = fingerprint(toy.model_dir, toy.data_files, "hf")
    copy = tmp_path / "copy"
    shutil.copytree(toy.model_dir, copy / "model")
    data = []
    for f in toy.data_files:
        data.append(copy / f.name)
        shutil.copy(f, data[-1])
    later = time.time() + 3600
    for path in [*copy.rglob("*")]:
        os.utime(path, (later, later))
    same = fingerprint(copy / "model", data, "hf")
    assert same["model"]["sha256"] == recorded["model"]["sha256"]
    assert [d["sha256"] for d in same["data"]] == [d["sha256"] for d in recorded["data"]]
    weights = copy / "model" / "model.safetensors"
    payload = bytearray(weights.read_bytes())
    payload[-1] ^= 0x01  # one weight's last byte: a fine-tune of the same architecture
    weights.write_bytes(bytes(payload))
    assert fingerprint(copy / "model", data, "hf")["model"]["sha256"] != same["model"]["sha256"]
    assert fingerprint(copy / "model", data, "vllm")["backend"] == "vllm"


def test_a_data_file_changed_in_place_is_named_once_as_changed(toy: Any, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    recorded = fingerprint(toy.model_dir, [data], "hf")
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    diffs = differences(recorded, fingerprint(toy.model_dir, [data], "hf"))
    assert diffs == [f"data: {data} changed since the state dir was created"], diffs
