"""Settings of the reference trainer (`adaptive-rollout train`).

A module of its own, with pydantic alone, so the command line can be built from it
without importing torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer_client.contract.protocol import DEFAULT_URL, URL_ENV

# The knobs `adaptive-rollout demo` passes on to this trainer: their bounds are stated once,
# here; each command gives its own default and help.
Steps = Annotated[int, Field(ge=1)]
BatchGroups = Annotated[int, Field(ge=1)]
LearningRate = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
SyncEvery = Annotated[int, Field(ge=1)]
TimeLimit = Annotated[float | None, Field(gt=0.0, allow_inf_nan=False)]


class TrainConfig(BaseModel):
    """Settings of the reference trainer: `adaptive-rollout train` builds its flags from
    these fields (trainer_client.contract.flags), so each default is stated here only."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        default_factory=lambda: os.environ.get(URL_ENV) or DEFAULT_URL,
        description=f"sampler service URL (default: env {URL_ENV}, else {DEFAULT_URL})",
    )
    model: Path = Field(
        description="Hugging Face model directory the sampler started from (or one of our "
        "checkpoints, to resume from its step and policy version)"
    )
    out_dir: Path = Field(
        Path("runs/train"),
        description="log and checkpoint directory",
        json_schema_extra={"cli_flag": "out"},
    )
    steps: Steps = Field(100, description="optimizer steps (batches) to train")
    batch_groups: BatchGroups = Field(
        8, description="groups per batch; the sampler's batch_groups is set to match"
    )
    lr: LearningRate = Field(1e-5, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="AdamW decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="clip norm")
    advantage: Literal["server", "grpo"] = Field(
        "server",
        description="use the service's advantages, or recompute GRPO's per group",
    )
    clip_low: float = Field(0.2, ge=0.0, allow_inf_nan=False, description="PPO clip below 1")
    clip_high: float = Field(0.28, ge=0.0, allow_inf_nan=False, description="PPO clip above 1")
    tis_cap: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="truncated importance correction min(pi_old / pi_sampler, CAP) per "
        "token; unset: 2 for a batch that holds an answer a continue weight update ran "
        "across (version_spans: its tokens' sampler logprobs are each span's own version's), "
        "off otherwise",
    )
    replayed: Literal["clip", "drop"] = Field(
        "clip",
        description="answers the sampler replayed into all-wrong groups (off-policy): "
        "clip: weight each token by min(pi_old / pi_sampled, --replay-is-cap); drop: "
        "leave them out of the loss",
    )
    replay_is_cap: float = Field(
        1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="cap of a replayed answer's per-token importance ratio",
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")
    minibatches: int = Field(
        1, ge=1, description="optimizer steps per epoch (the batch is split this many ways)"
    )
    sync_every: SyncEvery = Field(1, description="push weights to the sampler every N steps")
    save_every: int = Field(
        10,
        ge=0,
        description="checkpoint after every N weight pushes, so a crash loses at most N pushes "
        "of training (0: only when training ends or stops)",
    )
    keep_checkpoints: int = Field(
        2, ge=0, description="periodic checkpoints kept in --out, newest first (0: all)"
    )
    resume: bool = Field(
        False, description="continue from the newest checkpoint in --out (it must hold one)"
    )
    fresh: bool = Field(
        False,
        description="start from --model even if --out holds a run (moved aside, never "
        "deleted); by default a rerun continues from the newest checkpoint in --out",
    )
    device: str = Field("cpu", description="torch device (cpu, cuda, cuda:1, ...)")
    consumer: str | None = Field(
        None,
        description="stream consumer name, one per trainer (none: <host>-<pid>-<6 hex>)",
    )
    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("ADAPTIVE_ROLLOUT_API_KEY"),
        description="bearer key for the sampler (default: env ADAPTIVE_ROLLOUT_API_KEY)",
        repr=False,
    )
    watchdog_s: float = Field(
        120.0,
        gt=0.0,
        allow_inf_nan=False,
        description="fail if the sampler sends no heartbeat or group for this long",
    )
    max_unacked: int | None = Field(
        None, ge=1, description="stream credits (default: 2 x batch groups, one batch in flight)"
    )
    configure_sampler: bool = Field(
        True, description="PATCH the sampler's batch_groups to --batch-groups"
    )
    lag_warning: float | None = Field(
        None,
        ge=0.0,
        allow_inf_nan=False,
        description="warn once when a step's groups lag the trainer's weights by more than "
        "this many policy versions on average (0: never; unset: the sampler's max_staleness "
        "plus the pushes a group waits through in the trainer's credit, 2 when unbounded)",
    )
    seed: int = Field(0, description="seed for the trainer's shuffling")
    progress: bool = Field(True, description="show a progress bar")
    time_limit_s: TimeLimit = Field(
        None, description="stop early (after a whole step) once this much time is spent"
    )
    eval_files: list[Path] = Field(
        default_factory=list,
        description="held-out prompt file for greedy accuracy before and after (repeatable)",
        json_schema_extra={"cli_flag": "eval"},
    )

    @model_validator(mode="after")
    def _one_start(self) -> TrainConfig:
        if self.resume and self.fresh:
            raise ValueError("--resume and --fresh exclude each other")
        return self

    @property
    def stream_credit(self) -> int:
        """Groups the stream may hand out unacked: `max_unacked`, else two steps' worth
        (one training, the next one held)."""
        return self.max_unacked or 2 * self.batch_groups
