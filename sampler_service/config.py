"""All configuration of the sampler, in one place, as validated pydantic models.

`SamplerConfig` is the live, runtime-tunable part (GET/PATCH /v1/config); `ServeSettings`
is fixed at start-up (CLI flags). Unknown keys are errors, never ignored, and a bad
combination names the knob at fault so the API can answer 422 with a `field`.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from sampler_service.backends.http.discovery import ServiceName
from sampler_service.verifiers.verdicts import pattern_error, template_error
from strategies import admission, mixing, reweighting, selection
from strategies import stopping as stopping_rules
from strategies.allocation import ALLOCATIONS, AllocationPolicy
from strategies.estimator import MAX_ANSWERS, Estimator, EstKnobs
from strategies.registry import Policy, PolicyError
from trainer_client.contract.dtypes import ServingDType


class ConfigError(ValueError):
    """A configuration that cannot be served; `field` names the knob at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class _Live(BaseModel):
    """A live config model: what a client sends is taken literally, never coerced.

    Strict types reject `"3"` for an int, `true` for a count and `"nan"` for a float, and
    no float may be NaN or infinite: a lax parse once turned `"nan"` into a threshold that
    made every answer negative, and `"inf"` into leases that never expire.
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=False, strict=True, allow_inf_nan=False
    )


#: Upper bounds that the machine can honour: each knob scales memory or work, and an
#: unbounded one let a single PATCH spawn a billion prompt tasks.
MAX_PROMPTS = 65_536
MAX_LIST_ITEMS = 100_000


class PolicySpec(_Live):
    """A policy by registered name with its parameters (validated by the registry)."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class MixingSpec(_Live):
    name: str = "static"
    params: dict[str, Any] = Field(default_factory=dict)


class ScheduleAt(_Live):
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


class ScheduleStep(_Live):
    """A config patch applied once, when `at` is first met."""

    at: ScheduleAt
    set: dict[str, Any] = Field(min_length=1)


class EpisodeKnobs(_Live):
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


class ReplayKnobs(_Live):
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

#: A judge's name, as rows and --verifier name it (`judge:NAME`) and --judge-url gives it.
JudgeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
JUDGE_PREFIX = "judge:"


def _checked_pattern(pattern: str | None) -> str | None:
    if pattern is not None and (error := pattern_error(pattern)):
        raise ValueError(error)
    return pattern


class ScoreVerdict(_Live):
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


class LabelVerdict(_Live):
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


class YesProbVerdict(_Live):
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


class JudgeKnobs(_Live):
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


@dataclass(frozen=True)
class PolicySet:
    """One config version's group and batch policies, built once when the version is
    installed: a policy holds only its parameters, so one object serves every prompt and
    frame of that version."""

    #: Applied to each finished group, in order.
    group: tuple[selection.GroupSelection, ...]
    #: A frame's selections, then its reweightings, each in the order given.
    selections: tuple[selection.BatchSelection, ...]
    weightings: tuple[Reweighting, ...]


