"""One engine replica: an unchanged backend (hf, vLLM, the simulated engine) in a Ray actor.

The Ray transport (`transport.py`) creates this class as a detached, named Ray actor, so
a sampler that restarts finds its replicas still warm. The actor holds no scheduling
logic: it builds its backend from a picklable factory, runs waves concurrently on its
event loop (so the backend batches them as it does in-process; its fleet member sends
them, and cancels, and collects their answers one by one as each finishes, in batched
calls, `channel.py`), loads weights, and answers health probes. It imports nothing of Ray itself, so the same class runs in a test without a
cluster.

A Ray restart runs `__init__` again on a fresh process: the new incarnation reports
`started: False` until the fleet calls `start()` and loads the committed weights into it.

Orphans exit: a detached replica outlives its sampler on purpose (a restarted one
re-attaches), but one that has heard from no sampler (no call, no probe) for `orphan_s`
seconds closes its engine and exits for good (`ray.actor.exit_actor`: no restart, the name
is freed), so a sampler that never comes back does not hold its GPUs forever. A watchdog
thread started in `__init__` covers every incarnation, including one Ray restarted after
the sampler died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sampler_service.aio import TaskSet
from sampler_service.backends.base import (
    Backend,
    Completion,
    PauseMode,
    SamplingParams,
    Wave,
    packed,
)
from sampler_service.backends.engine_process import picklable
from sampler_service.backends.ray.channel import Finished, SentCancel, SentWave
from sampler_service.weights.types import NCCLDescription, NCCLUnavailable, WeightsRejected

log = logging.getLogger(__name__)

#: Fault hook for tests (off unless set): a path; the first replica that starts loading
#: weights while that file exists removes it and exits at once, as a replica killed in the
#: middle of a weight load would.
FAULT_EXIT_IN_LOAD_ENV = "ADAPTIVE_ROLLOUT_FAULT_EXIT_IN_LOAD"
#: An orphan whose graceful exit has not ended the process this long after it began is
#: killed through Ray (a call stuck in the engine keeps `exit_actor` waiting).
ORPHAN_EXIT_GRACE_S = 60.0
#: Fault hook for tests (off unless set): comma-separated `<replica index>` or
#: `<replica index>:<version>` entries; a replica named there refuses to load weights
#: (every version, or that version) with WeightsRejected, as a replica whose own vetting
#: refuses a file would, after the others may have installed it.
FAULT_REJECT_WEIGHTS_ENV = "ADAPTIVE_ROLLOUT_FAULT_REJECT_WEIGHTS"


def fault_rejects(spec: str | None, index: int, version: int) -> bool:
    """Whether the reject hook `spec` (FAULT_REJECT_WEIGHTS_ENV) names this load."""
    for entry in (spec or "").split(","):
        replica, _, only = entry.strip().partition(":")
        if replica.strip() == str(index) and (not only or only.strip() == str(version)):
            return True
    return False


class NotStarted(RuntimeError):
    """The replica's process is a fresh incarnation: its engine is not loaded yet."""


