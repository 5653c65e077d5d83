"""The live config (`SamplerConfig`, GET/PATCH /v1/config): its model, the policies it
builds, and how a PATCH body becomes a new version."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    create_model,
)
from pydantic.fields import FieldInfo

from sampler_service.config.base import MAX_LIST_ITEMS, MAX_PROMPTS, ConfigError, LiveModel
from sampler_service.config.knobs import (
    EpisodeKnobs,
    JudgeKnobs,
    JudgeName,
    MixingSpec,
    PolicySpec,
    ReplayKnobs,
    Reweighting,
    ScheduleStep,
)
from strategies import admission, reweighting, selection
from strategies import stopping as stopping_rules
from strategies.allocation import ALLOCATIONS, AllocationPolicy
from strategies.estimator import MAX_ANSWERS, Estimator, EstKnobs
from strategies.registry import Policy, PolicyError

#: `handout_hold_s: auto` under `weight_update_mode: wait`: no late prompt on the
#: step-time model ran past 231 s of a hold (BENCHMARKS.md section 5).
AUTO_HANDOUT_HOLD_S = 300.0
#: `max_delay_versions: auto` per weight update mode: on the step-time model (three
#: prompt draws) `continue` at 4 took 0.847x `wait`'s step, against 0.860x at 2, and
#: `wait` at 4 took 1.02x its own step at 2 (`abort` keeps 2, not measured at 4).
AUTO_DELAY_VERSIONS: dict[str, int] = {"wait": 2, "abort": 2, "continue": 4}
#: The order engines serve queued answers in (`SamplerConfig.engine_order`).
EngineOrder = Literal["oldest_prompt", "answer_index", "arrival"]


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


class SamplerConfig(LiveModel):
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
        description="wave: the rule is asked when a whole wave is back, and the group trains "
        "on every answer generated; exact: answers are counted in index order as they finish "
        "and the rule is asked after each, so the group is answers 1..j for the first j where "
        "it holds (as sequential sampling) and answers above j are cancelled",
    )
    min_answers: int | None = Field(
        None,
        ge=1,
        le=MAX_ANSWERS,
        description="exact stopping asks the rule from this many answers on (null: "
        "group_size), so no group is smaller than what down-sampling keeps",
    )
    hard_wave_size: int | None = Field(
        None,
        ge=1,
        le=MAX_ANSWERS,
        description="exact stopping: a prompt in the hardest pass-rate quartile (estimated "
        "below 0.25) issues waves of at least this many answers, within n_max and its "
        "budget, so it takes fewer waves in a row and misses the staleness bound less, for "
        "more surplus (null: the rule's own waves)",
    )
    wave_min_need: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="exact stopping: a wave issues an answer above min_answers only while "
        "the chance that the rule still needs it (the answers before it in the wave leave "
        "the rule open, at the prompt's estimated pass rate) is at least this; 0 issues "
        "whole waves. It cuts the surplus decoded for prompts that stop early, for more "
        "waves in a row: worth it where the engine is kept full (weight_update_mode "
        "continue) and is what a step waits on, not where a wave's tail idles it",
    )
    positive_threshold: float = Field(
        0.5, ge=-1e9, le=1e9, description="an answer is right iff its reward > this"
    )
    downsample: Literal["balanced", "max_variance", "none"] = Field(
        "balanced",
        description="which answers a group of more than group_size keeps; among answers "
        "it ranks alike, those of the newest weights first",
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
    max_delay_versions: Annotated[int, Field(ge=0, le=1_000)] | Literal["auto"] = Field(
        "auto",
        description="paced admission under max_staleness: a prompt expected to finish past "
        "the bound (its rule's expected answers at its estimated pass rate, times the "
        "current answer length, behind the tokens the running prompts still need, at the "
        "engines' measured tokens/s and seconds per weight push) is delayed, first in line "
        "once it fits, and admitted anyway after waiting this many versions (the line holds "
        "what that many training steps admit; while it is full no new prompt is drawn); 0: "
        "no pacing; auto: 4 under weight_update_mode continue (its answers run on across "
        "a push, so a longer line keeps the engine full), 2 under wait and abort",
    )
    handout_hold_s: Annotated[float, Field(ge=0.0, le=86_400.0)] | Literal["auto"] = Field(
        "auto",
        description="under max_staleness: a frame about to be handed out waits up to this "
        "many seconds for prompts still sampling that the next weight push would make too "
        "stale (admitted max_staleness or more versions ago), and their groups take the "
        "places of its newest members, which wait for the next frame; without it those "
        "slow, hard prompts' groups miss the frame and are dropped (`stale`) at the push. "
        "Streams get heartbeats meanwhile. auto: 300 under weight_update_mode wait (the "
        "engine idles at a push anyway, so the trainer's wait costs little), 0 under abort "
        "and continue (the engine never idles at a push, and a held trainer stalls it); "
        "0: hand out at once",
    )
    engine_priority: Literal["auto", "oldest_prompt", "answer_index", "arrival"] = Field(
        "auto",
        description="the order engines serve queued answers in (vLLM's priority "
        "scheduling): oldest_prompt (the earliest admitted prompt's first, so the prompts "
        "nearest the staleness bound finish before newer ones start), answer_index (by "
        "the weight version a prompt was admitted under, then by each answer's index in "
        "its prompt: under exact stopping a later answer is likelier surplus, so it waits "
        "behind the earlier answers of every prompt and is often cancelled before it "
        "decodes), arrival (first come, first served), auto (answer_index under exact "
        "stopping; else oldest_prompt, or arrival under max_staleness 0); an engine that "
        "cannot order its queue serves in arrival order (/v1/stats "
        "staleness.engine_priority)",
    )
    lease_ttl_s: float = Field(
        300.0, gt=0.0, le=86_400.0, description="a lease not acked by then is served again"
    )
    weight_update_mode: Literal["wait", "abort", "continue"] = Field(
        "wait",
        description="at a weight update, running answers finish first (wait), are aborted "
        "and drawn again on the new weights (abort), or go on decoding under the new "
        "weights from their next token (continue: each answer carries its version_spans, "
        "and consumers must declare that feature); an engine that cannot continue uses wait",
    )
    weight_update_kv: Literal["recompute", "keep"] = Field(
        "recompute",
        description="under continue, what a running answer's cache becomes: recomputed "
        "under the new weights (exact: every token's logprob is its own version's; costs a "
        "prefill of the prompt and the tokens decoded so far) or kept (the old weights' "
        "keys and values stay for the tokens before the update: no prefill, later spans "
        "only approximately their version's)",
    )
    max_versions_per_answer: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="under continue, an answer still running that would span more weight "
        "versions than this is cancelled at the update and drawn again (counted as "
        "redrawn version_cap: a re-draw that favours short answers); null: unbounded",
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
        if self.rule == "est" or self.wave == "adaptive" or self.wave_min_need > 0:
            # Adaptive waves size a seen prompt's first wave from its estimated pass
            # rate; need-cut waves start every wave's belief from its posterior.
            params["estimator"] = estimator
        return stopping_rules.build(self.rule, **params)

    @property
    def counts_in_order(self) -> bool:
        """Whether prompts count their answers in index order as they finish (`stopping:
        exact`). Rounds form their groups from whole rounds, and `rule: fixed` cannot hold
        inside a wave (its waves never go past `group_size`), so whole waves already give
        those the group that counting in order would, with no request per answer."""
        return self.stopping == "exact" and self.mode == "continuous" and self.rule != "fixed"

    @property
    def delay_versions(self) -> int:
        """`max_delay_versions` resolved: what measured best for the weight update mode
        (BENCHMARKS.md section 5)."""
        if self.max_delay_versions != "auto":
            return self.max_delay_versions
        return AUTO_DELAY_VERSIONS[self.weight_update_mode]

    @property
    def handout_hold(self) -> float:
        """`handout_hold_s` resolved: what measured best for the weight update mode
        (BENCHMARKS.md section 5)."""
        if self.handout_hold_s != "auto":
            return self.handout_hold_s
        return AUTO_HANDOUT_HOLD_S if self.weight_update_mode == "wait" else 0.0

    @property
    def engine_order(self) -> EngineOrder:
        """`engine_priority` resolved: what measured best for this stopping and bound
        (BENCHMARKS.md section 5)."""
        if self.engine_priority != "auto":
            return self.engine_priority
        if self.counts_in_order:
            return "answer_index"
        return "arrival" if self.max_staleness == 0 else "oldest_prompt"

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
        if isinstance(model, type) and issubclass(model, LiveModel):
            patch = _partial(model, f"{model.__name__}Patch")
            return patch | None if type(None) in members else patch
    return _constrained(info)


def _partial(model: type[LiveModel], name: str) -> type[BaseModel]:
    """The model of a patch of `model`: every key optional (absent keys keep their value;
    an explicit null is valid only where the config itself allows one), nested models
    patched likewise."""
    fields: dict[str, Any] = {
        key: (_patch_type(info), Field(None, description=info.description))
        for key, info in model.model_fields.items()
    }
    return create_model(name, __base__=LiveModel, **fields)


class ConfigPatch(_partial(SamplerConfig, "SamplerConfigPatch")):  # type: ignore[misc]
    """PATCH /v1/config: the knobs to change, merged into the live config and validated
    whole (`parse_patch`)."""

    # Absent: any version; an explicit null is no version and is refused.
    config_version: int = Field(  # type: ignore[assignment]
        None, ge=0, description="refuse (409) unless this is the current version"
    )


#: PolicyError.field values that mean "no such policy" rather than a bad parameter.
_FAMILY_KEYS = {None, "name", "selection", "reweighting", "mixing", "admission", "allocation"}


def policy_field(where: str, field: str | None) -> str:
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
        raise ConfigError(str(exc), policy_field(where, exc.field)) from exc
    if policy.scope != scope and not (scope == "batch" and policy.scope == "token"):
        raise ConfigError(
            f"policy {spec.name!r} has scope {policy.scope!r}; {where} takes {scope}-scope policies",
            f"{where}.name",
        )
    return policy


#: The label pydantic puts after a knob that takes a value or "auto" (`constrained-float`,
#: `literal['auto']`): which member of the union refused it, not a knob.
_UNION_MEMBER = re.compile(r"(constrained-)?(int|float|str|bool)|literal\[.*\]")


def _config_error(exc: ValidationError) -> ConfigError:
    """A pydantic error as one ConfigError naming the knob at fault."""
    first = exc.errors()[0]
    loc = list(first["loc"])
    if loc and isinstance(loc[-1], str) and _UNION_MEMBER.fullmatch(loc[-1]):
        loc.pop()
    # List positions read as in the error messages of whole-config checks: a[0].b
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
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
