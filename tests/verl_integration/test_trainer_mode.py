"""The deploy config, the ``adaptive_rollout`` trainer mode's construction and start-up checks.

- deploy/verl/sampler_grpo.yaml composes on top of verl's own ppo_trainer.yaml and passes
  verl's ``validate_config``; its class paths resolve the way verl resolves them;
- the trainer mode is registered, builds on verl's PPOTrainer, and asks for actor workers
  only (no rollout engine on the trainer GPUs) with the sampler checkpoint engine;
- start-up refuses a sampler verl cannot train on, with a message naming each problem,
  and sets the sampler's batch_groups to the step's group count.
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
from verl_suite import GRPO_CONFIG, REPO, Sampler, verl_config

from trainer_client.client import SamplerClient
from trainer_client.verl.session import SamplerSession
from trainer_client.verl.settings import (
    MODE,
    IncompatibleSamplerConfig,
    SamplerSettings,
    check_sampler_config,
    check_verl_config,
)

pytestmark = pytest.mark.verl


def test_deploy_config_passes_verls_validation(monkeypatch) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.config import validate_config
    from verl.utils.import_utils import load_class_from_fqn

    import trainer_client.verl.v1  # noqa: F401  (what VERL_USE_EXTERNAL_MODULES imports)

    monkeypatch.setenv("ADAPTIVE_ROLLOUT_URL", "http://sampler.example:8000")
    cfg = verl_config(
        "${oc.env:ADAPTIVE_ROLLOUT_URL}",
        n=4,
        batch=8,
        overrides=["actor_rollout_ref.model.path=/models/x"],
    )
    validate_config(
        config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
    )
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode).__name__ == "SamplerPPOTrainer"
    manager = load_class_from_fqn(
        cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager"
    )
    assert manager.__name__ == "SamplerAgentLoopManager"
    settings = SamplerSettings.from_verl_config(cfg)
    assert settings.url == "http://sampler.example:8000" and settings.weight_sync == "upload"
    assert cfg.trainer.use_v1 and not need_critic(cfg)


def test_launch_scripts_parse() -> None:
    for script in ("deploy/verl/launch.sh", "deploy/gpu_checks/run.sh"):
        subprocess.run(["bash", "-n", str(REPO / script)], check=True)


def test_launch_script_composes_verls_config(tmp_path) -> None:
    """The trainer role's exact verl command line, up to Hydra's composed config (``--cfg job``)."""
    import os
    import sys

    env = {
        **os.environ,
        "MODEL": "/models/x",
        "SAMPLER_URL": "http://inference-0:8000",
        "GROUP_SIZE": "8",
        "TRAIN_BATCH": "32",
        "PACING_DATA": str(tmp_path / "pacing.parquet"),
        "PYTHON": sys.executable,
    }
    out = subprocess.run(
        [str(REPO / "deploy/verl/launch.sh"), "trainer", "--cfg", "job"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(out.stdout)
    assert (
        cfg.trainer.v1.trainer_mode == MODE
        and cfg.trainer.v1.adaptive_rollout.url == "http://inference-0:8000"
    )
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.data.train_batch_size == 32
    assert (
        cfg.actor_rollout_ref.model.path == "/models/x"
        and cfg.data.train_files == env["PACING_DATA"]
    )
    assert (
        cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES
        == "trainer_client.verl.v1"
    )
    assert (tmp_path / "pacing.parquet").is_file()


def test_trainer_mode_builds_without_rollout_engine(sampler) -> None:
    from verl.trainer.ppo.utils import Role

    from trainer_client.verl.v1 import SamplerPPOTrainer

    cfg = verl_config(sampler.url, overrides=["actor_rollout_ref.model.path=/models/x"])
    trainer = SamplerPPOTrainer(cfg)
    assert trainer.trainer_mode == MODE and trainer._enable_hybrid_replicas is False
    trainer._init_resource_pool_mgr()
    assert set(trainer.role_worker_mapping) == {
        Role.Actor
    }  # no ActorRollout: no vLLM on these GPUs
    engine = cfg.actor_rollout_ref.rollout.checkpoint_engine
    assert engine.backend == MODE and engine.custom_backend_module == "trainer_client.verl.weights"
    assert engine.engine_kwargs[MODE]["url"] == sampler.url


def test_dapo_filtering_and_reward_models_are_refused(sampler) -> None:
    from trainer_client.verl.v1 import SamplerPPOTrainer

    cfg = verl_config(
        sampler.url,
        overrides=[
            "actor_rollout_ref.model.path=/m",
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=acc",
        ],
    )
    assert check_verl_config(cfg)
    with pytest.raises(IncompatibleSamplerConfig, match="nonzero_std"):
        SamplerPPOTrainer(cfg)


def _start(cfg):
    """The start-up both trainers run (SamplerSession.start), against the live sampler."""
    session = SamplerSession(SamplerSettings.from_verl_config(cfg))
    session.start(cfg, global_steps=0, use_critic=False, step_groups=int(cfg.data.train_batch_size))
    return session


def test_start_up_checks_against_the_live_sampler(sampler, reinforce_ada_sampler) -> None:
    with pytest.raises(IncompatibleSamplerConfig) as err:
        _start(
            verl_config(
                sampler.url,
                n=3,
                overrides=[
                    "actor_rollout_ref.model.path=/m",
                    "actor_rollout_ref.rollout.temperature=0.7",
                ],
            ),
        )
    message = str(err.value)
    assert "rollout.n = 3" in message and "group_size 4" in message and "temperature" in message
    assert len(err.value.problems) == 2

    client = SamplerClient(sampler.url)
    try:
        trainer = _start(
            verl_config(sampler.url, n=4, batch=3, overrides=["actor_rollout_ref.model.path=/m"]),
        )
        assert client.get_config()["batch_groups"] == 3  # set to the step's group count
        assert (
            trainer.use_sampler_advantages is False
        )  # grpo: verl's estimator gives the same numbers
        assert trainer.versions.version(1) == max(1, client.health().policy_version + 1)
    finally:
        client.update_config(batch_groups=1)
    ada = _start(
        verl_config(reinforce_ada_sampler.url, n=4, overrides=["actor_rollout_ref.model.path=/m"]),
    )
    assert ada.use_sampler_advantages is True  # global baseline: only the service can compute it


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"group_size": 0}, "group_size 0"),
        ({"group_policies": [{"name": "maxvar", "params": {}}]}, "'maxvar'"),
        ({"group_policies": [{"name": "gfpo", "params": {}}]}, "'gfpo'"),
        ({"batch_policies": [{"name": "topk", "params": {}}]}, "'topk'"),
        ({"rule": "est", "group_size": 4}, "est.n_min"),
        ({"rule": "positive", "k_pos": 1, "wave_size": 2}, "fewer than group_size"),
        (
            {"rule": "balanced", "k_pos": 1, "k_neg": 1, "wave": "adaptive", "wave_size": 8},
            "fewer than group_size",
        ),
    ],
)
def test_incompatible_configs(patch, needle) -> None:
    problems, _ = check_sampler_config({**GRPO_CONFIG, **patch}, rollout_n=4, temperature=1.0)
    assert problems and any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    "patch",
    [
        {},
        {
            "group_policies": [
                {"name": "nonzero_std", "params": {}},
                {"name": "difffilter", "params": {}},
            ]
        },
        {"batch_policies": [{"name": "per", "params": {}}, {"name": "ar", "params": {}}]},
        {"rule": "balanced", "k_pos": 2, "k_neg": 2, "wave": "adaptive"},
        {"rule": "positive", "k_pos": 1, "wave_size": 8, "advantage": "global"},
        {"rule": "est", "est": {"n_min": 4, "mean_budget": 8}, "n_max": 16},
    ],
)
def test_compatible_configs(patch) -> None:
    problems, _ = check_sampler_config({**GRPO_CONFIG, **patch}, rollout_n=4, temperature=1.0)
    assert problems == []


def test_a_fresh_trainer_never_rolls_a_trained_policy_back_silently(toy, tmp_path, caplog) -> None:
    """A verl run started from step 0 against a sampler that serves trained weights (a
    rerun that found no checkpoint, or resume_mode=disable) would push step-0 weights over
    them: refused, naming verl's resume_mode and the setting that pushes anyway; pushing
    anyway, and pushing a resumed checkpoint's weights, each say so once."""
    from safetensors.torch import load_file

    from trainer_client.verl.session import NewerPolicyServed

    fresh_sampler = Sampler(toy, tmp_path, GRPO_CONFIG).start()
    try:
        with SamplerClient(fresh_sampler.url) as client:
            client.push_weights(load_file(toy.model_dir / "model.safetensors"), 7)
        cfg = verl_config(fresh_sampler.url, overrides=["actor_rollout_ref.model.path=/m"])
        with pytest.raises(NewerPolicyServed, match="v7") as err:
            _start(cfg)
        assert "trainer.resume_mode=auto" in str(err.value)
        assert f"trainer.v1.{MODE}.push_initial_weights=always" in str(err.value)
        with caplog.at_level("WARNING", logger="trainer_client.verl.session"):
            anyway = SamplerSession(
                SamplerSettings.from_verl_config(
                    verl_config(
                        fresh_sampler.url,
                        overrides=["actor_rollout_ref.model.path=/m"],
                        push_initial_weights="always",
                    )
                )
            )
            anyway.start(cfg, global_steps=0, use_critic=False, step_groups=2)
            assert anyway.initial_push_due(0) and anyway.next_version(0, initial=True) == 8
            resumed = SamplerSession(SamplerSettings.from_verl_config(cfg))
            resumed.start(cfg, global_steps=3, use_critic=False, step_groups=2)
            assert resumed.initial_push_due(3) and resumed.next_version(3, initial=True) == 8
        rolled = [r.getMessage() for r in caplog.records if "rolling back" in r.getMessage()]
        assert len(rolled) == 2 and all("v7" in m and "as v8" in m for m in rolled), rolled
        for session in (anyway, resumed):
            session.close()
    finally:
        fresh_sampler.stop()


