"""The live config's nested knobs: policies, schedules, episodes, replay and judges."""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    field_validator,
    model_serializer,
    model_validator,
)

from sampler_service.config.base import LiveModel
from strategies import reweighting


class PolicySpec(LiveModel):
    """A policy by registered name with its parameters (validated by the registry)."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class MixingSpec(LiveModel):
    name: str = "static"
    params: dict[str, Any] = Field(default_factory=dict)


class ScheduleAt(LiveModel):
    """When a schedule step applies: once this many groups were acked since the state dir
    was created, or once this policy version (or a later one) is served. Exactly one key."""

    trained_groups: int | None = Field(None, ge=0, le=1 << 53)
    policy_version: int | None = Field(None, ge=0, le=1 << 53)

    @model_validator(mode="after")
    def _one_key(self) -> ScheduleAt:
        if (self.trained_groups is None) == (self.policy_version is None):
            raise ValueError("give exactly one of trained_groups or policy_version")
        return self

    @model_serializer(mode="wrap")
    def _only_the_key(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}

    def key(self) -> tuple[str, int]:
        """(key kind, threshold)."""
        if self.trained_groups is not None:
            return "trained_groups", self.trained_groups
        return "policy_version", int(self.policy_version or 0)


class ScheduleStep(LiveModel):
    """A config patch applied once, when `at` is first met."""

    at: ScheduleAt
    set: dict[str, Any] = Field(min_length=1)


class EpisodeKnobs(LiveModel):
    """Bounds of a multi-turn episode (prompts whose row names an environment)."""

    max_turns: int = Field(8, ge=1, le=1_000, description="model turns per episode")
    max_total_tokens: int = Field(
        4096,
        ge=1,
        le=10_000_000,
        description="tokens after the prompt, sampled and observation alike; the context "
        "length caps it too",
    )
    max_tokens_per_turn: int = Field(
        1024, ge=1, le=10_000_000, description="sampled tokens per model turn"
    )
    obs_max_tokens: int = Field(
        1024, ge=1, le=10_000_000, description="tokens kept of one observation (cut at the end)"
    )
    env_timeout_s: float = Field(
        30.0, gt=0.0, le=86_400.0, description="seconds an environment call may take"
    )
    max_env_errors: int = Field(
        3,
        ge=1,
        le=1_000,
        description="environment failures of one prompt (each episode re-run) before the "
        "prompt is dropped as env_error",
    )


class ReplayKnobs(LiveModel):
    """Replay of earlier right answers into all-wrong groups (`sampler_service.replay`)."""

    per_prompt: int = Field(
        2, ge=1, le=64, description="right answers kept per prompt (the newest)"
    )
    max_version_lag: int = Field(
        1000,
        ge=0,
        le=1_000_000,
        description="policy versions a kept answer may lag the served weights and still be "
        "replayed (a prompt comes back once an epoch: at least the steps of an epoch)",
    )


Reweighting = reweighting.SampleReweighting | reweighting.TokenReweighting

#: What a judge template may name.
FIELDS = ("prompt", "response", "answer")


def template_error(template: str) -> str | None:
    """Why `template` is not a judge template, or None."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"not a format string ({exc}); write {{{{ and }}}} for literal braces"
    named = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in FIELDS or spec or conversion:
            return (
                f"{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
                f" is not a field: use {', '.join('{' + f + '}' for f in FIELDS)}, and "
                "{{ and }} for literal braces"
            )
        named.add(name)
    if "response" not in named:
        return "the template never shows the judge the response: add {response}"
    return None


