"""The answer journal: every verified answer of a prompt still being sampled is stored, so
that a restart (a kill -9 included) continues the prompt from its answers instead of
sampling it from scratch.

What is stored, per admitted prompt (an *attempt*, whose id is the id its group will
have): its prompt, the answers issued so far (the next index), and each verified
answer with its index, policy version and reward. Writes are batched: the journal
collects what happened and writes it every `FLUSH_S` in one transaction on the store's
thread, never on the event loop, each row at its second write (`AnswerJournal`). Each
write carries the dataset's cursor as it was when the rows it writes were collected, so
the attempts a write records and the cursor that admitted them land together: after a
crash a prompt is either resumed or admitted again, never both and never neither.

An attempt ends in the same transaction that stores its group (`Store.add_pending`,
`Store.frame`), or through `ended` when it finishes without one (dropped). What a kill
loses is what was issued and not yet stored: answers still decoding, and those verified
in the last two write periods; a restart draws exactly those indices again (`resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from sampler_service.backends.base import Completion
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.prompt_run import PromptRun
from sampler_service.store import AsyncStore, JournalRows, Store
from sampler_service.verifiers.base import Verdict
from trainer_client.contract.wire import narrow_array

log = logging.getLogger(__name__)

#: Seconds between the journal's writes; a kill -9 can lose the verified answers of the
#: last two.
FLUSH_S = 0.05
#: The state store's key of the dataset's cursor, written by the journal alone.
DATASET_KEY = "dataset_state"

_ARRAYS = {"token_ids": "int", "logprobs": "float", "loss_mask": "int"}


def pack_answer(completion: Completion) -> bytes:
    """An answer's stored bytes: its number lists as narrow arrays, the rest as is."""
    doc = dict(completion.__dict__)
    for name, kind in _ARRAYS.items():
        if doc[name] is not None:
            array = narrow_array(doc[name], kind)
            doc[name] = [array.dtype.str, array.tobytes()]
    packed: bytes = msgpack.packb(doc)
    return packed


def unpack_answer(payload: bytes) -> Completion:
    doc = msgpack.unpackb(payload)
    for name in _ARRAYS:
        if doc[name] is not None:
            dtype, data = doc[name]
            doc[name] = np.frombuffer(data, dtype=dtype)
    return Completion(**doc)


@dataclass
class _Batch:
    """What the next write holds: attempts (their issued count), their answers by index,
    and the attempts that ended without a group."""

    attempts: dict[str, tuple[str, str, str, int]] = field(default_factory=dict)
    answers: dict[str, dict[int, tuple[str, int, int, float, Completion]]] = field(
        default_factory=dict
    )
    ended: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.attempts or self.answers or self.ended)

    def rows(self) -> list[tuple[str, int, int, float, bytes]]:
        """The answers' rows, packed (on the store's thread: packing is CPU)."""
        return [
            (attempt_id, index, version, reward, pack_answer(completion))
            for by_index in self.answers.values()
            for attempt_id, index, version, reward, completion in by_index.values()
        ]


def _merged(older: _Batch, newer: _Batch) -> _Batch:
    """One batch of both, the newer's rows winning."""
    out = _Batch(dict(older.attempts), {a: dict(rows) for a, rows in older.answers.items()})
    out.attempts.update(newer.attempts)
    for attempt_id, by_index in newer.answers.items():
        out.answers.setdefault(attempt_id, {}).update(by_index)
    out.ended = older.ended + newer.ended
    return out


def _write(store: Store, batch: _Batch, state: dict[str, Any]) -> None:
    """One journal write, on the store's thread: the answers are packed there too, off the
    event loop."""
    store.journal(JournalRows(list(batch.attempts.values()), batch.rows(), batch.ended, state))


class Journal:
    """What the sampler tells the journal as prompts are sampled. This base keeps nothing:
    a sampler without a store (benchmarks, tests) has nothing to resume."""

    #: Whether a restart resumes the prompts being sampled from what was told here.
    keeps_answers = False
    #: Prompts taken from the dataset and not admitted yet (paced admission's delayed
    #: ones): the cursor written is past them, so they are written to be served again.
    held: Callable[[], Iterable[PromptRow]] = staticmethod(lambda: ())

    def issued(self, run: PromptRun) -> None:
        """A prompt was admitted or issued more answers (its `issued` count moved)."""

    def answered(self, run: PromptRun, answers: Sequence[tuple[int, Completion, Verdict]]) -> None:
        """Verified answers of a prompt still sampling, by index."""

    def finished(self, run: PromptRun) -> None:
        """Its group is about to be stored, which ends the attempt in the same write."""

    def ended(self, run: PromptRun) -> None:
        """It finished without a group (dropped)."""


