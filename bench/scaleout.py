"""Scale-out with engine replicas as Ray actors: routing, the Ray hop, and failover time;
and several fronts sharing one prompt set and one trainer, in simulation.

Five measurements, each side by side in one run on one local Ray:

1. **Routing scales**: the real scheduler drives N = 1, 2, 4, 8 replicas of the simulated
   engine (`bench/sim_backend.py`, real time, each in its own Ray actor) through the
   real fleet; groups/s at N against N x the groups/s of one replica (target >= 0.9).
   The simulated engine sleeps instead of computing, so this measures what the front and
   Ray add (routing, the Ray calls that carry the waves), not the machine's compute.
2. **Ray hop**: one hf replica of the toy model through the fleet against the same engine
   in a child process (the default `--hf-engine process`); groups/s ratio (target >= 0.95)
   at the service's default admission (64 active prompts) and at 16, where the engine
   waits on every wave's round trip, so Ray's per-call latency shows in full.
3. **Affinity under a slow replica**: two simulated replicas, one decoding 5x slower;
   its share of the waves (sticky routing must give way: target < 1/2).
4. **Kill to re-issue**: two simulated replicas; one is killed with SIGKILL while it has
   waves in flight; the time until every wave in flight at the kill has finished
   (re-issued on the survivor), next to the median wave time. Repeated `--kills` times
   (a fresh fleet each), as one kill lands at a random point of the waves.
5. **Call costs**: one hf replica, waves sent one Ray call each vs through the fleet's
   channel (driver CPU per burst), and one wave's latency through the fleet, the engine
   process and an empty Ray call.

6. **Several fronts** (no Ray; simulated time, `bench/virtual_clock.py`): S fronts, each
   the real scheduler on its shard of the prompts (a stable hash of the prompt id modulo
   S) with its own simulated engine, and one trainer that takes B groups per step, the
   oldest frames first from whichever front formed them, trains, pushes each version to
   every front through its weight barrier and acks. With `max_staleness` 1 on every
   front: the samples' lag when each front frames B groups (as one front does today) or
   B / S, groups trained per hour, and with one front's engine 3x slower, that front's
   share of the groups and how often its shard's prompts are visited. Its results go to
   `bench/results/scaleout_fronts.json` whenever it runs (they do not depend on the
   machine).

    .venv/bin/python -m bench.scaleout --quick     # the default 3 Ray-hop pairs per level
    .venv/bin/python -m bench.scaleout --quick --pairs 5   # 5 Ray-hop pairs per level
    .venv/bin/python -m bench.scaleout --quick --only kill # one part, results not written
    .venv/bin/python -m bench.scaleout --only fronts       # the fronts simulation (~20 s)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import functools
import hashlib
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import virtual_clock
from bench.common import ROOT, environment, grpo, table, write_json
from bench.sim_backend import EngineSpec, SimBackend, sim_scheduler, verify_reward_text
from sampler_service.backends.base import (
    Backend,
    Completion,
    SamplingParams,
    Wave,
    WaveRequest,
    WholeWave,
)
from sampler_service.config import SamplerConfig
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.finalize import VolatileSink
from sampler_service.scheduler import Scheduler
from sampler_service.verifiers.base import Verdict
from sampler_service.weights.types import TensorSpec
from trainer_client.contract.protocol import Group

#: A replica of the simulated engine: 64 sequences, 50 ms per decode step, short answers
#: (~16 tokens): about 80 answers/s each, so 8 replicas stay within what one front core
#: verifies and routes on a small machine.
SIM_SPEC = EngineSpec.fixed_step(64, step_s=0.05, length_median=16.0, length_sigma=0.3)
PROMPTS = 512


class RateSink(VolatileSink):
    """Counts formed groups by time; nothing is buffered, so admission never stops."""

    def __init__(self) -> None:
        self.times: list[float] = []

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        now = time.monotonic()
        self.times.extend(now for _ in groups)

    def buffered(self) -> int:
        return 0

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.times) / (end - start)


class Timed(Backend):
    """Records when each wave was issued and when it came back, around another backend
    (read whole: its answers come back together)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[float, float]] = []

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def whole_waves_cheaper(self) -> bool:
        return self.inner.whole_waves_cheaper

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def issue(self, request: WaveRequest) -> Wave:
        return WholeWave(self._timed(request), request.n)

    async def _timed(self, request: WaveRequest) -> list[Completion]:
        started = time.monotonic()
        out = await self.inner.issue(request).answers()
        self.calls.append((started, time.monotonic()))
        return out

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return self.inner.weight_specs()

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        await self.inner.load_weights(tensors, version)

    def health(self) -> Any:
        return self.inner.health()


