"""The SQLite store: groups survive reopening, and WAL checkpoints run off the write path."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from sampler_service import store as store_module
from sampler_service.store import ACKED_KEY, FrameRows, Store

PAYLOAD = os.urandom(200_000)  # about one group of 4 x 1,024 tokens


def _fill(store: Store, n: int) -> None:
    for i in range(n):
        store.add_pending(f"g{i}", PAYLOAD)
    store.frame([FrameRows("b0", [(f"g{i}", PAYLOAD) for i in range(n // 2)])])


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_checkpoints_move_the_wal_into_the_database_from_another_thread(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=0.05)
    # The writer never checkpoints by itself...
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    _fill(store, 40)  # ~8 MB of WAL, eight times SQLite's default checkpoint threshold
    # ...the checkpoint thread copies the log into the database file.
    assert _wait_for(lambda: (tmp_path / "s.sqlite").stat().st_size > 40 * len(PAYLOAD))
    assert _wait_for(lambda: store.checkpoints > 0)
    store.close()
    assert (
        not (tmp_path / "s.sqlite-wal").exists() or (tmp_path / "s.sqlite-wal").stat().st_size == 0
    )


def test_under_constant_writes_the_wal_starts_again_instead_of_growing(tmp_path: Path) -> None:
    """Frames of 16 groups every few ms, acks of 64 (a busy front's pattern): a write
    always lands during a PASSIVE checkpoint, so the log never restarts by itself (it
    grew to ~240 MB in these 2 s before); past `wal_restart_bytes` the checkpointer's
    RESTART starts it again."""
    payload = os.urandom(35_000)  # a group of 4 x 700 tokens
    wal = tmp_path / "s.sqlite-wal"
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=0.02, wal_restart_bytes=4 << 20)
    largest, frames, unacked = 0, 0, []
    started = time.monotonic()
    while time.monotonic() - started < 2.0:
        ids = [f"g{frames}.{k}" for k in range(16)]
        store.frame([FrameRows(f"b{frames}", [(g, payload) for g in ids])])
        frames += 1
        unacked += ids
        if len(unacked) >= 64:
            store.delete(unacked)
            unacked = []
        largest = max(largest, wal.stat().st_size)
        time.sleep(0.003)
    restarts = store.wal_restarts
    store.close()
    assert frames * 16 * len(payload) > 64 << 20  # far more written than the log kept
    assert restarts > 0
    assert largest < 32 << 20


def test_without_the_thread_sqlite_checkpoints_inside_commits(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=None)
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    assert store.checkpoints == 0
    store.close()


def test_groups_and_frames_survive_reopening(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=0.05)
    _fill(store, 10)
    store.delete(["g0"])
    store.put({"scheduler_state": {"cursor": 7}})
    store._checkpointer.stop()  # as a crash would leave it: no final checkpoint, no close
    store._checkpointer = None
    reopened = Store(tmp_path / "s.sqlite")
    assert [g.group_id for g in reopened.pending()] == [f"g{i}" for i in range(5, 10)]
    (frame,) = reopened.frames()
    assert [m.group_id for m in frame.members] == ["g1", "g2", "g3", "g4"]
    assert all(m.payload == PAYLOAD for m in frame.members)
    assert reopened.get("scheduler_state") == {"cursor": 7}
    assert (
        sqlite3.connect(tmp_path / "s.sqlite").execute("PRAGMA integrity_check").fetchone()[0]
        == "ok"
    )
    reopened.close()


def test_keys_are_read_by_name_and_by_prefix(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=None)
    store.put({"a": 1, "replay/p": [1], "replay/q": [], "replayz": 2, "replay": 3, "b": 4})
    # by name (a missing one is left out), and every key that starts with "replay/"
    assert store.get_many(["a", "missing"], "replay/") == {"a": 1, "replay/p": [1], "replay/q": []}
    assert store.get_many(["b"]) == {"b": 4}
    store.close()


def test_each_kind_of_event_keeps_its_own_history(tmp_path: Path, monkeypatch) -> None:
    """A weight update every step must not push the config changes out of the log."""
    monkeypatch.setattr(store_module, "EVENTS_KEPT", 5)
    store = Store(tmp_path / "s.sqlite", None)
    try:
        for i in range(3):
            store.add_event("config", "api", {"i": i})
        for version in range(20):
            store.add_event("weights", "api", {"version": version})
        kinds = [e["kind"] for e in store.events(0, 100)]
        assert kinds.count("config") == 3 and kinds.count("weights") == 5
        configs = store.event_page(0, 100, ["config"])
        assert [e["data"]["i"] for e in configs["events"]] == [0, 1, 2]
        # The next page starts after every event seen, the other kinds included.
        assert configs["last_seq"] == store.last_event_seq() == 23
        first = store.event_page(0, 2, ["weights"])
        assert [e["data"]["version"] for e in first["events"]] == [15, 16]
        assert first["last_seq"] == first["events"][-1]["seq"]
    finally:
        store.close()


def test_frames_store_new_groups_once_update_pending_ones_and_share_a_commit(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.sqlite"
    store = Store(path, checkpoint_every_s=None)
    pending_seq = store.add_pending("waited", b"pending bytes")
    store.add_pending("dropped", b"dropped bytes")
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    seqs = store.frame(
        [
            FrameRows("b1", [("waited", b"framed a"), ("fresh", b"framed b")]),
            FrameRows("b2", [("later", b"framed c")], dropped=["dropped"]),
        ],
        state={"k": 1},
    )
    store._db.set_trace_callback(None)
    assert statements.count("COMMIT") == 1
    assert seqs[0][0] == pending_seq and seqs[0][1] > pending_seq  # the pending row kept its place
    assert seqs[1][0] > seqs[0][1]
    rows = store._db.execute("SELECT group_id, batch_index, payload FROM groups").fetchall()
    assert sorted(rows) == [
        ("fresh", 1, b"framed b"),
        ("later", 0, b"framed c"),
        ("waited", 0, b"framed a"),
    ]
    store.close()
    reopened = Store(path, checkpoint_every_s=None)
    first, second = reopened.frames()
    assert [(m.group_id, m.payload) for m in first.members] == [
        ("waited", b"framed a"),
        ("fresh", b"framed b"),
    ]
    assert [m.group_id for m in second.members] == ["later"]
    assert reopened.pending() == [] and reopened.get("k") == 1
    reopened.close()


def test_a_write_and_an_ack_take_a_statement_per_hundred_groups_not_one_each(
    tmp_path: Path,
) -> None:
    """Each statement step hands the GIL back and forth with the event loop, so many
    groups go in one statement; seqs still come back per member, in frame order."""
    store = Store(tmp_path / "s.sqlite", checkpoint_every_s=None)
    ids = [f"g{i}" for i in range(250)]
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    (seqs,) = store.frame([FrameRows("b", [(g, g.encode()) for g in ids])])
    assert sum(s.startswith("INSERT INTO groups") for s in statements) == 3
    by_id = dict(store._db.execute("SELECT group_id, seq FROM groups").fetchall())
    assert seqs == [by_id[g] for g in ids] and seqs == sorted(seqs)
    statements.clear()
    assert store.delete([*ids[:120], "never-stored"]) == 120
    assert sum(s.startswith("DELETE FROM groups") for s in statements) == 2
    store._db.set_trace_callback(None)
    assert store.count() == 130 and store.get(ACKED_KEY) == 120
    store.close()
