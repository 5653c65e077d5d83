"""What the NCCL weight transfer (vLLM backend on GPUs) checks and computes, without I/O.

For large models a trainer sends weights GPU to GPU instead of uploading a file: the
trainer (rank 0) and every vLLM worker (ranks 1..W) form one NCCL group, and each update
is a broadcast from the trainer that vLLM's weight-transfer engine receives straight
into the live model. Only metadata goes over HTTP (the routes: `sampler_service.nccl_routes`).

An update is vetted before any NCCL call (names, shapes, floating dtypes), because a
receiver that refuses after the trainer started broadcasting would leave the trainer
blocked in NCCL; the trainer client runs the same checks first.

With engine replicas (`serve --replicas N`, vLLM on each) the group spans every replica:
world size = 1 (the trainer) + the sum of the replicas' workers. The trainer sends one
init as for a single engine (rank offset 1); the pool gives each replica its own offset
(`nccl_replica_init_infos`), and remembers who joined (`NCCLGroup`): an engine that
restarts or comes up after the group was formed makes it stale.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sampler_service.backends.base import NCCLGroupStale
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


def nccl_rank_offsets(workers: Sequence[int]) -> list[int]:
    """Each replica's first rank in the trainer's NCCL group: the trainer is rank 0, then
    each replica's workers in replica order (world size = 1 + sum(workers))."""
    offsets, rank = [], 1
    for count in workers:
        if count < 1:
            raise ValueError(f"a replica needs at least one NCCL rank, got {count}")
        offsets.append(rank)
        rank += count
    return offsets


def nccl_replica_init_infos(init_info: Mapping[str, Any], workers: Sequence[int]) -> list[dict]:
    """The trainer's worker init info (vLLM `NCCLWeightTransferInitInfo` fields, written
    for one engine at rank offset 1) as each replica must get it: its own rank offset,
    the whole group's world size. ValueError when the trainer sized the group otherwise.
    """
    world = 1 + sum(workers)
    if init_info.get("world_size") != world:
        raise ValueError(
            f"world_size {init_info.get('world_size')!r} does not match the sampler's group: "
            f"1 trainer rank + {sum(workers)} replica ranks = {world} (GET /v1/weights/nccl "
            "again: a replica may have restarted)"
        )
    if init_info.get("rank_offset", 1) != 1:
        raise ValueError(
            f"rank_offset must be 1 (the trainer is rank 0 and the sampler lays out its "
            f"replicas' ranks after it), got {init_info.get('rank_offset')!r}"
        )
    return [{**init_info, "rank_offset": offset} for offset in nccl_rank_offsets(workers)]


def nccl_replicas(engines: Sequence[Mapping[str, Any]], workers: Sequence[int]) -> list[dict]:
    """The `replicas` rows of GET /v1/weights/nccl: each engine (as `engines` names it),
    its ranks and its first rank in the group."""
    offsets = nccl_rank_offsets(workers)
    return [
        {**engine, "workers": count, "rank_offset": offset}
        for engine, count, offset in zip(engines, workers, offsets, strict=True)
    ]


#: Why an update is refused when no group was formed.
NO_NCCL_GROUP = "no NCCL group is formed: POST /v1/weights/nccl/init first"


@dataclass(frozen=True)
class NCCLGroup:
    """A formed group over a pool's engines: each member's identity when it joined (by
    engine index; anything a restart changes) and their ranks."""

    members: dict[int, Hashable]
    workers: list[int]

    def __str__(self) -> str:
        return f"trainer + {self.workers} ranks at offsets {nccl_rank_offsets(self.workers)}"

    def stale_reason(self, engines: Iterable[tuple[int, str, bool, Hashable]]) -> str | None:
        """Why the group no longer spans the pool, or None; `engines` are every engine's
        (index, name for the message, up now, identity now)."""
        for index, name, up, identity in engines:
            joined = self.members.get(index)
            if joined is None:
                if up:
                    return f"{name} came up after the NCCL group was formed"
            elif not up or identity != joined:
                return f"{name} restarted or failed since the NCCL group was formed"
        return None


def nccl_group_for_update(group: NCCLGroup | None, stale: str | None) -> NCCLGroup:
    """The group an update goes to; NCCLGroupStale, before any transfer, when there is none
    or it no longer spans the pool (`stale`: why)."""
    if group is None or stale is not None:
        raise NCCLGroupStale(stale or NO_NCCL_GROUP)
    return group


def nccl_group_state(group: NCCLGroup | None, stale: str | None) -> str:
    """none (no group formed), ok, or stale (an engine restarted or joined since)."""
    if group is None:
        return "none"
    return "stale" if stale else "ok"
