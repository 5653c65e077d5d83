"""The live config and everything built from it, with one owner.

`LiveConfig` holds the config a PATCH or a schedule step installed, its version, and what
is built from it: the stopping rule and sampling a prompt snapshots at admission (its
`PromptPlan`), the group and batch policies, the mixer, the admission and allocation
policies, and the pass-rate estimator. The scheduler, the delivery and the control read
it through this object; only `install` changes it, so no component writes another's
fields and a prompt admitted under one version keeps that version's plan.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sampler_service.backends.base import SamplingParams
from sampler_service.config import PolicySet, SamplerConfig
from strategies import admission as admission_policies
from strategies import mixing
from strategies.allocation import AllocationPolicy
from strategies.estimator import Estimator
from strategies.stopping import StoppingRule


@dataclass(frozen=True)
class PromptPlan:
    """What a prompt snapshots at admission; later PATCHes do not touch it. Built once
    per config version (and estimator), not per prompt: none of it holds a prompt's
    state, and validating a rule's parameters per prompt cost the loop ~3% at the knee."""

    config_version: int
    cfg: SamplerConfig
    sampling: SamplingParams
    policies: PolicySet
    rule: StoppingRule


class LiveConfig:
    """The live config's one owner (see the module docstring)."""

    config: SamplerConfig
    version: int
    estimator: Estimator
    #: The live version's group and batch policies, built once per version.
    policies: PolicySet
    mixer: mixing.Mixer
    admission: list[admission_policies.AdmissionPolicy]
    allocation: AllocationPolicy | None
    plan: PromptPlan

    def __init__(
        self, cfg: SamplerConfig, version: int, domains: Sequence[str], prompt_ids: list[str]
    ) -> None:
        self.domains = list(domains)
        self._prompt_ids = prompt_ids
        estimator = cfg.build_estimator()
        estimator.set_prompts(prompt_ids)
        self._install(cfg, version, estimator)
        #: Set while a new estimator is built off the loop: (prompt, answers, correct) of
        #: the prompts finished meanwhile, folded into whichever estimator is installed.
        self._estimator_updates: list[tuple[str, int, int]] | None = None

    async def install(self, cfg: SamplerConfig, version: int) -> None:
        """Install a validated config: admission knobs apply now, prompt knobs on admission.

        A new estimator (est, n_max or rule changed) is built off the event loop, since
        its cost grows with the number of prompts; everything is installed at once after.
        """
        old = self.config
        estimator = self.estimator
        if cfg.est != old.est or cfg.n_max != old.n_max or cfg.rule != old.rule:
            estimator = await self._rebuilt_estimator(cfg)
        self._install(cfg, version, estimator, old)

    def quartile(self, prompt_id: str) -> str:
        """The prompt's pass-rate bin in the live estimator (`Estimator.quartile`)."""
        return self.estimator.quartile(prompt_id)

    def learned(self, prompt_id: str, answers: int, positives: int) -> None:
        """A prompt's answers, for the estimator (the one being built too, if any)."""
        if self._estimator_updates is None:
            self.estimator.update(prompt_id, answers, positives)
        else:  # a new estimator is being built from the live one's state
            self._estimator_updates.append((prompt_id, answers, positives))

    def _install(
        self,
        cfg: SamplerConfig,
        version: int,
        estimator: Estimator,
        old: SamplerConfig | None = None,
    ) -> None:
        """Make `cfg` live with `estimator`. The mixer and the admission and allocation
        policies are built anew only where their knobs differ from `old` (the config
        before; None: build everything), so the state they learned survives unrelated
        changes; an allocation that calibrates on the history (knapsack) starts afresh with
        a new estimator."""
        if old is None or cfg.mixing != old.mixing:
            self.mixer = mixing.build(cfg.mixing.name, domains=self.domains, **cfg.mixing.params)
        if old is None or cfg.admission_policies != old.admission_policies:
            self.admission = cfg.admission_policy_objects()
        if old is None or cfg.allocation != old.allocation or estimator is not self.estimator:
            self.allocation = cfg.build_allocation()
        self.config, self.version = cfg, version
        self.policies = cfg.policy_set()
        self.estimator = estimator
        sampling = SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens
        )
        rule = cfg.build_rule(estimator)
        self.plan = PromptPlan(version, cfg, sampling, self.policies, rule)

    async def _rebuilt_estimator(self, cfg: SamplerConfig) -> Estimator:
        """The learned state of the live estimator under `cfg`'s parameters.

        The worker thread reads the live estimator, so while it runs the prompts that
        finish are only logged; they are folded into the new estimator (or, should the
        build fail, back into the live one) before it is installed: none is lost.
        """
        live = self.estimator

        def build() -> Estimator:
            new = cfg.build_estimator()
            new.set_prompts(self._prompt_ids)
            new.load_state_dict(live.state_dict())
            return new

        self._estimator_updates = []
        target = live
        try:
            target = await asyncio.to_thread(build)
            return target
        finally:
            updates, self._estimator_updates = self._estimator_updates, None
            for update in updates:
                target.update(*update)

    def allocation_stats(self) -> dict[str, Any]:
        """The allocation policy in force and what it learned."""
        spec = self.config.allocation
        return {
            "policy": None if spec is None else spec.model_dump(),
            **({} if self.allocation is None else self.allocation.describe()),
        }
