"""Small asyncio helpers shared by the scheduler, the service and the engine pools."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for `event` at most `timeout` seconds; True if it was set.

    Uses asyncio.timeout rather than asyncio.wait_for: on Python 3.11, wait_for can
    swallow a cancellation that races with the inner wait finishing, which left a
    cancelled scheduler loop running forever.
    """
    try:
        async with asyncio.timeout(max(timeout, 0.0)):
            await event.wait()
    except TimeoutError:
        return False
    return True


class TaskSet:
    """Background tasks held until they end: the event loop keeps only a weak reference
    to a task, so one nobody holds can vanish before it finishes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, _T], name: str | None = None) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel(self) -> None:
        """Cancel every task and wait until each has ended."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
