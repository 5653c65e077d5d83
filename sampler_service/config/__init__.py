"""All configuration of the sampler, in one place, as validated pydantic models.

`SamplerConfig` (`live.py`) is the live, runtime-tunable part (GET/PATCH /v1/config),
with its nested knobs (`knobs.py`) and the whole-config checks (`checks.py`);
`ServeSettings` (`settings.py`) is fixed at start-up (CLI flags), the engine transport
among them as one discriminated union. Unknown keys are errors, never ignored, and a bad
combination names the knob at fault so the API can answer 422 with a `field`.

The package's names are importable from here, as vLLM's `vllm.config` offers its own.
"""

from sampler_service.config.base import MAX_PROMPTS, ConfigError
from sampler_service.config.checks import (
    apply_step,
    check_consistency,
    check_context,
    check_judges,
)
from sampler_service.config.knobs import (
    JUDGE_PREFIX,
    EpisodeKnobs,
    JudgeKnobs,
    LabelVerdict,
    Reweighting,
    ScoreVerdict,
    YesProbVerdict,
)
from sampler_service.config.live import (
    ConfigPatch,
    ConfigView,
    PolicySet,
    SamplerConfig,
    merge_patch,
    overridden_by_saved,
    parse_patch,
    validate_config,
)
from sampler_service.config.settings import ReplicaSettings, ServeSettings

__all__ = [
    "JUDGE_PREFIX",
    "MAX_PROMPTS",
    "ConfigError",
    "ConfigPatch",
    "ConfigView",
    "EpisodeKnobs",
    "JudgeKnobs",
    "LabelVerdict",
    "PolicySet",
    "ReplicaSettings",
    "Reweighting",
    "SamplerConfig",
    "ScoreVerdict",
    "ServeSettings",
    "YesProbVerdict",
    "apply_step",
    "check_consistency",
    "check_context",
    "check_judges",
    "merge_patch",
    "overridden_by_saved",
    "parse_patch",
    "validate_config",
]
