"""What an NCCL weight transfer's requests are, and the vetting of an update, without I/O.

For large models a trainer sends weights GPU to GPU instead of uploading a file: the
trainer (rank 0) and every vLLM worker (ranks 1..W) form one NCCL group, and each update
is a broadcast from the trainer that vLLM's weight-transfer engine receives straight
into the live model. Only metadata goes over HTTP (the routes: `sampler_service.nccl_routes`).

An update is vetted before any NCCL call (names, shapes, floating dtypes), because a
receiver that refuses after the trainer started broadcasting would leave the trainer
blocked in NCCL; the trainer client runs the same checks first. The group's layout over
several engines, and its staleness, are the fleet's (`sampler_service.fleet.nccl`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainer_client.contract.dtypes import FLOAT_NAMES


class NCCLInitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]


class NCCLUpdateInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str] = Field(min_length=1)
    dtype_names: list[str]
    shapes: list[list[int]]


class NCCLUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: NCCLUpdateInfo
    version: int = Field(ge=0)


def vet_update_info(
    info: NCCLUpdateInfo, specs: Mapping[str, Any], required: AbstractSet[str]
) -> str | None:
    """Why this update cannot be received, or None when it fits the model.

    `specs` are the checkpoint tensors by their checkpoint names (the names vLLM's loader
    takes); every name in `required` must be sent: vLLM rebuilds each layer from the
    tensors it receives, so a round that leaves out part of a fused layer (q_proj
    without k_proj) would fill the rest with uninitialised memory.
    """
    if not len(info.names) == len(info.dtype_names) == len(info.shapes):
        return "names, dtype_names and shapes must have the same length"
    if len(set(info.names)) != len(info.names):
        return "a tensor is named twice"
    missing = sorted(required - set(info.names))
    if missing:
        return f"an NCCL update must send every tensor; {len(missing)} missing, e.g. {missing[:3]}"
    for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
        spec = specs.get(name)
        if spec is None:
            return f"tensor {name!r}: the model has no tensor of this name"
        if tuple(shape) != tuple(spec.shape):
            return f"tensor {name!r}: shape {shape} does not match the model's {list(spec.shape)}"
        if dtype not in FLOAT_NAMES:
            return f"tensor {name!r}: dtype {dtype} is not a floating dtype"
    return None
