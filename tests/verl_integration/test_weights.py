"""The weight-push hook: a real tiny model's weights reach a running sampler as a new policy version.

The engine is built the way verl's actor worker builds it (ActorRolloutRefWorker.init_model):
the checkpoint-engine config our trainer mode writes, turned into verl's dataclass, the
custom backend module imported, then ``CheckpointEngineRegistry.new(backend, is_master=...,
bucket_size=..., **engine_kwargs[backend])``; the worker's ``update_weights(mode=...)``
then calls ``send_weights(per_tensor_param, global_steps=...)`` on every rank, which is
what these tests call with the model's (name, tensor) pairs.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from verl_suite import lease_groups, verl_config

from trainer_client.client import SamplerClient
from trainer_client.exceptions import ConflictError
from trainer_client.verl.settings import MODE, SamplerSettings

pytestmark = pytest.mark.verl


def _engine(cfg, *, is_master: bool):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    from trainer_client.verl.weights import configure_for_sampler

    configure_for_sampler(cfg, SamplerSettings.from_verl_config(cfg))
    engine_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    assert engine_cfg.backend == MODE
    import_external_libs(engine_cfg.custom_backend_module or None)
    return CheckpointEngineRegistry.new(
        engine_cfg.backend,
        is_master=is_master,
        bucket_size=engine_cfg.update_weights_bucket_megabytes << 20,
        **engine_cfg.engine_kwargs.get(engine_cfg.backend, {}),
    )


def _perturbed_model(toy, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return model


def test_checkpoint_engine_pushes_a_real_model(sampler, toy) -> None:
    client = SamplerClient(sampler.url)
    before = client.health().policy_version
    cfg = verl_config(
        sampler.url, overrides=["actor_rollout_ref.model.path=/m"], consumer="weights"
    )
    master, other = _engine(cfg, is_master=True), _engine(cfg, is_master=False)
    model = _perturbed_model(toy, seed=1)
    version = before + 1

    drained = []

    def rank1_weights():
        for item in model.state_dict().items():
            drained.append(item[0])
            yield item

    assert asyncio.run(other.send_weights(rank1_weights(), global_steps=version)) == {}
    assert len(drained) == len(model.state_dict())  # every rank takes part in the gathers
    assert client.health().policy_version == before  # only rank 0 pushes

    started = time.monotonic()
    metrics = asyncio.run(
        master.send_weights(iter(model.state_dict().items()), global_steps=version)
    )
    assert client.health().policy_version == version
    assert metrics[f"{MODE}/policy_version"] == version and metrics[f"{MODE}/weight_push_s"] > 0
    print(f"push of {len(model.state_dict())} tensors: {time.monotonic() - started:.2f}s")

    # samples generated after the push come from the new weights
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fresh = [
            s
            for g in lease_groups(sampler.url, 2)
            for s in g.samples
            if s.policy_version == version
        ]
        if fresh:
            break
    else:
        pytest.fail(f"no sample with policy_version {version} within 120s")

    # versions must increase: pushing the same version again is refused by the sampler
    with pytest.raises(ConflictError):
        asyncio.run(master.send_weights(iter(model.state_dict().items()), global_steps=version))


def test_shared_path_mode(sampler, toy, tmp_path) -> None:
    from trainer_client.verl.weights import WeightPusher

    client = SamplerClient(sampler.url)
    settings = SamplerSettings.from_mapping(
        {"url": sampler.url, "weight_sync": "path", "weights_dir": str(tmp_path / "w")}
    )
    pusher = WeightPusher(settings)
    model = _perturbed_model(toy, seed=2)
    for _ in range(2):
        version = client.health().policy_version + 1
        metrics = pusher.push(model.state_dict(), version)
        assert client.health().policy_version == version == metrics[f"{MODE}/policy_version"]
    files = sorted((tmp_path / "w").glob("*.safetensors"))
    assert [f.name for f in files] == [f"policy_v{version:08d}.safetensors"]  # keep_weight_files=1


def test_version_map() -> None:
    from trainer_client.verl.session import VersionMap

    fresh = VersionMap(served=0, step=0)
    assert [fresh.version(s) for s in (1, 2, 3)] == [1, 2, 3]
    # verl resumed at step 10 against a sampler already serving version 25 (earlier runs)
    resumed = VersionMap(served=25, step=10)
    assert resumed.version(11) == 26
    resumed.note_pushed(26, 10)  # an initial push at start-up took 26
    assert resumed.version(11) == 27
