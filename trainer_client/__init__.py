"""The trainer side of adaptive-rollout: what a trainer node installs and imports.

- `trainer_client.client`: `SamplerClient` / `AsyncSamplerClient` (group stream with
  credits, acks, reconnects, duplicate suppression, watchdog; config, stats, weights),
  twin I/O shells over `trainer_client.client_state`; their errors are
  `trainer_client.exceptions`;
- `trainer_client.contract`: what the server imports too (the wire models, their msgpack
  codec, the flag builder, the dtype table);
- `trainer_client.batch`: `BatchAssembler` / `collate` (groups -> padded training tensors);
- `trainer_client.grpo`: the reference GRPO trainer (`adaptive-rollout train`);
- `trainer_client.demo`, `trainer_client.toy`: `adaptive-rollout demo` and its toy task.

Nothing here imports the server or its dependencies (FastAPI, uvicorn, vLLM). The core
install (no extra) holds what the clients and the contract need; the reference trainer
needs the `[trainer]` extra (torch, transformers). Two opt-in paths need more on the
trainer, and import it only when used: `trainer_client.verl` (verl) and
`trainer_client.nccl`, the NCCL weight sender, which drives vLLM's own trainer-side NCCL
helpers (the sampler's vLLM workers speak vLLM's rendezvous) and so imports vLLM when it
connects. Names are loaded lazily, so `import trainer_client` stays cheap:

    from trainer_client import SamplerClient
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SamplerClient": "trainer_client.client",
    "AsyncSamplerClient": "trainer_client.client",
    "SamplerError": "trainer_client.exceptions",
    "SamplerUnavailable": "trainer_client.exceptions",
    "SamplerHTTPError": "trainer_client.exceptions",
    "EngineFailed": "trainer_client.exceptions",
    "InvalidRequest": "trainer_client.exceptions",
    "AuthError": "trainer_client.exceptions",
    "NotFound": "trainer_client.exceptions",
    "ConflictError": "trainer_client.exceptions",
    "PayloadTooLarge": "trainer_client.exceptions",
    "ServerError": "trainer_client.exceptions",
    "BatchAssembler": "trainer_client.batch",
    "TrainBatch": "trainer_client.batch",
    "GRPOTrainer": "trainer_client.grpo",
    "TrainConfig": "trainer_client.grpo",
    "Group": "trainer_client.contract.protocol",
    "Sample": "trainer_client.contract.protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
