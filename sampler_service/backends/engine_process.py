"""Any backend in a child process, behind the same `Backend` interface (vLLM's EngineCore idea).

The hf backend generates in Python: in the service's process its decode loop and the
service's own work (scheduler, HTTP, store) take turns on one GIL, so every millisecond
the service spends is a millisecond the engine does not generate. In a child process
the engine has an interpreter (and a core) to itself; the service talks to it over a
pipe. Messages are small (token ids in, completions out); weight loads send the tensors.

Protocol: the parent sends `(call_id, method, args)`; the child answers
`(call_id, ok, value_or_exception)`. The child starts by answering call 0 with what the
parent must know without asking (weight specs, model name, version). Calls run as tasks
on the child's event loop, so concurrent waves still batch there. If the child dies,
every waiting call and wave fails with an error that says so and gives its exit code.

Waves stream: a `wave` call is answered by `(None, "answers", [(call_id, index, answer),
...])` messages (an index of None: the error that ends the rest of the wave), one per turn of the child's event loop for every
answer that came back in it (an hf batch's rows come back together: one message), and
no reply of its own. `cancel_answers` reaches the child's wave, so a cancelled row stops
decoding there; `drop_wave` (the parent's reader left) stops what still runs of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import queue
import threading
from collections.abc import Awaitable, Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from sampler_service.aio import TurnBatch
from sampler_service.backends.base import (
    Backend,
    BackendHealth,
    ContinueKV,
    PauseMode,
    SamplingParams,
    StreamedWave,
    StreamingBackend,
    Wave,
    WaveRequest,
    packed,
)
from sampler_service.weights.types import TensorSpec

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 600.0
#: The status of a child's message that carries wave answers (see the module docstring).
_ANSWERS = "answers"
#: One wave event: (wave's call id, answer index, the answer, or None and the error that
#: ends the rest of the wave).
WaveEvent = tuple[int, int | None, Any]


class EngineProcessDied(RuntimeError):
    """The engine's child process exited; nothing it was doing will finish."""


def picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives a round trip through pickle, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _child_main(conn: Connection, factory: Callable[[], Backend], torch_threads: int) -> None:
    """Entry point of the child: build the backend, then serve calls until told to close."""
    if torch_threads > 0:
        import torch

        torch.set_num_threads(torch_threads)
    asyncio.run(_serve(conn, factory))


