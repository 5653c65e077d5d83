"""Whole-config checks that single fields cannot express (a 422 names the knob)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sampler_service.config.base import ConfigError
from sampler_service.config.live import (
    SamplerConfig,
    build_policy,
    merge_patch,
    policy_field,
    validate_config,
)
from strategies import admission, mixing
from strategies.registry import PolicyError


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
        raise ConfigError(str(exc), policy_field("allocation", exc.field)) from exc
    for i, spec in enumerate(cfg.admission_policies):
        try:
            admission.build(spec.name, **spec.params)
        except PolicyError as exc:
            raise ConfigError(
                str(exc), policy_field(f"admission_policies[{i}]", exc.field)
            ) from exc
    for attr, scope in (("group_policies", "group"), ("batch_policies", "batch")):
        for i, spec in enumerate(getattr(cfg, attr)):
            build_policy(spec, scope, f"{attr}[{i}]")
    try:
        mixing.build(cfg.mixing.name, domains=domains, **cfg.mixing.params)
    except PolicyError as exc:
        raise ConfigError(str(exc), policy_field("mixing", exc.field)) from exc
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
