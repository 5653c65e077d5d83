"""`math`: symbolic answer equivalence with the `math-verify` package.

math-verify's own time limits use SIGALRM, which only works on a process's main thread,
so they are switched off here (`parsing_timeout=None`, `timeout_seconds=None`); the
verifier pool enforces the time limit from the parent process instead.
"""

from __future__ import annotations

from typing import Any

from math_verify import parse
from math_verify import verify as math_verify


def verify(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    """1.0 if the response's final answer (boxed, or the last expression) equals `answer`.

    The reference is read as LaTeX math first (so "\\frac{1}{2}" and "\\{1,2\\}" parse),
    then as plain text; a reference that cannot be parsed is a dataset error and raises.
    """
    gold = parse(f"${answer}$", parsing_timeout=None) or parse(answer, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    predicted = parse(response, parsing_timeout=None)
    return 1.0 if math_verify(gold, predicted, timeout_seconds=None) else 0.0


# math-verify builds its parsers on first use (~0.1-0.5 s). Doing it at import means the
# verifier forkserver, which preloads this module, pays it once for every worker it forks,
# instead of each fresh worker spending it inside its first call's time limit.
verify("1", "1")
