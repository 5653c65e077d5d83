"""Prompt rows from JSONL (or Parquet) files, one file per domain or a `domain` column.

Each domain is an endless sequence of epochs, shuffled per epoch from a seed, so the
mixing policy can draw from any domain at any time; the cursor is part of the sampler's
persisted state, so a restart continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class DatasetError(ValueError):
    """A data file that cannot be served, with the file and line at fault."""


@dataclass
class PromptRow:
    id: str
    prompt: str | list[dict[str, Any]]
    answer: str
    domain: str
    verifier: str | None = None
    metadata: dict[str, Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


def _stable_id(row: dict[str, Any]) -> str:
    blob = json.dumps({k: row.get(k) for k in ("prompt", "answer")}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise DatasetError(f"{path}: reading Parquet needs pyarrow installed") from exc
        return pq.read_table(path).to_pylist()
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object")
            records.append(record)
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
    )


class Dataset:
    """All prompts by domain, with a persisted per-domain epoch cursor."""

    def __init__(self, paths: Sequence[Path], tokenize: Callable[[PromptRow], None], seed: int = 0):
        self.seed = seed
        self._tokenize = tokenize
        self.rows: dict[str, list[PromptRow]] = {}
        for path in paths:
            if not path.exists():
                raise DatasetError(f"{path}: no such data file")
            for i, record in enumerate(_read_records(path)):
                row = _to_row(record, path.stem, f"{path}:{i + 1}")
                self.rows.setdefault(row.domain, []).append(row)
        if not self.rows:
            raise DatasetError("the data files hold no prompts")
        self.domains = sorted(self.rows)
        self._cursor = {d: [0, 0] for d in self.domains}  # domain -> [epoch, position]
        self._orders: dict[str, tuple[int, np.ndarray]] = {}

    def prompt_ids(self) -> list[str]:
        return [row.id for rows in self.rows.values() for row in rows]

    def _order(self, domain: str, epoch: int) -> np.ndarray:
        cached = self._orders.get(domain)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, self.domains.index(domain)])
            cached = (epoch, rng.permutation(len(self.rows[domain])))
            self._orders[domain] = cached
        return cached[1]

    def next(self, domain: str) -> PromptRow:
        """The domain's next prompt, tokenized on first use; wraps into a new epoch."""
        epoch, pos = self._cursor[domain]
        rows = self.rows[domain]
        row = rows[int(self._order(domain, epoch)[pos])]
        pos += 1
        if pos == len(rows):
            epoch, pos = epoch + 1, 0
        self._cursor[domain] = [epoch, pos]
        if not row.token_ids:
            self._tokenize(row)
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self._cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for domain, (epoch, pos) in state.get("cursor", {}).items():
            if domain in self._cursor and 0 <= pos < len(self.rows[domain]):
                self._cursor[domain] = [int(epoch), int(pos)]
