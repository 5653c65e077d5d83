"""What both verl trainers (V1 trainer mode, V0 DataProto trainer) do with the sampler
around their steps, in one object: start-up checks, policy-version numbering and the
weight push through the ``adaptive_rollout`` checkpoint engine.

No verl import (Ray is imported when weights are pushed), so the start-up logic runs and
is tested without verl.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer_client.client import SamplerClient
from trainer_client.verl.settings import (
    MODE,
    IncompatibleSamplerConfig,
    SamplerSettings,
    require_compatible,
)
from trainer_client.verl.source import GroupSource

log = logging.getLogger(__name__)

__all__ = ["NewerPolicyServed", "SamplerSession", "VersionMap"]


class NewerPolicyServed(RuntimeError):
    """A fresh trainer found the sampler serving a policy trained past its own weights:
    its pushes would roll that policy back. The message names the ways on."""


class VersionMap:
    """verl global step -> sampler policy version (must increase on the sampler).

    ``version(step) = step + offset``, with the offset chosen when training starts so that
    the first step's version is above what the sampler serves.
    """

    def __init__(self, served: int, step: int) -> None:
        self.offset = max(0, served - step)

    def version(self, step: int) -> int:
        return step + self.offset

    def note_pushed(self, version: int, step: int) -> None:
        """After a push of `version` at `step`, the next step's version must be higher."""
        self.offset = max(self.offset, version - step)


class SamplerSession:
    """One trainer's connection to the sampler (see the module docstring)."""

    def __init__(self, settings: SamplerSettings, client: SamplerClient | None = None) -> None:
        self.settings = settings
        self.source = GroupSource(settings, client)
        self.client = self.source.client
        self.versions: VersionMap | None = None
        #: Whether the service's advantages replace verl's (decided by `start`).
        self.use_sampler_advantages = False

    def start(
        self, config: Any, *, global_steps: int, use_critic: bool, step_groups: int
    ) -> dict[str, Any]:
        """Check the sampler's config against verl's, set its batch_groups to the step's
        `step_groups`, fix the policy-version offset; returns the sampler's config."""
        health = self.client.wait_ready(timeout_s=self.settings.watchdog_s)
        sampler_config = self.client.get_config()
        rollout = config.actor_rollout_ref.rollout
        if self.settings.check_config:
            for warning in require_compatible(
                sampler_config,
                url=self.settings.url,
                rollout_n=int(rollout.n),
                temperature=float(rollout.temperature),
                top_p=float(rollout.get("top_p", 1.0)),
                max_response_length=config.data.get("max_response_length"),
                rollout_is=(config.algorithm.get("rollout_correction", None) or {}).get(
                    "rollout_is", None
                ),
            ):
                log.warning("sampler config: %s", warning)
        self.use_sampler_advantages = self.settings.sampler_advantages(sampler_config)
        if self.use_sampler_advantages and use_critic:
            raise IncompatibleSamplerConfig(
                [
                    "the service's advantages replace verl's estimator, which makes a critic (GAE) "
                    f"pointless: set trainer.v1.{MODE}.advantages=verl or use a critic-free estimator"
                ],
                self.settings.url,
            )
        if self.settings.configure_sampler and sampler_config.get("batch_groups") != step_groups:
            sampler_config = self.client.update_config(batch_groups=step_groups)
        self._check_roll_back(health.policy_version, global_steps)
        self.versions = VersionMap(health.policy_version, global_steps)
        log.info(
            "sampler at %s: policy version %d, config version %s, %s advantages",
            self.settings.url,
            health.policy_version,
            sampler_config.get("config_version"),
            "service" if self.use_sampler_advantages else "verl",
        )
        return sampler_config

    def _check_roll_back(self, served: int, global_steps: int) -> None:
        """Never roll the served policy back silently. A fresh start (step 0: verl's
        ``trainer.resume_mode`` found nothing, or was ``disable``) against a sampler that
        serves a trained policy is refused unless its weights are to be pushed over it
        (``push_initial_weights=always``), said loudly; a resumed one pushes its
        checkpoint's weights before its first step, which replaces what was trained after
        that checkpoint, said loudly too."""
        if served == 0 or self.settings.weight_sync == "none":
            return
        key = f"trainer.v1.{MODE}.push_initial_weights"
        push = self.settings.push_initial_weights
        if global_steps == 0 and push != "always":
            raise NewerPolicyServed(
                f"the sampler at {self.settings.url} serves policy v{served}, trained past "
                "this trainer's step-0 weights: training from them would roll it back. Resume "
                "the run that trained it (trainer.resume_mode=auto, with its "
                "trainer.default_local_dir), or push these weights over it (+"
                f"{key}=always), or start the sampler on a new --state-dir"
            )
        if self.initial_push_due(global_steps):
            log.warning(
                "the sampler serves policy v%d: the weights of verl step %d are pushed over it "
                "as v%d, rolling back what was trained after them",
                served,
                global_steps,
                max(served - global_steps, 0) + global_steps + 1,
            )
        else:
            log.warning(
                "the sampler serves policy v%d and %s=never: verl step %d trains on groups "
                "that other weights sampled until its first push",
                served,
                key,
                global_steps,
            )

    def initial_push_due(self, global_steps: int) -> bool:
        """Whether to push the trainer's weights before the first step (see
        `SamplerSettings.push_initial_weights`)."""
        push = self.settings.push_initial_weights
        return self.settings.weight_sync != "none" and (
            push == "always" or (push == "auto" and global_steps > 0)
        )

    def next_version(self, step: int, *, initial: bool = False) -> int:
        """The policy version a push at `step` takes (`initial`: the one before step 1)."""
        assert self.versions is not None, "start() did not run"
        return self.versions.version(step) + (1 if initial else 0)

    def push_weights(self, actor_wg: Any, step: int, *, initial: bool = False) -> dict[str, float]:
        """All actor ranks send their weights through the ``adaptive_rollout`` checkpoint
        engine; the sampler serves them as `next_version(step)`. Returns verl metrics."""
        if self.settings.weight_sync == "none":
            return {}
        import ray

        version = self.next_version(step, initial=initial)
        results = ray.get(actor_wg.update_weights(global_steps=version, mode=MODE))
        assert self.versions is not None
        self.versions.note_pushed(version, step)
        merged: dict[str, float] = {}
        for result in results if isinstance(results, list) else [results]:
            if isinstance(result, dict):
                merged.update(result)
        return merged

    def close(self) -> None:
        self.client.close()
