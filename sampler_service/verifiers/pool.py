"""Verifier worker processes with a time limit enforced by the parent.

A verifier is user code: it may raise, return garbage, hang in a sympy simplification or
kill its own process. Each worker is a separate process owned by one slot; the parent
sends (spec, responses, answer, metadata) over a pipe, a wave's answers to one prompt
in one message, and waits at most `timeout_s` for each answer's reply. A worker that
overruns is SIGKILLed and a fresh one takes the answers after the one it hung on, so a
hung verifier costs one timeout and never blocks later verifications.
`concurrent.futures.ProcessPoolExecutor` cannot do this: killing one of its workers
breaks the whole pool.

Workers are forked from a forkserver that has preloaded the built-in verifiers (and
math-verify, whose import takes ~0.6 s), so replacing a killed worker costs ~20 ms, and
nothing of the server (torch, the model, the event loop) is inherited.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import numbers
import reprlib
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any, Literal, NamedTuple

from sampler_service.verifiers import BUILTIN, resolve
from sampler_service.verifiers.base import Verdict, VerdictKind

log = logging.getLogger(__name__)

# Run on the event loop, not in a worker: `exact` costs ~3-10 us (<0.5 ms for a 100 KB
# response), while a pool round trip costs ~0.35-0.6 ms of which the thread hop alone
# exceeds the verification. It cannot hang: linear string ops on a bounded response.
INLINE = frozenset({"exact"})

_PRELOAD = [__name__, *(target.partition(":")[0] for target in BUILTIN.values())]
_READY = "ready"
_BOOT_TIMEOUT_S = 60.0
_MAX_ERROR_CHARS = 500
# A spec whose recent calls failed this often gets a warning in /health and /v1/stats.
_ERROR_WINDOW, _ERROR_SHARE, _ERROR_MIN_CALLS = 200, 0.5, 20
# A spec with this share of time-outs over its last calls is not called for a while: a
# verifier that hangs on some answers would otherwise hold every worker most of the time.
_TIMEOUT_WINDOW, _TIMEOUT_SHARE, _TIMEOUT_MIN = 50, 0.2, 2
BREAKER_OPEN_S = 30.0

# (spec, responses, answer, metadata); responses None asks only to resolve the spec.
Request = tuple[str, list[str] | None, str, dict[str, Any] | None]


class _Outcome(NamedTuple):
    reward: float
    error: str | None
    kind: Literal["ok", "error", "timeout", "crash"]
    #: From the request (or the previous answer's reply) to this answer's reply.
    seconds: float = 0.0


@dataclass
class VerifierStats:
    """Running totals for metrics export. `errors` counts failures other than timeouts
    and crashes, which have their own counts."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    crashes: int = 0
    unavailable: int = 0  # calls refused while a spec's breaker was open
    restarts: int = 0  # workers replaced after a timeout or a crash
    seconds_total: float = 0.0


class _SpecHealth:
    """Recent outcomes of one verifier spec: its error rate, time-outs and breaker."""

    def __init__(self, half_workers: int) -> None:
        self.outcomes: collections.deque[VerdictKind] = collections.deque(maxlen=_ERROR_WINDOW)
        self.slots = asyncio.Semaphore(half_workers)
        self.open_until = 0.0

    def recent_timeouts(self) -> int:
        recent = itertools.islice(reversed(self.outcomes), _TIMEOUT_WINDOW)
        return sum(kind == "timeout" for kind in recent)

    def record(self, kind: VerdictKind, now: float) -> bool:
        """Add an outcome; True if it opened the breaker. Only a time-out can, so only
        a time-out counts the window (~2.5 us, which every answer used to pay)."""
        self.outcomes.append(kind)
        if kind != "timeout":
            return False
        window = min(len(self.outcomes), _TIMEOUT_WINDOW)
        if self.recent_timeouts() >= max(_TIMEOUT_MIN, _TIMEOUT_SHARE * window):
            self.open_until = now + BREAKER_OPEN_S
            self.outcomes.clear()  # judged afresh once the breaker closes
            return True
        return False

    def error_share(self) -> float | None:
        if len(self.outcomes) < _ERROR_MIN_CALLS:
            return None
        return sum(kind != "ok" for kind in self.outcomes) / len(self.outcomes)


