"""`exact`: the answer matches after light normalization, numerically when both are numbers.

Meant for short final answers (the toy task, GSM8K-style numbers), where a model writing
"82.0", "82." or " 82" for "82" is right, and where parsing LaTeX would be overkill.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any


def normalize(text: str) -> str:
    """Strip surrounding whitespace and trailing periods, then case-fold."""
    return text.strip().rstrip(".").strip().casefold()


# Longer strings are not "a number" answer; the cap keeps Decimal parsing (superlinear in
# the digit count) cheap enough to run on the event loop for any response.
_MAX_NUMBER_CHARS = 100


def _number(text: str) -> Decimal | None:
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def verify(response: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    """1.0 if `response` equals `answer` as normalized strings or as numbers, else 0.0."""
    got, want = normalize(response), normalize(answer)
    if got == want:
        return 1.0
    got_num, want_num = _number(got), _number(want)
    # Decimal compares decimal literals exactly: "82" == "82.0" == "8.2e1", no float rounding.
    return 1.0 if got_num is not None and got_num == want_num else 0.0
