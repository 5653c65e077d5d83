"""An hf engine that holds back waves for one prompt until the test opens a gate.

The pool's channel sends several waves in one Ray call and must still answer each as
soon as it finishes; a wave that cannot finish until the test says so shows that
without timing. The gate is a file (the engine runs in a Ray actor, another process);
`abort_all` aborts the held waves (GenerationAborted: a held wave has decoded nothing)
as it aborts the engine's own. A held wave is answered whole.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sampler_service.backends.base import (
    Completion,
    GenerationAborted,
    Wave,
    WaveRequest,
    WholeWave,
)
from sampler_service.backends.hf import HFBackend

#: Waves whose prompt starts with this token id wait for the gate.
GATED_TOKEN = 7


class GatedEngine(HFBackend):
    def __init__(self, model_dir: Path, gate: Path, **kw: Any) -> None:
        super().__init__(model_dir, **kw)
        self._gate = Path(gate)
        self._aborts = 0

    def issue(self, request: WaveRequest) -> Wave:
        if request.prompt_token_ids[0] != GATED_TOKEN:
            return super().issue(request)
        return WholeWave(self._held(request), request.n)

    async def _held(self, request: WaveRequest) -> list[Completion]:
        aborts = self._aborts
        while not self._gate.exists():
            if self._aborts != aborts:
                raise GenerationAborted("aborted while held at the gate")
            await asyncio.sleep(0.05)
        return await super().issue(request).answers()

    async def abort_all(self) -> int:
        self._aborts += 1
        return await super().abort_all()