class Replica:
    """Actor body wrapping one backend; see the module docstring."""

    def __init__(
        self,
        factory: Callable[[], Backend],
        index: int,
        torch_threads: int = 1,
        orphan_s: float | None = None,
    ) -> None:
        self._factory = factory
        self._index = index
        self._torch_threads = torch_threads
        self._backend: Backend | None = None
        self._starting: asyncio.Lock | None = None
        self._inflight = 0
        self._generated_tokens = 0
        # The member's batched calls: its session, the waves running (each with the task
        # reading it), and answers finished but not collected.
        self._session = ""
        self._waves: dict[int, tuple[Wave, asyncio.Task[None]]] = {}
        self._finished: list[Finished] = []
        self._has_finished = asyncio.Event()
        self._wave_tasks = TaskSet()
        self._submit_calls = 0  # with _submitted_waves: how well the batching works
        self._submitted_waves = 0
        # Orphan watch (module docstring): when a sampler last called, and whether an
        # engine load (which may outlast the window) is under way.
        self._orphan_s = orphan_s
        self._last_heard = time.monotonic()
        self._loading_engine = False
        self._watching = False
        self._watch(orphan_s)

    # -- orphan exit --------------------------------------------------------------------
    def _watch(self, orphan_s: float | None) -> None:
        """Set the window (the latest sampler's wins) and start the watchdog once."""
        if orphan_s is None:
            return
        self._orphan_s = orphan_s
        if not self._watching:
            self._watching = True
            threading.Thread(target=self._watch_orphan, name="orphan-watch", daemon=True).start()

    def _heard(self) -> None:
        self._last_heard = time.monotonic()

    def _silent_s(self) -> float:
        """Seconds since a sampler last called (0 while the engine is being loaded)."""
        if self._loading_engine:
            return 0.0
        return time.monotonic() - self._last_heard

    def _watch_orphan(self) -> None:
        asked_at: float | None = None
        while True:
            window = self._orphan_s
            assert window is not None
            time.sleep(min(1.0, window / 5))
            if self._silent_s() <= window:
                asked_at = None  # a sampler called (the exit, if asked, was called off)
                continue
            if asked_at is None:
                asked_at = time.monotonic()
                self._request_exit()
            elif time.monotonic() - asked_at > ORPHAN_EXIT_GRACE_S:
                # exit_actor waits for the calls still running; one stuck in the engine
                # would keep the orphan alive, so it is killed (no restart) instead.
                log.warning("replica %d: orphan exit did not finish; killing it", self._index)
                self._kill_self()
                return

    def _request_exit(self) -> None:
        """Run `orphan_exit` as an actor task (exit_actor works only inside one)."""
        import ray

        ray.get_runtime_context().current_actor.orphan_exit.remote()

    def _kill_self(self) -> None:
        import ray

        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def orphan_exit(self) -> bool:
        """Close the engine and exit for good, unless a sampler called meanwhile (False)."""
        window = self._orphan_s
        silent = self._silent_s()
        if window is None or silent <= window:
            return False
        log.warning(
            "replica %d (pid %d) heard from no sampler (no call, no probe) for %.0fs "
            "(--replica-orphan-s %g): closing its engine and exiting",
            self._index,
            os.getpid(),
            silent,
            window,
        )
        if self._backend is not None:
            try:
                await asyncio.wait_for(self._backend.close(), ORPHAN_EXIT_GRACE_S / 2)
            except Exception as exc:  # noqa: BLE001 - exiting anyway
                log.warning("replica %d: engine close failed: %r", self._index, exc)
            self._backend = None
        import ray

        ray.actor.exit_actor()
        return True  # not reached

    def _info(self, attached: bool) -> dict[str, Any]:
        assert self._backend is not None
        return {
            "pid": os.getpid(),
            "name": self._backend.name,
            "model_name": self._backend.model_name,
            "policy_version": self._backend.policy_version,
            "specs": self._backend.weight_specs(),
            "cancels_answers": self._backend.cancels_answers,
            "continues": sorted(self._backend.continues),
            "orders_by_priority": self._backend.orders_by_priority,
            "attached": attached,
        }

    async def start(self, orphan_s: float | None = None, session: str = "") -> dict[str, Any]:
        """Load the engine once; later calls (a re-attaching sampler) report what runs.

        `attached` is True when the engine was already running: the caller is a new
        sampler taking over a warm replica. `orphan_s` replaces the orphan window the
        replica was created with (a re-attaching sampler's own setting applies).
        `session` is the caller's channel: finished waves are kept for it alone from now.
        """
        self._heard()
        self._watch(orphan_s)
        if session != self._session:
            self._session, self._finished = session, []
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._backend is not None:
                return self._info(attached=True)
            if self._torch_threads > 0:
                import torch

                torch.set_num_threads(self._torch_threads)
            self._loading_engine = True
            try:
                backend = self._factory()
                await backend.start()
            finally:
                self._loading_engine = False
                self._heard()
            self._backend = backend
            log.info("replica %d (pid %d) serving %s", self._index, os.getpid(), backend.model_name)
            return self._info(attached=False)

    def _engine(self) -> Backend:
        self._heard()  # every sampler call but start and health comes through here
        if self._backend is None:
            raise NotStarted(f"replica {self._index} (pid {os.getpid()}) has no engine loaded")
        return self._backend

    async def generate(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        """One wave in one call: for a second driver asking a replica directly (the fleet
        sends its waves through `submit_waves` and `collect_waves`)."""
        engine = self._engine()
        return await self._run(engine, prompt_token_ids, n, sampling)

    async def _run(
        self, engine: Backend, prompt_token_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        self._inflight += n
        try:
            out = await engine.generate(prompt_token_ids, n, sampling)
        finally:
            self._inflight -= n
            self._heard()
        self._generated_tokens += sum(len(c.token_ids) for c in out)
        return [packed(c) for c in out]

    # -- the member's batched calls (channel.py) ------------------------------------------
    def _check_session(self, session: str) -> None:
        if session != self._session:
            raise NotStarted(
                f"replica {self._index} (pid {os.getpid()}) serves another sampler session"
                if self._session
                else f"replica {self._index} (pid {os.getpid()}) has no engine loaded"
            )

    async def submit_waves(
        self, session: str, waves: list[SentWave], cancels: list[SentCancel]
    ) -> None:
        """Start each wave, then pass each cancel on to its wave; every answer goes to the
        session's next `collect_waves` as it finishes."""
        engine = self._engine()
        self._check_session(session)
        self._submit_calls += 1
        self._submitted_waves += len(waves)
        for call_id, prompt_token_ids, n, sampling, priorities in waves:
            self._wave_tasks.spawn(
                self._stream(engine, session, call_id, prompt_token_ids, n, sampling, priorities)
            )
        for call_id, indices in cancels:
            if (running := self._waves.get(call_id)) is None:
                continue  # finished before the cancel came
            wave, reader = running
            if indices is None:  # its reader left: stop what still runs
                reader.cancel()
            else:
                self._wave_tasks.spawn(self._cancel(wave, indices))

    async def _cancel(self, wave: Wave, indices: list[int]) -> None:
        try:
            await wave.cancel(indices)
        except Exception as exc:  # noqa: BLE001 - the answers still come back, finished
            log.warning("replica %d: a cancel of answers %s failed: %r", self._index, indices, exc)

    async def _stream(
        self,
        engine: Backend,
        session: str,
        call_id: int,
        prompt_token_ids: list[int],
        n: int,
        sampling: SamplingParams,
        priorities: tuple[int, ...],
    ) -> None:
        """Each answer of one wave to the session's collect, packed, as it finishes."""
        left = n
        self._inflight += n
        try:
            wave = engine.wave(prompt_token_ids, n, sampling, priorities=priorities)
            reader = asyncio.current_task()
            assert reader is not None
            self._waves[call_id] = (wave, reader)
            async for index, answer in wave:
                left -= 1
                self._inflight -= 1
                self._generated_tokens += len(answer.token_ids)
                self._answered(session, (call_id, index, packed(answer)))
        except Exception as exc:  # noqa: BLE001 - the wave's reader gets it
            self._answered(session, (call_id, None, picklable(exc)))
        finally:
            self._inflight -= left
            self._waves.pop(call_id, None)
            self._heard()

    def _answered(self, session: str, finished: Finished) -> None:
        if session == self._session:
            self._finished.append(finished)
            self._has_finished.set()

    async def collect_waves(self, session: str, timeout_s: float) -> list[Finished]:
        """Every wave of `session` finished since the last call; waits up to `timeout_s`
        for one."""
        self._heard()
        self._check_session(session)
        if not self._finished:
            self._has_finished.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._has_finished.wait(), timeout_s)
            self._check_session(session)  # another sampler may have taken over meanwhile
        finished, self._finished = self._finished, []
        return finished

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> float:
        """Install weights as `version`; returns the seconds the load took."""
        engine = self._engine()
        hook = os.environ.get(FAULT_EXIT_IN_LOAD_ENV)
        if hook:
            try:
                Path(hook).unlink()
            except FileNotFoundError:
                pass
            else:
                log.warning("fault hook: replica %d exits during a weight load", self._index)
                os._exit(1)
        self._fault_reject(version)
        started = time.monotonic()
        await engine.load_weights(tensors, version)
        return time.monotonic() - started

    def _fault_reject(self, version: int) -> None:
        if fault_rejects(os.environ.get(FAULT_REJECT_WEIGHTS_ENV), self._index, version):
            log.warning("fault hook: replica %d rejects weights v%d", self._index, version)
            raise WeightsRejected(f"fault hook: replica {self._index} rejects weights v{version}")

    async def load_weight_files(self, files: list[str], version: int) -> float:
        """Read and install weight files every replica can read (`serve --weights-dir`, or
        a path given to POST /v1/weights/load) as `version`; returns the seconds it took.

        The replica vets the files itself (headers, then every tensor: a path the front
        only checked the headers of may still hold NaN); a refusal raises WeightsRejected
        and changes nothing here.
        """
        from sampler_service.weights.vetting import vet_weight_files

        engine = self._engine()
        started = time.monotonic()
        tensors = await asyncio.to_thread(
            vet_weight_files, [Path(f) for f in files], engine.weight_specs()
        )
        await self.load_weights(tensors, version)
        return time.monotonic() - started

    # -- NCCL weight transfer (vLLM engines; the fleet fans the trainer's calls out) ------
    async def nccl_describe(self) -> NCCLDescription | None:
        """This engine's NCCL ranks, tensors and whether the transfer is configured, or
        None: its engine cannot take weights over NCCL (only the vLLM backend can)."""
        try:
            return await self._engine().nccl_describe()
        except NCCLUnavailable:
            return None

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        await self._engine().nccl_init(init_info)

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> float:
        started = time.monotonic()
        await self._engine().nccl_update(update_info, version)
        return time.monotonic() - started

    async def nccl_shutdown(self) -> None:
        await self._engine().nccl_shutdown()

    async def abort_all(self) -> int:
        self._heard()
        return await self._engine().abort_all() if self._backend is not None else 0

    async def pause(self, mode: PauseMode) -> None:
        await self._engine().pause_for_load(mode)

    async def resume(self) -> None:
        await self._engine().resume_after_load()

    async def policy_version(self) -> int:
        """The version its engine serves (a read, unlike `health`, which generates)."""
        return self._engine().policy_version

    async def health(self) -> dict[str, Any]:
        """The probe: the backend's own health, plus a 1-token generate when idle.

        An idle engine that hangs would otherwise look healthy until the next wave
        reached it; while waves run, their progress is the evidence. A probe is also what
        keeps an idle replica from counting as an orphan.
        """
        self._heard()
        if self._backend is None:
            return {"started": False, "ok": False, "pid": os.getpid()}
        health = self._backend.health()
        if health.ok and self._inflight == 0:
            await self._backend.generate([0], 1, SamplingParams(max_tokens=1))
        return {
            "started": True,
            "ok": health.ok,
            "pid": os.getpid(),
            "policy_version": self._backend.policy_version,
            "inflight": self._inflight,
            "generated_tokens": self._generated_tokens,
            "submit_calls": self._submit_calls,
            "submitted_waves": self._submitted_waves,
            "detail": health.detail,
        }

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()
            self._backend = None