async def _serve(conn: Connection, factory: Callable[[], Backend]) -> None:
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    waves: dict[int, Wave] = {}
    readers: dict[int, asyncio.Task[Any]] = {}
    events: TurnBatch[WaveEvent] = TurnBatch(lambda items: conn.send((None, _ANSWERS, items)))

    def reply(call_id: int, ok: bool, value: Any) -> None:
        conn.send((call_id, ok, value if ok else picklable(value)))

    async def stream(
        call_id: int,
        prompt: list[int],
        n: int,
        sampling: SamplingParams,
        priorities: tuple[int, ...],
    ) -> None:
        """Each answer of the wave as it comes back, packed; an error ends the rest."""
        try:
            wave = waves[call_id] = backend.wave(prompt, n, sampling, priorities=priorities)
            async for index, answer in wave:
                events.add((call_id, index, packed(answer)))
        except Exception as exc:  # noqa: BLE001 - the wave's reader gets it
            events.add((call_id, None, picklable(exc)))
        finally:
            waves.pop(call_id, None)
            readers.pop(call_id, None)

    async def cancel_answers(call_id: int, indices: list[int]) -> None:
        if (wave := waves.get(call_id)) is not None:
            await wave.cancel(indices)

    async def drop_wave(call_id: int) -> None:
        if (reader := readers.get(call_id)) is not None:
            reader.cancel()

    own: dict[str, Callable[..., Awaitable[Any]]] = {
        "cancel_answers": cancel_answers,
        "drop_wave": drop_wave,
    }

    async def run(call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            call: Callable[..., Awaitable[Any]] = own.get(method) or getattr(backend, method)
            result = await call(*args)
        except BaseException as exc:  # every failure goes back to the caller  # noqa: BLE001
            reply(call_id, False, exc)
        else:
            reply(call_id, True, result)
        if method == "close":
            closed.set()

    def start(call_id: int, method: str, args: tuple[Any, ...]) -> None:
        if method == "wave":
            readers[call_id] = loop.create_task(stream(call_id, *args))
        else:
            loop.create_task(run(call_id, method, args))

    def receive() -> None:  # a thread: recv() blocks
        while True:
            try:
                call_id, method, args = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                loop.call_soon_threadsafe(closed.set)
                return
            loop.call_soon_threadsafe(start, call_id, method, args)
            if method == "close":
                return

    try:
        backend = factory()
        await backend.start()
    except BaseException as exc:  # noqa: BLE001
        reply(0, False, exc)
        return
    reply(
        0,
        True,
        {
            "specs": backend.weight_specs(),
            "model_name": backend.model_name,
            "policy_version": backend.policy_version,
            "name": backend.name,
            "cancels_answers": backend.cancels_answers,
            "continues": sorted(backend.continues),
            "orders_by_priority": backend.orders_by_priority,
            # the dtype weights are served in (a trainer casts its upload to it)
            "dtype": backend.health().detail.get("dtype"),
        },
    )
    threading.Thread(target=receive, name="engine-recv", daemon=True).start()
    await closed.wait()


class EngineProcess(StreamingBackend):
    """Runs `factory()`'s backend in a spawned child process; see the module docstring.

    `factory` must be picklable (a class, or a functools.partial of one).
    """

    def __init__(self, factory: Callable[[], Backend], torch_threads: int = 0) -> None:
        self._factory = factory
        self._torch_threads = torch_threads
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._waves: dict[int, StreamedWave] = {}
        self._outbox: queue.SimpleQueue[tuple[int, str, tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._failure: BaseException | None = None
        self._info: dict[str, Any] = {
            "name": "hf",
            "model_name": "",
            "policy_version": 0,
            "specs": {},
            "cancels_answers": False,
            "continues": [],
            "orders_by_priority": False,
        }
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self._info["name"])

    @property
    def model_name(self) -> str:
        return str(self._info["model_name"])

    @property
    def policy_version(self) -> int:
        return int(self._info["policy_version"])

    @property
    def cancels_answers(self) -> bool:
        return bool(self._info["cancels_answers"])

    @property
    def orders_by_priority(self) -> bool:
        return bool(self._info["orders_by_priority"])

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=_child_main,
            args=(child_conn, self._factory, self._torch_threads),
            name="engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self._conn = conn
        started: asyncio.Future[Any] = loop.create_future()
        self._calls[0] = started
        threading.Thread(
            target=self._receive, args=(loop,), name="engine-replies", daemon=True
        ).start()
        threading.Thread(target=self._send, name="engine-calls", daemon=True).start()
        try:
            self._info = await asyncio.wait_for(started, _START_TIMEOUT_S)
        except TimeoutError:
            await self.close()
            raise EngineProcessDied(
                f"the engine process did not start within {_START_TIMEOUT_S:.0f}s"
            ) from None
        log.info("engine process %d serving %s", self._process.pid, self.model_name)

    def _send(self) -> None:
        """A thread: pickling and writing never run on the event loop (weights can be large)."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return

    def _receive(self, loop: asyncio.AbstractEventLoop) -> None:
        """A thread: hands each reply to the loop; fails every call when the child is gone."""
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(self._child_gone)
                return
            if call_id is None:
                loop.call_soon_threadsafe(self._answered, value)
            else:
                loop.call_soon_threadsafe(self._resolve, call_id, ok, value)

    def _resolve(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _answered(self, events: list[WaveEvent]) -> None:
        for call_id, index, value in events:
            if (wave := self._waves.get(call_id)) is None:
                continue  # dropped by its reader
            if index is None:
                wave.fail(value)
            else:
                wave.put(index, value)
            if index is None or not wave.missing:
                del self._waves[call_id]

    def _child_gone(self) -> None:
        code = self._process.exitcode if self._process else None
        if self._process is not None and code is None:
            self._process.join(timeout=1.0)
            code = self._process.exitcode
        self._failure = self._failure or EngineProcessDied(
            f"the engine process exited (exit code {code})"
        )
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self._failed())
        self._calls.clear()
        for wave in self._waves.values():
            wave.fail(self._failed())
        self._waves.clear()

    def _failed(self) -> EngineProcessDied:
        """A fresh exception per failed call: re-raising one instance would grow its
        traceback on every raise."""
        return EngineProcessDied(str(self._failure))

    async def _call(self, method: str, *args: Any) -> Any:
        if self._failure is not None:
            raise self._failed()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._outbox.put((call_id, method, args))
        return await future

    def issue(self, request: WaveRequest) -> StreamedWave:
        """The child's wave, answer by answer; a cancel goes to the child, and so does a
        reader that leaves (the child's rows stop)."""
        prompt_token_ids, n, sampling = request.prompt_token_ids, request.n, request.sampling
        call_id = next(self._ids)

        async def cancel(indices: list[int]) -> None:
            await self._call("cancel_answers", call_id, indices)

        def drop() -> None:
            self._waves.pop(call_id, None)
            self._outbox.put((next(self._ids), "drop_wave", (call_id,)))

        wave = StreamedWave(n, cancel, drop, cancels_answers=self.cancels_answers)
        if self._failure is not None:
            wave.fail(self._failed())
            return wave
        self._waves[call_id] = wave
        wave_args = (list(prompt_token_ids), n, sampling, request.priorities)
        self._outbox.put((call_id, "wave", wave_args))
        return wave

    async def abort_all(self) -> int:
        return await self._call("abort_all")

    async def pause(self, mode: PauseMode = "wait") -> None:
        await self._call("pause_for_load", mode)

    async def resume(self) -> None:
        await self._call("resume_after_load")

    @property
    def continues(self) -> frozenset[ContinueKV]:
        return frozenset(self._info["continues"])

    async def score(
        self, prompt_token_ids: list[int], response_token_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        return await self._call(
            "score", list(prompt_token_ids), list(response_token_ids), temperature
        )

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return self._info["specs"]

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        await self._call("load_weights", dict(tensors), version)
        self._info["policy_version"] = version

    def health(self) -> BackendHealth:
        alive = self._process is not None and self._process.is_alive()
        detail: dict[str, Any] = {
            "engine_pid": self.pid,
            "policy_version": self.policy_version,
            "dtype": self._info.get("dtype"),
        }
        if self._failure is not None:
            detail["error"] = repr(self._failure)
        return BackendHealth(ok=alive and self._failure is None, detail=detail)

    async def close(self) -> None:
        if self._process is None:
            return
        if self._failure is None and self._process.is_alive():
            try:
                await asyncio.wait_for(self._call("close"), 30.0)
            except Exception as exc:  # closing anyway  # noqa: BLE001
                log.warning("engine process did not close cleanly: %s", exc)
        self._failure = self._failure or EngineProcessDied("the engine process was closed")
        self._outbox.put(None)
        await asyncio.to_thread(self._process.join, 10.0)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5.0)
        self._conn.close()
