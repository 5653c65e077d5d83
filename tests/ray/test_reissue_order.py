"""Re-issued waves go first: the pool's FIFO order, shown without timing (no cluster).

The real `RayPoolBackend` routing (`_acquire`, `_dispatch`, `_release`) on replicas that
are only bookkeeping: nothing is called on them, so the order in which waiting waves get
a replica is exact.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from sampler_service.backends.ray_pool import RayPoolBackend, _Replica
from sampler_service.config import ReplicaSettings

pytestmark = pytest.mark.ray

CAP = 16


def _pool(replicas: int) -> RayPoolBackend:
    pool = RayPoolBackend(
        lambda: None,  # type: ignore[arg-type, return-value]
        ReplicaSettings(count=replicas, max_inflight=CAP),
        instance_id="order",
    )
    pool._replicas = [
        _Replica(i, f"r{i}", None, state="ok", version=0, last_ok=time.monotonic())
        for i in range(replicas)
    ]
    return pool


async def _settle() -> None:
    """Let every woken waiter run (a granted wave resumes a few loop turns later)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def _waiting(pool: RayPoolBackend, order: list[str], name: str, key: int, **kw: bool):
    task = asyncio.create_task(pool._acquire(key, 8, **kw))
    task.add_done_callback(lambda _: order.append(name))
    await _settle()
    assert not task.done(), name
    return task


async def test_reissued_waves_jump_ahead_of_fresh_waves_in_their_own_order() -> None:
    pool = _pool(1)
    rep = pool._replicas[0]
    await pool._acquire(1, 8)
    await pool._acquire(2, 8)  # full: 16 of 16
    order: list[str] = []
    tasks = [
        await _waiting(pool, order, "fresh-a", 3),
        await _waiting(pool, order, "fresh-b", 4),
        await _waiting(pool, order, "reissued-a", 5, reissue=True),
        await _waiting(pool, order, "fresh-c", 6),
        await _waiting(pool, order, "reissued-b", 7, reissue=True),
    ]
    for _ in tasks:  # one wave finishes at a time: one slot of 8
        pool._release(rep, 8)
        await _settle()
    await asyncio.gather(*tasks)
    assert order == ["reissued-a", "reissued-b", "fresh-a", "fresh-b", "fresh-c"]
    assert rep.inflight == 16 and not pool._router.queue


async def test_a_reissued_wave_may_exceed_the_cap_by_one_wave() -> None:
    pool = _pool(1)
    rep = pool._replicas[0]
    await pool._acquire(1, 12)  # 12 of 16: a fresh wave of 8 does not fit
    order: list[str] = []
    fresh = await _waiting(pool, order, "fresh", 2)
    # A re-issued one does (20 of 16), ahead of the fresh wave that was waiting...
    assert await pool._acquire(3, 8, reissue=True) is rep
    assert rep.inflight == 20
    # ...but only one wave over the cap.
    second = await _waiting(pool, order, "reissued", 4, reissue=True)
    pool._release(rep, 12)  # 8 of 16: the re-issued one first, then nothing fits
    await _settle()
    assert order == ["reissued"] and rep.inflight == 16 and not fresh.done()
    pool._release(rep, 8)
    await asyncio.gather(fresh, second)
    assert order == ["reissued", "fresh"]


async def test_a_reissued_wave_moves_to_the_replica_with_room() -> None:
    pool = _pool(2)
    a, b = pool._replicas
    assert await pool._acquire(1, 8) is a  # prompt 1 ran on replica 0
    assert await pool._acquire(2, 16) is b  # replica 1 full
    a.state = "recovering"  # replica 0 failed: its wave is re-issued
    pool._release(a, 8)
    order: list[str] = []
    fresh = await _waiting(pool, order, "fresh", 3)
    reissued = await _waiting(pool, order, "reissued", 1, reissue=True)
    pool._release(b, 8)
    await _settle()
    assert order == ["reissued"] and await reissued is b
    pool._release(b, 16)
    assert await fresh is b
