"""history_skip through the running service: prompts whose groups keep coming back all
wrong are skipped at admission, counted in /v1/stats and /metrics, the policy is tuned
live by PATCH, and bad parameters get 422."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import fixed_groups
from tests.service.test_service_api import collect
from trainer_client.toy import task

pytestmark = pytest.mark.timeout(300)

SKIP = {"name": "history_skip", "params": {"explore": 0.0, "max_skip": 0.99}}


def _unsolvable(toy, tmp_path: Path) -> Path:
    """Four toy prompts of one domain whose reference answer no answer matches: every
    group is all wrong, so every prompt's streak grows with each of its groups."""
    rows = [
        {**r, "domain": "unsolvable", "answer": "no answer is this"}
        for r in task.read_jsonl(toy.data_files[0])[:4]
    ]
    path = tmp_path / "unsolvable.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _skipped_metric(text: str, domain: str) -> float:
    line = f'adaptive_rollout_prompts_skipped_total{{domain="{domain}"}} '
    return next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_history_skip_counts_skips_is_live_tunable_and_validated(
    make_server, toy, tmp_path: Path
) -> None:
    data = _unsolvable(toy, tmp_path)
    domain = "unsolvable"
    config = fixed_groups(2)
    server = make_server({**config, "admission_policies": [SKIP]}, data=[data])
    with server.client() as c:
        # After a prompt's first group, 99 in 100 draws of it are skipped; but a prompt
        # may be admitted again while its first group is still running (no streak yet),
        # so the skips overtake the groups after a few rounds, not at a fixed count. A
        # policy that never skips never gets there.
        for _ in range(30):
            groups = collect(c, 10)
            assert all(g["stats"]["n_pos"] == 0 for g in groups)
            stats = c.get("/v1/stats").json()
            skipped = stats["skipped"][domain]
            admitted = stats["domains"][domain]["admitted"]
            if skipped > max(stats["groups_emitted"], admitted):
                break
        assert skipped > stats["groups_emitted"], stats
        assert stats["domains"][domain]["admitted"] < skipped
        assert _skipped_metric(c.get("/metrics").text, domain) >= skipped

        # explore 1: p_skip = 0 from the next admission on, so the count stops.
        live = {"admission_policies": [{"name": "history_skip", "params": {"explore": 1.0}}]}
        r = c.patch("/v1/config", json=live)
        assert r.status_code == 200, r.text
        assert r.json()["admission_policies"] == live["admission_policies"]
        frozen = c.get("/v1/stats").json()["skipped"][domain]
        collect(c, 8)
        assert c.get("/v1/stats").json()["skipped"][domain] == frozen

        for params, field in (
            ({"explore": 2.0}, "admission_policies[0].params.explore"),
            ({"max_skip": 1.0}, "admission_policies[0].params.max_skip"),
            ({"streak": 3}, "admission_policies[0].params.streak"),
        ):
            bad = {"admission_policies": [{"name": "history_skip", "params": params}]}
            r = c.patch("/v1/config", json=bad)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["field"] == field
        r = c.patch("/v1/config", json={"admission_policies": [{"name": "skip_all"}]})
        assert r.status_code == 422 and r.json()["error"]["field"] == "admission_policies[0].name"
