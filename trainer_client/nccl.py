"""Trainer side of the NCCL weight transfer to a sampler running `--backend vllm` on GPUs.

For large models, uploading a safetensors file per step is slow; instead the trainer's
rank 0 joins one NCCL group with the sampler's vLLM workers and broadcasts its parameters
GPU to GPU, the way vLLM's RLHF examples do. This module drives vLLM's own trainer-side
engine (`NCCLTrainerWeightTransferEngine`) through the sampler's HTTP control plane
(its `/v1/weights/nccl/*` routes), so the sampler pauses
sampling, receives, versions the weights and resumes, as for a file upload.

    sender = NCCLWeightSender("http://sampler:8000", api_key=key,
                              master_address="10.0.0.5", master_port=29600)
    sender.connect(model)          # once: forms the NCCL group (trainer = rank 0)
    ...
    sender.send(version=step)      # after each optimizer step
    sender.close()

Needs a CUDA GPU on the trainer and vLLM installed there (for its NCCL wrapper and packed
broadcast); nothing here is imported until `connect`. `master_address` must be an address
of this trainer host that the sampler's GPU workers can reach, and `master_port` a free
port on it. The sampler's workers sit on other GPUs than the trainer (NCCL allows one
rank per GPU in a group).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from trainer_client.contract.dtypes import FLOAT_NAMES

log = logging.getLogger(__name__)


class NCCLTransferError(RuntimeError):
    """The sampler refused a transfer, or the trainer's weights do not fit its model."""


class ServiceWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol over the sampler's HTTP API.

    vLLM's trainer engine calls start / update / finish around its broadcast; the
    sampler runs a whole round (pause, start, receive, finish, version, resume) inside
    one `update` request, so start and finish are no-ops here and `version` must be set
    before each round.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.version: int | None = None

    def info(self) -> dict[str, Any]:
        return self._call("GET", "")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init", {"init_info": init_info})

    def start_weight_update(self) -> None:
        return None

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if self.version is None:
            raise NCCLTransferError("set the policy version before sending weights")
        if isinstance(
            update_info, list
        ):  # one entry per data-parallel worker; dense NCCL sends one
            update_info = update_info[0]
        self._call("POST", "/update", {"update_info": update_info, "version": self.version})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        return None

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("POST", "/shutdown")

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self._http.request(method, "/v1/weights/nccl" + path, json=body)
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                message = f"{error['code']}: {error['message']}"
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise NCCLTransferError(
                f"{method} /v1/weights/nccl{path} -> {response.status_code} {message}"
            )
        return response.json() if response.content else {}


def check_metadata(meta: list[tuple[str, str, tuple[int, ...]]], info: dict[str, Any]) -> None:
    """Raise NCCLTransferError unless (name, dtype, shape) triples fit the sampler's model.

    Checked before any broadcast: a sampler that refuses mid-round would leave this
    trainer blocked inside NCCL.
    """
    tensors = info["tensors"]
    names = [m[0] for m in meta]
    missing = sorted(set(info.get("required", tensors)) - set(names))
    if missing:
        raise NCCLTransferError(
            f"the sampler's model needs every tensor; {len(missing)} missing, e.g. {missing[:3]}"
        )
    for name, dtype, shape in meta:
        if name not in tensors:
            raise NCCLTransferError(
                f"tensor {name!r}: the sampler's model has no tensor of this name"
            )
        if list(shape) != list(tensors[name][0]):
            raise NCCLTransferError(
                f"tensor {name!r}: shape {list(shape)} != sampler's {tensors[name][0]}"
            )
        if dtype not in FLOAT_NAMES:
            raise NCCLTransferError(f"tensor {name!r}: dtype {dtype} is not floating")


class NCCLWeightSender:
    """Broadcasts a trainer's weights into the sampler's vLLM workers over NCCL."""

    def __init__(
        self,
        base_url: str,
        *,
        master_address: str,
        master_port: int,
        api_key: str | None = None,
        packed: bool = True,
        timeout: float = 600.0,
    ) -> None:
        self.client = ServiceWeightSyncClient(base_url, api_key=api_key, timeout=timeout)
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self._engine: Any = None
        self._source: Any = None
        self._info: dict[str, Any] = {}

    def connect(self, source: Any) -> None:
        """Form the NCCL group with the sampler's workers; `source` is the trainer's
        `torch.nn.Module` (its `named_parameters()` use checkpoint names, as a Hugging
        Face model's do) or a vLLM `WeightSource`."""
        try:  # optional trainer-side dependencies: the core install has no torch or vLLM
            import torch
            from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )
        except ImportError as exc:
            raise NCCLTransferError(
                "NCCL weight transfer drives vLLM's trainer-side NCCL engine on torch: "
                "install both on the trainer (pip install 'adaptive-rollout[vllm]'), or push "
                f"weights as files instead ({exc})"
            ) from exc

        if not torch.cuda.is_available():
            raise NCCLTransferError("NCCL weight transfer needs a CUDA GPU on the trainer")
        self._source = source if isinstance(source, WeightSource) else ModuleSource(source)
        self._info = self.client.info()
        if not self._info.get("enabled"):
            raise NCCLTransferError(
                "the sampler's vLLM engine has no NCCL weight transfer configured"
            )
        self._check()
        ranks = int(self._info["inference_ranks"])
        init = NCCLTrainerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=1 + ranks,
            packed=self.packed,
            rank=0,
        )
        self._engine = NCCLTrainerWeightTransferEngine.trainer_init(
            init, client=self.client, source=self._source
        )
        log.info("NCCL weight transfer connected: trainer + %d sampler ranks", ranks)

    def send(self, version: int) -> None:
        """Broadcast every parameter; returns once the sampler serves them as `version`."""
        if self._engine is None:
            raise NCCLTransferError("call connect() first")
        info = self.client.info()
        if info.get("group") == "stale":  # a sampler with engine replicas, one restarted
            raise NCCLTransferError(
                "the sampler's NCCL group is stale (an engine replica restarted or joined "
                "since it was formed): call close() and connect() again"
            )
        current = int(info["policy_version"])
        if version <= current:
            raise NCCLTransferError(f"version {version} must be greater than the served {current}")
        self._check()
        self.client.version = version
        self._engine.send_weights()

    def close(self) -> None:
        if self._engine is not None:
            try:
                self.client.shutdown_weight_transfer_engine()
            finally:
                self._engine.shutdown()
                self._engine = None
        self.client.close()

    def _check(self) -> None:
        meta = [
            (m.name, str(m.dtype).removeprefix("torch."), tuple(m.shape))
            for m in self._source.metadata()
        ]
        check_metadata(meta, self._info)