def pattern_error(pattern: str) -> str | None:
    """Why `pattern` is not a regular expression a verdict can use, or None."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        return f"not a regular expression: {exc}"
    if compiled.groups > 1:
        return f"has {compiled.groups} groups; use at most one (the verdict)"
    return None


#: A judge's name, as rows and --verifier name it (`judge:NAME`) and --judge-url gives it.
JudgeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
JUDGE_PREFIX = "judge:"


def _checked_pattern(pattern: str | None) -> str | None:
    if pattern is not None and (error := pattern_error(pattern)):
        raise ValueError(error)
    return pattern


class ScoreVerdict(LiveModel):
    """The judge gives a number on a scale; the reward is its place on that scale."""

    form: Literal["score"] = "score"
    pattern: str | None = Field(
        None,
        max_length=1000,
        description="a regular expression whose group (or whole match) is the score in the "
        "judge's text; null: the last number in the text",
    )
    low: float = Field(0.0, ge=-1e12, le=1e12, description="the scale's bottom: reward 0")
    high: float = Field(1.0, ge=-1e12, le=1e12, description="the scale's top: reward 1")
    sigmoid: bool = Field(
        False,
        description="apply the logistic function first (a reward model's raw logit); the "
        "scale applies to the result",
    )
    index: int = Field(
        0, ge=0, le=1_000_000, description="api classify: the class whose probability is the score"
    )

    _pattern = field_validator("pattern")(_checked_pattern)

    @model_validator(mode="after")
    def _scale(self) -> ScoreVerdict:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        return self


class LabelVerdict(LiveModel):
    """The judge names a label; each label has its reward."""

    form: Literal["label"] = "label"
    labels: dict[Annotated[str, StringConstraints(min_length=1, max_length=200)], float] = Field(
        default_factory=lambda: {"yes": 1.0, "no": 0.0},
        min_length=1,
        max_length=100,
        description="label -> reward in [0, 1]; matched as a whole word, whatever its case",
    )
    pattern: str | None = Field(
        None,
        max_length=1000,
        description="a regular expression whose group (or whole match) is the label; null: "
        "the last label in the judge's text",
    )

    _pattern = field_validator("pattern")(_checked_pattern)

    @field_validator("labels")
    @classmethod
    def _rewards(cls, labels: dict[str, float]) -> dict[str, float]:
        seen: set[str] = set()
        for label, reward in labels.items():
            key = label.strip().casefold()
            if not key:
                raise ValueError("a label must not be blank")
            if key in seen:
                raise ValueError(f"label {label!r} is given twice (labels ignore case and space)")
            seen.add(key)
            if not 0.0 <= reward <= 1.0:
                raise ValueError(f"label {label!r}: reward {reward:g} is not in [0, 1]")
        return labels


class YesProbVerdict(LiveModel):
    """The reward is the judge's probability of answering `yes` (its first token's
    logprobs), against `no` when one is given."""

    form: Literal["yes_prob"] = "yes_prob"
    yes: str = Field("yes", min_length=1, max_length=200, description="the token that says yes")
    no: str | None = Field(
        "no",
        max_length=200,
        description="the token that says no: the reward is P(yes) / (P(yes) + P(no)); null: P(yes)",
    )
    top_logprobs: int = Field(
        20, ge=1, le=1000, description="first-token candidates asked for (OpenAI allows 20)"
    )


JudgeVerdict = Annotated[ScoreVerdict | LabelVerdict | YesProbVerdict, Field(discriminator="form")]

DEFAULT_JUDGE_TEMPLATE = (
    "Grade a response to a question against the reference answer.\n\n"
    "Question:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
    "Is the response correct? Reply with one word: yes or no."
)


class JudgeKnobs(LiveModel):
    """A model that grades answers over HTTP (`sampler_service.verifiers.judge`). Its
    server's URL and key are start-up settings (`--judge-url`, `--judge-api-key`)."""

    api: Literal["chat", "completions", "classify"] = Field(
        "chat",
        description="chat: /v1/chat/completions, one answer per request; completions: "
        "/v1/completions, `batch` answers per request as a prompt list; classify: vLLM's "
        "/classify (a reward or classification model), `batch` answers per request",
    )
    model: str | None = Field(
        None, max_length=1000, description="the model name sent; null: the server's own"
    )
    system: str | None = Field(
        None, max_length=100_000, description="api chat: a system message before the prompt"
    )
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        min_length=1,
        max_length=100_000,
        description="the judge's prompt, with {prompt}, {response} and {answer} (the row's "
        "prompt, the answer to grade, the reference answer); {{ and }} are literal braces",
    )
    verdict: JudgeVerdict = Field(
        default_factory=LabelVerdict,
        description="how the reply is read: score (a number on a scale), label (a label's "
        "reward) or yes_prob (P(yes) from the first token's logprobs)",
    )
    max_tokens: int = Field(
        16, ge=1, le=100_000, description="tokens the judge may write (yes_prob asks for 1)"
    )
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="the judge's temperature")
    batch: int = Field(
        16,
        ge=1,
        le=4096,
        description="api completions and classify: answers per request (1: a request per answer)",
    )
    concurrency: int = Field(
        16, ge=1, le=4096, description="requests in flight to the judge at once"
    )
    timeout_s: float = Field(
        60.0, gt=0.0, le=3600.0, description="a request's time limit, from send to last byte"
    )
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="times a failed judgement (an error, a time-out, a reply with no verdict) "
        "is asked again before its prompt is dropped as verifier_error",
    )
    backoff_s: float = Field(
        0.5,
        ge=0.0,
        le=60.0,
        description="wait before the first retry; doubled for each next one (at most 60 s), "
        "each drawn between half and all of it",
    )

    @field_validator("template")
    @classmethod
    def _template(cls, template: str) -> str:
        if error := template_error(template):
            raise ValueError(error)
        return template

    @model_validator(mode="after")
    def _api_reads_verdict(self) -> JudgeKnobs:
        if self.api == "classify" and self.verdict.form == "yes_prob":
            raise ValueError(
                "api classify returns class probabilities, not token logprobs: use verdict "
                "form score (a class's probability) or label (the predicted class)"
            )
        return self
