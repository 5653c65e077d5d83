"""The wire format between the sampler service and its trainers.

Defined once, here, and imported by both sides. It depends on pydantic alone so a
trainer node that imports it pulls in nothing of the server (FastAPI, engines).
Unknown fields are ignored on read so an older client keeps working against a newer
server that adds fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WithJsonSchema

StopReason = Literal["rule", "n_max", "budget", "fixed"]

MSGPACK_MEDIA_TYPE = "application/x-msgpack"
NDJSON_MEDIA_TYPE = "application/x-ndjson"
#: Where a sampler listens unless told otherwise (`serve`'s default port on this machine);
#: every command that calls a sampler reads :data:`URL_ENV` first.
DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "ADAPTIVE_ROLLOUT_URL"


def _listed(values: Any) -> Any:
    return values.tolist() if isinstance(values, np.ndarray) else values


#: A group's number lists: Python lists, or read-only numpy arrays where the reader asked
#: for them (`SamplerClient(arrays=True)`: no Python object per token, and `torch.from_numpy`
#: takes them as they are). Both serialize as JSON lists; the schema is the list's. Use
#: ``len(x)`` rather than ``bool(x)`` and ``list(a) + list(b)`` rather than ``a + b``.
Ints = Annotated[
    npt.NDArray[np.integer[Any]] | list[int],
    Field(union_mode="left_to_right"),  # an array is taken as it is, not tried as a list
    PlainSerializer(_listed, when_used="json-unless-none"),
    WithJsonSchema({"type": "array", "items": {"type": "integer"}}),
]
Floats = Annotated[
    npt.NDArray[np.floating[Any]] | list[float],
    Field(union_mode="left_to_right"),
    PlainSerializer(_listed, when_used="json-unless-none"),
    WithJsonSchema({"type": "array", "items": {"type": "number"}}),
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", arbitrary_types_allowed=True)


class Sample(_Wire):
    """One generated answer, with what the trainer needs to use it."""

    sample_id: str
    response_token_ids: Ints
    response_text: str | None = Field(
        None, description="the answer's text; None for a consumer that declared no_text"
    )
    logprobs: Floats = Field(description="behaviour logprob of each response token")
    reward: float
    finish_reason: str
    policy_version: int
    verifier_error: str | None = Field(
        None,
        description="always null from this sampler: a verification that fails is never a "
        "reward, its prompt is dropped (verifier_error); the field stays so that groups "
        "stored by earlier versions still read",
    )
    advantage: float = 0.0
    weight: float = Field(1.0, description="sample weight, mean 1 over its batch frame")
    token_weights: Floats | None = None
    loss_mask: Ints | None = Field(
        None,
        description="per response token: 1 where the policy sampled it, 0 where an "
        "environment's observation put it (train on mask 1 only); null: all 1 (one turn). "
        "Sent only to a consumer that declared the loss_mask feature",
    )
    num_turns: int = Field(1, description="model turns of the episode (1: a single answer)")
    index: int | None = Field(
        None,
        description="the answer's index in its prompt's sequence, fixed when its wave was "
        "issued (0-based); null for a replayed answer, which an earlier group drew",
    )
    version_spans: list[tuple[int, int]] | None = Field(
        None,
        description="(policy version, index of its first response token) for each weight "
        "version that decoded part of the answer, oldest first: a weight update in "
        "continue mode ran across it (policy_version is the first, the oldest); null: one "
        "version decoded all of it. Served only to a consumer that declared the "
        "version_spans feature while the sampler continues answers across updates",
    )
    replayed: bool = Field(
        False,
        description="an earlier right answer of the prompt put in place of one of an "
        "all-wrong group's answers: sampled by an older policy (`policy_version`, "
        "`logprobs` are its own), so off-policy; sent to a consumer that declared the "
        "replayed feature",
    )


class GroupStats(_Wire):
    """Counts over ALL answers generated for the prompt, not only the kept ones."""

    n_generated: int
    n_pos: int
    n_neg: int
    reward_mean: float
    reward_std: float
    n_env_errors: int = Field(
        0, description="episodes whose environment failed (run again, not counted above)"
    )
    outcomes: list[float] = Field(
        default_factory=list,
        description="the rewards of the prompt's answers 1..j in the order they were issued, "
        "j being where its stopping rule first held (the group's samples are some of them)",
    )
    sampled_tokens: int = Field(
        0,
        ge=0,
        description="tokens the policy sampled in those answers 1..j, kept or not: what "
        "forming the group cost (0: not reported)",
    )


class Group(_Wire):
    """A finished training group: the unit of delivery, acked and deduped by id."""

    group_id: str
    prompt_id: str
    domain: str
    prompt_token_ids: Ints
    prompt_text: str | None = Field(
        None, description="the prompt's text; None for a consumer that declared no_text"
    )
    answer: str | None = None
    metadata: dict[str, Any] | None = None
    config_version: int
    policy_version_min: int
    policy_version_max: int
    stop_reason: StopReason
    stats: GroupStats
    samples: list[Sample]
    batch_id: str
    batch_index: int
    batch_size: int
    delivery_id: str | None = None


class AdmissionWait(_Wire):
    """Why the sampler admits no new prompt now, and since when: a consumer waiting for
    groups learns what it would take (an ack, a declared step, a knob)."""

    blocked_by: Literal["weight_update", "engine", "max_buffered_groups", "max_staleness"]
    since: float = Field(description="Unix time admission started waiting on it")
    detail: str = Field(description="the bound's figures and what releases it")


class Heartbeat(_Wire):
    """Sent on an idle stream so a client can tell a slow sampler from a dead one."""

    type: Literal["heartbeat"] = "heartbeat"
    time: float
    policy_version: int
    config_version: int
    ready: int
    leased: int
    active_prompts: int = Field(description="prompts generating or finishing: groups still to come")
    unacked: int
    engine_error: str | None = Field(
        None, description="set once the engine has failed: no new groups will come"
    )
    closing: bool = Field(False, description="the sampler is shutting down; this stream ends")
    engine_state: str | None = Field(
        None,
        description="ok, degraded (no engine replica serving now, one recovering) or failed",
    )
    admission: AdmissionWait | None = Field(
        None, description="what new prompts wait on (None: admission is not held up)"
    )


class _Request(BaseModel):
    """A request body: unknown keys are errors and values are taken literally (no "3" for
    3, no true for 1, no NaN or infinity), as the live config is."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class AckRequest(_Request):
    delivery_ids: list[str] = Field(max_length=100_000)


