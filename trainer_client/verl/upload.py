"""Trainer weights -> sampler: named tensors made into a new policy version.

`WeightPusher` takes (name, tensor) pairs named as the Hugging Face checkpoint names them
(what verl's training engines yield from ``get_per_tensor_param``, what ``state_dict()``
of a transformers model holds) and makes the sampler serve them as a new policy version:

- ``upload``: a safetensors body to PUT /v1/weights, streamed from the host tensors (or
  from a file when `weights_dir` is set);
- ``path``: a safetensors file written under `weights_dir` (shared storage the sampler
  can read), then POST /v1/weights/load.

Floating tensors are cast to the dtype the sampler serves in before they are copied to
the host, and the body is produced chunk by chunk from those copies. Needs torch, not verl.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer_client.client import SamplerClient
from trainer_client.contract.dtypes import SERVING_DTYPES, safetensors_code, torch_dtype
from trainer_client.uploads import WeightStream, unique_tensors
from trainer_client.verl.settings import MODE, SamplerSettings

log = logging.getLogger(__name__)


_CHUNK = 1 << 20


def to_host(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A host copy of `tensor`, floating tensors cast to `dtype` first, on their device.

    Casting before the copy keeps one host copy in the serving dtype (half of float32 for
    bfloat16) and moves half the bytes over PCIe; the copy is always a new tensor, since
    verl's weight generator may reuse its buffers.
    """
    t = tensor.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
        return t.to("cpu").contiguous() if t.device.type != "cpu" else t.contiguous()
    return t.to("cpu", copy=True).contiguous()


def safetensors_stream(tensors: list[tuple[str, torch.Tensor]]) -> WeightStream:
    """These host tensors as a safetensors file produced chunk by chunk from their own
    memory: nothing but the header and one chunk is ever copied."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": safetensors_code(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    head = struct.pack("<Q", len(encoded)) + encoded

    def chunks() -> Iterator[bytes]:
        yield head
        for _, t in tensors:
            if t.numel() == 0:
                continue
            raw = t.reshape(-1).view(torch.uint8).numpy().data
            for start in range(0, len(raw), _CHUNK):
                yield bytes(raw[start : start + _CHUNK])

    return WeightStream(length=len(head) + offset, chunks=chunks)


class WeightPusher:
    """Pushes named tensors to the sampler as increasing policy versions.

    Peak host memory: the model once, in the dtype weights travel in (`wire_dtype`: 2.0 GB
    per billion parameters in bfloat16, 4.0 in float32), plus one 1 MiB chunk; the upload
    and the file of ``path`` mode are written from those tensors directly.
    """

    def __init__(self, settings: SamplerSettings, client: SamplerClient | None = None) -> None:
        self.settings = settings
        self._client = client
        self._wire_dtype: torch.dtype | None = None
        self.last_version: int | None = None

    @property
    def client(self) -> SamplerClient:
        if self._client is None:
            self._client = SamplerClient(self.settings.url, **self.settings.client_kwargs())
        return self._client

    def wire_dtype(self) -> torch.dtype | None:
        """The dtype floating weights travel in: `settings.dtype`, or (``auto``) the one the
        sampler serves in (GET /v1/stats), asked once; None keeps the trainer's dtype."""
        if self.settings.dtype != "auto":
            return torch_dtype(self.settings.dtype)
        if self._wire_dtype is None:
            served = (self.client.stats().get("engine") or {}).get("dtype")
            if served in SERVING_DTYPES:
                self._wire_dtype = torch_dtype(served)
            else:
                log.warning("sampler reports no serving dtype (%r); weights keep theirs", served)
        return self._wire_dtype

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
        *,
        on_host: bool = False,
    ) -> dict[str, float]:
        """Make the sampler serve these weights as policy `version`; returns metrics for verl's logger.

        `on_host`: the tensors are already this pusher's own host copies in `wire_dtype`
        (the checkpoint engine makes them as verl's generator yields), so none is copied.

        `version` must be above what the sampler serves (`ConflictError` otherwise); the
        trainers map verl steps onto versions with `trainer_client.verl.session.VersionMap`.
        """
        if self.settings.weight_sync == "none":
            return {}
        started = time.monotonic()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if not on_host:
            dtype = self.wire_dtype()
            items = [(name, to_host(t, dtype)) for name, t in items]
        tensors = unique_tensors(items)
        collected = time.monotonic()
        stream = safetensors_stream(tensors)
        if self.settings.weight_sync == "path" or self.settings.weights_dir:
            path = self._write(stream, version)
            if self.settings.weight_sync == "path":
                reply = self.client.load_weights(path, version)
            else:
                reply = self.client.push_weights(path, version)
        else:
            reply = self.client.push_weights(stream, version)
        self.last_version = reply.policy_version
        done = time.monotonic()
        log.info(
            "pushed %d tensors (%.0f MB) as policy version %d in %.1fs",
            len(tensors),
            stream.length / 1e6,
            version,
            done - started,
        )
        return {
            f"{MODE}/policy_version": float(reply.policy_version),
            f"{MODE}/weight_push_s": done - started,
            f"{MODE}/weight_gather_s": collected - started,
            f"{MODE}/weight_load_s": float(reply.load_s),
            f"{MODE}/weight_bytes": float(stream.length),
        }

    def _write(self, stream: WeightStream, version: int) -> Path:
        directory = Path(self.settings.weights_dir or ".")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"policy_v{version:08d}.safetensors"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as fh:
            for chunk in stream.chunks():
                fh.write(chunk)
        os.replace(tmp, path)
        keep = max(1, int(self.settings.keep_weight_files))
        old = sorted(directory.glob("policy_v*.safetensors"))[:-keep]
        for stale in old:
            stale.unlink(missing_ok=True)
        return path

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