class SamplerConfig(_Live):
    """Everything PATCH /v1/config may change while a run is live."""

    # How prompts are sampled (snapshotted per prompt at admission).
    mode: Literal["continuous", "rounds"] = Field(
        "continuous",
        description="continuous: per-prompt waves with no global barrier; rounds: the paper's "
        "synchronous rounds, cohort_size prompts at a time",
    )
    cohort_size: int = Field(64, ge=1, le=MAX_PROMPTS, description="prompts per round (rounds)")
    rule: Literal["fixed", "positive", "balanced", "est"] = Field(
        "balanced",
        description="when a prompt stops: fixed (n_max answers, plain GRPO), positive "
        "(k_pos right), balanced (k_pos right and k_neg wrong), est (a per-prompt budget "
        "from a pass-rate estimate); never past n_max",
    )
    k_pos: stopping_rules.KPos = stopping_rules.DEFAULTS.k_pos
    k_neg: stopping_rules.KNeg = stopping_rules.DEFAULTS.k_neg
    n_max: stopping_rules.NMax = stopping_rules.DEFAULTS.n_max
    wave: stopping_rules.Wave = Field(
        stopping_rules.DEFAULTS.wave,
        description="fixed: wave_size answers per wave; adaptive: sized from the expected "
        "answers still missing (a prompt seen before sizes its first wave from its pass rate)",
    )
    wave_size: stopping_rules.WaveSize = stopping_rules.DEFAULTS.wave_size
    group_size: stopping_rules.GroupSize = stopping_rules.DEFAULTS.group_size
    stopping: Literal["exact", "wave"] = Field(
        "exact",
        description="exact: answers are counted in index order as they finish and the rule "
        "is asked after each, so the group is answers 1..j for the first j where it holds "
        "(as sequential sampling) and answers above j are cancelled; wave: the rule is asked "
        "when a whole wave is back",
    )
    min_answers: int | None = Field(
        None,
        ge=1,
        le=MAX_ANSWERS,
        description="exact stopping asks the rule from this many answers on (null: "
        "group_size), so no group is smaller than what down-sampling keeps",
    )
    positive_threshold: float = Field(
        0.5, ge=-1e9, le=1e9, description="an answer is right iff its reward > this"
    )
    downsample: Literal["balanced", "max_variance", "none"] = Field(
        "balanced", description="which answers a group of more than group_size keeps"
    )
    advantage: Literal["grpo", "global", "est", "maxrl"] = Field(
        "global",
        description="grpo: group baseline; global: baseline over every generated answer of "
        "the prompt; est: the estimator's pass rate; maxrl: (r - mean) / mean",
    )
    norm_by_std: bool | None = Field(
        None, description="divide advantages by the std; null: the estimator's own choice"
    )
    est: EstKnobs = Field(default_factory=EstKnobs, description="the Est estimator")
    episode: EpisodeKnobs = Field(
        default_factory=EpisodeKnobs, description="multi-turn episodes (rows with an env)"
    )
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling")
    top_k: int | None = Field(None, ge=1, le=10_000_000, description="top-k sampling; null: off")
    max_tokens: int = Field(
        1024,
        ge=1,
        le=10_000_000,
        description="at most the model's context length; unless set, at most what the "
        "context leaves after the longest prompt",
    )
    allocation: PolicySpec | None = Field(
        None,
        description="bounds each prompt's answers from its history (posterior, knapsack, "
        "pilot_commit; strategies.allocation), within n_max; a group it stops has stop "
        "reason `budget`; null: the rule alone decides",
    )
    replay: ReplayKnobs | None = Field(
        None,
        description="a group whose answers are all wrong gets one earlier right answer of "
        "its prompt in place of one of its own (flagged `replayed`, off-policy; consumers "
        "declare ?features=replayed); null: off",
    )
    group_policies: list[PolicySpec] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="applied to each finished group, in order: drop or keep it",
    )
    admission_policies: list[PolicySpec] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="applied to every prompt about to be admitted; a skipped prompt is "
        "counted as `skipped` in /v1/stats and prompts_skipped_total{domain}",
    )
    batch_groups: int = Field(
        1, ge=1, le=MAX_PROMPTS, description="groups per batch frame (delivered together)"
    )
    batch_policies: list[PolicySpec] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="applied when a batch frame forms: selections, then reweightings",
    )
    mixing: MixingSpec = Field(
        default_factory=MixingSpec, description="how prompts are drawn across domains"
    )
    max_active_prompts: int = Field(
        64, ge=1, le=MAX_PROMPTS, description="prompts being generated at once"
    )
    max_buffered_groups: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="admission stops while this many groups wait for a trainer (READY + "
        "LEASED may exceed it by the prompts in flight)",
    )
    max_staleness: int | None = Field(
        1,
        ge=0,
        le=1_000_000,
        description="policy versions a delivered group may lag the served weights: admission "
        "keeps at most (s + 1) training steps of groups ahead of the trainer (a step is the "
        "consumers' declared groups_per_step, at least batch_groups), and READY frames that "
        "fall further behind at a weight update are dropped (`stale`) and their prompts "
        "served again; null: no bound",
    )
    lease_ttl_s: float = Field(
        300.0, gt=0.0, le=86_400.0, description="a lease not acked by then is served again"
    )
    weight_update_mode: Literal["wait", "abort"] = Field(
        "wait",
        description="at a weight update, running waves finish (wait) or are aborted and "
        "re-issued on the new weights (abort)",
    )
    weight_drain_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="in `wait` mode, waves still running after this long are aborted and "
        "re-issued after the update, so one long answer cannot stall every engine",
    )
    schedule: list[ScheduleStep] = Field(
        default_factory=list,
        max_length=1000,
        description="config patches the sampler applies itself as training progresses",
    )
    judges: dict[JudgeName, JudgeKnobs] = Field(
        default_factory=dict,
        max_length=64,
        description="models that grade answers over HTTP, by name: a row's verifier (or "
        "--verifier) `judge:NAME` asks the judge NAME, whose server is the start-up flag "
        "--judge-url NAME=URL",
    )

    def build_rule(self, estimator: Any = None) -> stopping_rules.StoppingRule:
        """The stopping rule this config describes (rounds mode always uses full waves)."""
        params: dict[str, Any] = dict(
            k_pos=self.k_pos,
            k_neg=self.k_neg,
            n_max=self.n_max,
            wave_size=self.wave_size,
            group_size=self.group_size,
            wave="fixed" if self.mode == "rounds" else self.wave,
        )
        if self.rule == "est" or self.wave == "adaptive":
            # Adaptive waves size a seen prompt's first wave from its estimated pass rate.
            params["estimator"] = estimator
        return stopping_rules.build(self.rule, **params)

    def build_estimator(self) -> Estimator:
        """The Est pass-rate estimator; it learns under every rule, only est spends budgets.

        Outside est its cap only has to admit mean_budget, so a small n_max under another
        rule does not make the estimator's own n_min <= mean_budget <= n_max check fail.
        """
        est = self.est
        n_max = self.n_max if self.rule == "est" else max(self.n_max, math.ceil(est.mean_budget))
        return Estimator(**est.model_dump(), n_max=n_max)

    def build_allocation(self) -> AllocationPolicy | None:
        """The allocation policy this config names, or None."""
        spec = self.allocation
        return None if spec is None else ALLOCATIONS.build(spec.name, **spec.params)

    def admission_policy_objects(self) -> list[admission.AdmissionPolicy]:
        return [admission.build(p.name, **p.params) for p in self.admission_policies]

    def policy_set(self) -> PolicySet:
        """The group and batch policies this config names, built (`build_policy`)."""
        group = [
            build_policy(spec, "group", f"group_policies[{i}]")
            for i, spec in enumerate(self.group_policies)
        ]
        batch = [
            build_policy(spec, "batch", f"batch_policies[{i}]")
            for i, spec in enumerate(self.batch_policies)
        ]
        return PolicySet(
            tuple(group),
            tuple(p for p in batch if isinstance(p, selection.BatchSelection)),
            tuple(p for p in batch if not isinstance(p, selection.BatchSelection)),
        )


