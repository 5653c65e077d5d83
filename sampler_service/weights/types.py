"""What weights are to every layer: a tensor's spec, the NCCL transfer's description,
the refusals, and the engine as the weights manager drives it.

Defined here, below the engines, so that `weights/` needs nothing from `backends/`: the
engines and their fleet satisfy `WeightTarget` as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sampler_service.errors import NotSupported


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model tensor, used to vet weight files up front."""

    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "F32", "BF16"


class WeightsRejected(ValueError):
    """A weight file was refused before anything was loaded (maps to HTTP 4xx)."""


class WeightsNotServed(RuntimeError):
    """No engine could install the new weights; the old version stays (maps to HTTP 503)."""


class NCCLUnavailable(NotSupported):
    """The engine cannot take weights over NCCL (not vLLM, or transfer not configured)."""


class NCCLGroupStale(RuntimeError):
    """The NCCL group no longer spans every engine (one restarted, or one came up after
    the group was formed): the trainer must form it again (maps to HTTP 409)."""


@dataclass(frozen=True)
class NCCLDescription:
    """What an engine, or a fleet of engines, offers the NCCL weight transfer.

    `specs` are the tensors a round may send (checkpoint names) and `required` those it
    must send. A fleet adds its group's state (`none`, `ok` or `stale`), each engine's
    ranks, and `stale`: why an update would be refused now (None for one engine on its
    own, which has no group to go stale).
    """

    enabled: bool
    inference_ranks: int
    specs: Mapping[str, TensorSpec]
    required: frozenset[str]
    group: str | None = None
    replicas: list[dict[str, Any]] | None = None
    stale: str | None = None


class WeightTarget(Protocol):
    """The engine as the weights manager drives it (`Backend` is one)."""

    @property
    def policy_version(self) -> int: ...

    @property
    def reads_weight_files(self) -> bool: ...

    def weight_specs(self) -> Mapping[str, TensorSpec]: ...

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None: ...

    async def load_weight_files(
        self, files: Sequence[str], version: int, names: Sequence[str]
    ) -> None: ...

    async def nccl_describe(self) -> NCCLDescription: ...

    async def nccl_init(self, init_info: dict[str, Any]) -> None: ...

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None: ...

    async def nccl_shutdown(self) -> None: ...
