"""An hf engine that plays the vLLM backend's NCCL part, for the pool's fan-out on CPU.

Real NCCL needs GPUs. This engine answers the calls the vLLM backend answers (its
description, init, update, shutdown) without a transfer: init records the init info it got in
a JSON file (so the test sees each replica's rank offset), update serves the weights it
has under the new version. Everything around it (Ray actors, the pool's rank layout,
fan-out, restarts, the stale-group check) is the real code.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from sampler_service.backends.hf import HFBackend
from sampler_service.weights.types import NCCLDescription


class FakeNCCLEngine(HFBackend):
    def __init__(self, model_dir: Path, record_dir: Path, workers: int = 2, **kw: Any) -> None:
        super().__init__(model_dir, **kw)
        self._record_dir = Path(record_dir)
        self._workers = workers
        self._group: dict[str, Any] | None = None

    async def nccl_describe(self) -> NCCLDescription:
        specs = dict(self.weight_specs())
        return NCCLDescription(
            enabled=True, inference_ranks=self._workers, specs=specs, required=frozenset(specs)
        )

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        self._group = dict(init_info)
        record = {"pid": os.getpid(), "init_info": init_info}
        path = self._record_dir / f"init-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(record))

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        if self._group is None:
            raise RuntimeError("no NCCL group: init first")
        self._version = version

    async def nccl_shutdown(self) -> None:
        self._group = None
