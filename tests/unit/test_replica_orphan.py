"""A replica that hears from no sampler for its window asks to exit; calls keep it alive.

The actor body without Ray: the exit request (an actor task calling exit_actor) is
recorded instead. tests/ray checks the real exit on a cluster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sampler_service.backends.base import Backend, Completion, Wave, WaveRequest, WholeWave
from sampler_service.backends.ray.replica import Replica
from sampler_service.weights.types import TensorSpec

WINDOW_S = 0.5


class Watched(Replica):
    def __init__(self, factory: Callable[[], Backend] | None = None) -> None:
        self.exit_requested = threading.Event()
        super().__init__(factory or Stub, 0, torch_threads=0, orphan_s=WINDOW_S)

    def _request_exit(self) -> None:
        self.exit_requested.set()

    def _kill_self(self) -> None:
        pass


async def test_probes_keep_a_replica_alive_and_silence_ends_it() -> None:
    replica = Watched()
    for _ in range(10):  # 2 windows of probes, one every 0.1 s
        assert (await replica.health())["started"] is False
        silent_from = time.monotonic()
        time.sleep(0.1)
        assert not replica.exit_requested.is_set()
    assert replica.exit_requested.wait(10 * WINDOW_S)
    assert time.monotonic() - silent_from >= WINDOW_S


async def test_the_exit_is_called_off_when_a_sampler_came_back_meanwhile() -> None:
    replica = Watched()
    assert replica.exit_requested.wait(10 * WINDOW_S)
    replica.exit_requested.clear()
    await replica.health()  # a sampler re-attaches just as the watchdog fired
    assert await replica.orphan_exit() is False
    # Watched again from then on: silence asks again.
    assert replica.exit_requested.wait(10 * WINDOW_S)


async def test_an_engine_load_longer_than_the_window_is_not_silence() -> None:
    replica = Watched()
    replica._loading_engine = True
    time.sleep(3 * WINDOW_S)
    assert not replica.exit_requested.is_set()


class Stub(Backend):
    name = "stub"
    model_name = "stub"
    policy_version = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def issue(self, request: WaveRequest) -> Wave:
        return WholeWave(self._answers(request.n), request.n)

    async def _answers(self, n: int) -> list[Completion]:
        return [Completion([1], [0.0], "", "length") for _ in range(n)]

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return {}

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        pass


async def test_a_reattaching_sampler_sets_the_window() -> None:
    replica = Watched(Stub)
    await replica.start(orphan_s=60.0)  # the new sampler's window: a minute
    time.sleep(3 * WINDOW_S)
    assert not replica.exit_requested.is_set()
    assert (await replica.start(orphan_s=WINDOW_S))["attached"] is True
    assert replica.exit_requested.wait(10 * WINDOW_S)