class AnswerJournal(Journal):
    """Collects the journal's rows as prompts are sampled and writes them in batches.

    A row is written at the second write after it was collected, if its prompt has not
    been handed to the finalizer by then: most prompts' last answers are followed by
    their group's write within a few milliseconds, and writing them first would double
    the store's work exactly when it is busiest (a front at its knee). What a kill can lose is therefore
    the answers verified in the last two write periods. The dataset's cursor is written
    with the same lag, so it never covers an admission whose attempt is not yet written.
    """

    keeps_answers = True

    def __init__(self, store: AsyncStore, dataset: Dataset, every_s: float = FLUSH_S) -> None:
        self._store = store
        self._dataset = dataset
        self._every_s = every_s
        #: Rows collected since the last write, and those collected before it.
        self._young = _Batch()
        self._old = _Batch()
        #: The cursor when the last write began: it covers exactly the admissions whose
        #: rows are now old, and goes with them.
        self._cursor: dict[str, Any] = {}
        #: Attempts that ended since the last write began: a failed write must not bring
        #: their rows back.
        self._ended_meanwhile: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- what happened --------------------------------------------------------------
    def issued(self, run: PromptRun) -> None:
        row = run.row
        self._young.attempts[run.attempt_id] = (run.attempt_id, row.id, row.domain, run.issued)
        self._wake.set()

    def answered(self, run: PromptRun, answers: Sequence[tuple[int, Completion, Verdict]]) -> None:
        by_index = self._young.answers.setdefault(run.attempt_id, {})
        for index, completion, verdict in answers:
            by_index[index] = (
                run.attempt_id,
                index,
                completion.policy_version,
                verdict.reward,
                completion,
            )
        self._wake.set()

    def finished(self, run: PromptRun) -> None:
        # What is still collected for it is not written: a later write would bring back
        # the attempt that its group's write ended.
        self._forget(run.attempt_id)

    def ended(self, run: PromptRun) -> None:
        self._forget(run.attempt_id)
        self._young.ended.append(run.attempt_id)
        self._wake.set()

    def _forget(self, attempt_id: str) -> None:
        for batch in (self._young, self._old):
            batch.attempts.pop(attempt_id, None)
            batch.answers.pop(attempt_id, None)
        self._ended_meanwhile.add(attempt_id)

    # -- writes -----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="answer-journal")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a failed write must not stop the journal; retried next
                log.exception("writing the answer journal failed")
            await asyncio.sleep(self._every_s)
            if self._old:  # written at the next write, whatever happens meanwhile
                self._wake.set()

    async def flush(self, everything: bool = False) -> None:
        """Write the old rows (`everything`: the young ones too, with the cursor of now),
        and the ended attempts."""
        batch, self._old, self._young = self._old, self._young, _Batch()
        batch.ended, self._old.ended = batch.ended + self._old.ended, []
        cursor, self._cursor = self._cursor, {DATASET_KEY: self._dataset.state_dict(self.held())}
        if everything:
            batch = _merged(batch, self._old)
            self._old, cursor = _Batch(), self._cursor
        if not batch and not cursor:
            return
        self._ended_meanwhile = set()
        try:
            await self._store.call(_write, self._store.sync, batch, cursor)
        except BaseException:
            self._merge_back(batch)
            raise

    def _merge_back(self, batch: _Batch) -> None:
        """A write that failed: its rows are written with the next (newer rows win), but
        not those of attempts that ended while it was under way."""
        for attempt_id in self._ended_meanwhile:
            batch.attempts.pop(attempt_id, None)
            batch.answers.pop(attempt_id, None)
        self._old = _merged(batch, self._old)

    async def close(self) -> None:
        """Stop, writing what is left (a graceful stop loses nothing verified)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush(everything=True)