class ConfigView(SamplerConfig):
    """GET /v1/config: the live config with the version that counts its changes."""

    config_version: int = Field(ge=0)


def _constrained(info: FieldInfo) -> Any:
    """A field's type with its bounds (ge, le, max_length) attached."""
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


def _patch_type(info: FieldInfo) -> Any:
    """A field's type in a PATCH body: a nested model (or an optional one) becomes its own
    patch, so `{"allocation": {"params": {...}}}` may leave the policy's name as it is;
    anything else (scalars with their bounds, lists) is given whole."""
    annotation = info.annotation
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    for model in (annotation, *members):
        if isinstance(model, type) and issubclass(model, _Live):
            patch = _partial(model, f"{model.__name__}Patch")
            return patch | None if type(None) in members else patch
    return _constrained(info)


def _partial(model: type[_Live], name: str) -> type[BaseModel]:
    """The model of a patch of `model`: every key optional (absent keys keep their value;
    an explicit null is valid only where the config itself allows one), nested models
    patched likewise."""
    fields: dict[str, Any] = {
        key: (_patch_type(info), Field(None, description=info.description))
        for key, info in model.model_fields.items()
    }
    return create_model(name, __base__=_Live, **fields)


class ConfigPatch(_partial(SamplerConfig, "SamplerConfigPatch")):  # type: ignore[misc]
    """PATCH /v1/config: the knobs to change, merged into the live config and validated
    whole (`parse_patch`)."""

    # Absent: any version; an explicit null is no version and is refused.
    config_version: int = Field(  # type: ignore[assignment]
        None, ge=0, description="refuse (409) unless this is the current version"
    )


#: PolicyError.field values that mean "no such policy" rather than a bad parameter.
_FAMILY_KEYS = {None, "name", "selection", "reweighting", "mixing", "admission", "allocation"}


