"""`adaptive-rollout config|stats|events` as subprocesses against a live toy sampler."""

from __future__ import annotations

import argparse
import functools
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from support import ops_cli, perturbed_file

from trainer_client.contract.flags import parse_key_values

pytestmark = pytest.mark.timeout(600)

KEY = "ops-test-key"
REPO = Path(__file__).parents[2]


#: The ops commands with this module's key (`key=None`: without one).
cli = functools.partial(ops_cli, key=KEY)


def test_parse_assignments() -> None:
    assert parse_key_values(["k_pos=4", "rule=positive", "mixing.params.temp=0.5"], "set") == {
        "k_pos": 4,
        "rule": "positive",
        "mixing": {"params": {"temp": 0.5}},
    }
    assert parse_key_values(['group_policies=[{"name": "x"}]', "max_staleness=null"], "set") == {
        "group_policies": [{"name": "x"}],
        "max_staleness": None,
    }
    with pytest.raises(argparse.ArgumentTypeError):
        parse_key_values(["k_pos"], "set")


def test_cli_against_live_sampler(
    make_server: Any, toy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = tmp_path / "engine-errors"  # absent until the warnings below
    monkeypatch.setenv("ADAPTIVE_ROLLOUT_FAULT_ENGINE_ERRORS", str(fault))
    server = make_server(extra=["--api-key", KEY])
    url = server.url

    with server.client() as c:
        assert c.get("/health").json()["auth_required"] is True
    got = cli(url, "config", "get")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["config_version"] == 0

    no_key = cli(url, "config", "get", key=None)
    assert no_key.returncode == 1
    assert "401" in no_key.stderr and "API key" in no_key.stderr

    changed = cli(url, "config", "set", "k_pos=3", "n_max=24")
    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.splitlines() == [
        "k_pos: 2 -> 3",
        "n_max: 32 -> 24",
        "config_version: 0 -> 1",
    ]
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        cfg = c.get("/v1/config").json()
    assert (cfg["k_pos"], cfg["n_max"], cfg["config_version"]) == (3, 24, 1)

    bad = cli(url, "config", "set", "k_pos=30")
    assert bad.returncode == 1
    assert "422" in bad.stderr and "k_pos + k_neg <= n_max" in bad.stderr
    assert "(field: k_pos)" in bad.stderr
    unknown = cli(url, "config", "set", "mixing.name=no_such_mixer")
    assert unknown.returncode == 1 and "mixing.name" in unknown.stderr

    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"at": {"trained_groups": 10**6}, "set": {"k_pos": 1}}]))
    scheduled = cli(url, "config", "schedule", str(schedule))
    assert scheduled.returncode == 0, scheduled.stderr
    assert scheduled.stdout.splitlines()[-1] == "config_version: 1 -> 2"
    bad_schedule = tmp_path / "bad.json"
    bad_schedule.write_text(json.dumps([{"at": {"trained_groups": 1}, "set": {"k_pos": -1}}]))
    refused = cli(url, "config", "schedule", str(bad_schedule))
    assert refused.returncode == 1 and "schedule[0].set.k_pos" in refused.stderr

    once = cli(url, "stats")
    assert once.returncode == 0, once.stderr
    assert once.stdout.count("stats at") == 1
    for domain in ("add1", "add2", "mul"):
        assert domain in once.stdout
    assert "turns per episode" not in once.stdout  # single answers: no episodes table
    assert "decoded tokens" in once.stdout and "waste: surplus" in once.stdout
    assert re.search(r"weight updates +wait *\n", once.stdout), once.stdout
    watched = cli(url, "stats", "--watch", "--count", "3", "--interval", "0.2")
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count("stats at") == 3  # no TTY: one frame per refresh

    events = cli(url, "events")
    assert events.returncode == 0, events.stderr
    lines = events.stdout.splitlines()
    assert len(lines) == 2
    assert " config api v1: " in lines[0] and "k_pos 2 -> 3" in lines[0]
    assert " config api v2: " in lines[1] and "schedule" in lines[1]
    followed = cli(url, "events", "--follow", "--count", "3", "--interval", "0.2", "--since", "1")
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.splitlines() == lines[1:]  # each event once, however many polls

    # The shipped schedule file, as docs/operate.md offers it: its starting knobs come with its
    # schedule in one PATCH, none is dropped.
    shipped = json.loads((REPO / "docs" / "k_schedule.json").read_text())
    applied = cli(url, "config", "schedule", str(REPO / "docs" / "k_schedule.json"))
    assert applied.returncode == 0, applied.stderr
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        cfg = c.get("/v1/config").json()
        assert {k: cfg[k] for k in shipped} == shipped
        r = c.put("/v1/weights", params={"version": 1}, content=perturbed_file(toy.model_dir, 0))
        assert r.status_code == 200, r.text
    # One kind of event at a time: a weight update does not hide the config changes.
    configs = cli(url, "events", "--kind", "config").stdout.splitlines()
    assert len(configs) == 3 and all(" config api " in line for line in configs), configs
    weights = cli(url, "events", "--kind", "weights").stdout.splitlines()
    assert len(weights) == 1 and " weights api v1 via upload" in weights[0], weights

    # A warning is on the stats screen: an engine failing its calls (the fault hook's file
    # makes every generate call fail while it exists; acking keeps admission open).
    assert "warnings" not in cli(url, "stats").stdout
    fault.touch()
    deadline = time.monotonic() + 120
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        while "engine: " not in (warned := cli(url, "stats").stdout):
            assert time.monotonic() < deadline, warned
            got = c.post("/v1/groups/lease", json={"max_groups": 64, "wait_s": 0}).json()
            ids = [g["delivery_id"] for g in got["groups"]]
            assert c.post("/v1/groups/ack", json={"delivery_ids": ids}).status_code == 200
    assert "warnings" in warned and "fault hook" in warned
    fault.unlink()
    # The hf engine continues answers across an update with either kv: no warning.
    asked = cli(url, "config", "set", "weight_update_mode=continue", "weight_update_kv=recompute")
    assert asked.returncode == 0, asked.stderr
    continued = cli(url, "stats").stdout
    assert "weight_update_mode continue" not in continued
    assert "continue (kv recompute): 0 answers / 0 tokens kept" in continued

    # Nothing listening: said at once, not after the retries meant for a starting sampler.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{sock.getsockname()[1]}"
    gone = cli(nowhere, "config", "get")
    assert gone.returncode == 1 and f"no sampler at {nowhere} (connection refused)" in gone.stderr
