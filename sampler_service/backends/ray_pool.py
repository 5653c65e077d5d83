"""N engine replicas as Ray actors behind the one `Backend` interface the scheduler uses.

The sampler (the "front": API, scheduler, store, outbox) stays a single process and the
only Ray driver; each replica is a detached, named actor (`replica.py`) wrapping an
unchanged backend. Everything the scheduler relies on holds across replicas:

- Routing is sticky least-outstanding with an in-flight cap per replica, and re-issued
  waves go first (`routing.py`, shared with the HTTP engine pool).
- Waves reach a replica through its channel (`replica_channel.py`): those asked for in
  one event-loop turn share one Ray call, and finished ones come back together, each
  with its own result, as soon as it is done.
- A replica fault never reaches the scheduler. A dead process makes its pending calls
  raise; a hang fails the periodic health probe and the actor is killed. Either way its
  waves are re-issued whole on another replica (their partial answers never reach the
  scheduler, so nothing is counted twice), Ray restarts the actor, and the pool loads the
  committed weights into it before routing to it again.
- Weights: every usable replica loads the new version; it is committed only when all of
  them serve it, and only replicas at the committed version are routed to, so each
  sample's policy version is exact. A replica that fails to load is recycled (it comes
  back at the committed version); a file a replica rejects rolls every replica back.

Health: `ok` while a replica is routable; `degraded` while none is but one is recovering
(waves park, admission stops); `failed` once every replica has used up its restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from sampler_service.aio import TaskSet
from sampler_service.backends import base
from sampler_service.backends.replica import NotStarted, Replica
from sampler_service.backends.replica_channel import ReplicaChannel
from sampler_service.backends.routing import DEFAULT_MAX_INFLIGHT, WaveRouter, affinity
from sampler_service.config import ReplicaSettings
from sampler_service.metrics import Metrics
from sampler_service.weights.nccl import (
    NO_NCCL_GROUP,
    NCCLGroup,
    nccl_group_for_update,
    nccl_group_state,
    nccl_replica_init_infos,
    nccl_replicas,
)

log = logging.getLogger(__name__)

#: Ray namespace of every replica actor; names are `adaptive-rollout/<instance>/replica-<i>`.
NAMESPACE = "adaptive-rollout"
#: A local Ray (no address): object store size; weights travel through it once per update.
LOCAL_OBJECT_STORE_BYTES = 512 * 1024**2

#: Seconds an actor may answer "died" after a failure before it counts as gone for good.
_DEATH_SETTLE_S = 15.0

#: Why a replica's waves were re-issued (label `reason`).
REISSUE_REASONS = (
    "died",
    "hung",
    "restarted",
    "unhealthy",
    "stale_version",
    "weights",
    "rollback",
    "start",
)

ReplicaState = Literal["starting", "ok", "recovering", "failed"]
_STATES: tuple[ReplicaState, ...] = ("starting", "ok", "recovering", "failed")


#: How long a replica's engine may take to start (load the model) before it counts as failed.
START_TIMEOUT_S = 600.0


@dataclass(eq=False)
class _Replica:
    index: int
    name: str
    handle: Any
    state: ReplicaState = "starting"
    version: int = -1
    pid: int | None = None
    inflight: int = 0
    restarts: int = 0
    #: Bumped at every detected failure: a call that started in an older epoch reports
    #: its error without failing the replica a second time.
    epoch: int = 0
    last_ok: float = 0.0
    reason: str = ""
    error: str | None = None
    reissued: int = 0
    attached: bool = False
    probing: bool = False
    #: The process this pool asked Ray to kill: until Ray's kill lands, calls may still
    #: reach it, and it is not a new incarnation.
    killed_pid: int | None = None
    #: Its per-wave metric series (in-flight gauge, wave seconds, generated tokens), looked
    #: up once: a toy model's waves take milliseconds, so per-wave lookups add up.
    series: tuple[Any, Any, Any] | None = None
    #: Its waves go through this (batched Ray calls).
    channel: ReplicaChannel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = ReplicaChannel(self.handle)

    def detail(self) -> dict[str, Any]:
        return {
            "replica": self.index,
            "name": self.name,
            "state": self.state,
            "pid": self.pid,
            "policy_version": self.version,
            "inflight_samples": self.inflight,
            "restarts": self.restarts,
            "reissued_waves": self.reissued,
            "error": self.error,
        }


#: Where committed weights can be loaded from again: ("ref", ObjectRef) or ("files", paths).
_Source = tuple[Literal["ref", "files"], Any]


class _ReplicaFailed(RuntimeError):
    """The wave's replica was found failed while the wave ran (the pool re-issues it)."""