def _policy_field(where: str, field: str | None) -> str:
    return f"{where}.name" if field in _FAMILY_KEYS else f"{where}.params.{field}"


def build_policy(spec: PolicySpec, scope: str, where: str) -> Any:
    """A group or batch policy by its spec: a selection (group or batch scope) or a
    reweighting (batch: sample or token scope), checked against `scope`; errors name
    `where.name` or `where.params.<param>`."""
    policy: Policy
    try:
        if scope == "group" or spec.name in selection.SELECTIONS.names():
            policy = selection.build(spec.name, **spec.params)
        else:
            policy = reweighting.build(spec.name, **spec.params)
    except PolicyError as exc:
        raise ConfigError(str(exc), _policy_field(where, exc.field)) from exc
    if policy.scope != scope and not (scope == "batch" and policy.scope == "token"):
        raise ConfigError(
            f"policy {spec.name!r} has scope {policy.scope!r}; {where} takes {scope}-scope policies",
            f"{where}.name",
        )
    return policy


def check_consistency(cfg: SamplerConfig, domains: list[str], estimator: Any = None) -> None:
    """Whole-config checks that single fields cannot express (a 422 names the knob)."""
    if cfg.rule == "est" and not cfg.est.n_min <= cfg.est.mean_budget <= cfg.n_max:
        raise ConfigError(
            f"est needs n_min <= mean_budget <= n_max (got {cfg.est.n_min}, "
            f"{cfg.est.mean_budget}, {cfg.n_max})",
            "est.mean_budget",
        )
    try:
        estimator = estimator or cfg.build_estimator()
    except PolicyError as exc:
        # The estimator's own checks name its knobs as the config does: est.<knob>.
        raise ConfigError(str(exc), f"est.{exc.field}" if exc.field else "est") from exc
    try:
        cfg.build_rule(estimator).validate()
    except PolicyError as exc:
        raise ConfigError(str(exc), exc.field) from exc
    if cfg.min_answers is not None and cfg.min_answers > cfg.n_max:
        raise ConfigError(
            f"min_answers ({cfg.min_answers}) exceeds n_max ({cfg.n_max}): the rule would "
            "never be asked",
            "min_answers",
        )
    if cfg.batch_groups > cfg.max_buffered_groups:
        # Admission stops at max_buffered_groups (unframed groups count), so a frame larger
        # than that would never complete: the sampler would hang silently.
        raise ConfigError(
            f"batch_groups ({cfg.batch_groups}) must not exceed max_buffered_groups "
            f"({cfg.max_buffered_groups}): such a frame could never fill",
            "batch_groups",
        )
    try:
        policy = cfg.build_allocation()
        if policy is not None:
            policy.validate(cfg.n_max)
    except PolicyError as exc:
        raise ConfigError(str(exc), _policy_field("allocation", exc.field)) from exc
    for i, spec in enumerate(cfg.admission_policies):
        try:
            admission.build(spec.name, **spec.params)
        except PolicyError as exc:
            raise ConfigError(
                str(exc), _policy_field(f"admission_policies[{i}]", exc.field)
            ) from exc
    for attr, scope in (("group_policies", "group"), ("batch_policies", "batch")):
        for i, spec in enumerate(getattr(cfg, attr)):
            build_policy(spec, scope, f"{attr}[{i}]")
    try:
        mixing.build(cfg.mixing.name, domains=domains, **cfg.mixing.params)
    except PolicyError as exc:
        raise ConfigError(str(exc), _policy_field("mixing", exc.field)) from exc
    _check_schedule(cfg, domains)


def check_judges(cfg: SamplerConfig, served: Iterable[str], used: dict[str, str]) -> None:
    """Every judge of the config has a server, and every judge in use is in the config.

    `served`: the judges given a URL at start-up (--judge-url); `used`: each judge a row
    or --verifier names (`judge:NAME`), with who names it first.
    """
    served = set(served)
    for name in cfg.judges:
        if name not in served:
            raise ConfigError(
                f"judges.{name}: no server for this judge; start the sampler with "
                f"--judge-url {name}=URL",
                f"judges.{name}",
            )
    for name, user in used.items():
        if name not in cfg.judges:
            raise ConfigError(
                f"judges: judge {name!r}, used by {user}, is not configured (set judges.{name})",
                "judges",
            )


