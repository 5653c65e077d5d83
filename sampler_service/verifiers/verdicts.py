"""A judge's prompt, and its verdict read from what the judge's server answered.

Three verdict forms (`config.ScoreVerdict`, `LabelVerdict`, `YesProbVerdict`): a number
on a scale mapped onto [0, 1]; a label looked up in a table of rewards; the probability
of a "yes" token among the judge's first-token logprobs. A reply that holds no verdict
raises `Unreadable`: it is a failed judgement (asked again, then the prompt is dropped),
never a reward of 0.

Templates are `str.format` strings restricted to three fields, `{prompt}`, `{response}`
and `{answer}`: no attribute or index access and no format specs, so a template can read
nothing but the three strings it is given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sampler_service.config import LabelVerdict, ScoreVerdict, YesProbVerdict

#: A decimal number as a judge writes one ("7", "0.85", "-1", "1e-3", ".5").
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
#: How much of an unreadable reply an error message quotes.
_QUOTED = 120


class Unreadable(ValueError):
    """The judge answered, but its answer holds no verdict."""


def render(template: str, *, prompt: str, response: str, answer: str) -> str:
    """The judge's prompt (the template was checked by `config.knobs.template_error`)."""
    return template.format(prompt=prompt, response=response, answer=answer)


def _quoted(text: str) -> str:
    return repr(text if len(text) <= _QUOTED else text[:_QUOTED] + "...")


def _matched(pattern: str, text: str) -> str:
    """What `pattern` picks out of `text`: its group, or the whole match."""
    found = re.search(pattern, text)
    picked = None if found is None else found.group(1) if found.re.groups else found.group(0)
    if picked is None:
        raise Unreadable(f"the verdict pattern {pattern!r} matches nothing in {_quoted(text)}")
    return picked


def scaled(verdict: ScoreVerdict, value: float) -> float:
    """A score on the judge's scale as a reward in [0, 1]; outside the scale is no verdict
    (a judge that says 11 on a scale of 10 is not clamped to right)."""
    if not math.isfinite(value):
        raise Unreadable(f"score {value!r} is not a finite number")
    if verdict.sigmoid:
        value = 1.0 / (1.0 + math.exp(-value)) if value > -700 else 0.0
    if not verdict.low <= value <= verdict.high:
        raise Unreadable(f"score {value!r} is outside [{verdict.low:g}, {verdict.high:g}]")
    return (value - verdict.low) / (verdict.high - verdict.low)


def read_score(verdict: ScoreVerdict, text: str) -> float:
    """The score a judge wrote: what the pattern picks, else the last number in the text."""
    if verdict.pattern is not None:
        picked = _matched(verdict.pattern, text)
    else:
        numbers = _NUMBER.findall(text)
        if not numbers:
            raise Unreadable(f"no number in {_quoted(text)}")
        picked = numbers[-1]
    try:
        value = float(picked)
    except ValueError:
        raise Unreadable(f"{_quoted(picked)} is not a number") from None
    return scaled(verdict, value)


def read_label(verdict: LabelVerdict, text: str) -> float:
    """The reward of the label a judge wrote: what the pattern picks, else the last label
    in the text as a whole word (so `incorrect` never reads as `correct`). Labels match
    without regard to case or surrounding space."""
    rewards = {label.strip().casefold(): reward for label, reward in verdict.labels.items()}
    if verdict.pattern is not None:
        picked = _matched(verdict.pattern, text)
    else:
        words = "|".join(re.escape(label) for label in sorted(rewards, key=len, reverse=True))
        found = re.findall(rf"(?<!\w)(?:{words})(?!\w)", text, flags=re.IGNORECASE)
        if not found:
            raise Unreadable(f"none of the labels {sorted(verdict.labels)} in {_quoted(text)}")
        picked = found[-1]
    key = picked.strip().casefold()
    if key not in rewards:
        raise Unreadable(f"{_quoted(picked)} is not one of the labels {sorted(verdict.labels)}")
    return rewards[key]


def yes_probability(verdict: YesProbVerdict, top: Sequence[tuple[str, float]]) -> float:
    """P(yes) from the judge's first token's top candidates, (token text, logprob) pairs.

    Tokens match the words without regard to case or surrounding space, and every token
    that matches adds its probability (" Yes" and "yes" are both a yes). With a `no` word
    the reward is P(yes) / (P(yes) + P(no)), the judge's odds between the two answers; a
    reply where neither is among the candidates is no verdict. Without one it is P(yes).
    """
    if not top:
        raise Unreadable("the judge's answer carries no logprobs")

    def mass(word: str) -> float:
        word = word.strip().casefold()
        return sum(math.exp(lp) for token, lp in top if token.strip().casefold() == word)

    yes = mass(verdict.yes)
    if verdict.no is None:
        return min(1.0, yes)
    no = mass(verdict.no)
    if yes + no <= 0.0:
        shown = ", ".join(repr(token) for token, _ in top[:8])
        raise Unreadable(
            f"neither {verdict.yes!r} nor {verdict.no!r} among the judge's top "
            f"{len(top)} first tokens ({shown})"
        )
    return yes / (yes + no)


def as_pairs(candidates: Any) -> list[tuple[str, float]]:
    """A server's top-logprob candidates as (token, logprob) pairs: OpenAI's chat form (a
    list of {"token", "logprob"}) or its completions form (a {token: logprob} map)."""
    if isinstance(candidates, dict):
        return [(str(token), float(lp)) for token, lp in candidates.items()]
    if isinstance(candidates, list):
        return [(str(c["token"]), float(c["logprob"])) for c in candidates]
    raise Unreadable(f"logprobs in an unknown shape: {_quoted(repr(candidates))}")
