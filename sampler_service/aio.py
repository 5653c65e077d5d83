"""Small asyncio helpers shared by the scheduler, the service and the engine pools."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

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


class TurnBatch(Generic[_T]):
    """Items added during one event-loop turn, handed to `flush` together once the turn
    ends: everything that happened at once (the waves asked for, the answers that came
    back) crosses a process boundary as one message, not one each."""

    def __init__(self, flush: Callable[[list[_T]], None]) -> None:
        self._flush = flush
        self._items: list[_T] = []

    def add(self, item: _T) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self._send)
        self._items.append(item)

    def _send(self) -> None:
        items, self._items = self._items, []
        if items:
            self._flush(items)