def run_verifier(
    spec: str, response: str, answer: str, metadata: dict[str, Any] | None
) -> tuple[float, str | None]:
    """Call the verifier `spec` names: (reward, None), or for any failure (0, why), which
    the pool turns into a failed verdict."""
    try:
        value = resolve(spec)(response, answer, metadata)
    except Exception as exc:  # noqa: BLE001
        return 0.0, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    # `not 0 <= value <= 1` also rejects NaN, for which every comparison is false.
    if not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        return 0.0, f"verifier returned {reprlib.repr(value)}, not a reward in [0, 1]"
    return float(value), None


def resolve_error(spec: str) -> tuple[float, str | None]:
    """(0, None) if `spec` names a callable verifier, else (0, why not)."""
    try:
        fn = resolve(spec)
    except Exception as exc:  # noqa: BLE001 - user code: any import failure is reported
        return 0.0, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    return 0.0, None if callable(fn) else f"{spec} is not callable"


def _worker_main(conn: Connection, sys_path: list[str]) -> None:
    """Worker process: answer requests until the parent closes the pipe."""
    sys.path[:] = sys_path  # so python:module:function resolves as in the server
    # Ctrl-C reaches the whole process group; the server decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(_READY)
    while True:
        try:
            request: Request = conn.recv()
        except EOFError:
            return
        spec, responses, answer, metadata = request
        if responses is None:
            conn.send(resolve_error(spec))
            continue
        for response in responses:  # a reply per answer: the parent times each one
            conn.send(run_verifier(spec, response, answer, metadata))


class _Worker:
    """One verifier process, (re)started on demand; used by one pool thread at a time."""

    def __init__(self, ctx: ForkServerContext) -> None:
        self._ctx = ctx
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._retired = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def call(self, request: Request, timeout_s: float) -> list[_Outcome]:
        """Blocking; runs on a pool thread. An outcome per answer (one for a spec check),
        each within `timeout_s` of the one before; the clock starts once the worker is up.
        A worker that overruns or dies is replaced, and the answers after the one it was
        on go to its replacement (unless the pool closed meanwhile)."""
        spec, responses, answer, metadata = request
        wanted = 1 if responses is None else len(responses)
        outcomes: list[_Outcome] = []
        while len(outcomes) < wanted:
            if self._retired:
                failed = _Outcome(0.0, "verifier pool closed", "error")
                return outcomes + [failed] * (wanted - len(outcomes))
            rest = None if responses is None else responses[len(outcomes) :]
            outcomes += self._replies(
                (spec, rest, answer, metadata), wanted - len(outcomes), timeout_s
            )
        return outcomes

    def _replies(self, request: Request, count: int, timeout_s: float) -> list[_Outcome]:
        """Up to `count` replies to `request`, ending early at a time-out or a crash."""
        if self._proc is None:
            self._start()
        assert self._proc is not None and self._conn is not None
        out: list[_Outcome] = []
        since = time.perf_counter()
        try:
            self._conn.send(request)
            while len(out) < count:
                if not self._conn.poll(timeout_s):
                    self.kill()
                    self.reap()
                    error = f"timeout: no verdict within {timeout_s:g} s (worker killed)"
                    return out + [_Outcome(0.0, error, "timeout", time.perf_counter() - since)]
                reward, error = self._conn.recv()
                now = time.perf_counter()
                out.append(_Outcome(reward, error, "ok" if error is None else "error", now - since))
                since = now
        except (EOFError, OSError):
            self.kill()
            code = self.reap()
            error = f"verifier worker died (exit code {code})"
            out.append(_Outcome(0.0, error, "crash", time.perf_counter() - since))
        return out

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main, args=(child, list(sys.path)), name="verifier", daemon=True
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        try:
            ready = parent.poll(_BOOT_TIMEOUT_S) and parent.recv() == _READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            code = self.reap()
            raise RuntimeError(f"verifier worker failed to start (exit code {code})")

    def kill(self) -> None:
        """SIGKILL the process; safe from any thread (the owning thread then sees EOF)."""
        if self._proc is not None and self._proc.exitcode is None:
            self._proc.kill()

    def retire(self) -> None:
        """Kill the process for good: a call in progress starts no replacement."""
        self._retired = True
        self.kill()

    def reap(self) -> int | None:
        """Wait for a killed or exited process and drop it; only its owning thread calls this."""
        if self._proc is None:
            return None
        self._proc.join()
        code = self._proc.exitcode
        assert self._conn is not None
        self._conn.close()
        self._proc = self._conn = None
        return code


