"""The real scheduler on the simulated engine until every prompt has reached the engine:
what the scheduler asked of the engine, wave by wave (`SimBackend.requests`)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from bench import adaptive_sim, virtual_clock
from bench.sim_backend import EngineSpec, SimBackend, verify_reward_text
from sampler_service.config import SamplerConfig
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.finalize import MemorySink
from sampler_service.scheduler import Scheduler

T = TypeVar("T")
#: (prompt index, answers asked, their priorities) of every wave, in the order asked.
Waves = list[tuple[int, int, tuple[int, ...]]]


def waves_until_every_prompt_asked(
    pass_rates: Sequence[float],
    config: dict[str, Any],
    max_num_seqs: int,
    prepare: Callable[[Scheduler], T],
) -> tuple[Waves, T]:
    """One prompt per pass rate; `prepare(scheduler)` runs before the scheduler starts,
    and what it returns comes back with the waves."""
    prompts = len(pass_rates)

    async def main() -> tuple[Waves, T]:
        with tempfile.TemporaryDirectory() as tmp:
            data = adaptive_sim.write_dataset(Path(tmp), prompts)
            dataset = Dataset([data], _index_tokens, seed=0)
        engine = SimBackend(np.asarray(pass_rates), EngineSpec(max_num_seqs=max_num_seqs), seed=0)
        await engine.start()
        scheduler = Scheduler(
            backend=engine,
            dataset=dataset,
            verify=verify_reward_text,
            sink=MemorySink(),
            config=SamplerConfig(**config),
        )
        prepared = prepare(scheduler)
        scheduler.start()
        try:
            async with asyncio.timeout(1e6):
                while len({i for i, _, _ in engine.requests}) < prompts:
                    await asyncio.sleep(1.0)
        finally:
            await scheduler.stop()
            await engine.close()
        return list(engine.requests), prepared

    return virtual_clock.run(main())


def _index_tokens(row: PromptRow) -> None:
    """The benchmark's prompts: the prompt's index is its first token (the engine's key)."""
    row.token_ids = [int(row.id[1:]), 0, 0]
