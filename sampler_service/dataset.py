"""Prompt rows from JSONL (or Parquet) files, one file per domain or a `domain` column.

Each domain is an endless sequence of epochs, shuffled per epoch from a seed, so the
mixing policy can draw from any domain at any time; the cursor is part of the sampler's
persisted state, so a restart continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class DatasetError(ValueError):
    """A data file that cannot be served, with the file and line at fault."""


class OverlongPrompt(DatasetError):
    """A prompt that leaves no room for one answer token in the model's context."""


@dataclass
class PromptRow:
    id: str
    prompt: str | list[dict[str, Any]]
    answer: str
    domain: str
    verifier: str | None = None
    metadata: dict[str, Any] | None = None
    #: The environment an episode of this prompt runs against (a spec, as verifiers);
    #: None: single answers (unless the service has a default environment).
    env: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    #: Where the row was read (`file:line`), for the messages about it.
    where: str = ""


def _stable_id(row: dict[str, Any]) -> str:
    blob = json.dumps({k: row.get(k) for k in ("prompt", "answer")}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for every record of a data file; `where` is `file:line` (JSONL) or
    `file:row N` (Parquet), for error messages."""
    if not path.exists():
        raise DatasetError(f"{path}: no such data file")
    if not path.is_file():
        raise DatasetError(f"{path}: not a file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise DatasetError(f"{path}: reading Parquet needs pyarrow installed") from exc
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
            raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from exc
        return [(f"{path}:row {i}", row) for i, row in enumerate(rows, 1)]
    records = []
    try:
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DatasetError(f"{path}:{lineno}: not UTF-8 text ({exc.reason})") from exc
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
                if not isinstance(record, dict):
                    raise DatasetError(f"{path}:{lineno}: expected a JSON object")
                records.append((f"{path}:{lineno}", record))
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    return records


def _to_row(record: dict[str, Any], default_domain: str, where: str) -> PromptRow:
    for key in ("prompt", "answer"):
        if key not in record:
            raise DatasetError(f"{where}: missing required field {key!r}")
    prompt = record["prompt"]
    if not isinstance(prompt, str | list):
        raise DatasetError(f"{where}: 'prompt' must be a string or a list of chat messages")
    return PromptRow(
        id=str(record.get("id") or _stable_id(record)),
        prompt=prompt,
        answer=str(record["answer"]),
        domain=str(record.get("domain") or default_domain),
        verifier=record.get("verifier"),
        metadata=record.get("metadata"),
        env=_env_spec(record.get("env"), where),
        where=where,
    )


def _env_spec(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str) and value:
        return value
    raise DatasetError(f"{where}: 'env' must be an environment spec string, got {value!r}")


class Dataset:
    """All prompts by domain, with a persisted per-domain epoch cursor."""

    def __init__(self, paths: Sequence[Path], tokenize: Callable[[PromptRow], None], seed: int = 0):
        self.seed = seed
        self._tokenize = tokenize
        self.rows: dict[str, list[PromptRow]] = {}
        for path in paths:
            records = _read_records(path)
            if not records:
                raise DatasetError(f"{path}: holds no prompts")
            for where, record in records:
                row = _to_row(record, path.stem, where)
                self.rows.setdefault(row.domain, []).append(row)
        if not self.rows:
            raise DatasetError("no data files given")
        self.domains = sorted(self.rows)
        self._cursor = {d: [0, 0] for d in self.domains}  # domain -> [epoch, position]
        self._orders: dict[str, tuple[int, np.ndarray]] = {}
        # Prompts to serve again before the cursor moves on (their group was dropped
        # after it was finished, e.g. too stale to train on), per domain, oldest first.
        self._again: dict[str, deque[PromptRow]] = {d: deque() for d in self.domains}
        self._by_id: dict[tuple[str, str], PromptRow] | None = None

    def env_specs(self) -> set[str]:
        """The environment specs the rows name (each loaded once at start-up)."""
        return {row.env for rows in self.rows.values() for row in rows if row.env}

    @property
    def size(self) -> int:
        """Prompts served, over every domain."""
        return sum(len(rows) for rows in self.rows.values())

    def prompt_ids(self) -> list[str]:
        return [row.id for rows in self.rows.values() for row in rows]

    def longest_prompt(self) -> tuple[int, str]:
        """(tokens, prompt id) of the longest prompt; tokenizes every row (each row keeps its
        tokens, as the first epoch would)."""
        longest, which = 0, ""
        for rows in self.rows.values():
            for row in rows:
                if len(self._prepared(row).token_ids) > longest:
                    longest, which = len(row.token_ids), row.id
        return longest, which

    def fit_context(self, context_length: int | None, *, drop_overlong: bool) -> list[PromptRow]:
        """Tokenize every row, and refuse (`OverlongPrompt`) or, `drop_overlong`, drop
        each prompt that leaves no room for one answer token in `context_length`; returns
        the rows dropped. A start checks every prompt before anything is claimed: one that
        fails at its first wave is a dropped prompt and an engine warning hours in."""
        rows = [self._prepared(row) for domain_rows in self.rows.values() for row in domain_rows]
        if context_length is None:
            return []
        over = [row for row in rows if len(row.token_ids) + 1 > context_length]
        if over and not drop_overlong:
            first, more = over[0], len(over) - 1
            raise OverlongPrompt(
                f"{first.where}: prompt {first.id!r} has {len(first.token_ids)} tokens: no room "
                f"for an answer in the model's context ({context_length} tokens)"
                + (f" (and {more} more prompt{'s' if more > 1 else ''})" if more else "")
            )
        if over:
            dropped = {id(row) for row in over}
            for domain in self.domains:
                kept = [row for row in self.rows[domain] if id(row) not in dropped]
                if not kept:
                    raise DatasetError(
                        f"every prompt of domain {domain!r} is over-long for the model's "
                        f"context ({context_length} tokens)"
                    )
                self.rows[domain] = kept
        return over

    def _prepared(self, row: PromptRow) -> PromptRow:
        """`row` tokenized: every path by which a row leaves the dataset goes through here,
        so the engine never receives a prompt this process did not tokenize."""
        if not row.token_ids:
            self._tokenize(row)
            if not row.token_ids:
                raise DatasetError(f"{row.where}: prompt {row.id!r} tokenizes to no tokens")
        return row

    def _find(self, domain: str, prompt_id: str) -> PromptRow | None:
        if self._by_id is None:  # built on first use: most runs never look a prompt up
            self._by_id = {(r.domain, r.id): r for rows in self.rows.values() for r in rows}
        return self._by_id.get((domain, prompt_id))

    def find(self, domain: str, prompt_id: str) -> PromptRow | None:
        """The prompt, tokenized; None if the dataset has no such prompt (any more)."""
        row = self._find(domain, prompt_id)
        return None if row is None else self._prepared(row)

    def serve_again(self, domain: str, prompt_id: str) -> None:
        """Have `next(domain)` return this prompt before any other."""
        if (row := self._find(domain, prompt_id)) is not None:
            self._again[domain].append(row)

    def _order(self, domain: str, epoch: int) -> np.ndarray:
        cached = self._orders.get(domain)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, self.domains.index(domain)])
            cached = (epoch, rng.permutation(len(self.rows[domain])))
            self._orders[domain] = cached
        return cached[1]

    def next(self, domain: str) -> PromptRow:
        """The domain's next prompt (one to serve again first), tokenized on first use;
        wraps into a new epoch."""
        if self._again[domain]:
            return self._prepared(self._again[domain].popleft())
        epoch, pos = self._cursor[domain]
        rows = self.rows[domain]
        row = rows[int(self._order(domain, epoch)[pos])]
        pos += 1
        if pos == len(rows):
            epoch, pos = epoch + 1, 0
        self._cursor[domain] = [epoch, pos]
        return self._prepared(row)

    def state_dict(self, held: Iterable[PromptRow] = ()) -> dict[str, Any]:
        """The cursor and the prompts to serve again; `held`: prompts the cursor has passed
        that were not admitted yet (paced admission's delayed ones), served again first."""
        again: dict[str, list[str]] = {}
        for row in [*held, *(r for rows in self._again.values() for r in rows)]:
            again.setdefault(row.domain, []).append(row.id)
        return {"cursor": self._cursor, "again": again}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for domain, (epoch, pos) in state.get("cursor", {}).items():
            if domain in self._cursor and 0 <= pos < len(self.rows[domain]):
                self._cursor[domain] = [int(epoch), int(pos)]
        for domain, ids in state.get("again", {}).items():
            if domain in self._again:
                self._again[domain].clear()
                for prompt_id in ids:
                    self.serve_again(domain, prompt_id)
