"""The fleet's wave routing: bookkeeping only.

Routing is sticky least-outstanding: load is the samples in flight on an engine, counted
by the fleet, never polled. A prompt's next wave goes back to the engine that ran its last
one (its prefix is cached there) unless that engine's load exceeds the least-loaded one's
by more than 64 samples and 1.5x. An engine takes at most `max_inflight` samples (a larger
wave still goes to an idle one); waves wait in one FIFO, a prompt's wave for its own
engine while loads are about even. Waves are never split.

Re-issued waves (their engine failed) go first: they enter the FIFO ahead of every fresh
wave (behind earlier re-issued ones), and one may take an engine below its cap even if it
ends up over it by that wave: a failure costs detection plus about one wave where an
engine has room, never a wait behind the fresh work that queued meanwhile.

The fleet says which engines exist and which are routable now (callbacks), and charges
an engine when it is handed a wave; the router never talks to an engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

#: Sticky routing gives way when the prompt's engine is this much busier than the
#: least-loaded one, in samples and as a ratio (vllm-router's cache_aware defaults).
STICKY_SLACK_SAMPLES = 64
STICKY_SLACK_RATIO = 1.5
#: Default in-flight cap: 1.5 x vLLM's default max_num_seqs (256).
DEFAULT_MAX_INFLIGHT = 384
#: Prompts whose last engine is remembered (oldest forgotten first).
AFFINITY_ENTRIES = 100_000

Route = Literal["sticky", "least-loaded"]
Decision = Literal["sticky", "moved", "new"]


def affinity(prompt_token_ids: Sequence[int], affinity_key: str | None) -> int:
    """The key a prompt's waves are sticky on: the caller's affinity key (the prompt's
    id, which stays the same across an episode's turns while the tokens grow), else the
    prompt's tokens."""
    return hash(affinity_key) if affinity_key is not None else hash(tuple(prompt_token_ids))


class Target(Protocol):
    """An engine as the router sees it: its position in the fleet and its load."""

    index: int
    inflight: int


T = TypeVar("T", bound=Target)


class NoTarget(RuntimeError):
    """No engine became routable within the wait (the scheduler retries the wave)."""


@dataclass(eq=False)
class _Wait(Generic[T]):
    """A wave waiting in the FIFO for an engine."""

    key: int
    n: int
    future: asyncio.Future[T]
    #: Re-issued after its engine failed: queued ahead of fresh waves, may overshoot a cap.
    reissue: bool = False


def choose(
    last: T | None,
    n: int,
    routable: Sequence[T],
    blocked: set[int],
    *,
    max_inflight: int,
    route: Route = "sticky",
    reissue: bool = False,
) -> tuple[T | None, Decision, T | None]:
    """(engine to run the wave now or None, decision kind, engine it waits for).

    `last` ran the prompt's previous wave (None: none did). A prompt that ran before
    waits for its engine while that one is full but not overloaded (loads about even:
    moving would only lose the cached prefix); an overloaded, gone or unknown one gives
    way to the least-loaded engine with room. A re-issued wave has room on any engine
    below the cap (over it by one wave at most). `routable` must not be empty.
    """

    def room(t: T) -> bool:
        if t.index in blocked:
            return False
        return (
            t.inflight + n <= max_inflight
            or t.inflight == 0
            or (reissue and t.inflight < max_inflight)
        )

    if route == "sticky" and last is not None:
        lowest = min(t.inflight for t in routable)
        overloaded = (
            last.inflight - lowest > STICKY_SLACK_SAMPLES
            and last.inflight > STICKY_SLACK_RATIO * lowest
        )
        if last in routable and not overloaded:
            return (last if room(last) else None), "sticky", last
    kind: Decision = "new" if last is None else "moved"
    fits = [t for t in routable if room(t)]
    if not fits:
        return None, kind, None
    return min(fits, key=lambda t: (t.inflight, t.index)), kind, None


class WaveRouter(Generic[T]):
    """The FIFO of waves waiting for an engine, and each prompt's last engine."""

    def __init__(
        self,
        targets: Callable[[], Sequence[T]],
        routable: Callable[[T], bool],
        charge: Callable[[T, int], None],
        *,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        route: Route = "sticky",
        poll_s: float = 5.0,
        wait_s: float = 300.0,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self._targets = targets  # every engine, indexed by its `index`
        self._routable = routable
        self._charge = charge
        self.max_inflight = max_inflight
        self.route: Route = route
        self._poll_s = poll_s
        self._wait_s = wait_s
        self._on_decision = on_decision
        self.queue: deque[_Wait[T]] = deque()
        self.affinity: OrderedDict[int, int] = OrderedDict()

    def dispatch(self) -> None:
        """Hand engines to waiting waves, oldest first.

        Order is kept per engine: a wave waiting for one engine holds back the later
        waves that want that engine, not those bound elsewhere; a wave that fits nowhere
        holds back everything after it.
        """
        if not self.queue:  # most calls: an answer came back and nothing waits
            return
        targets = self._targets()
        routable = [t for t in targets if self._routable(t)]
        if not routable:
            return
        blocked: set[int] = set()
        waiting: deque[_Wait[T]] = deque()
        while self.queue:
            item = self.queue.popleft()
            if item.future.done():  # its caller gave up
                continue
            last_index = self.affinity.get(item.key)
            last = targets[last_index] if last_index is not None else None
            target, kind, wanted = choose(
                last,
                item.n,
                routable,
                blocked,
                max_inflight=self.max_inflight,
                route=self.route,
                reissue=item.reissue,
            )
            if target is None:
                waiting.append(item)
                if wanted is None:  # fits nowhere: nothing after it may overtake it
                    waiting.extend(self.queue)
                    self.queue.clear()
                    break
                blocked.add(wanted.index)
                continue
            self.affinity[item.key] = target.index
            self.affinity.move_to_end(item.key)
            if len(self.affinity) > AFFINITY_ENTRIES:
                self.affinity.popitem(last=False)
            if self._on_decision is not None:
                self._on_decision(kind)
            self._charge(target, item.n)
            item.future.set_result(target)
        self.queue = waiting

    def release(self, target: T, n: int) -> None:
        """A wave of n left `target`: uncharge it and let waiting waves in."""
        self._charge(target, -n)
        self.dispatch()

    async def acquire(self, key: int, n: int, reissue: bool = False) -> T:
        """An engine for a wave of n, charged with it; waits in the FIFO if none has room.

        A re-issued wave queues ahead of every fresh one, behind the re-issued ones
        already waiting (they keep their order). NoTarget once no engine was routable
        for `wait_s`.
        """
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        wait = _Wait(key, n, future, reissue)
        if reissue:
            at = sum(1 for w in self.queue if w.reissue)  # re-issued ones are at the front
            self.queue.insert(at, wait)
        else:
            self.queue.append(wait)
        self.dispatch()
        if future.done():  # an engine had room: no wait (most waves)
            return future.result()
        parked_since = time.monotonic()
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(future), self._poll_s)
                except TimeoutError:
                    if any(self._routable(t) for t in self._targets()):
                        parked_since = time.monotonic()
                    elif time.monotonic() - parked_since > self._wait_s:
                        raise NoTarget(
                            f"no engine became routable within {self._wait_s:.0f}s"
                        ) from None
        except BaseException:
            if future.done() and not future.cancelled():
                self.release(future.result(), n)  # assigned just as we gave up
            future.cancel()
            raise

    def cancel_all(self) -> None:
        for wait in self.queue:
            wait.future.cancel()
        self.queue.clear()
