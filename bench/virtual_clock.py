"""An asyncio event loop that runs in simulated time.

`VirtualTimeLoop.time()` returns a virtual clock that starts at 0 and only moves when
the loop has nothing runnable: instead of blocking in `select(timeout)` until the next
timer is due, the loop jumps its clock straight to that timer. Everything built on the
loop's clock (`asyncio.sleep`, `asyncio.timeout`, `call_later`) then runs in simulated
time, so the real scheduler can be driven through hours of engine time in seconds.

Only coroutines and timers are simulated. Threads and subprocesses still run in real
time, so code that waits on them (run_in_executor, process pools) must not be used
under this loop; the simulated engine and verifier of the benchmarks are pure asyncio.
The exception is work handed to a thread that answers at once (the episode runner's
environment threads with an instant simulated environment): a `hold` predicate says
when such a call is in flight, and while it holds the loop waits for it in real time
instead of jumping, so the call takes no simulated time.
A loop with nothing runnable and no timer left is a simulation deadlock and raises.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


#: Real seconds a held loop waits on its file descriptors before asking `hold` again.
_HOLD_POLL_S = 0.05


class SimulationDeadlock(RuntimeError):
    """Nothing is runnable and no timer is pending: the simulation can never progress."""


class _JumpingSelector(selectors.DefaultSelector):
    """A selector whose blocking wait advances the loop's virtual clock instead."""

    def __init__(self, hold: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None
        self.hold = hold

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Real file descriptors (the loop's self-pipe) are polled without blocking.
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if self.hold is not None and self.hold():
            # a thread's answer comes through the self-pipe; the loop asks again after
            return super().select(_HOLD_POLL_S)
        if timeout is None:
            raise SimulationDeadlock("no runnable callback and no timer: the simulation is stuck")
        assert self.loop is not None
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock is simulated (see the module docstring)."""

    def __init__(self, start: float = 0.0, hold: Callable[[], bool] | None = None) -> None:
        selector = _JumpingSelector(hold)
        super().__init__(selector)
        selector.loop = self
        self._now = float(start)
        # The loop runs every timer due before now + resolution; a jump lands exactly on
        # the next timer, so a tiny positive resolution absorbs float rounding.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the selector does this when the loop would block)."""
        if seconds > 0:
            self._now += seconds


def run(
    coro: Coroutine[Any, Any, T], *, start: float = 0.0, hold: Callable[[], bool] | None = None
) -> T:
    """Run a coroutine to completion on a fresh VirtualTimeLoop (like asyncio.run); `hold`:
    see the module docstring."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start, hold)) as runner:
        return runner.run(coro)
