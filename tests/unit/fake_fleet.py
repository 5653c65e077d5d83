"""A fleet's members without engines: `FakeMember` answers the member protocol from a few
fields the test sets (down, hung, refusing a load, holding its waves, streaming them),
records every call but probes, and keeps the weights it holds as a version number;
`FakeTransport` stages updates as the versions they are. The fleet driving them is the
real one."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from sampler_service.backends.base import (
    Completion,
    PauseMode,
    StreamedWave,
    Wave,
    WaveRequest,
    WholeWave,
)
from sampler_service.errors import NotSupported
from sampler_service.fleet.member import (
    Attached,
    ForeignWeights,
    Member,
    MemberDown,
    MemberGone,
    Probe,
    Source,
)
from sampler_service.weights.types import NCCLDescription, TensorSpec

SPECS = {"a.weight": TensorSpec((2,), "F32"), "b.weight": TensorSpec((2,), "F32")}


def trainer_init(world_size: int) -> dict[str, Any]:
    """What the trainer sends (vLLM's NCCLTrainerInitInfo, written for rank offset 1)."""
    return {
        "master_address": "127.0.0.1",
        "master_port": 29600,
        "rank_offset": 1,
        "world_size": world_size,
        "packed": True,
    }


class FakeMember:
    """One engine; `restartable` ones behave as Ray replicas (the fleet restarts them, a
    restart brings back the base model, which they cannot load otherwise), the others as
    servers their owner runs."""

    address = None
    continues: frozenset[str] = frozenset()
    orders_by_priority = False

    def __init__(
        self, index: int, *, restartable: bool = True, workers: int = 1, streams: bool = False
    ) -> None:
        self.name = f"member {index}"
        self.restartable = restartable
        self.workers = workers
        self.nccl = True
        self.pid = 100 + index
        self.weights: int | None = 0  # the version of the weights it holds (0: the base)
        self.labelled: int | None = 0  # what it answers when asked its version
        self.calls: list[tuple[Any, ...]] = []
        self.down = False  # every call raises MemberDown
        self.hung = False  # probes never answer
        self.gone = False  # never comes back
        self.crashes = False  # every start fails
        self.healthy = True
        self.paused = False
        self.digest = "same"
        #: Its answers say which label sampled them (as `vllm-generate` servers' spans
        #: do): a whole wave under a label not the wave's raises ForeignWeights.
        self.spans = False
        #: Its next loads raise this (a class: raised with a message naming the member).
        self.refuse: type[Exception] | None = None
        self.refuse_receive: type[Exception] | None = None
        #: Waves wait for it (set: they answer at once).
        self.open = asyncio.Event()
        self.open.set()
        #: A recovery waits for it (set: it is back at once).
        self.back = asyncio.Event()
        self.back.set()
        #: Its waves stream and cancel single answers; held ones (`open` cleared) are
        #: answered one by one by the test (`answer`).
        self.streams = streams
        self.waves: list[StreamedWave] = []
        #: Every wave it was asked for, as asked.
        self.requests: list[WaveRequest] = []

    @property
    def cancels_answers(self) -> bool:
        return self.streams

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid}

    def _call(self, *call: Any) -> None:
        self.calls.append(call)
        if self.down:
            raise MemberDown(f"{self.name} does not answer", "died")

    def named(self, call: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == call]

    async def attach(self) -> Attached:
        self._call("attach")
        if self.crashes:
            raise RuntimeError(f"{self.name} crashed while starting")
        return Attached(self.labelled, self.pid, paused=self.paused, model_name="fake", specs=SPECS)

    async def recover(self, kill: bool) -> Attached:
        self.calls.append(("recover", kill))
        await self.back.wait()
        if self.gone:
            raise MemberGone(f"{self.name} is gone for good")
        if self.restartable:  # a new process, serving the base model, holding no wave
            self.down = self.hung = False
            self.pid += 1000
            self.weights = self.labelled = 0
            self.open.set()
        return await self.attach()

    async def probe(self) -> Probe:
        if self.hung:
            await asyncio.Event().wait()
        if self.down:
            raise MemberDown(f"{self.name} does not answer", "died")
        return Probe(self.healthy, self.labelled, self.pid, self.paused, "unhealthy")

    def generate(self, request: WaveRequest, version: int) -> Wave:
        self.requests.append(request)
        n = request.n
        if not self.streams:
            return WholeWave(self._wave(n, version), n)
        self._call("generate", n, version)
        wave = StreamedWave(
            n, lambda indices: self._stop(wave, indices), lambda: self.calls.append(("drop",))
        )
        self.waves.append(wave)
        if self.open.is_set():
            for index in range(n):
                wave.put(index, _answer(version))
        return wave

    def answer(self, index: int, version: int = 0) -> None:
        """Its latest wave's answer `index` finishes."""
        self.waves[-1].put(index, _answer(version))

    async def _stop(self, wave: StreamedWave, indices: list[int]) -> None:
        """A cancelled answer comes back aborted with the one token it had decoded."""
        self._call("cancel", indices)
        for index in indices:
            wave.put(index, Completion([1], [-0.5], "a", "abort"))

    async def _wave(self, n: int, version: int) -> list[Completion]:
        self._call("generate", n, version)
        await self.open.wait()
        if self.down:
            raise MemberDown(f"{self.name} lost the wave", "died")
        if self.spans and self.labelled != version:
            raise ForeignWeights(f"{self.name} sampled under {self.labelled}, not v{version}")
        return [_answer(version) for _ in range(n)]

    async def abort(self) -> int:
        """Streamed waves end their answers aborted, with the token each had decoded."""
        self._call("abort")
        for wave in self.waves:
            for index in sorted(wave.missing):
                wave.put(index, Completion([1], [-0.5], "a", "abort"))
        return 0

    async def pause(self, mode: PauseMode) -> None:
        self._call("pause", mode)
        self.paused = True

    async def resume(self) -> None:
        self._call("resume")
        self.paused = False

    async def load(self, source: Source | None, version: int) -> None:
        self._call("load", None if source is None else source.version, version)
        if source is None and self.restartable:
            raise NotSupported("the base model comes back only with a restart")
        if self.refuse is not None:
            raise self.refuse(f"{self.name} refuses v{version}")
        self.weights = self.labelled = version

    async def label(self) -> int | None:
        self._call("label")
        return self.labelled

    async def set_label(self, version: int) -> None:
        self._call("set_label", version)
        self.labelled = version

    async def checksum(self) -> str:
        self._call("checksum")
        return self.digest

    async def nccl_ranks(self) -> NCCLDescription:
        self._call("ranks")
        return NCCLDescription(self.nccl, self.workers, SPECS, frozenset(SPECS))

    async def nccl_join(self, init_info: dict[str, Any]) -> None:
        self._call("join", init_info["rank_offset"], init_info["world_size"])

    async def nccl_receive(self, update_info: dict[str, Any], version: int) -> None:
        self._call("receive", version)
        if self.refuse_receive is not None:
            raise self.refuse_receive(f"{self.name}'s receive of v{version} broke off")
        self.weights = self.labelled = version

    async def nccl_leave(self) -> None:
        self._call("leave")

    async def close(self) -> None:
        self.calls.append(("close",))