def _sim_dataset(work: Path) -> tuple[Dataset, np.ndarray]:
    rates = np.random.default_rng(0).uniform(0.15, 0.85, PROMPTS)
    path = work / "sim.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"p{i}", "answer": ""}) + "\n"
            for i in range(PROMPTS)
        )
    )

    def tokenize(row: PromptRow) -> None:  # the simulated engine reads the prompt index
        row.text = str(row.prompt)
        row.token_ids = [int(row.id[1:])] + [0] * 15

    return Dataset([path], tokenize, seed=0), rates


def _pool(
    factory: Any, replicas: int, tag: str, torch_threads: int = 0, max_inflight: int = 96
) -> Any:
    """A fleet on the bench's Ray session; the simulated engine's cap is 1.5 x its 64 seqs."""
    from sampler_service.backends.ray.transport import build_ray_fleet
    from sampler_service.config import ReplicaSettings

    settings = ReplicaSettings(
        count=replicas, cpus=0.1, max_inflight=max_inflight, probe_s=1.0, probe_timeout_s=10.0
    )
    return build_ray_fleet(
        factory, settings, instance_id=f"bench-{tag}-{os.getpid()}", torch_threads=torch_threads
    )


def _replica(pool: Any, index: int) -> Any:
    """A fleet's replica `index`: its actor handle, its channel, its own health answer."""
    return pool.table.seats[index].member


async def _drive(
    backend: Backend,
    dataset: Dataset,
    verify: Any,
    cfg: SamplerConfig,
    warmup_s: float,
    measure_s: float,
    during: Any = None,
) -> tuple[float, RateSink]:
    """Groups/s of the real scheduler over `measure_s` after `warmup_s`."""
    sink = RateSink()
    scheduler = Scheduler(backend=backend, dataset=dataset, verify=verify, sink=sink, config=cfg)
    scheduler.start()
    try:
        await asyncio.sleep(warmup_s)
        start = time.monotonic()
        if during is not None:
            await during()
        await asyncio.sleep(max(0.0, start + measure_s - time.monotonic()))
        end = time.monotonic()
    finally:
        await scheduler.stop(drain_timeout_s=5.0)
    return sink.rate(start, end), sink


def _sim_config(replicas: int) -> SamplerConfig:
    return SamplerConfig(
        rule="balanced",
        stopping="wave",  # as the committed figures were measured
        n_max=16,
        wave_size=8,
        group_size=4,
        max_tokens=64,
        max_active_prompts=16 * replicas,
        max_buffered_groups=100_000,
        max_staleness=None,  # no trainer: engine throughput alone
    )


async def routing(work: Path, counts: list[int], warmup_s: float, measure_s: float) -> list[dict]:
    dataset, rates = _sim_dataset(work)
    rows = []
    base = None
    for n in counts:
        factory = functools.partial(SimBackend, rates.tolist(), SIM_SPEC)
        pool = _pool(factory, n, f"sim{n}")
        await pool.start()
        try:
            rate, _ = await _drive(
                pool, dataset, verify_reward_text, _sim_config(n), warmup_s, measure_s
            )
        finally:
            await pool.close()
        decisions = {
            kind: pool.metrics.registry.get_sample_value(
                "adaptive_rollout_route_decisions_total", {"kind": kind}
            )
            or 0.0
            for kind in ("sticky", "moved", "new")
        }
        # Of the waves whose prompt had run before, the share sent back to its replica.
        sticky = decisions["sticky"] / max(decisions["sticky"] + decisions["moved"], 1.0)
        base = base or rate
        rows.append(
            {
                "replicas": n,
                "sticky_share": sticky,
                "groups_per_s": rate,
                "speedup": rate / base,
                "of_ideal": rate / (base * n),
            }
        )
        print(rows[-1], flush=True)
    return rows


