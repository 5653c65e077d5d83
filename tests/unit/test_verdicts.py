"""A judge's verdict read from its reply, in each of the three forms, and the knobs that
describe a judge: what reads as a reward, what is no verdict (a failure, never a 0), and
which configurations are refused with the field at fault."""

from __future__ import annotations

import math

import pytest

from sampler_service.config import (
    ConfigError,
    JudgeKnobs,
    LabelVerdict,
    SamplerConfig,
    ScoreVerdict,
    YesProbVerdict,
    check_judges,
    merge_patch,
    parse_patch,
    validate_config,
)
from sampler_service.config.knobs import template_error
from sampler_service.verifiers.verdicts import (
    Unreadable,
    as_pairs,
    read_label,
    read_score,
    render,
    yes_probability,
)


def test_a_template_names_only_the_three_fields() -> None:
    assert template_error("Q: {prompt}\nA: {response}\nRef: {answer} {{literal}}") is None
    assert render("{prompt}|{response}|{answer}", prompt="p", response="r", answer="a") == "p|r|a"
    for bad, why in (
        ("{response.__class__}", "not a field"),
        ("{response[0]}", "not a field"),
        ("{response!r}", "not a field"),
        ("{response:>10}", "not a field"),
        ("{metadata} {response}", "not a field"),
        ("{prompt} {answer}", "add {response}"),
        ("{response", "not a format string"),
    ):
        error = template_error(bad)
        assert error is not None and why in error, (bad, error)


def test_a_score_is_its_place_on_the_scale() -> None:
    ten = ScoreVerdict(low=0.0, high=10.0)
    assert read_score(ten, "The answer is fine. Score: 7") == pytest.approx(0.7)
    assert read_score(ten, "3 mistakes, so 2.5") == pytest.approx(0.25)  # the last number
    assert read_score(ScoreVerdict(), "0.85") == pytest.approx(0.85)
    picked = ScoreVerdict(pattern=r"rating=(\d+)", high=5.0)
    assert read_score(picked, "rating=4 after 12 checks") == pytest.approx(0.8)
    assert read_score(ScoreVerdict(sigmoid=True), "0") == pytest.approx(0.5)
    assert read_score(ScoreVerdict(sigmoid=True), "-1000") == 0.0
    for verdict, text in (
        (ten, "no number here"),
        (ten, "11"),  # off the scale: not clamped to right
        (ten, "-1"),
        (ScoreVerdict(), "nan"),
        (picked, "score 4"),  # the pattern matches nothing
        (ScoreVerdict(sigmoid=True), "inf"),
    ):
        with pytest.raises(Unreadable):
            read_score(verdict, text)


def test_a_label_is_its_reward_read_as_a_whole_word() -> None:
    graded = LabelVerdict(labels={"correct": 1.0, "incorrect": 0.0, "partial": 0.5})
    assert read_label(graded, "This is INCORRECT.") == 0.0
    assert read_label(graded, "correct") == 1.0
    # Judges reason first and conclude last: the last label wins.
    assert read_label(graded, "Looks correct at first, but it is partial") == 0.5
    assert read_label(LabelVerdict(), " Yes") == 1.0
    boxed = LabelVerdict(labels={"A": 1.0, "B": 0.0}, pattern=r"\[\[(\w)\]\]")
    assert read_label(boxed, "A is better... verdict: [[B]]") == 0.0
    for verdict, text in (
        (graded, "incorrectly phrased"),  # no whole-word label
        (graded, "I cannot tell"),
        (boxed, "[[C]]"),  # picked, but not a label
        (boxed, "no brackets"),
    ):
        with pytest.raises(Unreadable):
            read_label(verdict, text)