def test_v0_trainer_start_and_batches_from_the_sampler(sampler, toy) -> None:
    """What the V0 trainer does before verl's steps: start-up checks, lease -> DataProto, ack."""
    from transformers import AutoTokenizer

    from trainer_client.verl.v0 import lease_batch_proto

    cfg = verl_config(
        sampler.url, n=4, batch=3, overrides=["actor_rollout_ref.model.path=/m"], consumer="v0"
    )
    session = SamplerSession(SamplerSettings.from_verl_config(cfg))
    try:
        sampler_config = session.start(cfg, global_steps=0, use_critic=False, step_groups=3)
        assert sampler_config["batch_groups"] == 3 and session.use_sampler_advantages is False
        groups = session.source.take(3)
        batch = lease_batch_proto(
            groups,
            cfg,
            AutoTokenizer.from_pretrained(toy.model_dir),
            1,
            sample_weights=True,
            drop_replayed=True,
        )
        assert len(groups) == 3 and len(batch) == 12
        assert batch.meta_info["temperature"] == 1.0
        assert list(batch.non_tensor_batch["uid"]) == [g.group_id for g in groups for _ in range(4)]
        assert session.source.ack(groups) == 3
        assert session.client.stats()["queue"]["leased"] == 0
    finally:
        session.client.update_config(batch_groups=1)