def check_context(cfg: SamplerConfig, context_length: int | None) -> None:
    """max_tokens beyond the model's context could never be generated."""
    if context_length is not None and cfg.max_tokens > context_length:
        raise ConfigError(
            f"max_tokens ({cfg.max_tokens}) exceeds the model's context ({context_length} tokens)",
            "max_tokens",
        )


def _check_schedule(cfg: SamplerConfig, domains: list[str]) -> None:
    """One key kind, strictly increasing thresholds, and every step valid when applied in
    order on top of this config; errors name `schedule[i].at...` or `schedule[i].set.<knob>`."""
    kind, previous = None, -1
    current = cfg.model_dump(mode="json", exclude={"schedule"})
    for i, step in enumerate(cfg.schedule):
        where = f"schedule[{i}]"
        step_kind, threshold = step.at.key()
        if kind is not None and step_kind != kind:
            raise ConfigError(
                f"{where}.at: all steps of a schedule use one key ({kind}), not {step_kind}",
                f"{where}.at.{step_kind}",
            )
        if threshold <= previous:
            raise ConfigError(
                f"{where}.at.{step_kind}: thresholds must increase strictly "
                f"({threshold} after {previous})",
                f"{where}.at.{step_kind}",
            )
        kind, previous = step_kind, threshold
        if "schedule" in step.set:
            raise ConfigError(
                f"{where}.set.schedule: a step cannot change the schedule", f"{where}.set.schedule"
            )
        try:
            current = apply_step(current, step.set, domains).model_dump(
                mode="json", exclude={"schedule"}
            )
        except ConfigError as exc:
            field = f"{where}.set.{exc.field}" if exc.field else f"{where}.set"
            raise ConfigError(f"{where}.set: {exc}", field) from exc


def apply_step(current: dict[str, Any], patch: dict[str, Any], domains: list[str]) -> SamplerConfig:
    """`current` (a config dict) with a schedule step's patch merged in, fully validated."""
    merged = merge_patch(current, patch)
    merged.pop("schedule", None)
    cfg = validate_config(merged)
    check_consistency(cfg, domains)
    return cfg


def _config_error(exc: ValidationError) -> ConfigError:
    """A pydantic error as one ConfigError naming the knob at fault."""
    first = exc.errors()[0]
    # List positions read as in the error messages of whole-config checks: a[0].b
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
    field = path.lstrip(".") or None
    return ConfigError(f"{field}: {first['msg']}" if field else first["msg"], field)


def validate_config(data: dict[str, Any]) -> SamplerConfig:
    """Parse a full config dict, turning pydantic errors into one ConfigError."""
    try:
        return SamplerConfig.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc) from exc


def parse_patch(body: Any) -> tuple[dict[str, Any], int | None]:
    """A PATCH body read by its model (`ConfigPatch`): the knobs it sets, nested ones as
    far as it names them, and the config_version it expects (None: any)."""
    if not isinstance(body, dict):
        raise ConfigError("the body must be a JSON object of config keys")
    try:
        patch = ConfigPatch.model_validate(body)
    except ValidationError as exc:
        raise _config_error(exc) from exc
    changes = patch.model_dump(exclude_unset=True)
    return changes, changes.pop("config_version", None)


_WHOLE = frozenset({"params", "verdict"})