def test_yes_probability_from_the_first_tokens_logprobs() -> None:
    top = [("Yes", math.log(0.6)), (" yes", math.log(0.1)), ("No", math.log(0.2)), ("x", -5.0)]
    assert yes_probability(YesProbVerdict(), top) == pytest.approx(0.7 / 0.9)
    assert yes_probability(YesProbVerdict(no=None), top) == pytest.approx(0.7)
    # A yes outside the candidates is a probability below theirs, not a failure...
    assert yes_probability(YesProbVerdict(no=None), [("x", 0.0)]) == 0.0
    # ...but with neither yes nor no the judge did not answer the question.
    with pytest.raises(Unreadable, match="neither"):
        yes_probability(YesProbVerdict(), [("maybe", 0.0)])
    with pytest.raises(Unreadable, match="no logprobs"):
        yes_probability(YesProbVerdict(), [])
    # The toy's character tokens as the words.
    assert yes_probability(YesProbVerdict(yes="1", no="2"), [("1", -1.0), ("2", -1.0)]) == 0.5


def test_logprob_candidates_in_both_openai_shapes() -> None:
    chat = [{"token": "yes", "logprob": -0.1, "bytes": [121]}, {"token": "no", "logprob": -2.0}]
    assert as_pairs(chat) == [("yes", -0.1), ("no", -2.0)]
    assert as_pairs({"yes": -0.1}) == [("yes", -0.1)]
    with pytest.raises(Unreadable):
        as_pairs("yes")


def _judge_error(judge: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_config({"judges": {"g": judge}})
    return info.value


def test_judge_knobs_are_validated_naming_the_field() -> None:
    assert validate_config({"judges": {"g": {}}}).judges["g"] == JudgeKnobs()
    for judge, field in (
        ({"template": "{answer}"}, "judges.g.template"),
        ({"timeout_s": 0}, "judges.g.timeout_s"),
        ({"retries": 11}, "judges.g.retries"),
        ({"concurrency": 0}, "judges.g.concurrency"),
        ({"api": "responses"}, "judges.g.api"),
        ({"verdict": {"form": "vote"}}, "judges.g.verdict"),
        ({"verdict": {"form": "label", "labels": {"yes": 2.0}}}, "judges.g.verdict.label.labels"),
        ({"verdict": {"form": "label", "labels": {"Yes": 1.0, "yes ": 0.0}}}, "judges.g.verdict.label.labels"),
        ({"verdict": {"form": "score", "pattern": "(a)(b)"}}, "judges.g.verdict.score.pattern"),
        ({"verdict": {"form": "score", "low": 1.0, "high": 1.0}}, "judges.g.verdict.score"),
        ({"verdict": {"form": "yes_prob"}, "api": "classify"}, "judges.g"),
    ):  # fmt: skip
        assert _judge_error(judge).field == field, judge
    with pytest.raises(ConfigError) as info:
        validate_config({"judges": {"no spaces": {}}})
    assert info.value.field is not None and info.value.field.startswith("judges")


def test_a_patch_replaces_a_verdict_whole_and_merges_the_rest() -> None:
    live = SamplerConfig(judges={"g": JudgeKnobs(batch=4, verdict=LabelVerdict())})
    patch, _ = parse_patch({"judges": {"g": {"verdict": {"form": "score", "high": 10.0}}}})
    merged = validate_config(merge_patch(live.model_dump(), patch))
    # The label form's `labels` did not linger in the score form, and `batch` stayed.
    assert merged.judges["g"].verdict == ScoreVerdict(high=10.0)
    assert merged.judges["g"].batch == 4


def test_judges_need_a_server_and_every_judge_in_use_needs_knobs() -> None:
    cfg = SamplerConfig(judges={"g": JudgeKnobs()})
    check_judges(cfg, ["g"], {"g": "prompt 'p1'"})
    with pytest.raises(ConfigError) as info:
        check_judges(cfg, [], {})
    assert info.value.field == "judges.g" and "--judge-url g=URL" in str(info.value)
    with pytest.raises(ConfigError) as info:
        check_judges(SamplerConfig(), ["g"], {"g": "prompt 'p1'"})
    assert info.value.field == "judges" and "prompt 'p1'" in str(info.value)
