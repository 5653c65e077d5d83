"""GPU checks of the vLLM backend and the NCCL weight transfer (marker `gpu`).

Run on a GPU machine by deploy/gpu_checks/vllm_gpu_check.sh. They skip on CPU-only
machines. The NCCL test needs two GPUs: the trainer's rank and the sampler's vLLM worker
must sit on different devices (NCCL refuses two ranks of one group on one GPU). It runs
twice: into the in-process engine (`--backend vllm`) and into a `vllm serve` the sampler
drives over HTTP (`--backend http`).
"""

from __future__ import annotations

import math
import os
import time

import httpx
import pytest
from vllm_suite import LoopThread, ServeProcess

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.timeout(900)]


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 1, reason="needs a CUDA GPU")
def test_vllm_backend_on_cuda_matches_hf_and_reloads(toy) -> None:
    pytest.importorskip("vllm.v1.engine.async_llm")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from sampler_service.backends.base import SamplingParams
    from sampler_service.backends.hf import HFBackend
    from sampler_service.backends.vllm import VLLMBackend
    from trainer_client.toy import eval_rows

    tokenizer = AutoTokenizer.from_pretrained(str(toy.model_dir))
    runner = LoopThread()
    vllm = VLLMBackend(
        toy.model_dir,
        tokenizer=tokenizer,
        dtype="float32",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
    )
    hf = HFBackend(toy.model_dir, device="cuda", tokenizer=tokenizer)
    try:
        runner.run(vllm.start(), timeout=600)
        runner.run(hf.start())
        assert vllm.health().detail["nccl_weight_transfer"]
        prompts = [
            tokenizer(r["prompt"])["input_ids"]
            for d in ("add1", "add2", "mul")
            for r in eval_rows(d, 3, seed=0)
        ]
        greedy = SamplingParams(temperature=0.0, max_tokens=10)
        worst = 0.0
        for prompt in prompts:
            [v] = runner.run(vllm.generate(prompt, 1, greedy))
            [h] = runner.run(hf.generate(prompt, 1, greedy))
            assert v.token_ids == h.token_ids
            worst = max(worst, max(abs(a - b) for a, b in zip(v.logprobs, h.logprobs, strict=True)))
        print(f"CUDA greedy parity: max |logprob diff| {worst:.2e}")
        assert worst <= 1e-3
        prompt, answer = prompts[0], [5, 6, 1]
        before = runner.run(vllm.score(prompt, answer))
        state = load_file(str(toy.model_dir / "model.safetensors"))
        gen = torch.Generator().manual_seed(0)
        runner.run(
            vllm.load_weights(
                {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}, 1
            )
        )
        after = runner.run(vllm.score(prompt, answer))
        assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-2
        assert vllm.policy_version == 1
    finally:
        runner.run(hf.close())
        runner.run(vllm.close(), timeout=120)
        runner.close()


@pytest.mark.skipif(
    _cuda_devices() < 2, reason="NCCL transfer needs two GPUs (trainer and sampler)"
)
@pytest.mark.parametrize("backend", ["vllm", "http"])
def test_nccl_weight_transfer_into_the_service(toy, tmp_path, backend: str) -> None:
    """Trainer on cuda:0 broadcasts weights into the service's engine on GPU 1: in-process
    (`serve --backend vllm`), or a `vllm serve` started with --weight-transfer-config that
    `serve --backend http` drives through the server's own weight-transfer endpoints."""
    pytest.importorskip("vllm.v1.engine.async_llm")
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_client.launch import EngineServer, SamplerProcess, free_port
    from trainer_client.nccl import NCCLTransferError, NCCLWeightSender

    config = {
        "rule": "fixed",
        "group_size": 2,
        "n_max": 4,
        "wave_size": 2,
        "max_tokens": 6,
        "max_active_prompts": 4,
        "max_buffered_groups": 4,
    }
    engine: EngineServer | None = None
    server: SamplerProcess
    if backend == "http":
        engine = EngineServer(
            toy.model_dir,
            tmp_path / "vllm-serve.log",
            env={"CUDA_VISIBLE_DEVICES": "1"},
            args=(
                "--weight-transfer-config", '{"backend":"nccl"}',
                "--gpu-memory-utilization", "0.3",
            ),
        ).start()  # fmt: skip
        engine.wait_ready(600)
        server = SamplerProcess(
            toy.model_dir,
            toy.data_files,
            tmp_path / "state",
            config,
            tmp_path / "state.log",
            heartbeat_s=0.5,
            extra=["--backend", "http", "--engine-url", engine.url,
                   "--weights-dir", str(tmp_path / "weights")],
        )  # fmt: skip
        try:
            server.start(420)
        except BaseException:
            engine.stop()
            raise
    else:
        server = ServeProcess(
            toy,
            tmp_path / "state",
            config,
            extra=["--vllm-arg", "gpu_memory_utilization=0.3", "--vllm-arg", "dtype=float32"],
        )
        env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the server subprocess inherits this
        try:
            server.start()
        finally:
            if env_before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = env_before
    sender = None
    try:
        model = AutoModelForCausalLM.from_pretrained(str(toy.model_dir), dtype=torch.float32).to(
            "cuda:0"
        )
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # a zero model has uniform logits: every logprob is -ln(vocab)
        sender = NCCLWeightSender(server.url, master_address="127.0.0.1", master_port=free_port())
        sender.connect(model)
        started = time.monotonic()
        sender.send(version=1)
        print(f"NCCL round: {time.monotonic() - started:.2f}s")
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.get("/health").json()["policy_version"] == 1
            uniform = -math.log(model.config.vocab_size)
            seen = 0
            for _ in range(40):
                r = c.post(
                    "/v1/groups/lease", json={"max_groups": 4, "wait_s": 20, "consumer": "t"}
                )
                groups = r.json()["groups"]
                c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in groups]})
                for g in groups:
                    if g["policy_version_min"] >= 1:
                        for s in g["samples"]:
                            assert all(abs(lp - uniform) < 1e-3 for lp in s["logprobs"]), s[
                                "logprobs"
                            ]
                        seen += 1
                if seen >= 2:
                    break
            assert seen >= 2, "no groups sampled from the transferred weights"
        with pytest.raises(NCCLTransferError, match="greater"):
            sender.send(version=1)
    finally:
        if sender is not None:
            sender.close()
        server.stop()
        if engine is not None:
            engine.stop()
