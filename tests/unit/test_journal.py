"""The answer journal and what a restart makes of it: answers stored with their index,
version and reward; attempts that end with their group's write or on their own; and
the runs a restart rebuilds, which draw again exactly the indices that were not stored."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sampler_service.backends.base import Completion
from sampler_service.config import SamplerConfig
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.journal import DATASET_KEY, AnswerJournal, pack_answer, unpack_answer
from sampler_service.live_config import LiveConfig
from sampler_service.prompt_run import PromptRun
from sampler_service.resume import resume
from sampler_service.store import AsyncStore, FrameRows, JournalRows, Store, StoredAttempt
from sampler_service.tally import Tally
from sampler_service.verifiers.base import Verdict

#: Seq-Balance 2/2 under exact stopping, asked from the fourth answer on.
BALANCED = {"rule": "balanced", "k_pos": 2, "k_neg": 2, "n_max": 32, "stopping": "exact"}


def _answer(tokens: int, version: int = 0, seed: int = 0) -> Completion:
    rng = np.random.default_rng(seed)
    return Completion(
        token_ids=rng.integers(0, 50_000, tokens).astype(np.int32),
        logprobs=rng.normal(size=tokens).astype(np.float32),
        text=f"answer {seed}",
        finish_reason="stop",
        policy_version=version,
    )


def test_an_answer_round_trips_through_its_stored_bytes() -> None:
    plain = _answer(7, version=3)
    episode = Completion(
        token_ids=[1, 2, 70_000],
        logprobs=[-0.5, 0.0, -1.25],
        text="2+2=[4]4",
        finish_reason="stop",
        policy_version=2,
        loss_mask=[1, 0, 1],
        num_turns=2,
        answer_text="4",
        env_reward=1.0,
        prompt_token_ids=[5, 6],
        prompt_text="2+2=",
    )
    for completion in (plain, episode):
        back = unpack_answer(pack_answer(completion))
        for name, value in completion.__dict__.items():
            got = back.__dict__[name]
            if name in ("token_ids", "logprobs", "loss_mask") and value is not None:
                assert list(got) == list(value), name
            else:
                assert got == value, name
    assert unpack_answer(pack_answer(plain)).loss_mask is None


def _stored(store: Store) -> dict[str, tuple[int, list[int]]]:
    return {a.attempt_id: (a.issued, [i for i, *_ in a.answers]) for a in store.attempts()}


def test_an_attempt_ends_with_its_groups_write_or_on_its_own(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db", checkpoint_every_s=None)
    try:
        payload = pack_answer(_answer(3))
        store.journal(
            JournalRows(
                attempts=[("a", "p1", "d", 4), ("b", "p2", "d", 2), ("c", "p3", "d", 1)],
                answers=[("a", 0, 0, 1.0, payload), ("a", 2, 0, 0.0, payload)]
                + [("b", 1, 0, 1.0, payload), ("c", 0, 0, 0.0, payload)],
                state={DATASET_KEY: {"cursor": {"d": [0, 3]}}},
            )
        )
        assert _stored(store) == {"a": (4, [0, 2]), "b": (2, [1]), "c": (1, [0])}
        assert store.get(DATASET_KEY) == {"cursor": {"d": [0, 3]}}
        # The issued count only grows (writes of one attempt may land out of order).
        store.journal(JournalRows(attempts=[("a", "p1", "d", 3)], answers=[("a", 3, 1, 1.0, b"x")]))
        assert _stored(store)["a"] == (4, [0, 2, 3])
        store.add_pending("a", b"group a")  # its group: the attempt ends in that write
        assert set(_stored(store)) == {"b", "c"}
        store.frame([FrameRows("f1", [("b", b"group b")], dropped=["c"])])
        assert _stored(store) == {}
        store.journal(JournalRows(attempts=[("e", "p4", "d", 1)]))
        store.journal(JournalRows(ended=["e"]))
        assert _stored(store) == {} and store.count() == 2  # the groups a (pending) and b
    finally:
        store.close()


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    path = tmp_path / "d.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def tokenize(row: PromptRow) -> None:
        row.text, row.token_ids = row.prompt, [1, 2, 3]

    return Dataset([path], tokenize)


def _live(dataset: Dataset, **knobs: Any) -> LiveConfig:
    cfg = SamplerConfig(**{**BALANCED, "max_staleness": None, **knobs})
    return LiveConfig(cfg, 0, dataset.domains, dataset.prompt_ids())


def _attempt(prompt: str, issued: int, answers: dict[int, tuple[bool, int]]) -> StoredAttempt:
    """`answers`: index -> (right, version); each answer is `index + 1` tokens long."""
    return StoredAttempt(
        f"attempt-{prompt}",
        prompt,
        "d",
        issued,
        [
            (i, version, float(right), pack_answer(_answer(i + 1, version, seed=i)))
            for i, (right, version) in sorted(answers.items())
        ],
    )


def test_a_resumed_prompt_draws_again_only_the_indices_not_stored(dataset: Dataset) -> None:
    tally = Tally(dataset.domains, lambda: 0.0)
    live = _live(dataset)
    # Issued 0..5; 2 and 5 were decoding at the kill. 0 and 1 count at once, 3 and 4 wait.
    attempt = _attempt("p0", 6, {0: (True, 0), 1: (False, 0), 3: (True, 0), 4: (False, 0)})
    gone = _attempt("no-such-prompt", 2, {0: (True, 0)})
    found = resume([attempt, gone], dataset, live, 0, tally)
    assert found.gone == ["attempt-no-such-prompt"]
    [run] = found.runs
    assert run.attempt_id == "attempt-p0" and run.row.id == "p0"
    assert (run.n_pos, run.n_neg, run.issued) == (1, 1, 6)
    assert sorted(run.waiting) == [3, 4] and run.redo == [2, 5]
    assert run.recorded_tokens == 1 + 2 and tally.decoded == 3  # answers 0 and 1
    assert tally.to_dict({})["restart"] == {
        "resumed_prompts": 1,
        "reused_answers": 4,
        "stale_answers": 0,
        "regenerated_answers": 2,
    }
    # Index 2 drawn again (wrong): 0..3 count, and the rule holds at index 3 (2 right, 2
    # wrong); the stored 4 is surplus and 5 is never needed.
    run.arrived(2, _answer(3), Verdict(0.0))
    assert run.count_arrived() and run.stopped and (run.n_pos, run.n_neg) == (2, 2)
    assert run.surplus() == [4, 5]


def test_stale_answers_are_dropped_and_drawn_again(dataset: Dataset) -> None:
    tally = Tally(dataset.domains, lambda: 0.0)
    live = _live(dataset, max_staleness=1)
    attempt = _attempt("p1", 3, {0: (True, 4), 1: (False, 2), 2: (True, 4)})
    [run] = resume([attempt], dataset, live, 4, tally).runs  # served: 4, bound 1
    assert run.n_generated == 1 and sorted(run.waiting) == [2] and run.redo == [1]
    restart = tally.to_dict({})["restart"]
    assert restart["reused_answers"] == 2 and restart["stale_answers"] == 1
    assert restart["regenerated_answers"] == 0  # index 1 was stored: drawn again as stale
    assert tally.waste["stale"] == 2  # index 1's two tokens


def test_a_prompt_whose_rule_holds_on_its_stored_answers_takes_no_more(dataset: Dataset) -> None:
    tally = Tally(dataset.domains, lambda: 0.0)
    stored = {0: (True, 0), 1: (False, 0), 2: (True, 0), 3: (False, 0), 4: (True, 0)}
    [run] = resume([_attempt("p2", 7, stored)], dataset, _live(dataset), 0, tally).runs
    assert run.stopped and run.n_generated == 4 and run.redo == [] and run.wave_size() == 0
    assert tally.waste["surplus"] == 5  # index 4, five tokens
    assert tally.to_dict({})["restart"]["regenerated_answers"] == 0


def test_the_journal_writes_in_batches_and_forgets_what_ended(
    tmp_path: Path, dataset: Dataset
) -> None:
    live = _live(dataset)

    async def run() -> None:
        store = AsyncStore(Store(tmp_path / "state.db", checkpoint_every_s=None))
        journal = AnswerJournal(store, dataset)
        runs = [PromptRun(dataset.next("d"), live.plan) for _ in range(3)]
        for r in runs:
            r.issued = 2
            journal.issued(r)
            journal.answered(r, [(0, _answer(2), Verdict(1.0)), (1, _answer(3), Verdict(0.0))])
        cursor = dataset.state_dict()
        journal.finished(runs[1])  # its group's write ends it: nothing of it is written
        await journal.flush()  # a first write holds the rows back: their prompts may end
        sync = store.sync
        assert sync.attempts() == [] and sync.get(DATASET_KEY) is None
        dataset.next("d")  # an admission after that write: not yet in the written cursor
        await journal.flush()
        assert {a.attempt_id for a in sync.attempts()} == {runs[0].attempt_id, runs[2].attempt_id}
        assert sync.get(DATASET_KEY) == cursor  # the cursor that admitted them, with them
        journal.ended(runs[2])
        journal.start()
        await asyncio.sleep(0.3)
        [left] = sync.attempts()
        assert left.attempt_id == runs[0].attempt_id and [i for i, *_ in left.answers] == [0, 1]
        assert left.answers[0][2] == 1.0 and left.issued == 2
        runs[0].issued = 3
        journal.issued(runs[0])
        await journal.close()  # a clean stop writes everything, with the cursor of now
        assert sync.attempts()[0].issued == 3 and sync.get(DATASET_KEY) == dataset.state_dict()
        await store.close()

    asyncio.run(run())


def test_prompts_taken_and_not_yet_admitted_are_written_to_be_served_again(
    tmp_path: Path, dataset: Dataset
) -> None:
    """Paced admission holds prompts the cursor has passed: the cursor the journal writes
    names them first in line, so a crash does not skip them."""
    delayed = dataset.next("d")
    dataset.serve_again("d", "p2")

    async def run() -> dict[str, Any]:
        store = AsyncStore(Store(tmp_path / "state.db", checkpoint_every_s=None))
        journal = AnswerJournal(store, dataset)
        journal.held = lambda: [delayed]
        await journal.close()
        written = store.sync.get(DATASET_KEY)
        await store.close()
        return written

    written = asyncio.run(run())
    assert written["again"] == {"d": [delayed.id, "p2"]}
    fresh = Dataset([tmp_path / "d.jsonl"], lambda row: setattr(row, "token_ids", [1]))
    fresh.load_state_dict(written)
    assert [fresh.next("d").id for _ in range(2)] == [delayed.id, "p2"]
