"""What a fleet asks of one engine (`Member`) and of its wire as a whole (`Transport`),
and what they answer.

A member is one admin client per engine: a Ray replica, a `vllm serve` server, or the
in-process engine of a fleet of one. It makes its calls and says what happened; every
decision (route to it or not, take it out, bring it back, roll it back, commit a version)
is the fleet's. Its failures come back as the errors below, so that the fleet never
needs to know a transport's own exceptions.

`generate` hands a wave handle from the start (`Wave`): answers by index as they finish
and a cancel by index, so a reader that stops early needs no new call; a member that
answers whole waves wraps them (`WholeWave`) and says so (`cancels_answers`). `pause` takes a mode, so the weight
barrier's other modes need no new call either; a mode a member lacks raises
NotSupported.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sampler_service.backends.base import ContinueKV, PauseMode, Wave, WaveRequest
from sampler_service.errors import NotSupported
from sampler_service.weights.types import NCCLDescription, TensorSpec


class MemberDown(RuntimeError):
    """The member did not answer (refused, timed out, its process died): the fleet takes
    it out of routing and re-issues its waves elsewhere. `reason` names why for the
    re-issue metrics."""

    def __init__(self, message: str, reason: str = "down") -> None:
        super().__init__(message)
        self.reason = reason


class MemberGone(RuntimeError):
    """The member will never come back (its actor was given up): it is failed for good."""


class Misconfigured(RuntimeError):
    """The member answers, but is set up so that the fleet must not use it (a logprob
    mode other than the sampler's, an RL endpoint refused): start-up says so at once."""


class ForeignWeights(RuntimeError):
    """The member reported answers sampled under weights that are not the wave's:
    someone else changed them. The wave is re-issued and the member resynced."""


class PartialWeights(RuntimeError):
    """A weight transfer into the member broke off and it did not restore itself: what
    it holds is unknown until it is loaded again."""


@dataclass(frozen=True)
class Attached:
    """What a member says when the fleet first reaches it, and again when it is back."""

    #: The weights it serves, as this fleet numbers them; None: unknown, or not ours.
    version: int | None
    #: Anything that changes when its process does (a Ray replica's pid); a new process
    #: has lost the NCCL group it was in.
    identity: Hashable = None
    #: Unlabelled, serving the weights it was started with (a fresh `vllm serve`): at
    #: start-up that is the fleet's version 0.
    fresh: bool = False
    #: Still paused from a weight update it dropped out of: resumed before it is routed to.
    paused: bool = False
    model_name: str = ""
    specs: Mapping[str, TensorSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class Probe:
    """A member's answer to a health probe."""

    ok: bool
    version: int | None
    identity: Hashable = None
    paused: bool = False
    detail: Any = None


@dataclass(frozen=True)
class Source:
    """Weights every member can load (again): their version, the tensors they name, and
    the transport's handle on them (a directory, an object ref, files, tensors). A
    source of None is the base model the members were started with."""

    version: int
    names: frozenset[str]
    payload: Any


class Member(Protocol):
    """One engine as the fleet drives it (see the module docstring)."""

    @property
    def name(self) -> str:
        """How messages name it ("replica 2", a server's URL)."""
        ...

    @property
    def address(self) -> str | None:
        """Where it answers, where it has an address of its own (a server's URL)."""
        ...

    @property
    def cancels_answers(self) -> bool:
        """Its waves cancel single answers (known once it is attached)."""
        ...

    @property
    def continues(self) -> frozenset[ContinueKV]:
        """The caches its running answers can go on under across a weight load
        (`Backend.continues`; known once it is attached)."""
        ...

    @property
    def orders_by_priority(self) -> bool:
        """It serves queued answers by their request's priority (`Backend.orders_by_priority`;
        known once it is attached)."""
        ...

    @property
    def restartable(self) -> bool:
        """The fleet restarts it when it fails (a Ray actor); otherwise its owner does,
        and the fleet waits until it answers again."""
        ...

    def describe(self) -> dict[str, Any]:
        """Its own fields of the fleet's per-member rows (/health, /v1/stats)."""
        ...

    async def attach(self) -> Attached:
        """First contact: start it, or find it running. Misconfigured if unusable."""
        ...

    async def recover(self, kill: bool) -> Attached:
        """Back after a failure: (`kill`: make sure the old process is gone first) its
        next incarnation, or the same engine answering again. MemberGone if never."""
        ...

    async def probe(self) -> Probe: ...

    def generate(self, request: WaveRequest, version: int) -> Wave:
        """Issue one wave; its answers carry `version`, the weights it is routed under. A
        request read whole (`request.whole`) may go as one request of n where that is
        cheaper (an HTTP server parses one request)."""
        ...

    async def abort(self) -> int:
        """Abort this fleet's requests on it (their waves raise GenerationAborted)."""
        ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def load(self, source: Source | None, version: int) -> None:
        """Install `source` (None: the base model). WeightsRejected: refused before
        anything changed; WeightsNotServed: failed, and restored itself."""
        ...

    async def label(self) -> int | None:
        """The version it serves, read back from it."""
        ...

    async def set_label(self, version: int) -> None: ...

    async def checksum(self) -> str:
        """One digest of the weights it serves (NotSupported where it computes none)."""
        ...

    async def nccl_ranks(self) -> NCCLDescription:
        """Its own ranks and tensors for the NCCL transfer (NCCLUnavailable if none)."""
        ...

    async def nccl_join(self, init_info: dict[str, Any]) -> None: ...

    async def nccl_receive(self, update_info: dict[str, Any], version: int) -> None:
        """Receive one broadcast and serve it as `version`. PartialWeights: it failed
        and the member holds what it got; any other error: it serves what it did."""
        ...

    async def nccl_leave(self) -> None: ...

    async def close(self) -> None: ...


class Transport(Protocol):
    """A fleet's wire as a whole: what its members share, and its words. A transport
    subclasses it for the defaults of a fixed fleet that keeps what it staged."""

    @property
    def name(self) -> str:
        """The backend's name (`ray`, `http`, or the in-process engine's)."""
        ...

    @property
    def reads_weight_files(self) -> bool: ...

    #: A wave read whole costs less as one request of n than as n streamed ones (an
    #: HTTP server parses, and answers, one request): `Backend.whole_waves_cheaper`.
    whole_waves_cheaper: bool = False

    @property
    def noun(self) -> str:
        """What one member is called in messages ("engine replica")."""
        ...

    @property
    def row_key(self) -> str:
        """The key of a member's index in its row ("replica")."""
        ...

    @property
    def rows_key(self) -> str:
        """The key the members' rows are listed under in the health detail."""
        ...

    @property
    def nccl_hint(self) -> str:
        """What turns the NCCL transfer on where a member has it off."""
        ...

    async def open(self) -> list[Member]:
        """Start what the members share; the members to attach."""
        ...

    async def close(self) -> None: ...

    async def stage_tensors(self, tensors: Mapping[str, Any], version: int) -> Source: ...

    async def stage_files(
        self, files: Sequence[str], version: int, names: Sequence[str]
    ) -> Source: ...

    def retain(self, source: Source) -> Source:
        """What of committed weights the fleet keeps to load them again (into a member
        that comes back, or to roll one back): all of it, unless a transport says less."""
        return source

    async def release(self, source: Source) -> None:
        """Weights no member will load again (replaced, or refused); nothing to free
        unless a transport staged something."""
        return None

    async def roster(self, present: list[str]) -> tuple[list[str], list[str]] | None:
        """(names to add, names to retire) to go from the `present` members to those
        there are now; None: no change known (a fixed fleet, or a lookup that failed)."""
        return None

    def member(self, name: str) -> Member:
        """A member for a name the roster lists for the first time."""
        raise NotSupported(f"the {self.noun}s of this fleet are fixed")

    def detail(self, committed: int) -> dict[str, Any]:
        """The transport's own fields of the health detail."""
        return {}
