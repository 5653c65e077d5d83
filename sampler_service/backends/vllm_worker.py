"""Worker extension injected into every vLLM worker process (`worker_extension_cls`).

The sampler's `VLLMBackend` calls these methods through `AsyncLLM.collective_rpc`, so
they run inside each worker (one per GPU, or the CPU worker) next to the live model.
Tensors never travel through the RPC channel: the backend writes them to a safetensors
file and sends a plan of (tensor name, file path) pairs; each worker reads the tensors
it needs from the file (memory-mapped) and streams them into the model.

Loading goes through `model_runner.reload_weights`, not `model.load_weights`: the CPU
build repacks linear weights after the first load (their parameters become
`torch.Size([0])`), and quantized or otherwise post-processed layers need the same
post-processing again; `reload_weights` restores each layer to checkpoint layout, loads,
and redoes that processing layer by layer.

This module is imported by vLLM in the worker processes; keep it free of sampler imports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

# The methods get a prefix so they can never shadow a vLLM Worker method.
PREFIX = "adaptive_rollout_"


class WeightLoaderExtension:
    """Mixed into vLLM's Worker class; `self.model_runner` is the worker's runner."""

    model_runner: Any  # set by vLLM's Worker, which this class is mixed into

    def adaptive_rollout_load_weights(self, plan: list[tuple[str, str]]) -> dict[str, Any]:
        """Stream the named tensors from their files into the model, in plan order.

        `plan` lists (checkpoint tensor name, safetensors path). The order matters for
        memory: vLLM processes a layer as soon as all its tensors arrived, so a plan in
        checkpoint order keeps at most a layer or two of extra buffers alive.
        """
        started = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=_read_plan(plan))
        return {"tensors": len(plan), "seconds": time.perf_counter() - started}

    def adaptive_rollout_param_count(self) -> int:
        """How many parameters the live model has (a cheap liveness probe for tests)."""
        return sum(1 for _ in self.model_runner.model.named_parameters())


def _read_plan(plan: list[tuple[str, str]]) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    try:
        for name, path in plan:
            handle = handles.get(path)
            if handle is None:
                handle = handles[path] = safe_open(path, framework="pt", device="cpu")
            yield name, handle.get_tensor(name)
    finally:
        handles.clear()
