"""N engine replicas as Ray actors, as one fleet (`serve --replicas N`, `--ray-address`).

The sampler (the "front": API, scheduler, store, outbox) stays a single process and the
only Ray driver; each replica is a detached, named actor (`replica.py`) wrapping an
unchanged backend, so a restarted sampler finds its replicas still warm (`attach`). The
fleet (`sampler_service.fleet`) routes, watches, restarts and loads them; each replica is
one member (`member.py`). What they share is here: the Ray session, the actors' names and
options, and how an update reaches them: tensors once into Ray's object store (the
committed ones stay there for replicas that restart), or the paths of weight files every
replica can read (`--weights-dir`, or POST /v1/weights/load).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from sampler_service.backends.base import Backend
from sampler_service.backends.ray.member import RayMember
from sampler_service.backends.ray.replica import Replica
from sampler_service.config import ReplicaSettings
from sampler_service.fleet.member import Member, Source, Transport
from sampler_service.fleet.pool import Fleet
from sampler_service.metrics import Metrics

#: Ray namespace of every replica actor; names are `adaptive-rollout/<instance>/replica-<i>`.
NAMESPACE = "adaptive-rollout"
#: A local Ray (no address): object store size; weights travel through it once per update.
LOCAL_OBJECT_STORE_BYTES = 512 * 1024**2


def actor_name(instance_id: str, index: int) -> str:
    return f"adaptive-rollout/{instance_id}/replica-{index}"


@dataclass
class RayTransport(Transport):
    """The replicas' shared wire: see the module docstring. `instance_id` names this
    sampler's replicas (a restarted one finds them); `torch_threads` is each replica
    engine's torch thread count."""

    name = "ray"
    reads_weight_files = True
    noun = "engine replica"
    row_key = "replica"
    rows_key = "replicas"
    nccl_hint = "vLLM weight_transfer_config not set"

    factory: Callable[[], Backend]
    settings: ReplicaSettings
    instance_id: str
    torch_threads: int = 1
    #: A Ray this transport started, and ends.
    _owns_ray: bool = field(default=False, init=False)

    def _init_ray(self) -> None:
        s = self.settings
        if ray.is_initialized():  # the caller's own Ray session (benchmarks): theirs to end
            return
        self._owns_ray = True
        if s.ray_address is not None:
            ray.init(address=s.ray_address, namespace=NAMESPACE, configure_logging=False)
        else:
            ray.init(
                namespace=NAMESPACE,
                num_cpus=max(1, round(s.count * s.cpus)),
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                configure_logging=False,
            )

    async def open(self) -> list[Member]:
        s = self.settings
        await asyncio.to_thread(self._init_ray)
        actor_class = ray.remote(Replica)
        members: list[Member] = []
        for i in range(s.count):
            name = actor_name(self.instance_id, i)
            handle = actor_class.options(
                name=name,
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=s.max_restarts,
                max_task_retries=0,
                max_concurrency=1000,
                num_cpus=s.cpus,
                num_gpus=s.gpus,
            ).remote(self.factory, i, self.torch_threads, s.orphan_s)
            members.append(RayMember(i, name, handle, orphan_s=s.orphan_s, on_exit=s.on_exit))
        return members

    async def close(self) -> None:
        if self._owns_ray and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)

    async def stage_tensors(self, tensors: Mapping[str, Any], version: int) -> Source:
        """Put the tensors into Ray's object store once; each replica reads them there."""
        ref = await asyncio.to_thread(ray.put, dict(tensors))
        return Source(version, frozenset(tensors), ("ref", ref))

    async def stage_files(self, files: Sequence[str], version: int, names: Sequence[str]) -> Source:
        return Source(version, frozenset(names), ("files", [str(f) for f in files]))


def build_ray_fleet(
    factory: Callable[[], Backend],
    settings: ReplicaSettings,
    *,
    instance_id: str,
    torch_threads: int = 1,
    metrics: Metrics | None = None,
    on_state_change: Callable[[dict[str, Any]], None] | None = None,
) -> Fleet:
    """`settings.count` replicas of `factory`'s engine (see the module docstring)."""
    transport = RayTransport(
        factory, settings, instance_id=instance_id, torch_threads=torch_threads
    )
    return Fleet(transport, settings, metrics=metrics, on_state_change=on_state_change)