def merge_patch(current: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch: nested objects merge, lists and scalars replace. A policy's
    `params` and a judge's `verdict` are replaced whole: their keys depend on the name or
    form beside them, so keys of the old one must not linger in the new."""
    merged = copy.deepcopy(current)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in _WHOLE:
            merged[key] = merge_patch(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class ReplicaSettings(_Strict):
    """Engine replicas (Ray actors) or engine servers (`--backend http`): how many, where,
    and how the pool routes waves to them and watches them. The pools take it as it is;
    nested in `ServeSettings` as `replica`, its flags are `--replica-<field>` but for
    the few named otherwise (`--replicas`, `--ray-address`, `--route`,
    `--replicas-on-exit`)."""

    count: int = Field(
        1,
        ge=1,
        description="engine replicas, each a Ray actor (a local Ray unless --ray-address); 1 "
        "keeps the engine beside the server and never imports Ray",
        json_schema_extra={"cli_flag": "replicas"},
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to run the replicas on (auto, or host:port); replicas outlive "
        "the sampler there, so a restarted sampler re-attaches to them",
        json_schema_extra={"cli_flag": "ray-address"},
    )
    gpus: float = Field(0.0, ge=0.0, description="GPUs per replica")
    cpus: float = Field(1.0, ge=0.0, description="CPUs per replica")
    max_restarts: int = Field(
        3, ge=0, description="restarts of a failed replica before it is given up"
    )
    max_inflight: int | None = Field(
        None,
        ge=1,
        description="samples in flight per replica or engine server (none: 384, 1.5 x vLLM's "
        "256 sequences)",
    )
    route: Literal["sticky", "least-loaded"] = Field(
        "sticky",
        description="sticky: a prompt's next wave goes to its last replica (prefix cached) "
        "unless that one is overloaded; least-loaded: always the replica with the fewest samples",
        json_schema_extra={"cli_flag": "route"},
    )
    probe_s: float = Field(
        5.0, gt=0.0, description="seconds between replica (or engine server) health probes"
    )
    probe_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="a replica that does not answer a probe this long is killed and restarted",
    )
    wait_s: float = Field(
        300.0,
        gt=0.0,
        description="how long a wave waits for a routable replica before it counts as failed",
    )
    compare_checksums: bool = Field(
        False,
        description="with --backend http: after every weight load, compare the servers' "
        "/weight_checker checksums with each other (vLLM checksums its fused runtime tensors, "
        "so servers are compared with each other, not with the trainer's tensors); a server "
        "outside the majority is taken out of routing and reloaded",
        json_schema_extra={"cli_flag": "engine-compare-checksums"},
    )
    on_exit: Literal["keep", "kill"] = Field(
        "kill",
        description="on a clean exit, kill the replicas or keep them warm for the next sampler",
        json_schema_extra={"cli_flag": "replicas-on-exit"},
    )
    orphan_s: float = Field(
        600.0,
        gt=0.0,
        description="a replica that hears from no sampler (no call, no probe) this long exits "
        "for good, freeing its GPUs; probes keep it alive, so a restarted sampler must "
        "re-attach within this window (at least 2 x --replica-probe-s)",
    )

    @model_validator(mode="after")
    def _orphan_window_spans_probes(self) -> ReplicaSettings:
        if self.orphan_s < 2 * self.probe_s:
            raise ValueError(
                f"replica_orphan_s ({self.orphan_s:g}) must be at least twice "
                f"replica_probe_s ({self.probe_s:g}): probes keep replicas alive"
            )
        return self


class ServeSettings(_Strict):
    """Start-up settings of `adaptive-rollout serve` (not changeable at runtime).

    The command line is generated from these fields (one flag each, this description as
    its help, the default shown), so a new start-up option is one new field here.
    """

    model: Path = Field(description="Hugging Face model directory (weights + tokenizer)")
    data: list[Path] = Field(
        description="prompt file (.jsonl or .parquet); repeat for several domains "
        "(domain = file stem unless a row says)"
    )
    verifier: str = Field(
        "exact",
        description="default verifier for rows without one: exact | math | "
        "python:module:function (python: specs import with the working directory on "
        "sys.path, as under python -m) | judge:NAME (a model over HTTP: --judge-url)",
    )
    judge_url: dict[JudgeName, str] = Field(
        default_factory=dict,
        description="NAME=URL: the judge NAME (a verifier judge:NAME, its knobs the live "
        "config's judges.NAME) is the server at URL, `vllm serve` or any OpenAI-compatible "
        "server, given as its base (http://host:port, no /v1); repeatable",
        json_schema_extra={"cli_flag": "judge-url"},
    )
    judge_api_key: str | None = Field(
        default_factory=lambda: os.environ.get("ADAPTIVE_ROLLOUT_JUDGE_API_KEY") or None,
        description="sent to every judge as 'Authorization: Bearer KEY' (vllm serve "
        "--api-key; default: env ADAPTIVE_ROLLOUT_JUDGE_API_KEY)",
        repr=False,
    )

    @field_validator("judge_url")
    @classmethod
    def _judge_urls(cls, urls: dict[str, str]) -> dict[str, str]:
        for name, url in urls.items():
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"judge_url {name}={url!r} must be http(s)://HOST[:PORT]")
            if parsed.query or parsed.fragment:
                raise ValueError(f"judge_url {name}={url!r} must be a base URL, no query")
        return urls

    env: str | None = Field(
        None,
        description="default environment for rows without one (their prompts are answered "
        "by multi-turn episodes): a built-in name | python:module:factory (imported from the "
        "working directory too); unset: rows without an env get single answers",
    )
    filter_overlong_prompts: bool = Field(
        False,
        description="drop prompts with no room for one answer token in the model's context "
        "(counted in the start-up log and /v1/stats `prompts`) instead of refusing to start",
    )
    backend: Literal["hf", "vllm", "http"] = Field(
        "hf",
        description="inference engine: hf, vllm (in this process), or http (vllm serve servers "
        "you run, given by --engine-url)",
    )
    engine_url: list[str] = Field(
        default_factory=list,
        description="with --backend http: base URL of one vllm serve server (its own "
        "address, not a load balancer: each is paused and reloaded by itself); repeatable",
    )
    engine_service: list[str] = Field(
        default_factory=list,
        description="with --backend http: NAME:PORT of a Kubernetes headless Service whose DNS "
        "name lists the servers (one per pod IP); re-resolved every --engine-resolve-s, new "
        "pods are synced before they are routed to; repeatable",
    )
    engine_resolve_s: float = Field(
        10.0, gt=0, description="how often --engine-service names are re-resolved (seconds)"
    )
    engine_dialect: Literal["vllm", "vllm-generate", "sglang"] = Field(
        "vllm",
        description="with --backend http: the servers' API, vllm (vllm serve, tested live), "
        "vllm-generate (vllm serve --enable-scale-out: waves through /inference/v1/generate, "
        "each answer's weight_versions spans checked against the wave's label; tested live) "
        "or sglang (SGLang's native /generate and weight endpoints, tested against its "
        "documented shapes)",
    )

    @model_validator(mode="after")
    def _engine_urls(self) -> ServeSettings:
        if self.backend != "http":
            if self.engine_url or self.engine_service:
                raise ValueError("engine_url and engine_service are for --backend http")
            if self.engine_dialect != "vllm":
                raise ValueError("engine_dialect is for --backend http")
            if self.replica.compare_checksums:
                raise ValueError("engine_compare_checksums is for --backend http")
            return self
        if self.replica.compare_checksums and self.engine_dialect == "sglang":
            raise ValueError(
                "engine_compare_checksums needs vLLM servers (SGLang has no /weight_checker)"
            )
        if not (self.engine_url or self.engine_service):
            raise ValueError(
                "--backend http needs at least one --engine-url (one per server) or "
                "--engine-service (a headless Service)"
            )
        for name in self.engine_service:
            ServiceName.parse(name)
        seen: set[str] = set()
        for url in self.engine_url:
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
                raise ValueError(
                    f"engine_url {url!r} must be http(s)://HOST:PORT (a server's own address)"
                )
            if parsed.path not in ("", "/") or parsed.query:
                raise ValueError(f"engine_url {url!r} must be the server's base URL, no path")
            base = url.rstrip("/")
            if base in seen:
                raise ValueError(f"engine_url {url!r} is given twice")
            seen.add(base)
        if self.weights_dir is None:
            raise ValueError(
                "--backend http needs --weights-dir: a directory every server can read, where "
                "the sampler puts the weights each server reloads"
            )
        if self.uses_ray:
            raise ValueError(
                "--backend http routes to its servers itself: no --replicas or --ray-address"
            )
        if self.vllm:
            raise ValueError("--vllm-arg is for --backend vllm; give engine flags to vllm serve")
        return self

    hf_engine: Literal["process", "thread"] = Field(
        "process",
        description="run the hf backend in its own process (the service's work then never "
        "waits on the engine's GIL) or on a thread of the server process",
    )
    torch_threads: int = Field(
        1,
        ge=0,
        description="CPU threads for torch in the engine (1 suits small models: more threads "
        "spin against the verifier and HTTP work on few cores; 0 leaves torch's default)",
    )
    device: str = Field("cpu", description="torch device for the hf backend")
    dtype: ServingDType = Field("float32", description="engine dtype of the hf backend")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0 picks a free one)")
    state_dir: Path = Field(
        Path("sampler_state"),
        description="directory for the SQLite store (groups, config, mixer state) and "
        "accepted weights; one sampler at a time, and it records the model, data and "
        "backend it was created for",
    )
    resume: bool = Field(
        False,
        description="continue the run stored in --state-dir as it is (its weights, groups "
        "and config) although the model, data or backend differ from those it recorded",
    )
    fresh: bool = Field(
        False,
        description="move an existing --state-dir aside (renamed to <dir>.<time>, never "
        "deleted) and start a new run in it",
    )

    @model_validator(mode="after")
    def _resume_or_fresh(self) -> ServeSettings:
        if self.resume and self.fresh:
            raise ValueError("give --resume (continue the stored run) or --fresh (a new one)")
        return self

    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("ADAPTIVE_ROLLOUT_API_KEY") or None,
        description="require 'Authorization: Bearer KEY' on /v1/* (default: env "
        "ADAPTIVE_ROLLOUT_API_KEY)",
        repr=False,
    )
    heartbeat_s: float = Field(5.0, gt=0.0, description="stream heartbeat interval")
    verifier_timeout_s: float = Field(10.0, gt=0.0, description="time limit per verification")
    verifier_retries: int = Field(
        1,
        ge=0,
        le=10,
        description="times a failed verification (an exception, a value not in [0, 1], a "
        "crash or a time-out) is asked again before its prompt is dropped as verifier_error; "
        "a failure is never a negative (judges have their own: judges.NAME.retries)",
    )
    verifier_workers: int | None = Field(
        None,
        ge=1,
        description="verifier processes (default: one per core this process may run on, "
        "less one for its event loop, at least 2)",
    )
    max_request_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="size limit of a JSON request body (acks: 8x; weight uploads: twice the "
        "model's weight bytes)",
    )
    store_checkpoint_s: float = Field(
        0.5,
        ge=0.0,
        description="seconds between SQLite WAL checkpoints, run off the write path; 0 = "
        "SQLite's default (inside commits)",
    )
    seed: int = Field(0, description="seed for data order and sampling")
    vllm: dict[str, Any] = Field(
        default_factory=dict,
        description="engine argument passed to vLLM, e.g. tensor_parallel_size=2 (value "
        "parsed as JSON if it can be); repeatable",
        json_schema_extra={"cli_flag": "vllm-arg"},
    )
    max_lease_wait_s: float = Field(
        300.0,
        gt=0.0,
        le=300.0,
        description="a lease call waits at most this long for groups, whatever its wait_s",
    )
    shutdown_timeout_s: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="on SIGTERM, streams end at once and the process exits within this bound",
    )
    # Scale-out: engine replicas as Ray actors, or engine servers over HTTP. The defaults
    # (one replica, no address) keep the engine in or beside this process and never
    # import Ray.
    replica: ReplicaSettings = Field(
        default_factory=ReplicaSettings,
        description="engine replicas and engine servers",
        json_schema_extra={"cli_prefix": "replica-"},
    )
    weights_dir: Path | None = Field(
        None,
        description="with replicas or --backend http: a directory every replica or server can "
        "read (shared storage); an "
        "uploaded weight file is written there atomically and each replica reads weight "
        "files itself (uploads and POST /v1/weights/load paths) instead of receiving the "
        "tensors through Ray's object store",
    )

    @model_validator(mode="after")
    def _weights_dir_needs_replicas(self) -> ServeSettings:
        if self.weights_dir is not None and not (self.uses_ray or self.backend == "http"):
            raise ValueError(
                "weights_dir is for engine replicas (--replicas > 1 or --ray-address) and "
                "--backend http; a single engine loads uploads from the state dir"
            )
        return self

    @property
    def uses_ray(self) -> bool:
        return self.replica.count > 1 or self.replica.ray_address is not None

    @property
    def verifier_pool_size(self) -> int:
        """`verifier_workers`, or what the cores this process may run on allow: verifying
        (math-verify, ~1 ms of CPU per answer) scales with the workers until they take
        every core the event loop does not need. At least 2, so one verifier hanging
        until its time limit never stops all verification."""
        if self.verifier_workers is not None:
            return self.verifier_workers
        return max(2, len(os.sched_getaffinity(0)) - 1)


def overridden_by_saved(
    given: Iterable[str], initial: SamplerConfig, saved: SamplerConfig
) -> list[str]:
    """The knobs set on the command line (`given`: top-level keys) whose value the
    config saved by an earlier run replaces; the saved config wins so that a restart
    continues the run as it was tuned through the API."""
    return [
        f"{key}={getattr(initial, key)!r} (saved: {getattr(saved, key)!r})"
        for key in given
        if getattr(initial, key) != getattr(saved, key)
    ]
