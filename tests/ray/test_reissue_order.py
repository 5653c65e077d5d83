"""Re-issued waves go first, through the pool: a recovering replica takes none, and a
re-issued wave moves to the replica with room (no cluster). The router's own order is
tests/unit/test_reissue_order.py's.

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
