"""The front under measurement: the real sampler service, fed by a simulated engine.

`python -m bench.front_service SPEC` (SPEC a JSON object, written by `bench.front`'s worker)
runs `SamplerService` and its FastAPI app on uvicorn exactly as `adaptive-rollout serve`
does (scheduler, verifier pool, SQLite store, outbox, stream and ack routes), with two
additions that only this process has:

- the engine is `bench.sim_backend.SimBackend` on a thread of its own with its own event
  loop (`EngineThread`), so the engine's bookkeeping never runs on the front's loop: the
  front pays what any in-process engine client pays, a future resolved from another
  thread. Its answers are cut from pools made at start-up (log-normal lengths, random
  token ids, float32 logprobs, a reasoning text of ~4 characters per token ending in a
  boxed answer that the verifier scores as the engine drew it), so the engine's cost per
  answer is a few list slices. The first two token ids of every answer carry the wall
  time it finished (`stamp`), which the client reads back for the delay from a group's
  last answer to its delivery;
- `GET /bench/counters`: CPU per thread (the event loop's own clock, the store thread,
  the verifier threads, the engine thread), CPU of the child processes (verifier
  workers), the engine's and verifier's counts, and the totals of the probes below;
- `GET /bench/stages`: when each group passed each stage of its way from the engine to
  the stream (`Stages`), so the client can split its delay from last answer to delivery.

Probes wrap today's functions at the places a group passes (`PROBES`): the msgpack
encoding for the store, group building, framing, inline verification, the outbox, the
SQLite calls (on the store thread) and the stream's framing of stored bytes. Each adds
its calls, wall seconds, CPU seconds of the calling thread and, where it applies, bytes.
A probe whose target does not exist in the checkout is listed in `missing` and skipped:
the totals that do not depend on probes (CPU per thread, bytes on the wire) are what the
targets use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.common import grpo, serve_app, tree_cpu_s
from bench.sim_backend import EngineSpec, SimBackend
from sampler_service.backends.base import (
    Backend,
    BackendHealth,
    Completion,
    SamplingParams,
    TensorSpec,
    Wave,
    WaveRequest,
    WholeWave,
)

#: Two token ids in [0, STAMP_BASE) hold the microseconds since the run's epoch.
STAMP_BASE = 100_000
#: Token ids and characters the answers are cut from (more than the longest answer).
POOL_TOKENS = 8192
CHARS_PER_TOKEN = 4
VOCAB = 151_000
#: Every prompt's reference answer; a wrong answer boxes another number.
ANSWER = "42"
#: The words of the simulated reasoning, between inline equations.
WORDS = (
    "let the sum of we have so then since each term is equal to thus it follows that "
    "number value first second step compute both sides divide multiply by check"
)


def stamp(epoch: float) -> list[int]:
    """The two token ids that carry the time now (microseconds since `epoch`)."""
    micros = int((time.time() - epoch) * 1e6)
    return [micros // STAMP_BASE % STAMP_BASE, micros % STAMP_BASE]


def stamped_time(token_ids: Sequence[int], epoch: float) -> float:
    """The wall time `stamp` wrote into an answer's first two token ids."""
    return epoch + (int(token_ids[0]) * STAMP_BASE + int(token_ids[1])) / 1e6


def _reasoning_text(rng: np.random.Generator, chars: int) -> str:
    parts: list[str] = []
    size = 0
    while size < chars:
        if rng.random() < 0.15:
            a, b, c = rng.integers(1, 99, 3)
            part = f"${a}x + {b} = {c}$"
        else:
            part = " ".join(rng.choice(WORDS.split(), 8)) + "."
        parts.append(part)
        size += len(part) + 1
    return " ".join(parts)