class VerifierPool:
    """`await pool.verify_wave(spec, responses, answer, metadata)` -> a Verdict per answer
    (`verify` for one).

    A verifier that raises, returns something other than a number in [0, 1], crashes its
    process or runs past `timeout_s` yields a failed verdict (kind `error`, `crash` or
    `timeout`, `error` set; its worker is then replaced), which is not a reward: the
    caller asks it again or drops the prompt. verify itself only raises once the pool is
    closed. Specs in INLINE run
    in-process, all others in a worker process: at most `max_workers` at once, the rest
    wait for a free worker (a wait that is not part of the time limit). A wave goes to
    the workers free when it comes, one message to each, or whole to the next free one:
    a hand-off costs the loop a thread hop and a pipe round trip whatever it carries.
    `stats` keeps the totals for metrics.
    """

    def __init__(self, max_workers: int = 2, timeout_s: float = 10.0) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self.timeout_s = timeout_s
        self.stats = VerifierStats()
        self._workers = [_Worker(ctx) for _ in range(max_workers)]
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for worker in self._workers:
            self._idle.put_nowait(worker)
        # Each busy worker is driven by one thread blocked on its pipe, off the event loop.
        self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="verifier")
        self._closed = False
        self._half_workers = max(1, max_workers // 2)
        self._specs: dict[str, _SpecHealth] = {}

    def worker_pids(self) -> list[int | None]:
        """Process ids of the workers (None for one not started yet or just killed)."""
        return [worker.pid for worker in self._workers]

    def _health(self, spec: str) -> _SpecHealth:
        if spec not in self._specs:
            self._specs[spec] = _SpecHealth(self._half_workers)
        return self._specs[spec]

    def warnings(self) -> list[str]:
        """One line per spec with a high error rate or an open breaker."""
        out = []
        now = time.monotonic()
        for spec, health in self._specs.items():
            if health.open_until > now:
                out.append(
                    f"verifier {spec}: too many time-outs, not called for "
                    f"{health.open_until - now:.0f} s (its prompts are dropped)"
                )
            share = health.error_share()
            if share is not None and share >= _ERROR_SHARE:
                out.append(
                    f"verifier {spec}: {share:.0%} of its last {len(health.outcomes)} calls failed"
                )
        return out

    async def check(self, spec: str) -> str | None:
        """Why `spec` cannot be resolved, or None; resolved in a worker, as verify does."""
        if spec in INLINE:
            return resolve_error(spec)[1]
        worker = await self._idle.get()
        try:
            [outcome] = await asyncio.get_running_loop().run_in_executor(
                self._threads, worker.call, (spec, None, "", None), _BOOT_TIMEOUT_S
            )
        finally:
            self._release(worker)
        return outcome.error

    async def verify(
        self, spec: str, response: str, answer: str, metadata: dict[str, Any] | None = None
    ) -> Verdict:
        """One answer's verdict."""
        [verdict] = await self.verify_wave(spec, [response], answer, metadata)
        return verdict

    async def verify_wave(
        self,
        spec: str,
        responses: Sequence[str],
        answer: str,
        metadata: dict[str, Any] | None = None,
    ) -> list[Verdict]:
        """A verdict for each of one prompt's answers, in order."""
        if self._closed:
            raise RuntimeError("verifier pool is closed")
        if not responses:
            return []
        health = self._health(spec)
        if spec in INLINE:
            return [self._inline(spec, response, answer, metadata) for response in responses]
        if health.open_until > time.monotonic():
            self.stats.unavailable += len(responses)
            refused = f"verifier {spec} is not called: too many time-outs"
            return [Verdict(0.0, refused, kind="unavailable") for _ in responses]
        # A spec that has hung lately holds at most half the workers.
        hung = health.recent_timeouts() > 0
        workers = max(
            1, min(self._idle.qsize(), self._half_workers if hung else len(self._workers))
        )
        size = -(-len(responses) // workers)
        parts = [list(responses[i : i + size]) for i in range(0, len(responses), size)]

        async def part(chunk: list[str]) -> list[Verdict]:
            if not hung:
                return await self._verify_in_worker(spec, chunk, answer, metadata)
            async with health.slots:
                return await self._verify_in_worker(spec, chunk, answer, metadata)

        if len(parts) == 1:
            return await part(parts[0])
        return [v for verdicts in await asyncio.gather(*map(part, parts)) for v in verdicts]

    def _inline(
        self, spec: str, response: str, answer: str, metadata: dict[str, Any] | None
    ) -> Verdict:
        started = time.perf_counter()
        reward, error = run_verifier(spec, response, answer, metadata)
        outcome = _Outcome(reward, error, "ok" if error is None else "error")
        return self._record(spec, outcome, time.perf_counter() - started)

    async def _verify_in_worker(
        self, spec: str, responses: list[str], answer: str, metadata: dict[str, Any] | None
    ) -> list[Verdict]:
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            job = self._threads.submit(
                worker.call, (spec, responses, answer, metadata), self.timeout_s
            )
        except RuntimeError:  # closed while this call waited for a worker
            self._release(worker)
            raise
        # The worker goes back to the idle queue when its thread is done with it, even if
        # this coroutine is cancelled first (so two calls can never share a worker).
        job.add_done_callback(lambda _: self._release_threadsafe(loop, worker))
        try:
            outcomes = await asyncio.wrap_future(job)
        except Exception as exc:  # the pool itself failed (e.g. no worker could start)
            log.exception("verifier pool failure for %s", spec)
            failed = _Outcome(
                0.0, f"verifier pool: {exc!r}", "error", time.perf_counter() - started
            )
            outcomes = [failed] * len(responses)
        return [self._record(spec, outcome, outcome.seconds) for outcome in outcomes]

    def _record(self, spec: str, outcome: _Outcome, seconds: float) -> Verdict:
        stats = self.stats
        stats.calls += 1
        stats.seconds_total += seconds
        if outcome.kind == "timeout":
            stats.timeouts += 1
        elif outcome.kind == "crash":
            stats.crashes += 1
        elif outcome.error is not None:
            stats.errors += 1
        if outcome.kind in ("timeout", "crash"):
            stats.restarts += 1
            log.warning("verifier %s: %s", spec, outcome.error)
        if self._health(spec).record(outcome.kind, time.monotonic()):
            log.warning(
                "verifier %s: too many time-outs; not called for %.0f s", spec, BREAKER_OPEN_S
            )
        return Verdict(
            reward=outcome.reward, error=outcome.error, seconds=seconds, kind=outcome.kind
        )

    def close(self) -> None:
        """Kill every worker. Calls in progress return an error verdict; later ones raise."""
        self._closed = True
        for worker in self._workers:
            worker.retire()
        while not self._idle.empty():  # idle workers have no thread to reap them
            self._idle.get_nowait().reap()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _release(self, worker: _Worker) -> None:
        if self._closed:
            worker.reap()
        else:
            self._idle.put_nowait(worker)

    def _release_threadsafe(self, loop: asyncio.AbstractEventLoop, worker: _Worker) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._release, worker)