def _answer(version: int) -> Completion:
    return Completion([1, 2], [-0.5, -0.5], "ab", "stop", version)


class FakeTransport:
    """Updates are staged as their versions; released ones are listed."""

    name = "fake"
    reads_weight_files = True
    whole_waves_cheaper = False
    noun = "fake engine"
    row_key = "member"
    rows_key = "members"
    nccl_hint = "turn the transfer on"

    def __init__(self, members: Sequence[FakeMember]) -> None:
        self.members = list(members)
        self.released: list[int] = []
        #: What the roster finds now (None: a fixed fleet).
        self.found: list[str] | None = None
        self.joining: dict[str, FakeMember] = {}

    async def open(self) -> list[Member]:
        return list(self.members)

    async def close(self) -> None:
        """Nothing is shared."""

    async def stage_tensors(self, tensors: Mapping[str, Any], version: int) -> Source:
        return Source(version, frozenset(tensors), "tensors")

    async def stage_files(self, files: Sequence[str], version: int, names: Sequence[str]) -> Source:
        return Source(version, frozenset(names), tuple(files))

    def retain(self, source: Source) -> Source:
        return source

    async def release(self, source: Source) -> None:
        self.released.append(source.version)

    async def roster(self, present: list[str]) -> tuple[list[str], list[str]] | None:
        if self.found is None:
            return None
        return sorted(set(self.found) - set(present)), sorted(set(present) - set(self.found))

    def member(self, name: str) -> Member:
        return self.joining[name]

    def detail(self, committed: int) -> dict[str, Any]:
        return {}
