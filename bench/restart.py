"""Restart: what a kill -9 costs the prompts being sampled.

A toy sampler on the hard mix (the `mul` domain; Seq-Balance 2/2 with exact stopping,
n_max 32, 8 prompts sampled at once) under a consumer that leases and acks everything,
is killed with SIGKILL at random points (after a uniform wait over `--window-s` seconds,
the first moment the answer journal holds answers), restarted on the same state dir each
time. After each kill the benchmark
reads the killed process's SQLite file, then asks the restarted one what it did:

- issued and not stored: indices issued before the kill whose answers were not in the
  answer journal (decoding, or verified in the journal's last moments), over every
  prompt being sampled;
- regenerated: what the restart drew again of those (`/v1/stats` `restart`);
- reused: stored answers the restart continued from;
- before the journal, every answer issued to a prompt being sampled was drawn again:
  reused + issued and not stored.

With `--front-baseline REV`, it also measures what the journal costs a front at its
knee: `bench/front.py`'s sweep (the real service at 700-token answers, the front's
process on one core) for REV and this working tree side by side, its highest delivered
answers/s for each.

    .venv/bin/python -m bench.restart --quick     # 3 kills, ~1 minute
    .venv/bin/python -m bench.restart             # 5 kills
    .venv/bin/python -m bench.restart --front-baseline REV   # and the front's knee, ~5 min
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import table, write_json
from sampler_service.journal import unpack_answer
from sampler_service.startup import STORE_FILE
from trainer_client.launch import SamplerProcess

#: Seq-Balance 2/2, exact stopping, every counted answer in its group (so a consumer can
#: check each index).
HARD: dict[str, Any] = {
    "rule": "balanced",
    "k_pos": 2,
    "k_neg": 2,
    "n_max": 32,
    "stopping": "exact",
    "min_answers": 4,
    "group_size": 4,
    "wave_size": 4,
    "downsample": "none",
    "max_tokens": 8,
    "max_active_prompts": 8,
    "max_buffered_groups": 100_000,
    "max_staleness": None,
}
#: Goal: regenerated answers at most this times those issued and not stored at the kill.
REGENERATED_GOAL = 1.1
#: Goal: the front's knee with the journal at least this share of the baseline's.
KNEE_GOAL = 0.9
#: Offered answers/s of the front's sweep: past the knee of one front core here.
FRONT_RATES = ("3000", "5000", "7000", "9000")


def journal_left(db: Path) -> dict[str, dict[str, Any]]:
    """What a killed sampler's journal holds: by attempt (its group's id to be), the
    prompt, the answers issued and the stored answers by index as (reward, token ids)."""
    with sqlite3.connect(db) as conn:
        attempts: dict[str, dict[str, Any]] = {
            a: {"prompt": p, "issued": n, "answers": {}}
            for a, p, n in conn.execute("SELECT attempt_id, prompt_id, issued FROM attempts")
        }
        for a, idx, reward, payload in conn.execute(
            "SELECT attempt_id, idx, reward, payload FROM answers"
        ):
            tokens = [int(t) for t in unpack_answer(payload).token_ids]
            attempts[a]["answers"][idx] = (reward, tokens)
    return attempts


def issued_not_stored(left: dict[str, dict[str, Any]]) -> int:
    """Indices issued before the kill whose answers the journal did not hold."""
    return sum(
        max(a["issued"], max(a["answers"], default=-1) + 1) - len(a["answers"])
        for a in left.values()
    )


def wait_for_answers(db: Path, at_least: int = 3, timeout_s: float = 120.0) -> None:
    """Until the journal holds `at_least` answers (the run is under way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if db.exists():
            with sqlite3.connect(db) as conn:
                if conn.execute("SELECT COUNT(*) FROM answers").fetchone()[0] >= at_least:
                    return
        time.sleep(0.02)
    raise TimeoutError(f"no {at_least} answers journalled in {timeout_s:.0f} s")


def _until_delivered(http: httpx.Client, url: str, ids: set[str], timeout_s: float) -> float:
    """Lease and ack until every group of `ids` came; the seconds it took."""
    started = time.monotonic()
    while ids:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{len(ids)} resumed prompts' groups not delivered")
        r = http.post(f"{url}/v1/groups/lease", json={"max_groups": 64, "wait_s": 5.0})
        got = r.json()["groups"]
        ids -= {g["group_id"] for g in got}
        http.post(f"{url}/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]})
    return time.monotonic() - started


def front_knees(baseline: str) -> dict[str, Any]:
    """The front's knee (highest delivered answers/s) at `baseline` and in this working
    tree, swept side by side (`bench.front`, its rows alternating between the two)."""
    from bench import front

    out = front.main(
        ["--quick", "--only", "sweep", "--rates", *FRONT_RATES]
        + ["--checkout", f"before={baseline}", "--checkout", "after=."]
    )
    before, after = (out["variants"][name]["knee"]["answers_per_s"] for name in ("before", "after"))
    return {"baseline": baseline, "before": before, "after": after, "ratio": after / before}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trainer_client.toy import build_toy

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="restart-"))
    toy = build_toy(work / "toy", seed=0)
    [mul] = [f for f in toy.data_files if f.stem == "mul"]
    state = work / "state"
    server = SamplerProcess(toy.model_dir, [mul], state, HARD, work / "server.log")
    db = state / STORE_FILE
    rows = []
    url = server.start()
    with httpx.Client(timeout=120) as http:
        for kill in range(args.kills):
            time.sleep(rng.uniform(0.0, args.window_s))
            wait_for_answers(db)
            server.kill()
            left = journal_left(db)
            url = server.start()
            restart = http.get(f"{url}/v1/stats").json()["restart"]
            reused = sum(len(a["answers"]) for a in left.values())
            lost = issued_not_stored(left)
            finish_s = _until_delivered(http, url, set(left), timeout_s=300)
            rows.append(
                {
                    "kill": kill,
                    "prompts": len(left),
                    "resumed": restart["resumed_prompts"],
                    "reused": reused,
                    "reused_seen": restart["reused_answers"],
                    "issued_not_stored": lost,
                    "regenerated": restart["regenerated_answers"],
                    "before": reused + lost,
                    "finish_s": finish_s,
                }
            )
            print(
                f"kill {kill}: {len(left)} prompts, {reused} answers reused, {lost} issued and "
                f"not stored, {restart['regenerated_answers']} regenerated",
                flush=True,
            )
    server.stop()
    total = {k: sum(r[k] for r in rows) for k in ("reused", "issued_not_stored", "regenerated")}
    ratio = total["regenerated"] / max(total["issued_not_stored"], 1)
    before = total["reused"] + total["issued_not_stored"]
    targets = {
        "46/regenerated": {
            "target": "regenerated answers / answers issued and not stored at the kill",
            "measured": ratio,
            "goal": f"<= {REGENERATED_GOAL}",
            "met": ratio <= REGENERATED_GOAL,
            "reason": None,
        }
    }
    knees = front_knees(args.front_baseline) if args.front_baseline else None
    if knees is not None:
        targets["46/front_knee"] = {
            "target": f"front's knee (answers/s) with the journal / at {knees['baseline']}",
            "measured": knees["ratio"],
            "goal": f">= {KNEE_GOAL}",
            "met": knees["ratio"] >= KNEE_GOAL,
            "reason": None,
        }
    return {
        "settings": {**vars(args), "config": HARD},
        "kills": rows,
        "totals": {**total, "before": before, "saved_share": total["reused"] / max(before, 1)},
        "front": knees,
        "targets": targets,
    }


