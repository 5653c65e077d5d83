"""The trainer side of adaptive-rollout: what a trainer node installs and imports.

- `trainer_client.client`: `SamplerClient` / `AsyncSamplerClient` (group stream with
  credits, acks, reconnects, duplicate suppression, watchdog; config, stats, weights);
- `trainer_client.batch`: `BatchAssembler` / `collate` (groups -> padded training tensors);
- `trainer_client.grpo`: the reference GRPO trainer (`adaptive-rollout train`);
- `trainer_client.demo`: `adaptive-rollout demo`;
- `trainer_client.protocol`: the wire models shared with the server, and
  `trainer_client.wire` their msgpack encoding.

Nothing here imports the server or its dependencies (FastAPI, uvicorn, vLLM). Two opt-in
paths need more on the trainer, and import it only when used: `trainer_client.verl`
(verl) and `trainer_client.nccl`, the NCCL weight sender, which drives vLLM's own
trainer-side NCCL helpers (the sampler's vLLM workers speak vLLM's rendezvous) and so
imports vLLM when it connects. Names are loaded lazily, so `import trainer_client` stays
cheap:

    from trainer_client import SamplerClient
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SamplerClient": "trainer_client.client",
    "AsyncSamplerClient": "trainer_client.client",
    "SamplerError": "trainer_client.client",
    "SamplerUnavailable": "trainer_client.client",
    "SamplerHTTPError": "trainer_client.client",
    "EngineFailed": "trainer_client.client",
    "BatchAssembler": "trainer_client.batch",
    "TrainBatch": "trainer_client.batch",
    "GRPOTrainer": "trainer_client.grpo",
    "TrainConfig": "trainer_client.grpo",
    "Group": "trainer_client.protocol",
    "Sample": "trainer_client.protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
