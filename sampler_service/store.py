"""Durable state in one SQLite file (WAL): finished groups, the answer journal of the
prompts still being sampled (`sampler_service.journal`) and the sampler's own state.

A group is written here before it is offered to any consumer and deleted only when it
is acked, so a crash, a dropped connection or a restart never loses a finished group.
Lease state lives in memory only: after a restart every group is READY again, which is
exactly the at-least-once contract, so persisting leases would buy nothing.

SQLite calls block, so the async side goes through `AsyncStore`, which runs every call
on one dedicated thread (one connection, no cross-thread sharing).

WAL checkpoints (copying the log into the database file, with its fsyncs) run on a thread
and connection of their own. SQLite's default runs them inside whichever commit crosses
1,000 pages, which put ~20 ms into every ~18th group's delivery latency. Under constant
writes the log must also be restarted by that thread (`_Checkpointer`), or it grows
without end.

Groups are written and deleted a statement per batch of rows, not a statement per row:
the sqlite3 module lets go of the GIL around every step of a statement, and the store's
thread must win it back from the event loop after each one. A row at a time, a write of
n groups stepped 2n statements (the insert, then its seq read back), and each hand-over
can wait up to the interpreter's switch interval (5 ms) while the loop is busy.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

T = TypeVar("T")
#: After a checkpoint the WAL file is cut back to this size; without a limit it keeps its
#: high-water mark for the life of the process. Set above what half a second of groups
#: writes at a few thousand answers/s (~20 MB), so the checkpointed log is reused in
#: place rather than cut and grown again at every checkpoint.
_WAL_LIMIT_BYTES = 64 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id    TEXT NOT NULL UNIQUE,
    batch_id    TEXT,             -- NULL while the group waits for its batch frame
    batch_index INTEGER,
    payload     BLOB NOT NULL,    -- the msgpack Group (trainer_client.contract.wire), without delivery_id
    created_at  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS groups_batch ON groups(batch_id);
CREATE TABLE IF NOT EXISTS kv (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    time   REAL NOT NULL,
    kind   TEXT NOT NULL,   -- config | weights | engine_failed | replica | schedule_skipped
    source TEXT NOT NULL,   -- who caused it: api | schedule | engine | ...
    data   TEXT NOT NULL    -- JSON object
);
CREATE INDEX IF NOT EXISTS events_kind ON events(kind, seq);
CREATE TABLE IF NOT EXISTS attempts (
    attempt_id TEXT PRIMARY KEY,  -- the group id its group will have once finished
    prompt_id  TEXT NOT NULL,
    domain     TEXT NOT NULL,
    issued     INTEGER NOT NULL,  -- answers issued so far: the next answer's index
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS answers (
    attempt_id TEXT NOT NULL,
    idx        INTEGER NOT NULL,  -- its index in the prompt's sequence of answers
    version    INTEGER NOT NULL,  -- the policy version that sampled it
    reward     REAL NOT NULL,
    payload    BLOB NOT NULL,     -- the msgpack answer (sampler_service.journal)
    PRIMARY KEY (attempt_id, idx)
) WITHOUT ROWID;
"""

#: The event log keeps this many of the newest events of each kind; older ones are deleted
#: as new ones arrive, so a long run's log stays small, and a weight update every step
#: never pushes out the config history.
EVENTS_KEPT = 10_000
#: What the event log records: config changes, weight updates, schedule steps skipped,
#: an engine failure, replica state changes.
EventKind = Literal["config", "weights", "schedule_skipped", "engine_failed", "replica"]
#: kv key of the number of groups acked since the state dir was created.
ACKED_KEY = "acked_groups"
#: Rows per multi-row statement: 100 rows of 5 values bind 500 variables, below SQLite's
#: limit (32,766; 999 before 3.32).
_ROWS_PER_STATEMENT = 100