#: The kills' table: its columns by key.
HEADINGS = {
    "kill": "kill",
    "prompts": "prompts sampling",
    "reused": "answers reused",
    "issued_not_stored": "issued, not stored",
    "regenerated": "regenerated",
    "before": "regenerated before the journal",
    "finish_s": "s to their groups",
}


def kills_table(data: dict[str, Any]) -> str:
    return table(data["kills"], list(HEADINGS.items()))


def summary(data: dict[str, Any]) -> str:
    """The committed run in a few lines: the regenerated ratio and the front's knee."""
    t, kills = data["totals"], len(data["kills"])
    ratio = data["targets"]["46/regenerated"]["measured"]
    text = (
        f"Over {kills} kills: **{t['regenerated']} answers regenerated of {t['issued_not_stored']} "
        f"issued and not stored** ({ratio:.2f}x, goal <= {REGENERATED_GOAL}x); {t['reused']} of "
        f"the {t['before']} answers a restart drew again before the journal were reused "
        f"({t['saved_share']:.0%})."
    )
    if (f := data.get("front")) is not None:
        text += (
            f" The front's knee with the journal: {f['after']:,.0f} answers/s against "
            f"{f['before']:,.0f} at {f['baseline']} (**{f['ratio']:.2f}x**, goal >= {KNEE_GOAL}x)."
        )
    return text + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 kills (~1 minute)")
    p.add_argument("--kills", type=int, help="kills in all (default 5; quick 3)")
    p.add_argument("--window-s", type=float, default=3.0, help="kill at a uniform point of it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--front-baseline", metavar="REV", help="also sweep the front at REV and here (~4 min)"
    )
    args = p.parse_args(argv)
    args.kills = args.kills or (3 if args.quick else 5)
    started = time.monotonic()
    result = run(args)
    print(kills_table(result))
    t = result["totals"]
    print(
        f"regenerated {t['regenerated']} of {t['issued_not_stored']} issued and not stored "
        f"(goal <= {REGENERATED_GOAL}x); {t['reused']} of {t['before']} answers reused "
        f"({t['saved_share']:.0%}) that a restart drew again before the journal"
    )
    if result["front"] is not None:
        f = result["front"]
        print(
            f"front's knee: {f['after']:.0f} answers/s here against {f['before']:.0f} at "
            f"{f['baseline']} ({f['ratio']:.2f}x, goal >= {KNEE_GOAL}x)"
        )
    write_json("restart", result, started=started)
    return result


if __name__ == "__main__":
    main()
