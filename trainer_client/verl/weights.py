"""Trainer weights -> sampler at the end of every verl step, as a verl checkpoint engine.

`trainer_client.verl.upload.WeightPusher` makes named tensors the sampler's next policy
version.

Policy versions must increase on the sampler. verl counts steps from 1 (or from the step
it resumed at); the trainers map ``version = global_step + offset`` (`session.VersionMap`),
with the offset fixed at start-up so that the first version is above what the sampler
serves, and pass the version down.

`SamplerCheckpointEngine` plugs this into verl 0.9 as a checkpoint-engine backend named
``adaptive_rollout``: the actor workers call ``send_weights(per_tensor_param)`` on every
rank (the generator all-gathers FSDP shards, so every rank must drain it); rank 0 pushes.
verl imports this module on each worker through
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``, which our trainer
mode sets (trainer_client.verl.v1).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from trainer_client.verl.settings import MODE, SamplerSettings
from trainer_client.verl.upload import WeightPusher, to_host

__all__ = ["SamplerCheckpointEngine", "WeightPusher", "configure_for_sampler"]


@CheckpointEngineRegistry.register(MODE)
class SamplerCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine whose "rollout side" is the sampler's HTTP API.

    Constructed by verl's actor workers as ``CheckpointEngineRegistry.new(backend,
    is_master=..., bucket_size=..., **engine_kwargs[backend])``; the engine kwargs are the
    `SamplerSettings` fields (our trainer mode fills them in from
    ``trainer.v1.adaptive_rollout``).
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **settings: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.settings = SamplerSettings.from_mapping(settings)
        self.pusher = WeightPusher(self.settings) if is_master else None

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ):
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """All ranks drain `weights`; rank 0 pushes them as policy version `global_steps`.

        Our trainers call the workers' ``update_weights(global_steps=version, ...)`` with
        the sampler policy version (step + offset), which verl hands on to here.
        """
        version = int(global_steps or 0)
        if self.pusher is None:
            async for _ in ensure_async_iterator(weights):  # take part in the all-gathers
                pass
            return {}
        dtype = await asyncio.to_thread(self.pusher.wire_dtype)
        held = []
        async for name, tensor in ensure_async_iterator(weights):
            held.append((name, to_host(tensor, dtype)))  # cast on the GPU, then copied
        return await asyncio.to_thread(self.pusher.push, held, version, on_host=True)

    async def receive_weights(self, global_steps: int | None = None):
        raise NotImplementedError(
            "the sampler receives weights over HTTP, not through a checkpoint engine"
        )


def configure_for_sampler(config: Any, settings: SamplerSettings) -> None:
    """Point verl's checkpoint engine at the sampler (weights leave the actor workers through it)."""
    from omegaconf import open_dict

    with open_dict(config):
        engine = config.actor_rollout_ref.rollout.checkpoint_engine
        engine.backend = MODE
        engine.custom_backend_module = "trainer_client.verl.weights"
        if engine.get("engine_kwargs") is None:
            engine.engine_kwargs = {}
        kwargs = settings.to_dict()
        if kwargs["api_key"] and kwargs["api_key"] == os.environ.get("ADAPTIVE_ROLLOUT_API_KEY"):
            # Keep a key that came from the environment out of the config (verl logs its
            # config); the workers read the same variable (multi-node: pass it in
            # ray_kwargs.ray_init.runtime_env.env_vars).
            kwargs["api_key"] = None
        engine.engine_kwargs[MODE] = kwargs
