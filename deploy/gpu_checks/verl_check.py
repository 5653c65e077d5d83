"""The verl GPU check's stages (run by deploy/gpu_checks/run.sh; see its header).

GPU run: the sampler (hf backend) on CUDA, then `python -m verl.trainer.main_ppo` with
deploy/verl/sampler_grpo.yaml for STEPS GRPO steps in the ``adaptive_rollout`` trainer
mode, in two phases: float32 sampler and actor (``training/rollout_probs_diff_max`` below
1e-3 at every step: the records are laid out right and the sampler serves exactly the
trained weights), then bfloat16 (``rollout_probs_diff_mean`` below 1e-3, the max
reported). Each phase checks that the policy version advanced once per step and that
every group verl took was acked.

CPU dry run (``--cpu-dry-run``): every stage but verl's FSDP steps (verl 0.9.1 runs none
on CPU): the sampler, verl's config composition and the trainer built the way verl's
entry point builds it through its LLM server manager, the agent-loop manager writing
leased groups into TransferQueue and reading them back, one weight push through the
checkpoint engine, and the ack.

Writes ``summary.json`` (stages, checks, tokens/s, step times, memory, the skipped
stage) to ``--out``; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer_client.client import SamplerClient  # noqa: E402
from trainer_client.launch import SamplerProcess  # noqa: E402

STEPS = 3
GROUPS = 4
N = 4
SAMPLER = {
    "rule": "fixed",
    "group_size": N,
    "wave_size": N,
    "n_max": 2 * N,
    "advantage": "grpo",
    "temperature": 1.0,
    "max_tokens": 16,
    "batch_groups": GROUPS,
    "max_buffered_groups": 8 * GROUPS,
    "max_active_prompts": 8 * GROUPS,
    "max_staleness": 0,
}
DIFF_LIMIT = 1e-3


class Check:
    """Stages, checks and figures, written to summary.json as they accrue."""

    def __init__(self, out: Path, mode: str) -> None:
        self.out = out
        self.summary: dict[str, Any] = {
            "mode": mode,
            "stages": {},
            "checks": [],
            "skipped": [],
            "figures": {},
        }

    def stage(self, name: str, seconds: float, **info: Any) -> None:
        self.summary["stages"][name] = {"seconds": round(seconds, 2), **info}
        print(f"== {name}: {seconds:.1f}s {info or ''}", flush=True)
        self.write()

    def expect(self, ok: bool, what: str) -> None:
        self.summary["checks"].append({"ok": bool(ok), "what": what})
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        self.write()

    @property
    def passed(self) -> bool:
        return bool(self.summary["checks"]) and all(c["ok"] for c in self.summary["checks"])

    def write(self) -> None:
        self.summary["passed"] = self.passed
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")


def start_sampler(toy: Any, work: Path, device: str, dtype: str) -> SamplerProcess:
    server = SamplerProcess(
        toy.model_dir,
        toy.data_files,
        work / "state",
        SAMPLER,
        work / "sampler.log",
        extra=["--device", device, "--dtype", dtype],
    )
    server.start(timeout_s=300)
    return server


def verl_overrides(url: str, model: Path, pacing: Path, work: Path, dtype: str) -> list[str]:
    """Hydra overrides of deploy/verl/sampler_grpo.yaml for the toy model on one GPU."""
    precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    return [
        f"trainer.v1.adaptive_rollout.url={url}",
        "trainer.v1.adaptive_rollout.consumer=gpu_check",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.rollout.n={N}",
        f"data.train_files={pacing}",
        f"data.val_files={pacing}",
        f"data.train_batch_size={GROUPS}",
        "data.max_prompt_length=64",
        f"data.max_response_length={SAMPLER['max_tokens']}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={GROUPS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={GROUPS}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={GROUPS}",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        # float32 master weights; the forward passes in the sampler's dtype
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        f"++actor_rollout_ref.actor.fsdp_config.mixed_precision={{param_dtype:{precision},"
        "reduce_dtype:fp32,buffer_dtype:fp32}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=-1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.default_local_dir={work / 'checkpoints'}",
        # ray_cpus_needed: verl's default of 8 storage units would ask for 13 of these 8.
        "ray_kwargs.ray_init.num_cpus=8",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def step_metrics(log: str) -> list[dict[str, float]]:
    """verl's console logger lines of training steps (``step:N - key:value - ...``).

    With ``val_before_train`` verl also logs ``step:0`` with the validation metrics alone;
    a training step's line is the one that carries ``timing_s/step``.
    """
    steps = []
    for line in log.splitlines():
        m = re.search(r"step:(\d+) - (.*)$", line)
        if not m:
            continue
        values = {"step": float(m.group(1))}
        for part in m.group(2).split(" - "):
            key, _, value = part.partition(":")
            try:
                values[key.strip()] = float(value)
            except ValueError:
                continue
        if "timing_s/step" in values:
            steps.append(values)
    return steps


def ray_cpus_needed(cfg: Any) -> int:
    """The CPUs Ray must offer before verl's first step, from the composed config.

    verl asks for them up front: the TaskRunner (1), the FSDP worker group's placement
    bundle (3 CPUs with the GPU), TransferQueue's controller (1) and one per storage unit.
    With fewer, a placement group waits forever and verl prints nothing more.
    """
    storage = cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units
    return 1 + 3 + 1 + int(storage)


def gpu_phase(check: Check, toy: Any, work: Path, dtype: str, verl_timeout_s: float) -> None:
    """One verl run of STEPS steps against a sampler serving `dtype` on the GPU."""
    phase = f"{dtype} phase"
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    server = start_sampler(toy, work, "cuda", dtype)
    try:
        check.stage(f"{phase}: sampler", time.monotonic() - started, url=server.url)
        client = SamplerClient(server.url)
        before = client.health().policy_version
        from trainer_client.verl.pacing import write_pacing_dataset

        pacing = write_pacing_dataset(work / "pacing.parquet", rows=GROUPS * 16)
        env = {
            **os.environ,
            "VERL_USE_EXTERNAL_MODULES": "trainer_client.verl.v1",
            "ADAPTIVE_ROLLOUT_URL": server.url,
        }
        cmd = [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            f"--config-path={REPO / 'deploy' / 'verl'}",
            "--config-name=sampler_grpo",
            *verl_overrides(server.url, toy.model_dir, pacing, work, dtype),
        ]
        started = time.monotonic()
        with (work / "verl.log").open("w") as log:
            rc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=verl_timeout_s
            ).returncode
        text = (work / "verl.log").read_text()
        check.stage(f"{phase}: verl {STEPS} steps", time.monotonic() - started, exit_code=rc)
        check.expect(rc == 0, f"{phase}: verl exited 0 (log {work / 'verl.log'})")
        steps = step_metrics(text)
        check.expect(len(steps) == STEPS, f"{phase}: verl logged {len(steps)} of {STEPS} steps")
        key = (
            "training/rollout_probs_diff_max"
            if dtype == "float32"
            else "training/rollout_probs_diff_mean"
        )
        for s in steps:
            value = s.get(key)
            check.expect(
                value is not None and value < DIFF_LIMIT,
                f"{phase}: step {int(s['step'])} {key} = {value} < {DIFF_LIMIT}",
            )
        after = client.health().policy_version
        check.expect(
            after >= before + STEPS,
            f"{phase}: policy version {before} -> {after} over {STEPS} steps",
        )
        stats = client.stats()
        check.expect(
            stats["queue"]["leased"] == 0,
            f"{phase}: no group left leased (every group used was acked)",
        )
        check.summary["figures"][dtype] = {
            "sampler_tokens_per_s": stats.get("tokens_per_s"),
            "step_s": [s.get("timing_s/step") for s in steps],
            "update_weights_s": [s.get("timing_s/update_weights") for s in steps],
            "rollout_probs_diff_max": [s.get("training/rollout_probs_diff_max") for s in steps],
            "rollout_probs_diff_mean": [s.get("training/rollout_probs_diff_mean") for s in steps],
            "max_memory_allocated_gb": [s.get("actor/perf/max_memory_allocated_gb") for s in steps],
        }
        check.write()
    finally:
        server.stop()


def dry_run(check: Check, toy: Any, work: Path) -> None:
    """Every stage but the FSDP steps, on CPU (see the module docstring)."""
    import asyncio

    import ray
    import torch
    import transfer_queue as tq
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.rollout.llm_server import LLMServerManager

    import trainer_client.verl.v1  # noqa: F401  (what VERL_USE_EXTERNAL_MODULES imports)
    from trainer_client.verl.pacing import write_pacing_dataset
    from trainer_client.verl.settings import MODE
    from trainer_client.verl.weights import SamplerCheckpointEngine

    started = time.monotonic()
    server = start_sampler(toy, work, "cpu", "float32")
    check.stage("sampler", time.monotonic() - started, url=server.url)
    try:
        started = time.monotonic()
        pacing = write_pacing_dataset(work / "pacing.parquet", rows=GROUPS * 16)
        with initialize_config_dir(config_dir=str(REPO / "deploy" / "verl"), version_base=None):
            cfg = compose(
                config_name="sampler_grpo",
                overrides=verl_overrides(server.url, toy.model_dir, pacing, work, "float32"),
            )
        validate_config(
            config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
        )
        OmegaConf.resolve(cfg)
        check.stage("verl config composed and validated", time.monotonic() - started)
        cpus, needed = cfg.ray_kwargs.ray_init.num_cpus, ray_cpus_needed(cfg)
        check.expect(needed <= cpus, f"the GPU run's Ray offers {cpus} CPUs, verl needs {needed}")

        started = time.monotonic()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        tq.init(
            OmegaConf.create(
                {
                    "backend": {
                        "storage_backend": "SimpleStorage",
                        "SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 10000},
                    }
                }
            )
        )
        trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(config=cfg)
        servers = LLMServerManager.create_empty(config=trainer.config)
        engine_config = omega_conf_to_dataclass(
            trainer.config.actor_rollout_ref.rollout.checkpoint_engine
        )
        engine_config.backend = "naive"
        CheckpointEngineManager(
            config=engine_config, actor_wg=None, replicas=servers.get_replicas()
        )
        manager_cls = load_class_from_fqn(
            trainer.config.actor_rollout_ref.rollout.agent.agent_loop_manager_class,
            "AgentLoopManager",
        )
        manager = manager_cls.create(
            config=trainer.config,
            llm_client=servers.get_client(),
            teacher_client=None,
            reward_loop_worker_handles=[],
        )
        check.stage("trainer built through the rollout manager", time.monotonic() - started)
        check.expect("vllm" not in sys.modules, "vLLM never imported")

        started = time.monotonic()
        groups = manager.take_groups(GROUPS)
        uids = manager.write_groups(groups, global_steps=1)
        keys = [f"{uid}_{s}_0" for uid in uids for s in range(N)]
        data = tq.kv_batch_get(keys=keys, partition_id="train")
        same = all(
            data["responses"][i].tolist() == groups[i // N].samples[i % N].response_token_ids
            for i in range(len(keys))
        )
        check.stage(
            "TransferQueue write/read of leased groups",
            time.monotonic() - started,
            groups=len(groups),
        )
        check.expect(same, f"{len(keys)} records read back from TransferQueue as written")

        started = time.monotonic()
        client = SamplerClient(server.url)
        before = client.health().policy_version
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32)
        engine = SamplerCheckpointEngine(
            is_master=True,
            **trainer.config.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs[MODE],
        )
        metrics = asyncio.run(
            engine.send_weights(iter(model.state_dict().items()), global_steps=before + 1)
        )
        check.stage(
            "weight push through the checkpoint engine", time.monotonic() - started, **metrics
        )
        check.expect(
            client.health().policy_version == before + 1, f"policy version {before} -> {before + 1}"
        )

        acked = manager.ack(uids)
        check.expect(
            acked == GROUPS and client.stats()["queue"]["leased"] == 0,
            f"{acked} groups acked, none left leased",
        )
        check.summary["figures"]["cpu"] = {
            "sampler_tokens_per_s": client.stats().get("tokens_per_s"),
            "weight_push_s": metrics.get(f"{MODE}/weight_push_s"),
            "weight_bytes": metrics.get(f"{MODE}/weight_bytes"),
        }
        manager.close()
        tq.close()
        ray.shutdown()
    finally:
        server.stop()
    check.summary["skipped"].append(
        f"verl GRPO steps ({STEPS} per phase, float32 and bfloat16): verl 0.9.1 runs no FSDP step on CPU"
    )
    check.write()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="the GPU phases to run, in order [float32,bfloat16]",
    )
    parser.add_argument(
        "--verl-timeout-s",
        type=float,
        default=420.0,
        help="how long one phase's verl run may take before it is killed [420]",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, "cpu-dry-run" if args.cpu_dry_run else "gpu")
    started = time.monotonic()
    try:
        import torch
        import transformers
        import verl

        check.summary["versions"] = {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "verl": verl.__version__,
            "cuda_devices": torch.cuda.device_count(),
        }
        if not args.cpu_dry_run and not torch.cuda.is_available():
            check.expect(False, "a CUDA GPU is visible (use --cpu-dry-run without one)")
            return 1
        from trainer_client.toy import build_toy

        toy = build_toy(args.out / "toy", seed=0)
        if args.cpu_dry_run:
            dry_run(check, toy, args.out / "dry")
        else:
            for dtype in args.dtypes.split(","):
                gpu_phase(check, toy, args.out / dtype, dtype, args.verl_timeout_s)
    except Exception:  # noqa: BLE001 - recorded as a failed check, with its traceback
        check.expect(False, "no stage raised:\n" + traceback.format_exc())
    finally:
        check.summary["wall_s"] = round(time.monotonic() - started, 1)
        check.write()
    print(f"summary: {args.out / 'summary.json'} ({'passed' if check.passed else 'FAILED'})")
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