class Answers:
    """Answers of any length, cut from pools made once (the engine's cost stays tiny)."""

    def __init__(self, seed: int, epoch: float) -> None:
        rng = np.random.default_rng(seed)
        self.epoch = epoch
        # Answers come packed, as the engine's process and Ray replicas hand them over
        # (`sampler_service.backends.base.packed`): int32 ids, float32 logprobs.
        self.token_ids = rng.integers(0, VOCAB, POOL_TOKENS).astype(np.int32)
        self.logprobs = (-rng.exponential(0.7, POOL_TOKENS)).astype(np.float32)
        self.text = _reasoning_text(rng, POOL_TOKENS * CHARS_PER_TOKEN)
        self.tails = {
            True: f" Therefore, the answer is $\\boxed{{{ANSWER}}}$.",
            False: f" Therefore, the answer is $\\boxed{{{int(ANSWER) + 1}}}$.",
        }

    def payload(
        self, rng: np.random.Generator, length: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        start = int(rng.integers(0, POOL_TOKENS - length + 1))
        ids = self.token_ids[start : start + length].copy()
        ids[: min(2, length)] = stamp(self.epoch)[:length]
        return ids, self.logprobs[start : start + length]

    def answer_text(self, rng: np.random.Generator, length: int, correct: bool) -> str:
        tail = self.tails[correct]
        start = int(rng.integers(0, len(self.text) // 2))
        return self.text[start : start + max(0, CHARS_PER_TOKEN * length - len(tail))] + tail


def engine_spec(spec: Mapping[str, Any]) -> EngineSpec:
    """An engine whose `slots` sequences finish `rate` answers/s between them when full.

    Mean answer length `length_mean` (log-normal, log-sd `length_sigma`, so the median is
    mean x exp(-sigma^2 / 2)); a decode step of slots / (rate x mean length) seconds. It
    reports finished answers every `engine_tick_s` (a real engine's step boundaries), so
    its thread wakes a few hundred times a second whatever the rate.
    """
    sigma = float(spec["length_sigma"])
    mean = float(spec["length_mean"])
    slots = int(spec["slots"])
    engine = EngineSpec.fixed_step(
        slots, slots / (float(spec["rate"]) * mean), mean * math.exp(-sigma * sigma / 2), sigma
    )
    return dataclasses.replace(engine, tick_s=float(spec["engine_tick_s"]))


class EngineThread(Backend):
    """A backend running on a thread with its own event loop; the front awaits its futures."""

    name = "sim"

    def __init__(self, make: Callable[[], SimBackend], stages: Stages) -> None:
        self._make = make
        self._stages = stages
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sim-engine", daemon=True
        )
        self.engine: SimBackend | None = None

    @property
    def model_name(self) -> str:
        return "simulated-engine"

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version if self.engine is not None else 0

    async def _on_engine_loop(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def start(self) -> None:
        self._thread.start()

        async def build() -> SimBackend:
            engine = self._make()
            await engine.start()
            return engine

        self.engine = await self._on_engine_loop(build())

    async def close(self) -> None:
        if self.engine is not None:
            await self._on_engine_loop(self.engine.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def issue(self, request: WaveRequest) -> Wave:
        return WholeWave(self._answers(request.n, request.sampling), request.n)

    async def _answers(self, n: int, sampling: SamplingParams) -> list[Completion]:
        assert self.engine is not None
        # Every prompt has the same pass rate: the engine's prompt index is 0.
        result: list[Completion] = await self._on_engine_loop(
            self.engine.generate([0], n, sampling)
        )
        self._stages.seen([c.token_ids for c in result], "front")
        return result

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return {}

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        assert self.engine is not None
        await self._on_engine_loop(self.engine.load_weights(tensors, version))

    def health(self) -> BackendHealth:
        return BackendHealth(ok=self.engine is not None)


# -- probes -----------------------------------------------------------------------------------


def _payload_bytes(args: tuple[Any, ...], result: Any) -> int:
    return len(args[2])  # Store.add_pending(self, group_id, payload, state)


def _frame_bytes(args: tuple[Any, ...], result: Any) -> int:
    # Store.frame(self, frames, state): every frame's members' bytes
    return sum(len(payload) for frame in args[1] for _, payload in frame.members)


def _result_bytes(args: tuple[Any, ...], result: Any) -> int:
    return len(result)


#: (probe name, module, attribute path, bytes of a call or None). Loop-side probes time
#: synchronous code on the event loop; `store.*` run on the store's thread.
PROBES: list[tuple[str, str, str, Callable[[tuple[Any, ...], Any], int] | None]] = [
    ("encode_for_store", "sampler_service.outbox", "pack_group", _result_bytes),
    ("build_group", "sampler_service.grouping", "build_group", None),
    ("frame_policies", "sampler_service.grouping", "apply_batch_policies", None),
    ("verify_inline", "sampler_service.verifiers.pool", "run_verifier", None),
    ("outbox_take", "sampler_service.outbox", "Outbox.take", None),
    ("stream_frame", "sampler_service.encoding", "MsgpackEncoding.group_message", _result_bytes),
    ("store.add_pending", "sampler_service.store", "Store.add_pending", _payload_bytes),
    ("store.frame", "sampler_service.store", "Store.frame", _frame_bytes),
    ("store.delete", "sampler_service.store", "Store.delete", None),
]


class Probes:
    """Totals per probe: calls, wall s, CPU s (of the calling thread), bytes."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0, "bytes": 0}
        )
        self.missing: list[str] = []

    def install(self) -> None:
        for name, module_name, path, size in PROBES:
            owner: Any = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            try:
                for part in parents:
                    owner = getattr(owner, part)
                original = getattr(owner, attr)
            except AttributeError:
                self.missing.append(f"{module_name}.{path}")
                continue
            setattr(owner, attr, self._timed(name, original, size))

    def _timed(
        self, name: str, original: Callable[..., Any], size: Callable[..., int] | None
    ) -> Callable[..., Any]:
        totals = self.totals[name]

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            result = original(*args, **kwargs)
            totals["cpu_s"] += time.thread_time() - cpu
            totals["wall_s"] += time.perf_counter() - wall
            totals["calls"] += 1
            if size is not None:
                totals["bytes"] += size(args, result)
            return result

        return timed


def answers_key(token_ids: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """A group's key from its answers' stamps (their first two token ids), in any order."""
    return tuple(
        sorted(int(ids[0]) * STAMP_BASE + int(ids[1]) for ids in token_ids if len(ids) >= 2)
    )


#: A group's stages, in the order it meets them: the front's loop has the engine's
#: answers, the finalizer takes the prompt up, its frame is stored and offered, and the
#: stream frames it for the socket.
STAGES = ("front", "finalize", "stored", "sent")


class Stages:
    """When each group met each of `STAGES` (wall time), by group id once it has one.

    A group is known by its answers' stamps until it is built (`answers_key`), then by its
    id. Probes wrap the functions a group passes, as `Probes` does.
    """

    def __init__(self) -> None:
        self._by_answers: dict[tuple[int, ...], dict[str, float]] = {}
        self.by_group: dict[str, dict[str, float]] = {}

    def seen(self, token_ids: Sequence[Sequence[int]], stage: str) -> None:
        self._by_answers.setdefault(answers_key(token_ids), {})[stage] = time.time()

    def stored(self, groups: list[Any]) -> None:
        now = time.time()
        for group in groups:
            key = answers_key([s.response_token_ids for s in group.samples])
            self.by_group[group.group_id] = {**self._by_answers.pop(key, {}), "stored": now}

    def sent(self, group_id: str) -> None:
        if (record := self.by_group.get(group_id)) is not None:
            record.setdefault("sent", time.time())

    def install(self) -> None:
        from sampler_service.encoding import JSONEncoding, MsgpackEncoding
        from sampler_service.finalize import Finalizer
        from sampler_service.outbox import StoreSink

        finalize, add_frames = Finalizer.finalize, StoreSink.add_frames

        async def finalize_seen(finalizer: Finalizer, runs: list[Any]) -> None:
            for run in runs:
                self.seen([c.token_ids for c in run.completions], "finalize")
            await finalize(finalizer, runs)

        async def add_frames_seen(sink: StoreSink, frames: list[Any], *args: Any) -> None:
            await add_frames(sink, frames, *args)
            self.stored([group for frame in frames for group in frame.kept])

        Finalizer.finalize = functools.wraps(finalize)(finalize_seen)  # type: ignore[method-assign]
        StoreSink.add_frames = functools.wraps(add_frames)(add_frames_seen)  # type: ignore[method-assign]
        for encoding in (JSONEncoding, MsgpackEncoding):
            self._wrap_group_message(encoding)

    def _wrap_group_message(self, encoding: Any) -> None:
        original = encoding.group_message

        @functools.wraps(original)
        def group_message(instance: Any, delivered: Any) -> bytes:
            self.sent(delivered.group.group_id)
            result: bytes = original(instance, delivered)
            return result

        encoding.group_message = group_message


def _thread_kind(name: str) -> str:
    if name == "MainThread":
        return "loop"
    for prefix, kind in (
        ("store-checkpoint", "checkpoint"),
        ("store", "store"),
        ("verifier", "verifier_threads"),
        ("sim-engine", "engine"),
    ):
        if name.startswith(prefix):
            return kind
    return "other"


def runqueue_wait_s(thread: threading.Thread) -> float | None:
    """Seconds `thread` was runnable but waiting for a core (Linux schedstat), if known.

    On a machine whose cores are taken, a thread's CPU clock says how much it ran, not
    how much it wanted to: the wait is the difference.
    """
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()
    except OSError:
        return None
    return int(fields[1]) / 1e9


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, summed by kind."""
    out: dict[str, float] = defaultdict(float)
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ProcessLookupError):  # it ended meanwhile
            continue
        out[_thread_kind(thread.name)] += seconds
    return dict(out)


# -- the server -------------------------------------------------------------------------------


def serve(spec: dict[str, Any]) -> None:
    from fastapi.responses import Response

    from sampler_service.app import create_app
    from sampler_service.config import SamplerConfig, ServeSettings
    from sampler_service.service import SamplerService

    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    probes = Probes()
    probes.install()
    stages = Stages()
    stages.install()
    answers = Answers(int(spec["seed"]), float(spec["epoch"]))
    backend = EngineThread(
        functools.partial(
            SimBackend,
            [0.5],
            engine_spec(spec),
            seed=int(spec["seed"]),
            payload=answers.payload,
            text=answers.answer_text,
        ),
        stages,
    )
    settings = ServeSettings(
        model=Path(spec["model"]),
        data=[Path(f) for f in spec["data"]],
        state_dir=Path(spec["state_dir"]),
        port=0,
        verifier=spec["verifier"],
        verifier_workers=int(spec["verifier_workers"]),
    )
    n = int(spec["n"])
    config = SamplerConfig(
        **grpo(n),
        max_tokens=int(spec["max_tokens"]),
        # Twice the prompts whose answers fill the engine, so finished sequences' slots
        # are taken at once while their siblings decode.
        max_active_prompts=int(spec["max_active_prompts"]),
        batch_groups=1,
        max_staleness=None,  # the offered load is the bound: no trainer pushes weights
    )
    app = create_app(
        settings, functools.partial(SamplerService.build, settings, config, backend=backend)
    )

    @app.get("/bench/counters")
    async def counters() -> Response:
        engine = backend.engine
        service = app.state.service
        scheduler = service.scheduler
        body = {
            "time": time.time(),
            "loop_cpu_s": time.thread_time(),
            "loop_runqueue_wait_s": runqueue_wait_s(threading.main_thread()),
            "threads_cpu_s": thread_cpu(),
            "process_cpu_s": time.process_time(),
            "children_cpu_s": tree_cpu_s(os.getpid(), include_root=False),
            "engine_answers": engine.stats.sequences if engine else 0,
            "engine_tokens": engine.stats.tokens if engine else 0,
            "verifier_calls": service.verifiers.stats.calls,
            "verifier_pids": service.verifiers.worker_pids(),
            "samples": scheduler.tally.samples,
            "groups_emitted": scheduler.tally.groups_emitted,
            "queue": service.stats.document()["queue"],
            "probes": probes.totals,
            "probes_missing": probes.missing,
            "code_root": str(Path(sys.modules["sampler_service"].__file__ or "").parent.parent),
        }
        return Response(json.dumps(body), media_type="application/json")

    @app.get("/bench/stages")
    async def stage_times() -> Response:
        """Every stored group's stage times (wall), by group id."""
        return Response(json.dumps(stages.by_group), media_type="application/json")

    serve_app(app)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
