"""Trainer weights -> sampler, at the end of every verl step.

`WeightPusher` takes (name, tensor) pairs named as the Hugging Face checkpoint names them
(what verl's training engines yield from ``get_per_tensor_param``, what ``state_dict()``
of a transformers model holds) and makes the sampler serve them as a new policy version:

- ``upload``: a safetensors body to PUT /v1/weights (streamed from a file when
  `weights_dir` is set, from memory otherwise);
- ``path``: a safetensors file written under `weights_dir` (shared storage the sampler
  can read), then POST /v1/weights/load.

Policy versions must increase on the sampler. verl counts steps from 1 (or from the step
it resumed at); the trainers map ``version = global_step + offset`` (`v1.VersionMap`),
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
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer_client.client import SamplerClient
from trainer_client.verl.settings import MODE, SamplerSettings

log = logging.getLogger(__name__)


class WeightPusher:
    """Pushes named tensors to the sampler as increasing policy versions."""

    def __init__(self, settings: SamplerSettings, client: SamplerClient | None = None) -> None:
        self.settings = settings
        self._client = client
        self.last_version: int | None = None

    @property
    def client(self) -> SamplerClient:
        if self._client is None:
            self._client = SamplerClient(self.settings.url, **self.settings.client_kwargs())
        return self._client

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
    ) -> dict[str, float]:
        """Make the sampler serve these weights as policy `version`; returns metrics for verl's logger.

        `version` must be above what the sampler serves (`ConflictError` otherwise); the
        trainers map verl steps onto versions with `trainer_client.verl.v1.VersionMap`.
        """
        if self.settings.weight_sync == "none":
            return {}
        started = time.monotonic()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        state = {name: t.detach().to("cpu").contiguous() for name, t in items}
        collected = time.monotonic()
        if self.settings.weight_sync == "path" or self.settings.weights_dir:
            path = self._write(state, version)
            if self.settings.weight_sync == "path":
                reply = self.client.load_weights(path, version)
            else:
                reply = self.client.push_weights(path, version)
        else:
            reply = self.client.push_weights(state, version)
        self.last_version = reply.policy_version
        done = time.monotonic()
        log.info(
            "pushed %d tensors as policy version %d in %.1fs", len(state), version, done - started
        )
        return {
            f"{MODE}/policy_version": float(reply.policy_version),
            f"{MODE}/weight_push_s": done - started,
            f"{MODE}/weight_gather_s": collected - started,
            f"{MODE}/weight_load_s": float(reply.load_s),
        }

    def _write(self, state: dict[str, torch.Tensor], version: int) -> Path:
        from safetensors.torch import save_file

        directory = Path(self.settings.weights_dir or ".")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"policy_v{version:08d}.safetensors"
        tmp = path.with_suffix(".tmp")
        # Tied weights share storage and safetensors refuses aliases: keep the first name
        # (the sampler loads a subset of tensors as a partial update).
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        unique = {}
        for name, t in state.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                unique[name] = t
        save_file(unique, str(tmp))
        os.replace(tmp, path)
        keep = max(1, int(self.settings.keep_weight_files))
        old = sorted(directory.glob("policy_v*.safetensors"))[:-keep]
        for stale in old:
            stale.unlink(missing_ok=True)
        return path

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


# -- verl checkpoint-engine backend ---------------------------------------------------------
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402
from verl.workers.rollout.utils import ensure_async_iterator  # noqa: E402


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
        collected = []
        async for name, tensor in ensure_async_iterator(weights):
            collected.append((name, tensor.detach().to("cpu", copy=True)))
        return await asyncio.to_thread(self.pusher.push, collected, version)

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