class AckResponse(_Wire):
    acked: int
    unknown: int
    hint: str | None = Field(
        None, description="what the unknown ids look like (e.g. group ids, not delivery ids)"
    )


class LeaseRequest(_Request):
    max_groups: int = Field(
        8,
        ge=1,
        le=100_000,
        description="whole batch frames are handed out until this many groups are met, and "
        "at least one frame when any is READY: a frame larger than max_groups comes whole",
    )
    wait_s: float = Field(0.0, ge=0.0, le=300.0)
    consumer: str = Field("lease", min_length=1, max_length=200)


class LeaseResponse(_Wire):
    lease_id: str
    groups: list[Group]
    expires_at: float


class WeightsLoadRequest(_Request):
    path: str = Field(min_length=1)
    version: int = Field(ge=0)


class WeightsResponse(_Wire):
    policy_version: int
    tensors: int
    load_s: float


class Health(_Wire):
    status: str = Field(description="starting, ok, degraded, or engine_failed")
    backend: str
    model: str
    policy_version: int
    uptime_s: float
    engine_error: str | None = None
    warnings: list[str] = Field(
        default_factory=list,
        description="what works badly while the sampler still serves (verifier or engine errors)",
    )
    auth_required: bool = Field(False, description="whether /v1/* needs an API key")
    replicas: list[dict[str, Any]] | None = Field(
        None, description="per engine replica: state, pid, policy_version, restarts, ..."
    )


class ErrorDetail(_Wire):
    code: str
    message: str
    field: str | None = None


class ErrorResponse(_Wire):
    error: ErrorDetail