@dataclasses.dataclass(frozen=True)
class _SlowedFirst:
    """Factory of the simulated engine whose replica 0 decodes `factor` x slower.

    The fleet builds every replica's engine with one factory; this one asks Ray which
    replica it is building for.
    """

    rates: list[float]
    factor: float

    def __call__(self) -> SimBackend:
        import ray

        name = ray.get_runtime_context().get_actor_name() or ""
        slow = name.endswith("/replica-0")
        step = SIM_SPEC.step_base_s * (self.factor if slow else 1.0)
        return SimBackend(self.rates, dataclasses.replace(SIM_SPEC, step_base_s=step))


async def affinity(work: Path, warmup_s: float, measure_s: float, factor: float) -> dict:
    """Two simulated replicas, replica 0 `factor` x slower: the waves it gets, the groups/s."""
    dataset, rates = _sim_dataset(work)
    pool = _pool(_SlowedFirst(rates.tolist(), factor), 2, "slowed")
    await pool.start()
    try:
        rate, _ = await _drive(
            pool, dataset, verify_reward_text, _sim_config(2), warmup_s, measure_s
        )
        waves = [(await _replica(pool, i).replica_health())["submitted_waves"] for i in range(2)]
    finally:
        await pool.close()
    result = {
        "replicas": 2,
        "slowed_by": factor,
        "groups_per_s": rate,
        "waves": waves,
        "slow_share": waves[0] / max(1, sum(waves)),
    }
    print(result, flush=True)
    return result


async def failovers(work: Path, warmup_s: float, measure_s: float, kills: int) -> dict[str, Any]:
    runs = []
    for i in range(kills):
        runs.append(await failover(work, warmup_s, measure_s, tag=f"kill{i}"))
        print(runs[-1], flush=True)
    done = [r["all_reissued_done_s"] for r in runs if r["all_reissued_done_s"] is not None]
    return {
        "runs": runs,
        "detect_s": statistics.median(r["detect_s"] for r in runs),
        "all_reissued_done_s": statistics.median(done) if done else None,
        "median_wave_s": statistics.median(r["median_wave_s"] for r in runs),
        # What the target allows: detection + one wave, per run.
        "over_target_s": statistics.median(
            r["all_reissued_done_s"] - r["detect_s"] - r["median_wave_s"]
            for r in runs
            if r["all_reissued_done_s"] is not None
        )
        if done
        else None,
    }


async def failover(
    work: Path, warmup_s: float, measure_s: float, tag: str = "kill"
) -> dict[str, Any]:
    dataset, rates = _sim_dataset(work)
    factory = functools.partial(SimBackend, rates.tolist(), SIM_SPEC)
    pool = _pool(factory, 2, tag)
    timed = Timed(pool)
    await pool.start()
    killed: dict[str, float] = {}

    def victim() -> dict[str, Any]:
        return pool.health().detail["replicas"][0]

    async def kill() -> None:
        while (rep := victim())["inflight_samples"] == 0:
            await asyncio.sleep(0.005)
        killed["at"] = time.monotonic()
        killed["inflight_samples"] = rep["inflight_samples"]
        os.kill(rep["pid"], signal.SIGKILL)
        while victim()["state"] == "ok":
            await asyncio.sleep(0.005)
        killed["detected"] = time.monotonic()

    try:
        await _drive(timed, dataset, verify_reward_text, _sim_config(2), warmup_s, measure_s, kill)
    finally:
        await pool.close()
    at = killed["at"]
    hit = [end for start, end in timed.calls if start < at < end]
    waves = [end - start for start, end in timed.calls if end < at]
    reissued = victim()["reissued_waves"]
    return {
        "inflight_samples_at_kill": killed["inflight_samples"],
        "detect_s": killed["detected"] - at,
        "reissued_waves": reissued,
        "all_reissued_done_s": max(hit) - at if hit else None,
        "median_wave_s": statistics.median(waves),
    }