@dataclass(frozen=True)
class StoredGroup:
    seq: int
    group_id: str
    payload: bytes
    # What delivery needs to know without decoding the payload: the oldest sample's policy
    # version (staleness) and the prompt it came from (to serve it again if it is dropped).
    policy_version_min: int = 0
    prompt_id: str = ""
    domain: str = ""
    #: Sampled tokens of its fresh answers (replayed ones were counted when sampled):
    #: what acking it trains on, or what dropping it wastes.
    tokens: int = 0
    #: Sampled tokens of the prompt's answers down-sampling left out: dropping the group
    #: wastes them too.
    downsampled: int = 0


@dataclass(frozen=True)
class FrameRows:
    """A batch frame to store: its members' final bytes in frame order, and the ids of
    members stored as pending that a batch policy dropped."""

    batch_id: str
    members: list[tuple[str, bytes]]
    dropped: Sequence[str] = ()


@dataclass(frozen=True)
class JournalRows:
    """One write of the answer journal: prompts' attempts (their answers issued so far),
    their verified answers `(attempt_id, index, version, reward, payload)`, the attempts
    that ended without a group, and state that moves with them."""

    attempts: Sequence[tuple[str, str, str, int]] = ()  # attempt, prompt, domain, issued
    answers: Sequence[tuple[str, int, int, float, bytes]] = ()
    ended: Sequence[str] = ()
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredAttempt:
    """A prompt that was being sampled when the sampler stopped, with the answers that
    were stored: `(index, version, reward, payload)`, in index order."""

    attempt_id: str
    prompt_id: str
    domain: str
    issued: int
    answers: list[tuple[int, int, float, bytes]]


@dataclass(frozen=True)
class StoredFrame:
    batch_id: str
    members: list[StoredGroup]  # in batch_index order


class _Checkpointer(threading.Thread):
    """Checkpoints the WAL every `every_s` seconds from its own connection.

    PASSIVE never waits for the writer or readers, so the writer's commits stay short; a
    checkpoint that could not finish simply continues at the next tick. But the WAL
    starts again from its beginning only when a write begins with every frame already
    copied, and under constant writes one always lands during the checkpoint: the log
    then grows without end (to ~1 GB in 30 s at 880 groups/s of 35 KB in the front
    benchmark), and the disk's writeback of it stalled the writer 100-230 ms at a time.
    So once the log holds more than `restart_bytes`, a RESTART checkpoint holds the
    writer back until everything is copied (the next write starts the log afresh).
    """

    def __init__(self, path: Path, every_s: float, restart_bytes: int) -> None:
        super().__init__(name="store-checkpoint", daemon=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._every_s = every_s
        page_size = self._db.execute("PRAGMA page_size").fetchone()[0]
        self._restart_frames = max(1, restart_bytes // page_size)
        self._stopping = threading.Event()
        self.checkpoints = 0
        self.restarts = 0

    def run(self) -> None:
        while not self._stopping.wait(self._every_s):
            _, frames, _ = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if frames > self._restart_frames:
                busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
                self.restarts += not busy  # busy: the writer held on; again next tick
            self.checkpoints += 1

    def stop(self) -> None:
        self._stopping.set()
        self.join()
        self._db.close()


def _marks(n: int) -> str:
    """The placeholders of an `IN (...)` list of n values."""
    return ", ".join("?" * n)


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), _ROWS_PER_STATEMENT):
        yield items[start : start + _ROWS_PER_STATEMENT]


def _seqs(db: sqlite3.Connection, group_ids: Sequence[str]) -> dict[str, int]:
    """Each group's seq, a row of JSON per chunk (one statement step, not one a group)."""
    seq_of: dict[str, int] = {}
    for chunk in _chunks(group_ids):
        (found,) = db.execute(
            "SELECT json_group_object(group_id, seq) FROM groups "
            f"WHERE group_id IN ({_marks(len(chunk))})",
            chunk,
        ).fetchone()
        seq_of.update(json.loads(found))
    return seq_of


def _end_attempts(db: sqlite3.Connection, attempt_ids: Sequence[str]) -> None:
    """Forget these attempts and their answers (their group is stored, or they ended
    without one)."""
    for chunk in _chunks(attempt_ids):
        marks = _marks(len(chunk))
        db.execute(f"DELETE FROM answers WHERE attempt_id IN ({marks})", chunk)
        db.execute(f"DELETE FROM attempts WHERE attempt_id IN ({marks})", chunk)


