"""Half-sampled prompts survive kill -9 and SIGTERM: the real server, on the toy's hard
prompts (mul) under Seq-Balance 2/2 with exact stopping and n_max 32, is killed five
times at random points, then stopped cleanly. After each restart every prompt the journal held resumes: its stored answers are
reused at their indices (the very tokens), only the indices that were not stored are
drawn again, and the group that mixes both obeys the rule with each index once. The
restart counters add up against what the killed process left in its SQLite file."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from bench.restart import HARD, issued_not_stored, journal_left, wait_for_answers
from sampler_service.startup import STORE_FILE
from tests.support import lease

pytestmark = pytest.mark.timeout(900)

KILLS = 5


def _check_group(group: dict[str, Any], stored: dict[int, tuple[float, list[int]]]) -> None:
    """Each index once, 0..n-1; the stored answers as they were; the rule held first at
    the last index, asked from `min_answers` on (or n_max was reached)."""
    samples = sorted(group["samples"], key=lambda s: s["index"])
    n = group["stats"]["n_generated"]
    assert [s["index"] for s in samples] == list(range(n)), group["group_id"]
    for s in samples:
        if s["index"] in stored:
            reward, tokens = stored[s["index"]]
            assert s["response_token_ids"] == tokens and s["reward"] == reward
    right = [s["reward"] > 0.5 for s in samples]
    holds = [
        j + 1 >= HARD["min_answers"]
        and sum(right[: j + 1]) >= 2
        and j + 1 - sum(right[: j + 1]) >= 2
        for j in range(n)
    ]
    assert n == HARD["n_max"] or (holds[-1] and not any(holds[:-1])), (right, group)


def test_half_sampled_prompts_resume_after_kill9(make_server, toy, tmp_path: Path) -> None:
    rng = random.Random(0)
    [mul] = [f for f in toy.data_files if f.stem == "mul"]
    server = make_server(HARD, data=[mul])
    db = tmp_path / "state" / STORE_FILE
    totals = {"issued_not_stored": 0, "regenerated": 0, "reused": 0}
    for kill in range(KILLS):
        time.sleep(rng.uniform(0.0, 3.0))
        wait_for_answers(db)
        server.kill()
        left = journal_left(db)
        stored_answers = sum(len(a["answers"]) for a in left.values())
        lost = issued_not_stored(left)
        server.start()
        with server.client() as c:
            restart = c.get("/v1/stats").json()["restart"]
            assert restart["resumed_prompts"] == len(left), (kill, restart)
            assert restart["reused_answers"] == stored_answers, (kill, restart)
            assert restart["stale_answers"] == 0
            assert restart["regenerated_answers"] <= lost
            totals["issued_not_stored"] += lost
            totals["regenerated"] += restart["regenerated_answers"]
            totals["reused"] += stored_answers
            # Every resumed prompt's group comes out (its id is the attempt's), and holds
            # its stored answers where they were.
            waiting = set(left)
            deadline = time.monotonic() + 300
            while waiting:
                assert time.monotonic() < deadline, f"kill {kill}: {len(waiting)} never came"
                got = lease(c, 64, wait_s=5.0)
                for group in got:
                    if group["group_id"] in waiting:
                        waiting.discard(group["group_id"])
                        _check_group(group, left[group["group_id"]]["answers"])
                    else:
                        _check_group(group, {})
                c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]})
            # Their groups' writes ended their attempts: a next restart will not find them.
            assert set(left).isdisjoint(journal_left(db)), f"kill {kill}: attempts left over"
    assert totals["regenerated"] <= 1.1 * totals["issued_not_stored"], totals
    assert totals["reused"] > 0, totals  # answers decoded before a kill were counted after it
    # A clean stop (SIGTERM) writes what was verified before it exits: the prompts resume
    # in the same way.
    wait_for_answers(db)
    server.stop()
    left = journal_left(db)
    server.start()
    with server.client() as c:
        restart = c.get("/v1/stats").json()["restart"]
    assert restart["resumed_prompts"] == len(left) > 0, restart
    assert restart["reused_answers"] == sum(len(a["answers"]) for a in left.values()) > 0
    assert restart["regenerated_answers"] <= issued_not_stored(left)
