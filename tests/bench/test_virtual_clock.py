"""The simulated-time event loop the adaptive-sampling benchmark runs on."""

from __future__ import annotations

import asyncio

import pytest

from bench.virtual_clock import SimulationDeadlock, VirtualTimeLoop, run
from sampler_service.aio import wait_event


def test_sleep_jumps_the_clock_without_waiting() -> None:
    async def main() -> float:
        await asyncio.sleep(3600.0)
        return asyncio.get_running_loop().time()

    # An hour of simulated time: in real time it would run past the test's timeout.
    assert run(main()) == pytest.approx(3600.0)


def test_timers_fire_in_order_at_their_simulated_times() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[str, float]] = []

        async def at(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            fired.append((name, loop.time()))

        await asyncio.gather(at("c", 3.0), at("a", 1.0), at("b", 2.5))
        return fired

    assert run(main()) == [("a", 1.0), ("b", 2.5), ("c", 3.0)]


def test_timeouts_and_event_waits_use_the_simulated_clock() -> None:
    async def main() -> tuple[bool, float, bool, float]:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        missed = await wait_event(event, 5.0)  # nobody sets it: times out after 5 s
        t_missed = loop.time()
        loop.call_later(2.0, event.set)
        hit = await wait_event(event, 10.0)
        return missed, t_missed, hit, loop.time()

    missed, t_missed, hit, t_hit = run(main())
    assert (missed, hit) == (False, True)
    assert t_missed == pytest.approx(5.0)
    assert t_hit == pytest.approx(7.0)


def test_work_at_one_instant_takes_no_simulated_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        for _ in range(1000):
            await asyncio.sleep(0)
        sum(range(100_000))  # real CPU work
        return loop.time()

    assert run(main(), start=42.0) == 42.0


def test_a_stuck_simulation_raises_instead_of_hanging() -> None:
    async def main() -> None:
        await asyncio.Event().wait()  # nothing will ever set it, and no timer is pending

    with pytest.raises(SimulationDeadlock):
        run(main())


def test_the_loop_is_a_regular_selector_loop() -> None:
    loop = VirtualTimeLoop()
    try:
        assert isinstance(loop, asyncio.SelectorEventLoop)
        assert loop.time() == 0.0
        loop.advance(1.5)
        assert loop.time() == 1.5
    finally:
        loop.close()