def test_trainer_starts_the_way_verls_entry_point_builds_it(ray_tq, sampler, toy) -> None:
    """TaskRunnerV1.run's construction, then what PPOTrainer._setup does without hybrid
    replicas (steps 9 and 10) and TaskRunnerV1.init_agent_loop_manager, with no vLLM in
    this environment: nothing may assert or import vLLM."""
    import sys

    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.rollout.llm_server import LLMServerManager

    import trainer_client.verl.v1  # noqa: F401  (what VERL_USE_EXTERNAL_MODULES imports)

    cfg = verl_config(sampler.url, overrides=[f"actor_rollout_ref.model.path={toy.model_dir}"])
    OmegaConf.resolve(cfg)
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(config=cfg)
    assert trainer._enable_hybrid_replicas is False
    manager = LLMServerManager.create_empty(config=trainer.config)
    assert manager.get_replicas() == []
    engine_config = omega_conf_to_dataclass(
        trainer.config.actor_rollout_ref.rollout.checkpoint_engine
    )
    engine_config.backend = "naive"
    CheckpointEngineManager(config=engine_config, actor_wg=None, replicas=manager.get_replicas())
    agent_cls = load_class_from_fqn(
        trainer.config.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager"
    )
    agent = agent_cls.create(
        config=trainer.config,
        llm_client=manager.get_client(),
        teacher_client=None,
        reward_loop_worker_handles=[],
    )
    assert agent.settings.url == sampler.url
    agent.close()
    assert "vllm" not in sys.modules


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_v0_path_exits_naming_vllm() -> None:
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "trainer_client.verl.v0", "actor_rollout_ref.model.path=/m"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode != 0
    assert "needs vLLM" in out.stderr and "trainer_mode=adaptive_rollout" in out.stderr, out.stderr