def _delete(db: sqlite3.Connection, group_ids: Sequence[str]) -> int:
    """Delete these groups; how many there were."""
    before = db.total_changes
    for chunk in _chunks(group_ids):
        db.execute(f"DELETE FROM groups WHERE group_id IN ({_marks(len(chunk))})", chunk)
    return db.total_changes - before


class Store:
    """Synchronous SQLite access; use from a single thread.

    `checkpoint_every_s=None` leaves checkpoints to SQLite's default (inside commits).
    """

    def __init__(
        self,
        path: Path,
        checkpoint_every_s: float | None = 0.5,
        wal_restart_bytes: int = _WAL_LIMIT_BYTES,
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a process crash (kill -9); only an OS crash or
        # power loss can drop the last commits.
        self._db.execute("PRAGMA synchronous=NORMAL")
        # Some builds (Debian's, so Ubuntu's and the python images') default to
        # secure_delete, which zeroes every freed page through the WAL: each acked
        # group's ~35 KB was written a second time, and an ack of 64 groups held the
        # store's thread ~30-50 ms. A freed group's pages are reused, not secret.
        self._db.execute("PRAGMA secure_delete=OFF")
        self._db.execute(f"PRAGMA journal_size_limit={_WAL_LIMIT_BYTES}")
        self._db.executescript(_SCHEMA)
        self._checkpointer: _Checkpointer | None = None
        if checkpoint_every_s is not None:
            self._db.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = _Checkpointer(path, checkpoint_every_s, wal_restart_bytes)
            self._checkpointer.start()

    @property
    def checkpoints(self) -> int:
        """Checkpoints run by the background thread so far."""
        return self._checkpointer.checkpoints if self._checkpointer else 0

    @property
    def wal_restarts(self) -> int:
        """RESTART checkpoints the background thread ran to start the WAL afresh."""
        return self._checkpointer.restarts if self._checkpointer else 0

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(self._db)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

    # -- groups ---------------------------------------------------------------------
    def add_pending(
        self, group_id: str, payload: bytes, state: dict[str, Any] | None = None
    ) -> int:
        """Persist a finished group (not yet framed) and any state that moved with it."""

        def run(db: sqlite3.Connection) -> int:
            cur = db.execute(
                "INSERT INTO groups (group_id, payload, created_at) VALUES (?, ?, ?)",
                (group_id, payload, time.time()),
            )
            _end_attempts(db, [group_id])
            self._put_many(db, state or {})
            assert cur.lastrowid is not None  # set by every INSERT
            return cur.lastrowid

        return self._tx(run)

    def frame(
        self, frames: Sequence[FrameRows], state: dict[str, Any] | None = None
    ) -> list[list[int]]:
        """Store READY batch frames with their final bytes in one transaction; returns each
        frame's members' seqs.

        A member stored before as pending is updated in place; one that completes its
        frame as it finishes is written here for the first time, so it is written once.
        Frames that finished together share a commit: the finalizer's pace is one commit
        per batch of groups, not per group. `state` moves in the same transaction, as
        with `add_pending`.
        """

        def run(db: sqlite3.Connection) -> list[list[int]]:
            now = time.time()
            rows = [
                (gid, frame.batch_id, i, payload, now)
                for frame in frames
                for i, (gid, payload) in enumerate(frame.members)
            ]
            for chunk in _chunks(rows):
                db.execute(
                    "INSERT INTO groups (group_id, batch_id, batch_index, payload, created_at) "
                    f"VALUES {', '.join(['(?, ?, ?, ?, ?)'] * len(chunk))} "
                    "ON CONFLICT(group_id) DO UPDATE SET batch_id = excluded.batch_id, "
                    "batch_index = excluded.batch_index, payload = excluded.payload",
                    [value for row in chunk for value in row],
                )
            seq_of = _seqs(db, [row[0] for row in rows])
            dropped = [g for frame in frames for g in frame.dropped]
            _end_attempts(db, [row[0] for row in rows] + dropped)
            _delete(db, dropped)
            self._put_many(db, state or {})
            return [[seq_of[gid] for gid, _ in frame.members] for frame in frames]

        return self._tx(run)

    def delete(self, group_ids: Iterable[str]) -> int:
        """Delete acked groups; the acked-groups counter moves in the same transaction."""
        ids = list(group_ids)
        if not ids:
            return 0

        def run(db: sqlite3.Connection) -> int:
            deleted = _delete(db, ids)
            if deleted:
                db.execute(
                    "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT(key) "
                    "DO UPDATE SET value = CAST(value AS INTEGER) + excluded.value",
                    (ACKED_KEY, deleted),
                )
            return deleted

        return self._tx(run)

    def discard(self, group_ids: Iterable[str]) -> None:
        """Delete groups that will not be delivered (not acks: the counter stays)."""
        ids = list(group_ids)
        self._tx(lambda db: _delete(db, ids))

    def unframe(self, group_ids: Iterable[str]) -> None:
        """Make framed groups pending again (their frame was split before it was ever
        handed out); they are framed anew."""
        ids = list(group_ids)

        def run(db: sqlite3.Connection) -> None:
            for chunk in _chunks(ids):
                db.execute(
                    "UPDATE groups SET batch_id = NULL, batch_index = NULL "
                    f"WHERE group_id IN ({_marks(len(chunk))})",
                    chunk,
                )

        self._tx(run)

    def pending(self) -> list[StoredGroup]:
        rows = self._db.execute(
            "SELECT seq, group_id, payload FROM groups WHERE batch_id IS NULL ORDER BY seq"
        ).fetchall()
        return [StoredGroup(s, g, bytes(p)) for s, g, p in rows]

    def frames(self) -> list[StoredFrame]:
        """Every framed group, grouped by frame, oldest frame first."""
        rows = self._db.execute(
            "SELECT seq, group_id, payload, batch_id FROM groups WHERE batch_id IS NOT NULL "
            "ORDER BY batch_id, batch_index"
        ).fetchall()
        by_batch: dict[str, list[StoredGroup]] = {}
        for seq, gid, payload, batch_id in rows:
            by_batch.setdefault(batch_id, []).append(StoredGroup(seq, gid, bytes(payload)))
        frames = [StoredFrame(b, members) for b, members in by_batch.items()]
        frames.sort(key=lambda f: min(m.seq for m in f.members))
        return frames

    def count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM groups").fetchone()[0])

    # -- the answer journal -----------------------------------------------------------
    def journal(self, rows: JournalRows) -> None:
        """Write a batch of the answer journal in one transaction. An attempt's issued
        count only grows; an answer written again (drawn again after a restart) replaces
        the stored one."""

        def run(db: sqlite3.Connection) -> None:
            now = time.time()
            db.executemany(
                "INSERT INTO attempts (attempt_id, prompt_id, domain, issued, created_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT(attempt_id) "
                "DO UPDATE SET issued = MAX(issued, excluded.issued)",
                [(*attempt, now) for attempt in rows.attempts],
            )
            for chunk in _chunks(rows.answers):
                db.execute(
                    "INSERT OR REPLACE INTO answers (attempt_id, idx, version, reward, payload) "
                    f"VALUES {', '.join(['(?, ?, ?, ?, ?)'] * len(chunk))}",
                    [value for row in chunk for value in row],
                )
            _end_attempts(db, rows.ended)
            self._put_many(db, rows.state)

        self._tx(run)

    def attempts(self) -> list[StoredAttempt]:
        """The journalled attempts, oldest first, each with its stored answers. An attempt
        whose group was stored is gone (it ends with the group's write); answers whose
        attempt row is missing (none should be) are left out."""
        answers: dict[str, list[tuple[int, int, float, bytes]]] = {}
        for attempt_id, idx, version, reward, payload in self._db.execute(
            "SELECT attempt_id, idx, version, reward, payload FROM answers ORDER BY attempt_id, idx"
        ):
            answers.setdefault(attempt_id, []).append((idx, version, reward, bytes(payload)))
        rows = self._db.execute(
            "SELECT attempt_id, prompt_id, domain, issued FROM attempts ORDER BY created_at"
        ).fetchall()
        return [StoredAttempt(a, p, d, n, answers.get(a, [])) for a, p, d, n in rows]

    # -- key/value state ------------------------------------------------------------
    @staticmethod
    def _put_many(db: sqlite3.Connection, items: dict[str, Any]) -> None:
        db.executemany(
            "INSERT INTO kv (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [(k, json.dumps(v, default=_unpacked)) for k, v in items.items()],
        )

    def put(self, items: dict[str, Any]) -> None:
        self._tx(lambda db: self._put_many(db, items))

    def get(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def get_many(self, keys: Sequence[str], prefix: str | None = None) -> dict[str, Any]:
        """The values of `keys` that are set, and of every key that starts with `prefix`."""
        rows = self._db.execute(
            f"SELECT key, value FROM kv WHERE key IN ({_marks(len(keys))})", tuple(keys)
        ).fetchall()
        if prefix is not None:
            # [prefix, prefix + U+10FFFF): every key that starts with it, by the index
            rows += self._db.execute(
                "SELECT key, value FROM kv WHERE key >= ? AND key < ?",
                (prefix, prefix + "\U0010ffff"),
            ).fetchall()
        return {key: json.loads(value) for key, value in rows}

    # -- event log ------------------------------------------------------------------
    def add_event(
        self, kind: str, source: str, data: dict[str, Any], state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Append an event, with any state that changed with it, in one transaction.

        Writing both at once is what keeps a change and its record consistent across a
        crash: e.g. a scheduled config step is either applied and logged, or neither.
        """
        when = time.time()

        def run(db: sqlite3.Connection) -> int:
            cur = db.execute(
                "INSERT INTO events (time, kind, source, data) VALUES (?, ?, ?, ?)",
                (when, kind, source, json.dumps(data)),
            )
            assert cur.lastrowid is not None  # set by every INSERT
            seq = cur.lastrowid
            db.execute(
                "DELETE FROM events WHERE kind = ? AND seq <= (SELECT seq FROM events "
                "WHERE kind = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (kind, kind, EVENTS_KEPT),
            )
            self._put_many(db, state or {})
            return seq

        seq = self._tx(run)
        return {"seq": seq, "time": when, "kind": kind, "source": source, "data": data}

    def events(
        self, since: int = 0, limit: int = 1000, kinds: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """Events with seq > `since` (of `kinds`, when given), oldest first, at most `limit`."""
        where = f" AND kind IN ({_marks(len(kinds))})" if kinds else ""
        rows = self._db.execute(
            f"SELECT seq, time, kind, source, data FROM events WHERE seq > ?{where} "
            "ORDER BY seq LIMIT ?",
            (since, *kinds, limit),
        ).fetchall()
        return [
            {"seq": seq, "time": t, "kind": kind, "source": source, "data": json.loads(data)}
            for seq, t, kind, source, data in rows
        ]

    def last_event_seq(self) -> int:
        return int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])

    def event_page(self, since: int, limit: int, kinds: Sequence[str] = ()) -> dict[str, Any]:
        """`events(...)` and `last_seq`, where the next page starts: past every event seen
        when the page is short (the kinds left out included), else after its last event.
        One call, so no event added meanwhile is skipped."""
        events = self.events(since, limit, kinds)
        last = events[-1]["seq"] if len(events) == limit else self.last_event_seq()
        return {"events": events, "last_seq": last}


class AsyncStore:
    """Runs every Store call on one dedicated thread so the event loop never blocks."""

    def __init__(self, store: Store) -> None:
        self.sync = store
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def close(self) -> None:
        await self.call(self.sync.close)
        self._thread.shutdown(wait=True)


def _unpacked(value: Any) -> Any:
    """A state value's numpy parts as JSON: an engine on the far side of a process
    boundary packs answers' token ids and logprobs into arrays (`backends.base.packed`),
    and the replay store saves the answers it keeps as they came."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"a state value of type {type(value).__name__} cannot be stored as JSON")
