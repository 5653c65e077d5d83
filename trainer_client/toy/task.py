"""The toy arithmetic task: three domains of clearly different difficulty.

The sampler's interesting behaviour (adaptive stopping, balanced down-sampling, domain
mixing) only shows when prompts differ in how often the policy solves them. Arithmetic
gives that with a model small enough for CPU tests, and its answers are checked by exact
match, so the `exact` verifier suffices.

Domains, easiest first:

- ``add1``: one-digit addition, ``"3+4="`` -> ``"7"`` (100 problems in all);
- ``add2``: two-digit addition, ``"37+45="`` -> ``"82"`` (carries make it harder);
- ``mul``: two-digit times one-digit, ``"37*4="`` -> ``"148"`` (needs a per-digit product
  and a carry chain).

Each problem belongs to the held-out split or to the train split by a fixed hash of the
problem itself, never of the seed. So every seed's train rows are disjoint from every
seed's eval rows, and the shipped warm-start weights (trained on the train split only)
never saw an eval problem, whatever seed the caller builds data with. The seed decides
which problems of each split are drawn and in what order.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "eval"]

#: One problem in this many goes to the held-out split.
EVAL_EVERY = 5


@dataclass(frozen=True)
class Domain:
    """An arithmetic domain: all operand pairs ``left x right`` under one operator."""

    name: str
    op: Literal["+", "*"]
    left: range
    right: range

    def problems(self) -> list[tuple[int, int]]:
        """Every operand pair of the domain, in a fixed order."""
        return [(a, b) for a in self.left for b in self.right]

    def row(self, a: int, b: int) -> dict[str, str]:
        """The prompt row (the prompt file format of docs/serve.md) for ``a op b``."""
        prompt = f"{a}{self.op}{b}="
        answer = a + b if self.op == "+" else a * b
        return {
            "id": f"{self.name}-{a}{self.op}{b}",
            "prompt": prompt,
            "answer": str(answer),
            "domain": self.name,
            "verifier": "exact",
        }


DOMAINS: tuple[Domain, ...] = (
    Domain("add1", "+", range(0, 10), range(0, 10)),
    Domain("add2", "+", range(10, 100), range(10, 100)),
    Domain("mul", "*", range(10, 100), range(2, 10)),
)
DOMAIN_NAMES: tuple[str, ...] = tuple(d.name for d in DOMAINS)


def get_domain(name: str) -> Domain:
    """The domain called ``name``; a ``KeyError`` lists the valid names."""
    for domain in DOMAINS:
        if domain.name == name:
            return domain
    raise KeyError(f"unknown toy domain {name!r}; choose from {', '.join(DOMAIN_NAMES)}")


def split_of(domain: Domain, a: int, b: int) -> Split:
    """Which split ``a op b`` belongs to, from a stable hash of the problem alone."""
    digest = hashlib.sha256(f"{domain.name}:{a}{domain.op}{b}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_EVERY == 0 else "train"


def pool(domain: Domain, split: Split) -> list[tuple[int, int]]:
    """All problems of one split of ``domain``, in the domain's fixed order."""
    return [(a, b) for a, b in domain.problems() if split_of(domain, a, b) == split]


def rows(domain: str, split: Split, n: int | None, *, seed: int = 0) -> list[dict[str, str]]:
    """Up to ``n`` distinct rows of ``split`` for ``domain``, drawn by ``seed``.

    Rows are distinct so that a prompt id names one prompt (the scheduler's estimator
    keys on it); ``n`` larger than the split, or None, returns the whole split shuffled.
    """
    d = get_domain(domain)
    problems = pool(d, split)
    rng = random.Random(f"adaptive-rollout-toy:{d.name}:{split}:{seed}")
    rng.shuffle(problems)
    if n is not None:
        problems = problems[:n]
    return [d.row(a, b) for a, b in problems]


def train_rows(domain: str, n: int | None, *, seed: int = 0) -> list[dict[str, str]]:
    """Training prompts for ``domain`` (see :func:`rows`)."""
    return rows(domain, "train", n, seed=seed)


def eval_rows(domain: str, n: int | None, *, seed: int = 0) -> list[dict[str, str]]:
    """Held-out prompts for ``domain``, disjoint from every seed's training prompts."""
    return rows(domain, "eval", n, seed=seed)


def write_jsonl(path: Path, items: Iterable[dict[str, str]]) -> Path:
    """Write rows as JSON lines, byte-identical for identical rows (for idempotent builds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(item, sort_keys=True) + "\n" for item in items)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """Read rows written by :func:`write_jsonl`."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
