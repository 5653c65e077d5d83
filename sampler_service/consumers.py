"""The trainer's step as its consumers show it, which `max_staleness` counts in.

A consumer declares the groups it trains on per step (`groups_per_step` on its stream
or lease); one that declares nothing is taken to train on the most groups it has held
unacked at once. Either counts while the consumer is seen: a stream's while it lives, a
lease caller's for a lease TTL after its last call, so one large evaluation lease does
not widen the bound for good. Delivery, which sees the consumers, keeps this; admission
reads `step`.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ConsumerSteps:
    """Declared steps and undeclared consumers' holdings, each with until when it counts."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        #: Called when `step` changes (admission re-checks).
        self.on_change = on_change
        self._declared: dict[str, tuple[int, float]] = {}
        self._held: dict[str, tuple[int, float]] = {}
        self.step = 0

    def declare(self, consumer: str, groups: int | None, until: float) -> None:
        """A consumer's declared step (None: it declared none, nothing changes)."""
        if groups is not None:
            self._declared[consumer] = (groups, until)
            self._held.pop(consumer, None)
            self.refresh()

    def forget(self, consumer: str) -> None:
        """A stream ended: its declaration ends with it."""
        if self._declared.pop(consumer, None) is not None:
            self.refresh()

    def holding(self, consumer: str, held: int, until: float) -> None:
        """After a hand-out: what a consumer that declares no step now holds unacked."""
        if consumer in self._declared:
            return
        peak, seen_until = self._held.get(consumer, (0, 0.0))
        live_peak = peak if seen_until > time.monotonic() else 0
        self._held[consumer] = (max(held, live_peak), until)
        if held > self.step:
            self.refresh()

    def seen(self, consumer: str, until: float) -> None:
        """A live stream keeps its holding counting."""
        if consumer in self._held:
            self._held[consumer] = (self._held[consumer][0], until)

    def refresh(self) -> None:
        """Forget what no consumer shows any more; `on_change` if the step moved."""
        now = time.monotonic()
        self._declared = {c: d for c, d in self._declared.items() if d[1] > now}
        self._held = {c: d for c, d in self._held.items() if d[1] > now}
        step = max((g for g, _ in (*self._declared.values(), *self._held.values())), default=0)
        if step != self.step:
            self.step = step
            self.on_change()
