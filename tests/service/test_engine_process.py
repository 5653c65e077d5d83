"""The hf backend in its own process: the same answers as in-process, errors that cross
the boundary as themselves, a cancel that reaches the child's rows, and a dead engine
that fails calls instead of hanging them."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from support import endless
from transformers import AutoTokenizer

from sampler_service.backends.base import SamplingParams, as_list
from sampler_service.backends.engine_process import EngineProcess, EngineProcessDied
from sampler_service.backends.hf import HFBackend
from sampler_service.weights.types import WeightsRejected
from sampler_service.weights.vetting import vet_weight_file

pytestmark = pytest.mark.timeout(180)

SEEDED = SamplingParams(temperature=1.0, max_tokens=12, seed=7)


async def test_same_answers_scores_and_weight_loads_as_in_process(toy: Any) -> None:
    local = HFBackend(toy.model_dir)
    remote = EngineProcess(functools.partial(HFBackend, toy.model_dir), torch_threads=1)
    await local.start()
    await remote.start()
    try:
        assert (
            remote.weight_specs() == local.weight_specs() and remote.model_name == local.model_name
        )
        prompt = list(AutoTokenizer.from_pretrained(toy.model_dir)("12+34=")["input_ids"])
        a = await local.generate(prompt, 3, SEEDED)
        b = await remote.generate(prompt, 3, SEEDED)
        # The same answers, crossing the pipe packed (int32 ids, float32 logprobs).
        assert all(c.token_ids.dtype == np.int32 for c in b)
        assert all(c.logprobs.dtype == np.float32 for c in b)
        assert [c.token_ids for c in a] == [as_list(c.token_ids) for c in b]
        assert [c.text for c in a] == [c.text for c in b] and all(c.text for c in b)
        assert [c.logprobs for c in a] == [as_list(c.logprobs) for c in b]
        response = a[0].token_ids
        assert await remote.score(prompt, response, 1.0) == await local.score(prompt, response, 1.0)

        gen = torch.Generator().manual_seed(0)
        specs = local.weight_specs()
        name = "lm_head.weight" if "lm_head.weight" in specs else next(iter(specs))
        shape = specs[name].shape
        upload = safetensors.torch.save({name: 0.05 * torch.randn(*shape, generator=gen)})
        tensors = vet_weight_file(upload, specs)
        await local.load_weights(tensors, 5)
        await remote.load_weights(tensors, 5)
        assert remote.policy_version == 5
        after = await remote.score(prompt, response, 1.0)
        assert after == await local.score(prompt, response, 1.0)
        assert after != await remote.score(prompt, response, 0.5)
        assert (await remote.generate(prompt, 1, SEEDED))[0].policy_version == 5

        # Refusals and bad requests arrive as the backend's own exceptions.
        with pytest.raises(WeightsRejected, match=name):
            await remote.load_weights({name: torch.zeros(3, 3)}, 6)
        assert remote.policy_version == 5
        with pytest.raises(ValueError, match="n must be >= 1"):
            await remote.generate(prompt, 0, SEEDED)
        assert remote.health().ok
    finally:
        await local.close()
        await remote.close()
    assert not remote.health().ok


async def test_a_killed_engine_fails_waiting_and_later_calls(toy: Any, tmp_path: Path) -> None:
    import asyncio

    remote = EngineProcess(
        functools.partial(HFBackend, endless(toy.model_dir, tmp_path / "endless"))
    )
    await remote.start()
    try:
        running = asyncio.create_task(
            remote.generate([3, 4, 5], 8, SamplingParams(max_tokens=100_000))
        )
        await asyncio.sleep(1.0)
        assert not running.done()
        os.kill(remote.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessDied, match="exit code -9"):
            await asyncio.wait_for(running, 30)
        with pytest.raises(EngineProcessDied, match="exit code -9"):
            await remote.generate([3, 4, 5], 1, SEEDED)
        health = remote.health()
        assert not health.ok and "exit code -9" in health.detail["error"]
    finally:
        await remote.close()


async def test_a_cancel_reaches_the_rows_in_the_child(toy: Any, tmp_path: Path) -> None:
    """Greedy twins of one wave in the child: the cancelled one stops decoding there, and
    comes back with the tokens it had, a prefix of its twin's."""
    import asyncio

    remote = EngineProcess(
        functools.partial(HFBackend, endless(toy.model_dir, tmp_path / "endless")),
        torch_threads=1,
    )
    await remote.start()
    try:
        assert remote.cancels_answers
        wave = remote.wave([3, 4, 5], 2, SamplingParams(temperature=0, max_tokens=2000))
        await asyncio.sleep(1.0)  # the child's batch runs
        await wave.cancel([1])
        answers = dict([pair async for pair in wave])
        cut, twin = as_list(answers[1].token_ids), as_list(answers[0].token_ids)
        assert answers[1].finish_reason == "abort" and answers[0].finish_reason == "length"
        assert 0 < len(cut) < len(twin) == 2000 and cut == twin[: len(cut)]
        # A reader that leaves stops its rows too: a million tokens would take hours.
        left = asyncio.create_task(remote.generate([3, 4], 2, SamplingParams(max_tokens=10**6)))
        await asyncio.sleep(1.0)
        left.cancel()
        assert len(await asyncio.wait_for(remote.generate([3], 1, SEEDED), 60)) == 1
    finally:
        await remote.close()


async def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    remote = EngineProcess(functools.partial(HFBackend, tmp_path / "no-such-model"))
    with pytest.raises(OSError, match="no-such-model"):
        await remote.start()
    await remote.close()
