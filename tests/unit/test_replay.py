"""The replay store: which earlier right answers it keeps and which it offers, worked
out by hand."""

from __future__ import annotations

import json
from pathlib import Path

from sampler_service.backends.base import Completion, packed
from sampler_service.replay import ReplayStore
from sampler_service.store import Store


def _answer(text: str, version: int) -> Completion:
    return Completion([1, 2], [-0.5, -0.5], text, "stop", version)


def test_only_right_answers_are_kept_the_newest_per_prompt() -> None:
    store = ReplayStore()
    # rewards 1, 0, 1 over threshold 0.5: a and c are right; b is not kept.
    store.remember("p", [_answer("a", 0), _answer("b", 0), _answer("c", 0)], [1, 0, 1], 0.5, 2)
    # d is right too; with at most 2 per prompt the oldest (a) goes.
    store.remember("p", [_answer("d", 1)], [1.0], 0.5, 2)
    store.remember("q", [_answer("e", 1)], [0.0], 0.5, 2)  # nothing right: no entry
    assert store.stats() == {"prompts": 1, "answers": 2, "stored": 3}
    taken = store.take("p", served_version=1, max_version_lag=4)
    assert taken is not None and (taken.completion.text, taken.reward) == ("d", 1.0)
    assert store.take("q", served_version=1, max_version_lag=4) is None


def test_answers_older_than_the_lag_are_forgotten() -> None:
    store = ReplayStore()
    store.remember("p", [_answer("old", 1), _answer("new", 3)], [1, 1], 0.5, 2)
    # Served v5, lag 2: v1 is 4 behind (forgotten), v3 is 2 behind (offered).
    assert store.take("p", served_version=5, max_version_lag=2).completion.text == "new"
    assert store.stats()["answers"] == 1
    # Served v6: v3 is 3 behind, past the lag: nothing left, the prompt is gone.
    assert store.take("p", served_version=6, max_version_lag=2) is None
    assert store.stats()["prompts"] == 0


def test_a_save_writes_only_the_prompts_that_changed() -> None:
    store = ReplayStore()
    store.remember("p", [_answer("a", 2)], [1.0], 0.5, 2)
    store.remember("q", [_answer("b", 2)], [1.0], 0.5, 2)
    first = json.loads(json.dumps(store.changes()))  # as the state store keeps it
    assert sorted(first) == ["replay/p", "replay/q"]
    assert store.changes() == {}  # nothing changed since
    store.remember("q", [_answer("c", 3)], [1.0], 0.5, 2)
    assert store.take("p", served_version=9, max_version_lag=0) is None  # p's answer aged out
    second = json.loads(json.dumps(store.changes()))
    assert second["replay/p"] == [] and len(second["replay/q"]) == 2
    # A restart loads every saved key: the newer save of a prompt wins, emptied ones go.
    restored = ReplayStore()
    restored.restore({**first, **second})
    assert restored.stats()["prompts"] == 1 and restored.stats()["answers"] == 2
    taken = restored.take("q", served_version=3, max_version_lag=0)
    assert taken is not None and taken.completion == _answer("c", 3) and taken.reward == 1.0


def test_answers_packed_by_an_engine_process_are_saved_and_restored(tmp_path: Path) -> None:
    # Answers that crossed a process boundary (the hf engine's child, a Ray replica, the
    # streaming waves of exact stopping) hold numpy arrays; the save that carries them is
    # the one that stores finished groups, so it must not fail on them.
    store = ReplayStore()
    answer = packed(Completion([7, 8, 9], [-0.25, -0.5, -0.125], "a", "stop", 3))
    store.remember("p", [answer], [1.0], 0.5, 2)
    db = Store(tmp_path / "s.sqlite", checkpoint_every_s=None)
    db.put(store.changes())
    db.close()
    restored = ReplayStore()
    restored.restore(Store(tmp_path / "s.sqlite", checkpoint_every_s=None).get_many([], "replay/"))
    taken = restored.take("p", served_version=3, max_version_lag=0)
    assert taken is not None and taken.reward == 1.0
    assert list(taken.completion.token_ids) == [7, 8, 9]
    assert list(taken.completion.logprobs) == [-0.25, -0.5, -0.125]
