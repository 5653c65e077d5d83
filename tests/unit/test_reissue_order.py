"""Re-issued waves go first: the wave router's FIFO order, shown without timing.

Engines are only bookkeeping (an index, a load, a state), so the order in which waiting
waves get an engine is exact.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sampler_service.fleet.routing import WaveRouter

CAP = 16


@dataclass(eq=False)
class _Engine:
    index: int
    inflight: int = 0
    state: str = "ok"


def _router(engines: int) -> tuple[WaveRouter[_Engine], list[_Engine]]:
    pool = [_Engine(i) for i in range(engines)]

    def charge(engine: _Engine, n: int) -> None:
        engine.inflight += n

    router = WaveRouter(lambda: pool, lambda e: e.state == "ok", charge, max_inflight=CAP)
    return router, pool


async def _settle() -> None:
    """Let every woken waiter run (a granted wave resumes a few loop turns later)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def _waiting(
    router: WaveRouter[_Engine], order: list[str], name: str, key: int, reissue: bool = False
) -> asyncio.Task[_Engine]:
    task = asyncio.create_task(router.acquire(key, 8, reissue))
    task.add_done_callback(lambda _: order.append(name))
    await _settle()
    assert not task.done(), name
    return task


async def test_reissued_waves_jump_ahead_of_fresh_waves_in_their_own_order() -> None:
    router, (engine,) = _router(1)
    await router.acquire(1, 8)
    await router.acquire(2, 8)  # full: 16 of 16
    order: list[str] = []
    tasks = [
        await _waiting(router, order, "fresh-a", 3),
        await _waiting(router, order, "fresh-b", 4),
        await _waiting(router, order, "reissued-a", 5, reissue=True),
        await _waiting(router, order, "fresh-c", 6),
        await _waiting(router, order, "reissued-b", 7, reissue=True),
    ]
    for _ in tasks:  # one wave finishes at a time: one slot of 8
        router.release(engine, 8)
        await _settle()
    await asyncio.gather(*tasks)
    assert order == ["reissued-a", "reissued-b", "fresh-a", "fresh-b", "fresh-c"]
    assert engine.inflight == 16 and not router.queue


async def test_a_reissued_wave_may_exceed_the_cap_by_one_wave() -> None:
    router, (engine,) = _router(1)
    await router.acquire(1, 12)  # 12 of 16: a fresh wave of 8 does not fit
    order: list[str] = []
    fresh = await _waiting(router, order, "fresh", 2)
    # A re-issued one does (20 of 16), ahead of the fresh wave that was waiting...
    assert await router.acquire(3, 8, reissue=True) is engine
    assert engine.inflight == 20
    # ...but only one wave over the cap.
    second = await _waiting(router, order, "reissued", 4, reissue=True)
    router.release(engine, 12)  # 8 of 16: the re-issued one first, then nothing fits
    await _settle()
    assert order == ["reissued"] and engine.inflight == 16 and not fresh.done()
    router.release(engine, 8)
    await asyncio.gather(fresh, second)
    assert order == ["reissued", "fresh"]


async def test_a_reissued_wave_moves_to_the_engine_with_room() -> None:
    router, (a, b) = _router(2)
    assert await router.acquire(1, 8) is a  # prompt 1 ran on engine 0
    assert await router.acquire(2, 16) is b  # engine 1 full
    a.state = "recovering"  # engine 0 failed: its wave is re-issued
    router.release(a, 8)
    order: list[str] = []
    fresh = await _waiting(router, order, "fresh", 3)
    reissued = await _waiting(router, order, "reissued", 1, reissue=True)
    router.release(b, 8)
    await _settle()
    assert order == ["reissued"] and await reissued is b
    router.release(b, 16)
    assert await fresh is b
