"""The pool routes through the wave router (no cluster): only replicas in state `ok` take
waves, re-issued ones too, and a replica is charged with what it runs. The router's
re-issue order is tests/unit/test_reissue_order.py's.

The real `RayPoolBackend` routing (`_acquire`, `_release`) on replicas that are only
bookkeeping: nothing is called on them.
"""

from __future__ import annotations

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


async def test_the_pool_routes_waves_to_ok_replicas_and_charges_them() -> None:
    pool = _pool(2)
    a, b = pool._replicas
    a.state = "recovering"  # replica 0 failed: no wave goes to it, re-issued ones neither
    assert await pool._acquire(1, 8, reissue=True) is b
    assert await pool._acquire(2, 8) is b
    assert (a.inflight, b.inflight) == (0, 16)
    pool._release(b, 8)
    assert b.inflight == 8 and not pool._router.queue