class _KillPending(RuntimeError):
    """The process asked to die still answers: `ray.kill` has not landed yet."""


class RayPoolBackend(base.Backend):
    """See the module docstring."""

    name = "ray"
    reads_weight_files = True

    def __init__(
        self,
        factory: Callable[[], base.Backend],
        settings: ReplicaSettings,
        *,
        instance_id: str,
        torch_threads: int = 1,
        metrics: Metrics | None = None,
        on_state_change: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """`instance_id` names this sampler's replicas (a restarted one finds them);
        `torch_threads` is each replica engine's torch thread count."""
        self._factory = factory
        self.settings = settings
        self._instance_id = instance_id
        self._torch_threads = torch_threads
        self.metrics = metrics or Metrics()
        # Told every replica state change (its detail plus `previous`), for the event log.
        self._on_state_change = on_state_change
        self._replicas: list[_Replica] = []
        self._router: WaveRouter[_Replica] = WaveRouter(
            lambda: self._replicas,
            self._routable,
            self._charge,
            max_inflight=settings.max_inflight or DEFAULT_MAX_INFLIGHT,
            route=settings.route,
            poll_s=settings.probe_s,
            wait_s=settings.wait_s,
            on_decision=lambda kind: self.metrics.route_decisions.labels(kind).inc(),
        )
        self._committed_version = 0
        # Where the committed weights can be loaded from again (a restarted replica, a
        # rollback): ("ref", ObjectRef of the tensors) or ("files", paths every replica
        # reads); None: the base model. `_source_version` is its version: below the
        # committed one once an NCCL round committed weights that exist only in engines.
        self._source: _Source | None = None
        self._source_version = 0
        self._source_names: frozenset[str] = frozenset()
        self._nccl: NCCLGroup | None = None
        self._loading = False
        self._serving = False
        self._owns_ray = False
        self._weights_lock = asyncio.Lock()
        self._tasks = TaskSet()
        self._info: dict[str, Any] = {"model_name": "", "specs": {}}

    # -- life cycle -------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return str(self._info["model_name"])

    @property
    def policy_version(self) -> int:
        return self._committed_version

    def weight_specs(self) -> Mapping[str, base.TensorSpec]:
        return self._info["specs"]

    def actor_name(self, index: int) -> str:
        return f"adaptive-rollout/{self._instance_id}/replica-{index}"

    def _init_ray(self) -> None:
        s = self.settings
        if ray.is_initialized():  # the caller's own Ray session (benchmarks): theirs to end
            return
        self._owns_ray = True
        if s.ray_address is not None:
            ray.init(address=s.ray_address, namespace=NAMESPACE, configure_logging=False)
        else:
            ray.init(
                namespace=NAMESPACE,
                num_cpus=max(1, round(s.count * s.cpus)),
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                configure_logging=False,
            )

    async def start(self) -> None:
        s = self.settings
        await asyncio.to_thread(self._init_ray)
        actor_class = ray.remote(Replica)
        for i in range(s.count):
            handle = actor_class.options(
                name=self.actor_name(i),
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=s.max_restarts,
                max_task_retries=0,
                max_concurrency=1000,
                num_cpus=s.cpus,
                num_gpus=s.gpus,
            ).remote(self._factory, i, self._torch_threads, s.orphan_s)
            self._replicas.append(_Replica(i, self.actor_name(i), handle))
            self._precreate_metrics(str(i))
        # No weights yet: the sampler restores the committed ones next (load_weights),
        # and a re-attached replica already serving them keeps them.
        results = await asyncio.gather(
            *(self._start_replica(rep, sync=False) for rep in self._replicas),
            return_exceptions=True,
        )
        if all(isinstance(r, BaseException) for r in results):
            raise RuntimeError(f"no engine replica started: {results[0]!r}")
        for rep, result in zip(self._replicas, results, strict=True):
            if isinstance(result, BaseException):
                self._fail(rep, rep.epoch, "start", repr(result), kill=True)
        self._tasks.spawn(self._probe_loop(), "replica-probes")
        log.info(
            "%d engine replicas: %s",
            s.count,
            ", ".join(f"{r.name} pid {r.pid} v{r.version}" for r in self._replicas),
        )

    def _precreate_metrics(self, label: str) -> None:
        """Every known series at zero, so rate() and increase() work before the first event."""
        m = self.metrics
        for series in (m.replica_generated_tokens, m.replica_restarts, m.replica_wasted_samples):
            series.labels(label)
        for reason in REISSUE_REASONS:
            m.replica_reissued_waves.labels(label, reason)
        for kind in ("sticky", "moved", "new"):
            m.route_decisions.labels(kind)

    async def _start_replica(self, rep: _Replica, sync: bool = True) -> None:
        info = await asyncio.wait_for(
            rep.handle.start.remote(self.settings.orphan_s, rep.channel.session),
            START_TIMEOUT_S,
        )
        if info["attached"]:
            # A new sampler takes over a warm replica: whatever the old one asked of it
            # is nobody's any more.
            await rep.handle.abort_all.remote()
        if rep.killed_pid is not None and info["pid"] == rep.killed_pid:
            raise _KillPending(f"replica {rep.index}: pid {rep.killed_pid} is not dead yet")
        rep.killed_pid = None
        if not self._info["specs"]:
            self._info = info
        rep.pid, rep.version, rep.attached = (
            info["pid"],
            int(info["policy_version"]),
            info["attached"],
        )
        if sync:
            await self._sync_weights(rep)
        self._set_state(rep, "ok")

    async def close(self) -> None:
        await self._tasks.cancel()
        for rep in self._replicas:
            await rep.channel.close()
        self._router.cancel_all()
        if self.settings.on_exit == "kill":
            for rep in self._replicas:
                with contextlib.suppress(Exception):
                    ray.kill(rep.handle, no_restart=True)
        if self._owns_ray and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)

    # -- state ------------------------------------------------------------------------
    def _set_state(self, rep: _Replica, state: ReplicaState) -> None:
        previous, rep.state = rep.state, state
        if state == "ok":
            rep.last_ok = time.monotonic()
            rep.error = None
        label = str(rep.index)
        for s in _STATES:
            self.metrics.replica_state.labels(label, s).set(1.0 if s == state else 0.0)
        self.metrics.replica_policy_version.labels(label).set(rep.version)
        if previous != state and self._on_state_change is not None:
            self._on_state_change({**rep.detail(), "previous": previous})
        self._dispatch()

    def _routable(self, rep: _Replica) -> bool:
        return (
            rep.state == "ok"
            and rep.version == self._committed_version
            and not self._loading
            and time.monotonic() - rep.last_ok
            <= self.settings.probe_timeout_s + self.settings.probe_s
        )

    def health(self) -> base.BackendHealth:
        usable = any(r.state == "ok" for r in self._replicas)
        failed = bool(self._replicas) and all(r.state == "failed" for r in self._replicas)
        detail: dict[str, Any] = {
            "policy_version": self._committed_version,
            "replicas": [r.detail() for r in self._replicas],
        }
        if failed:
            detail["error"] = "every engine replica failed and used up its restarts: " + "; ".join(
                f"replica {r.index}: {r.error}" for r in self._replicas
            )
        state: base.HealthState = "ok" if usable else "failed" if failed else "degraded"
        return base.BackendHealth(ok=usable, detail=detail, state=state)

    # -- routing ----------------------------------------------------------------------
    def _dispatch(self) -> None:
        self._router.dispatch()

    def _series(self, rep: _Replica) -> tuple[Any, Any, Any]:
        if rep.series is None:
            m, label = self.metrics, str(rep.index)
            rep.series = (
                m.replica_inflight_samples.labels(label),
                m.replica_wave_seconds.labels(label),
                m.replica_generated_tokens.labels(label),
            )
        return rep.series

    def _charge(self, rep: _Replica, n: int) -> None:
        rep.inflight += n
        self._series(rep)[0].set(rep.inflight)

    def _release(self, rep: _Replica, n: int) -> None:
        self._router.release(rep, n)

    async def _acquire(self, key: int, n: int, reissue: bool = False) -> _Replica:
        return await self._router.acquire(key, n, reissue)

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        sampling: base.SamplingParams,
        *,
        affinity_key: str | None = None,
    ) -> list[base.Completion]:
        self._serving = True  # the sampler restored its weights before the first wave
        prompt = list(prompt_token_ids)
        key = affinity(prompt, affinity_key)
        reissue = False
        while True:
            rep = await self._acquire(key, n, reissue)
            epoch, started = rep.epoch, time.monotonic()
            try:
                out = await rep.channel.generate(prompt, n, sampling)
            except base.GenerationAborted:
                raise  # a weight update's abort: the scheduler re-issues it after the update
            except (RayActorError, NotStarted, _ReplicaFailed) as exc:
                # The replica died, was restarted by Ray before a probe noticed, or was
                # found failed meanwhile (then its epoch moved on and this fails nothing).
                reason = "died" if isinstance(exc, RayActorError) else "restarted"
                self._fail(rep, epoch, reason, repr(exc), kill=False)
                self._count_reissue(rep, n)
                reissue = True
                continue
            finally:
                self._release(rep, n)
            rep.last_ok = time.monotonic()
            _, wave_seconds, generated_tokens = self._series(rep)
            wave_seconds.observe(rep.last_ok - started)
            generated_tokens.inc(sum(len(c.token_ids) for c in out))
            return out

    def _count_reissue(self, rep: _Replica, n: int) -> None:
        rep.reissued += 1
        label = str(rep.index)
        self.metrics.replica_reissued_waves.labels(label, rep.reason or "died").inc()
        self.metrics.replica_wasted_samples.labels(label).inc(n)

    # -- failure and recovery ---------------------------------------------------------
    def _fail(self, rep: _Replica, epoch: int, reason: str, error: str, *, kill: bool) -> None:
        """Take a replica out of rotation once per failure, restart it, bring it back."""
        if epoch != rep.epoch or rep.state in ("recovering", "failed"):
            return
        rep.epoch += 1
        rep.reason, rep.error = reason, error
        rep.channel.fail_all(_ReplicaFailed(f"replica {rep.index} failed ({reason}): {error}"))
        log.warning("replica %d (pid %s) failed (%s): %s", rep.index, rep.pid, reason, error)
        if kill:
            rep.killed_pid = rep.pid
            with contextlib.suppress(Exception):
                ray.kill(rep.handle, no_restart=False)
        self._set_state(rep, "recovering")
        self._tasks.spawn(self._recover(rep), f"recover-replica-{rep.index}")

    async def _recover(self, rep: _Replica) -> None:
        """Wait for Ray's restart of the actor, then start it and load the committed weights.

        Each failure is one restart; a replica whose new incarnation fails to come up is
        recycled again, until its restarts are used up (or Ray gives up on the actor).
        """
        while True:
            rep.restarts += 1
            self.metrics.replica_restarts.labels(str(rep.index)).inc()
            if rep.restarts > self.settings.max_restarts:
                log.error(
                    "replica %d used up its %d restarts", rep.index, self.settings.max_restarts
                )
                self._set_state(rep, "failed")
                return
            began = time.monotonic()
            deadline = began + START_TIMEOUT_S
            try:
                while True:
                    try:
                        await self._start_replica(rep)
                        break
                    # Ray is still restarting it, or the killed process still answers
                    except (ActorUnavailableError, _KillPending):
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.5)
                    except ActorDiedError:
                        # Right after a death a call may still see the old incarnation's
                        # error; an actor Ray gave up on keeps answering it.
                        if time.monotonic() > began + _DEATH_SETTLE_S:
                            raise
                        await asyncio.sleep(1.0)
            except ActorDiedError as exc:  # Ray will not restart it any more
                rep.error = repr(exc)
                log.error("replica %d is gone for good: %r", rep.index, exc)
                self._set_state(rep, "failed")
                return
            except Exception as exc:  # noqa: BLE001 - any failure to come back is one more restart
                rep.error = repr(exc)
                log.warning("replica %d did not come back: %r", rep.index, exc)
                rep.killed_pid = rep.pid
                with contextlib.suppress(Exception):
                    ray.kill(rep.handle, no_restart=False)
                await asyncio.sleep(1.0)
                continue
            log.info("replica %d back (pid %s) at v%d", rep.index, rep.pid, rep.version)
            return

    async def _sync_weights(self, rep: _Replica) -> None:
        """Bring a replica to the committed version; re-checked, as a commit may land meanwhile.

        Weights committed over NCCL exist only in the engines: a replica that missed them
        loads the last file or object-store weights and waits for the trainer's next NCCL
        round (it is not routed to meanwhile).
        """
        while rep.version != self._committed_version:
            version, source = self._source_version, self._source
            if rep.version == version:
                return  # only the next NCCL round brings the committed version
            if source is None:
                raise RuntimeError(
                    f"replica {rep.index} serves v{rep.version} and the committed v{version} "
                    "is the base model: it must be restarted"
                )
            seconds = await self._load_source(rep, source, version)
            self.metrics.replica_weight_load_seconds.labels(str(rep.index)).observe(seconds)
            rep.version = version

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.probe_s)
            for rep in self._replicas:
                if rep.state == "ok" and not rep.probing:
                    rep.probing = True
                    self._tasks.spawn(self._probe(rep), f"probe-replica-{rep.index}")

    async def _probe(self, rep: _Replica) -> None:
        epoch = rep.epoch
        try:
            result = await asyncio.wait_for(
                rep.handle.health.remote(), self.settings.probe_timeout_s
            )
        except TimeoutError:
            self._fail(
                rep,
                epoch,
                "hung",
                f"no probe answer in {self.settings.probe_timeout_s}s",
                kill=True,
            )
            return
        except RayActorError as exc:
            self._fail(rep, epoch, "died", repr(exc), kill=False)
            return
        finally:
            rep.probing = False
        if not result["started"] or result["pid"] != rep.pid:
            self._fail(rep, epoch, "restarted", f"new process {result['pid']}", kill=False)
        elif not result["ok"]:
            self._fail(rep, epoch, "unhealthy", str(result.get("detail")), kill=True)
        elif (
            self._serving
            and rep.version != self._committed_version
            and not self._weights_lock.locked()
            and not self._awaits_nccl(rep)
        ):
            # A re-attached replica at a version the sampler no longer has: start afresh.
            self._fail(rep, epoch, "stale_version", f"serves v{rep.version}", kill=True)
        elif rep.epoch == epoch:
            rep.last_ok = time.monotonic()

    # -- weights ----------------------------------------------------------------------
    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Ship vetted tensors to every replica once, through Ray's object store."""
        ref = await asyncio.to_thread(ray.put, dict(tensors))
        await self._load_all(("ref", ref), version, frozenset(tensors))

    async def load_weight_files(
        self, files: Sequence[str], version: int, names: Sequence[str]
    ) -> None:
        """Have every replica read weight files itself (a path each one can read: `serve
        --weights-dir`, or POST /v1/weights/load); `names` are the tensors they hold."""
        await self._load_all(("files", [str(f) for f in files]), version, frozenset(names))

    async def _load_all(self, source: _Source, version: int, names: frozenset[str]) -> None:
        async with self._weights_lock:
            targets = [r for r in self._replicas if r.state == "ok"]
            if not targets:
                raise base.WeightsNotServed("no engine replica is up to load the weights")
            self._loading = True
            try:
                results = await asyncio.gather(
                    *(self._load_one(r, source, version) for r in targets), return_exceptions=True
                )
            finally:
                self._loading = False
            rejected = [
                base.WeightsRejected(f"replica {rep.index}: {getattr(r, 'cause', None) or r}")
                for rep, r in zip(targets, results, strict=True)
                if isinstance(r, base.WeightsRejected)
            ]
            if rejected:
                # Every replica that installed it goes back to the committed weights.
                await self._roll_back([r for r in targets if r.version == version], names)
            for rep, result in zip(targets, results, strict=True):
                if isinstance(result, BaseException) and not isinstance(
                    result, base.WeightsRejected
                ):
                    # A dead replica is being restarted by Ray already; a live one that
                    # failed is recycled so that it comes back clean.
                    dead = isinstance(result, RayActorError)
                    self._fail(rep, rep.epoch, "weights", repr(result), kill=not dead)
            if rejected:
                self._dispatch()
                raise rejected[0]
            serving = [r for r in targets if r.state == "ok" and r.version == version]
            if not serving:
                self._dispatch()
                raise base.WeightsNotServed(
                    f"no engine replica installed v{version}: "
                    + "; ".join(f"replica {r.index}: {r.error}" for r in targets)
                )
            self._committed_version = version
            self._source, self._source_version, self._source_names = source, version, names
            for rep in self._replicas:
                self.metrics.replica_policy_version.labels(str(rep.index)).set(rep.version)
                if rep.state == "ok" and rep.version != version:
                    # Came back from a restart during the load, at the old version.
                    self._tasks.spawn(self._resync(rep), f"resync-replica-{rep.index}")
            self._dispatch()

    async def _roll_back(self, installed: list[_Replica], names: frozenset[str]) -> None:
        """Return replicas that installed refused weights to the committed ones.

        In place when the committed source names every tensor the refused update changed
        (loading it restores them all); otherwise (the base model, or a partial source)
        the replica is restarted, which loads the base model and then the committed
        weights. Replicas at another version than the committed one are not routed to,
        so no sample comes from the refused weights either way.
        """

        async def one(rep: _Replica) -> None:
            epoch, source = rep.epoch, self._source
            if source is not None and names <= self._source_names:
                try:
                    seconds = await self._load_source(rep, source, self._source_version)
                except Exception as exc:  # noqa: BLE001 - falls back to a restart
                    log.warning("replica %d: in-place rollback failed: %r", rep.index, exc)
                else:
                    rep.version = self._source_version
                    self.metrics.replica_weight_load_seconds.labels(str(rep.index)).observe(seconds)
                    log.info("replica %d rolled back to v%d in place", rep.index, rep.version)
                    return
            self._fail(rep, epoch, "rollback", "rolled back (restart)", kill=True)

        await asyncio.gather(*(one(r) for r in installed))

    async def _resync(self, rep: _Replica) -> None:
        epoch = rep.epoch
        try:
            async with self._weights_lock:
                await self._sync_weights(rep)
        except Exception as exc:  # noqa: BLE001 - a replica that cannot load is recycled
            self._fail(rep, epoch, "weights", repr(exc), kill=True)
            return
        if rep.epoch == epoch:
            self._set_state(rep, "ok")

    async def _load_one(self, rep: _Replica, source: _Source, version: int) -> None:
        if rep.version == version:  # a re-attached replica already serving it
            return
        seconds = await self._load_source(rep, source, version)
        rep.version = version
        self.metrics.replica_weight_load_seconds.labels(str(rep.index)).observe(seconds)

    async def _load_source(self, rep: _Replica, source: _Source, version: int) -> float:
        kind, payload = source
        if kind == "files":
            return float(await rep.handle.load_weight_files.remote(payload, version))
        return float(await rep.handle.load_weights.remote(payload, version))

    def _awaits_nccl(self, rep: _Replica) -> bool:
        """A replica at the last file weights while newer ones came over NCCL: it waits
        for the trainer's next NCCL round."""
        return self._source_version != self._committed_version and rep.version == (
            self._source_version
        )

    # -- NCCL fan-out (vLLM replicas) ---------------------------------------------------
    async def _nccl_members(self) -> list[tuple[_Replica, base.NCCLDescription]]:
        """(replica, its engine's NCCL description) for every replica up now;
        NCCLUnavailable unless each one's engine can take weights over NCCL."""
        reps = [r for r in self._replicas if r.state == "ok"]
        if not reps:
            raise base.NCCLUnavailable("no engine replica is up")
        described = await asyncio.gather(*(r.handle.nccl_describe.remote() for r in reps))
        if any(d is None for d in described):
            raise base.NCCLUnavailable("NCCL weight transfer needs --backend vllm")
        return list(zip(reps, described, strict=True))

    async def nccl_describe(self) -> base.NCCLDescription:
        """The group over the replicas up now: ranks summed, each replica's offset."""
        pairs = await self._nccl_members()
        workers = [d.inference_ranks for _, d in pairs]
        first = pairs[0][1]
        return base.NCCLDescription(
            enabled=all(d.enabled for _, d in pairs),
            inference_ranks=sum(workers),
            specs=first.specs,
            required=first.required,
            group=self.nccl_group_state(),
            replicas=nccl_replicas([{"replica": rep.index} for rep, _ in pairs], workers),
            stale=self._nccl_stale_reason(),
        )

    def nccl_group_state(self) -> str:
        return nccl_group_state(self._nccl, self._nccl_stale_reason())

    def _nccl_stale_reason(self) -> str | None:
        """A replica's (pid, epoch) when it joined: a restart changes both."""
        if self._nccl is None:
            return NO_NCCL_GROUP
        return self._nccl.stale_reason(
            (r.index, f"replica {r.index}", r.state == "ok", (r.pid, r.epoch))
            for r in self._replicas
        )

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        """Form the group: every replica up joins at its own rank offset (trainer = 0)."""
        self._nccl = None
        pairs = await self._nccl_members()
        if not all(d.enabled for _, d in pairs):
            raise base.NCCLUnavailable(
                "NCCL weight transfer is off (vLLM weight_transfer_config not set)"
            )
        workers = [d.inference_ranks for _, d in pairs]
        per_replica = nccl_replica_init_infos(init_info, workers)
        members: dict[int, Hashable] = {rep.index: (rep.pid, rep.epoch) for rep, _ in pairs}
        results = await asyncio.gather(
            *(
                rep.handle.nccl_init.remote(info)
                for (rep, _), info in zip(pairs, per_replica, strict=True)
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        self._nccl = NCCLGroup(members, workers)
        log.info("NCCL group formed over the replicas: %s", self._nccl)

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        """Every member receives the trainer's broadcast and serves it as `version`.

        Refused with NCCLGroupStale before any transfer when the group no longer spans
        the replicas. A round that fails on some replica leaves the group unusable (the
        trainer forms it again); the version is committed if any replica installed it,
        and the others wait for the next round.
        """
        async with self._weights_lock:
            group = nccl_group_for_update(self._nccl, self._nccl_stale_reason())
            targets = [self._replicas[i] for i in group.members]
            self._loading = True
            try:
                results = await asyncio.gather(
                    *(r.handle.nccl_update.remote(update_info, version) for r in targets),
                    return_exceptions=True,
                )
            finally:
                self._loading = False
            failures = []
            for rep, result in zip(targets, results, strict=True):
                if not isinstance(result, BaseException):
                    rep.version = version
                    self.metrics.replica_weight_load_seconds.labels(str(rep.index)).observe(
                        float(result)
                    )
                    continue
                failures.append(f"replica {rep.index}: {result}")
                if isinstance(result, RayActorError):
                    self._fail(rep, rep.epoch, "weights", repr(result), kill=False)
                else:
                    with contextlib.suppress(Exception):  # what its engine serves now
                        health = await rep.handle.health.remote()
                        rep.version = int(health["policy_version"])
            if failures:
                self._nccl = None
            if any(r.version == version for r in targets):
                self._committed_version = version
                for rep in self._replicas:
                    self.metrics.replica_policy_version.labels(str(rep.index)).set(rep.version)
            self._dispatch()
            if failures:
                served = self._committed_version
                raise RuntimeError(
                    f"NCCL weight update to version {version} failed on "
                    + "; ".join(failures)
                    + f"; serving v{served}; form the NCCL group again"
                )

    async def nccl_shutdown(self) -> None:
        group, self._nccl = self._nccl, None
        if group is None:
            return
        calls = [
            self._replicas[i].handle.nccl_shutdown.remote()
            for i in group.members
            if self._replicas[i].state == "ok"
        ]
        await asyncio.gather(*calls, return_exceptions=True)

    async def abort_all(self) -> int:
        calls = [r.handle.abort_all.remote() for r in self._replicas if r.state == "ok"]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return sum(r for r in results if isinstance(r, int))

    # -- introspection (tests, benchmarks, /v1/stats) -----------------------------------
    async def replica_health(self, index: int) -> dict[str, Any]:
        """Replica `index`'s own answer to a health probe (with its call counters)."""
        return dict(await self._replicas[index].handle.health.remote())