#: Active prompts of the Ray-hop runs: the service's default admission, then a quarter of
#: it, where the engine waits on each wave's round trip (latency-bound).
def _hop_levels() -> list[int]:
    default = SamplerConfig.model_fields["max_active_prompts"].default
    return [default, default // 4]


async def ray_hop(warmup_s: float, measure_s: float, pairs: int) -> list[dict[str, Any]]:
    """One hf replica via the pool vs the same engine in a child process (toy model), at
    each admission level of `_hop_levels`, pairs alternating which runs first."""
    from transformers import AutoTokenizer

    from sampler_service.backends.engine_process import EngineProcess
    from sampler_service.backends.hf import HFBackend
    from trainer_client.toy import build_toy

    toy = build_toy(Path(tempfile.mkdtemp(prefix="scaleout-toy-")), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(toy.model_dir))

    def tokenize(row: PromptRow) -> None:
        row.text = str(row.prompt)
        row.token_ids = list(tokenizer(row.prompt)["input_ids"])

    async def verify(row: PromptRow, completions: Sequence[Completion]) -> list[Verdict]:
        return [Verdict(1.0 if c.text.strip() == row.answer else 0.0) for c in completions]

    factory = functools.partial(HFBackend, toy.model_dir)
    levels = _hop_levels()
    rates = {level: {"pool": [], "process": []} for level in levels}
    calls = {level: [0, 0] for level in levels}  # pool runs: submit calls, waves submitted
    for i in range(pairs):
        for level in levels:
            cfg = SamplerConfig(
                rule="balanced",
                stopping="wave",
                n_max=16,
                wave_size=8,
                group_size=4,
                max_tokens=8,
                max_active_prompts=level,
                max_buffered_groups=100_000,
                max_staleness=None,
            )
            for kind in ("pool", "process") if i % 2 == 0 else ("process", "pool"):
                dataset = Dataset(toy.data_files, tokenize, seed=i)
                if kind == "pool":
                    # The hf engine has no sequence limit: the cap must not be what differs.
                    backend: Any = _pool(
                        factory, 1, f"hf{i}-{level}", torch_threads=1, max_inflight=10_000
                    )
                else:
                    backend = EngineProcess(factory, torch_threads=1)
                await backend.start()
                try:
                    rate, _ = await _drive(backend, dataset, verify, cfg, warmup_s, measure_s)
                    if kind == "pool":
                        health = await _replica(backend, 0).replica_health()
                        calls[level][0] += health["submit_calls"]
                        calls[level][1] += health["submitted_waves"]
                finally:
                    await backend.close()
                rates[level][kind].append(rate)
                print(f"{level} active prompts: {kind} {rate:.1f} groups/s", flush=True)
    out = []
    for level in levels:
        pool, process = rates[level]["pool"], rates[level]["process"]
        ratios = [p / q for p, q in zip(pool, process, strict=True)]
        out.append(
            {
                "active_prompts": level,
                "pool_groups_per_s": statistics.median(pool),
                "process_groups_per_s": statistics.median(process),
                "pool_rates": pool,
                "process_rates": process,
                "pair_ratios": ratios,
                "ratio": statistics.median(ratios),
                "pairs": pairs,
                "waves_per_call": calls[level][1] / max(1, calls[level][0]),
            }
        )
    return out


async def _streamed(wave: Wave) -> list[tuple[int, Completion]]:
    """A wave read answer by answer, as a reader that may stop early reads it."""
    return [pair async for pair in wave]


async def call_costs(bursts: int, waves: int) -> dict[str, Any]:
    """What a wave costs in Ray calls, one hf replica of the toy model (no batch wait):

    - a burst of 16 concurrent waves (8 answers of 8 tokens each), sent as one Ray call
      per wave (the replica's direct `generate`) or through the pool's channel, read
      whole (`generate`) or answer by answer (`wave`): wall time and this process's (the
      driver's) CPU per burst;
    - one wave at a time (1-token answers): median latency through the pool, through the
      engine process, and of an empty `collect_waves` call (a Ray round trip alone).
    """
    from sampler_service.backends.engine_process import EngineProcess
    from sampler_service.backends.hf import HFBackend
    from trainer_client.toy import build_toy

    toy = build_toy(Path(tempfile.mkdtemp(prefix="scaleout-toy-")), seed=0)
    factory = functools.partial(HFBackend, toy.model_dir, max_batch_wait_s=0.0)
    burst = SamplingParams(max_tokens=8)
    single = SamplingParams(max_tokens=1)

    async def per_burst(send: Any) -> dict[str, float]:
        await asyncio.gather(*(send(i) for i in range(16)))  # warm
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(bursts):
            await asyncio.gather(*(send(i) for i in range(16)))
        return {
            "wall_ms": (time.perf_counter() - wall) / bursts * 1e3,
            "driver_cpu_ms": (time.process_time() - cpu) / bursts * 1e3,
        }

    async def latency_ms(call: Any) -> float:
        for _ in range(10):
            await call()
        times = []
        for _ in range(waves):
            start = time.perf_counter()
            await call()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    pool = _pool(factory, 1, "calls", torch_threads=1, max_inflight=10_000)
    await pool.start()
    try:
        actor = _replica(pool, 0)
        result = {
            "burst_per_wave_calls": await per_burst(
                lambda i: actor.handle.generate.remote([1, 2, i % 8], 8, burst)
            ),
            "burst_channel": await per_burst(lambda i: pool.generate([1, 2, i % 8], 8, burst)),
            "burst_channel_streamed": await per_burst(
                lambda i: _streamed(pool.wave([1, 2, i % 8], 8, burst))
            ),
            "wave_pool_ms": await latency_ms(lambda: pool.generate([1, 2, 3], 1, single)),
            "empty_call_ms": await latency_ms(
                lambda: actor.handle.collect_waves.remote(actor.channel.session, 0.0)
            ),
        }
    finally:
        await pool.close()
    process = EngineProcess(factory, torch_threads=1)
    await process.start()
    try:
        result["wave_process_ms"] = await latency_ms(lambda: process.generate([1, 2, 3], 1, single))
    finally:
        await process.close()
    print(result, flush=True)
    return result


# -- several fronts sharing one prompt set and one trainer (simulated time) ------------------

#: Each front's engine in the fronts simulation: a ~1.5B model on one GPU (the step-time
#: benchmark's decode step), 64 sequences, answers log-normal around 700 tokens.
FRONT_ENGINE = EngineSpec(max_num_seqs=64)
FRONT_PROMPTS = 1024
FRONT_BATCH = 64
#: Simulated seconds the trainer spends on a step's batch, then weights go to every front.
FRONT_TRAIN_S = 20.0


def shard_of(prompt_id: str, shards: int) -> int:
    """The front that owns a prompt: a stable hash of its id modulo the number of fronts."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big") % shards


class ShardSink(VolatileSink):
    """One front's frames, READY until the trainer takes them and LEASED until it acks."""

    def __init__(self, arrived: asyncio.Event) -> None:
        #: (when it formed, its groups), oldest first.
        self.frames: collections.deque[tuple[float, list[Group]]] = collections.deque()
        self.leased = 0
        self._arrived = arrived

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        if groups:
            self.frames.append((asyncio.get_running_loop().time(), groups))
            self._arrived.set()

    def buffered(self) -> int:
        return sum(len(f) for _, f in self.frames) + self.leased


@dataclasses.dataclass
class SimFront:
    scheduler: Scheduler
    engine: SimBackend
    sink: ShardSink
    prompts: int


async def _push(front: SimFront, version: int) -> None:
    """A weight update through the front's own barrier (the simulated engine loads nothing)."""
    async with front.scheduler.paused_for_weights():
        await front.engine.load_weights({}, version)


async def _merging_trainer(
    fronts: list[SimFront], arrived: asyncio.Event, steps: int, warmup: int
) -> dict[str, Any]:
    """Takes B groups per step, the oldest frames first whichever front formed them, trains,
    pushes the next version to every front, then acks what it took."""
    loop = asyncio.get_running_loop()
    version = 0
    lags: collections.Counter[int] = collections.Counter()
    per_front = [0] * len(fronts)
    domains: collections.Counter[str] = collections.Counter()
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            started = loop.time()
        taken: list[tuple[SimFront, list[Group]]] = []
        while sum(len(frame) for _, frame in taken) < FRONT_BATCH:
            ready = [f for f in fronts if f.sink.frames]
            if not ready:
                arrived.clear()
                await arrived.wait()
                continue
            front = min(ready, key=lambda f: f.sink.frames[0][0])
            _, frame = front.sink.frames.popleft()
            front.sink.leased += len(frame)
            taken.append((front, frame))
        if step >= warmup:
            for front, frame in taken:
                per_front[fronts.index(front)] += len(frame)
                domains.update(g.domain for g in frame)
                lags.update(version - s.policy_version for g in frame for s in g.samples)
        await asyncio.sleep(FRONT_TRAIN_S)
        version += 1
        await asyncio.gather(*(_push(f, version) for f in fronts))
        for front, frame in taken:
            front.sink.leased -= len(frame)
            front.scheduler.poke()
    seconds = loop.time() - started
    samples = sum(lags.values())
    trained = sum(per_front)
    visits = [
        n / max(1, f.prompts) / seconds * 3600 for n, f in zip(per_front, fronts, strict=True)
    ]
    return {
        "groups_per_hour": 3600 * trained / seconds,
        "mean_lag": sum(k * v for k, v in lags.items()) / samples,
        "max_lag": max(lags),
        "beyond_bound_share": sum(v for k, v in lags.items() if k > 1) / samples,
        "front_shares": [n / trained for n in per_front],
        "front0_share": per_front[0] / trained,
        "domain_shares": {d: n / trained for d, n in sorted(domains.items())},
        # Groups per prompt per hour, least-visited shard over most-visited one.
        "visit_ratio": min(visits) / max(visits),
    }


async def simulate_fronts(
    work: Path, fronts: int, batch_groups: int, slowed: float, steps: int, warmup: int
) -> dict[str, Any]:
    """S fronts, each a real scheduler on its shard with its own engine, one trainer."""
    rng = np.random.default_rng(0)
    rates = rng.uniform(0.1, 0.9, FRONT_PROMPTS)
    ids = [f"p{i}" for i in range(FRONT_PROMPTS)]
    arrived = asyncio.Event()
    out: list[SimFront] = []
    for i in range(fronts):
        shard = work / f"fronts-{fronts}-{batch_groups}-{slowed}" / f"front-{i}"
        shard.mkdir(parents=True, exist_ok=True)
        mine = [pid for pid in ids if shard_of(pid, fronts) == i]
        for domain, parity in (("a", 0), ("b", 1)):
            (shard / f"{domain}.jsonl").write_text(
                "".join(
                    json.dumps({"id": pid, "prompt": pid, "answer": ""}) + "\n"
                    for pid in mine
                    if int(pid[1:]) % 2 == parity
                )
            )

        def tokenize(row: PromptRow) -> None:  # the simulated engine reads the prompt index
            row.text = str(row.prompt)
            row.token_ids = [int(row.id[1:])] + [0] * 149

        dataset = Dataset(sorted(shard.glob("*.jsonl")), tokenize, seed=i)
        spec = FRONT_ENGINE
        if i == 0 and slowed > 1:
            spec = dataclasses.replace(spec, step_base_s=spec.step_base_s * slowed)
        engine = SimBackend(rates.tolist(), spec, seed=i)
        sink = ShardSink(arrived)
        cfg = SamplerConfig(
            **grpo(4),
            max_tokens=4096,
            max_staleness=1,
            batch_groups=batch_groups,
            max_active_prompts=32,
        )
        scheduler = sim_scheduler(engine, dataset, sink, cfg, i)
        out.append(SimFront(scheduler, engine, sink, len(mine)))
    for front in out:
        await front.engine.start()
        front.scheduler.start()
    try:
        async with asyncio.timeout(1e7):  # simulated seconds: a stuck simulation fails loudly
            result = await _merging_trainer(out, arrived, steps, warmup)
    finally:
        for front in out:
            await front.scheduler.stop(drain_timeout_s=1.0)
            await front.engine.close()
    return {"fronts": fronts, "batch_groups": batch_groups, "slowed": slowed, **result}


#: (fronts, batch_groups per front, first front's engine slowed by) of the fronts part.
FRONT_CASES = [
    (1, FRONT_BATCH, 1.0),
    (2, FRONT_BATCH, 1.0),
    (2, FRONT_BATCH // 2, 1.0),
    (4, FRONT_BATCH, 1.0),
    (4, FRONT_BATCH // 4, 1.0),
    (4, FRONT_BATCH, 3.0),
    (4, FRONT_BATCH // 4, 3.0),
]


def fronts_part(steps: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fronts, batch_groups, slowed in FRONT_CASES:
            row = virtual_clock.run(
                simulate_fronts(Path(tmp), fronts, batch_groups, slowed, steps, warmup)
            )
            print(row, flush=True)
            rows.append(row)
    return rows


PARTS = ("routing", "affinity", "kill", "hop", "calls", "fronts")
RAY_PARTS = {"routing", "affinity", "kill", "hop", "calls"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="shorter windows, 3 hf pairs, 3 kills (~8 minutes)"
    )
    p.add_argument("--pairs", type=int, help="Ray-hop pairs (default 3 quick, 5 full)")
    p.add_argument("--kills", type=int, help="kill runs (default 3 quick, 5 full)")
    p.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        help="run only this part (repeatable); the results file is then not written",
    )
    args = p.parse_args(argv)
    warmup_s, measure_s, pairs, kills = (5.0, 15.0, 3, 3) if args.quick else (10.0, 40.0, 5, 5)
    pairs = args.pairs or pairs
    kills = args.kills or kills
    parts = set(args.only or PARTS)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    scale: list[dict] = []
    kill: dict[str, Any] = {}
    hop: list[dict[str, Any]] = []
    slowed: dict[str, Any] = {}
    calls: dict[str, Any] = {}
    started = time.monotonic()
    if "fronts" in parts:  # simulated time: the same figures on any machine, written apart
        steps, warmup = (8, 2) if args.quick else (20, 3)
        fronts = fronts_part(steps, warmup)
        write_json("scaleout_fronts", {"steps": steps, "warmup": warmup, "cases": fronts})
        print(table(fronts, COLUMNS["fronts"]))
    if not parts & RAY_PARTS:
        return {"fronts": fronts}
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        namespace="adaptive-rollout",
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if "routing" in parts:
                scale = asyncio.run(routing(work, [1, 2, 4, 8], warmup_s, measure_s))
            if "affinity" in parts:
                slowed = asyncio.run(affinity(work, warmup_s, measure_s, factor=5.0))
            if "kill" in parts:
                kill = asyncio.run(failovers(work, warmup_s, measure_s, kills))
        if "hop" in parts:
            hop = asyncio.run(ray_hop(warmup_s, measure_s, pairs))
        if "calls" in parts:
            calls = asyncio.run(call_costs(bursts=50, waves=300))
    finally:
        ray.shutdown()
    result = {
        "quick": args.quick,
        "wall_s": time.monotonic() - started,
        "load_average": list(os.getloadavg()),
        "sim_spec": dataclasses.asdict(SIM_SPEC),
        "routing": scale,
        "affinity": slowed,
        "kill": kill,
        "ray_hop": hop,
        "calls": calls,
    }
    if parts >= RAY_PARTS:
        path = write_json("scaleout", result)
        print(f"wrote {path.relative_to(ROOT)}; {environment()['cpus']} CPUs")
    print(table(scale, COLUMNS["routing"]))
    print(json.dumps({"kill": kill, "ray_hop": hop}, indent=1))
    return result


#: Columns of the tables of the routing and fronts parts: (row key, header).
COLUMNS: dict[str, list[tuple[str, str]]] = {
    "routing": [
        ("replicas", "replicas"),
        ("groups_per_s", "groups/s"),
        ("speedup", "x of 1"),
        ("of_ideal", "of N x 1"),
        ("sticky_share", "sticky"),
    ],
    "fronts": [
        ("fronts", "fronts"),
        ("batch_groups", "batch_groups per front"),
        ("slowed", "front 0 slowed"),
        ("groups_per_hour", "groups trained/hour"),
        ("mean_lag", "mean lag (versions)"),
        ("max_lag", "max lag"),
        ("beyond_bound_share", "samples beyond max_staleness 1"),
        ("front0_share", "front 0's share of the groups"),
        ("visit_ratio", "visits/prompt, least/most visited shard"),
    ],
}


if __name__ == "__main__":
    main()
