"""The one async interface every inference engine sits behind.

The scheduler only ever talks to this interface, so the same adaptive loop drives the
transformers backend on a laptop, vLLM on a GPU node, a fleet of Ray replicas or HTTP
servers, or the simulated engine of the benchmarks.

A wave's answers come as a `Wave`: each answer with its index as it finishes, and a
cancel by index. An engine that streams hands each answer over as it finishes
(`StreamedWave`; one request per answer: `RequestWave`); one that answers whole waves
hands them all at once (`WholeWave`) and declares that it cannot cancel one answer
alone (`cancels_answers`), so a reader that stops early works with every engine.

An engine implements one generation call, `issue(WaveRequest)`: `wave` and `generate`
build the request once, here, `generate`'s marked as read whole, so an engine that
answers whole waves more cheaply (`whole_waves_cheaper`: an HTTP server, one request
of n) may. A request carries each answer's priority (lower first, ties in the order
issued, as vLLM's priority scheduling orders them; the scheduler's `engine_priority`
sets them), so an engine with a queue serves the answers that matter most first; an
engine that cannot order its queue serves in arrival order and says so
(`orders_by_priority`).
"""

from __future__ import annotations

import abc
import asyncio
import math
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from sampler_service.errors import NotSupported
from sampler_service.weights.types import NCCLDescription, NCCLUnavailable, TensorSpec
from trainer_client.contract.wire import narrow_array

#: Why an answer ended. An episode adds `turns` (max_turns reached) and `timeout` (an
#: environment step ran past env_timeout_s at the last turn); `length` is also an episode
#: that used up its token budget.
FinishReason = Literal["stop", "length", "abort", "turns", "timeout"]


class GenerationAborted(RuntimeError):
    """The engine dropped a request (weight update in `abort` mode); re-issue it."""


#: How an engine pauses: `wait` lets running requests finish, `abort` ends them
#: (GenerationAborted), `keep` freezes them with their cache until resume, and
#: `recompute` freezes them too but recomputes their cache under the weights loaded
#: meanwhile. Under the last two the running requests go on under the new weights: a
#: weight update in `continue` mode.
PauseMode = Literal["wait", "abort", "keep", "recompute"]
#: What a running answer's cache becomes at a `continue` weight update: kept (its tokens
#: before the update keep the old weights' keys and values, the approximation partial
#: rollouts make) or recomputed under the new weights (exact; costs a prefill of the
#: prompt and the tokens decoded so far).
ContinueKV = Literal["keep", "recompute"]
#: (version, index of its first token) for each weight version an answer was decoded
#: under, oldest first.
VersionSpans = list[tuple[int, int]]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs. Requests are only batched with equal params."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 16
    seed: int | None = None
    #: Strings and token ids that end an answer besides EOS (an episode's turn ends at
    #: the environment's stop strings, e.g. `</tool_call>`); the stop is kept in the
    #: answer's tokens, which are never re-encoded.
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class WaveRequest:
    """One wave as an engine takes it: n answers to a prompt. `whole`: its reader takes
    every answer and cancels none (`Backend.generate`), so an engine may answer it as
    one request of n."""

    prompt_token_ids: list[int]
    n: int
    sampling: SamplingParams
    affinity_key: str | None = None
    whole: bool = False
    #: Each answer's priority: a queued answer is served before those of a higher one,
    #: after those issued earlier with the same (`Backend.orders_by_priority`); empty:
    #: all 0.
    priorities: tuple[int, ...] = ()

    def priority(self, index: int = 0) -> int:
        """Answer `index`'s priority (a wave sent as one request: its first answer's)."""
        return self.priorities[index] if self.priorities else 0


def answer_seed(seed: int | None, index: int) -> int | None:
    """The seed of answer `index` of a seeded wave sent as one request per answer: the
    wave's seed plus the index, as vLLM seeds the `n` children of one request, so the
    answers stay distinct and a seeded wave draws what one request of n drew."""
    return None if seed is None else seed + index


def check_request(
    token_ids: list[int],
    n: int,
    sampling: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int | None = None,
) -> None:
    """Reject a request that would crash an engine, with a message for the caller.

    Every engine needs these checks before the request reaches it: an out-of-range token
    id is a device-side assert on CUDA (which kills the process), not an exception.
    """
    if not token_ids:
        raise ValueError("prompt_token_ids is empty")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if max_model_len is not None and len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt of {len(token_ids)} tokens leaves no room under max_model_len {max_model_len}"
        )
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")


#: Token ids (or a loss mask) as engines hand them over: a list, or an int32 array where
#: the engine's side of a process boundary packed them (`packed`).
TokenIds = list[int] | npt.NDArray[np.integer[Any]]
#: Logprobs likewise: a list, or a float32 (float64 where float32 is not exact) array.
Floats = list[float] | npt.NDArray[np.floating[Any]]


@dataclass
class Completion:
    """One generated answer with the behaviour policy's per-token logprobs.

    An episode of several turns is one completion too: `token_ids` hold everything after
    the prompt (sampled and observation tokens alike), `loss_mask` is 1 on the sampled
    ones only (None: all sampled, a single-turn answer) and `logprobs` are 0.0 where the
    mask is 0. `answer_text` is what the verifier scores when it is not `text` (an
    episode's last turn), `env_reward` the environment's terminal reward if it gave one.
    `prompt_token_ids` and `prompt_text` are the prompt the answer continues where it is
    not the row's (None: the row's): an episode on a chat row whose environment added
    messages or tools began from its own rendering of the conversation.
    `policy_version` is the oldest version that decoded any of its tokens; an answer a
    `continue` weight update ran across holds each version's first token in
    `version_spans` (None: one version decoded all of it).
    """

    token_ids: TokenIds
    logprobs: Floats
    text: str
    finish_reason: FinishReason
    policy_version: int = 0
    loss_mask: TokenIds | None = None
    num_turns: int = 1
    answer_text: str | None = None
    env_reward: float | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    version_spans: VersionSpans | None = None

    @property
    def verified_text(self) -> str:
        """What the row's verifier scores: an episode's last turn, else the whole answer
        (an episode's `text` holds its observations too)."""
        return self.text if self.answer_text is None else self.answer_text


def versions_of(
    spans: VersionSpans, version: int, length: int | None = None
) -> tuple[int, VersionSpans | None]:
    """An answer's `policy_version` and `version_spans` from the (version, first token)
    spans its engine recorded, leaving out those that begin past its `length` tokens (a
    row cut before the load reached it); no span recorded: `version` decoded it all."""
    kept = [span for i, span in enumerate(spans) if i == 0 or length is None or span[1] < length]
    if not kept:
        return version, None
    return kept[0][0], kept if len(kept) > 1 else None


def packed(completion: Completion) -> Completion:
    """`completion` with its token ids, logprobs and mask as narrow numpy arrays.

    An engine's side of a process boundary (the engine's child process, a Ray replica)
    calls it before its answers cross: a 700-token answer as Python lists pickles to
    1,400 numbers that the front's process rebuilds one object at a time, as arrays to
    two buffers that it copies. From there the arrays stay packed up to the store's
    encoder, which writes them as they are (`trainer_client.contract.wire`).
    """
    mask = completion.loss_mask
    return replace(
        completion,
        token_ids=narrow_array(completion.token_ids, "int"),
        logprobs=narrow_array(completion.logprobs, "float"),
        loss_mask=None if mask is None else narrow_array(mask, "int"),
    )


def as_list(values: TokenIds | Floats) -> list[Any]:
    """Token ids or logprobs as a Python list, whether an engine packed them or not (for
    the few places that extend or concatenate them: episodes)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def aborted(version: int = 0) -> Completion:
    """An answer stopped with nothing decoded that anyone can count: it never reached an
    engine, or its tokens were lost with the engine that held them."""
    return Completion([], [], "", "abort", version)


class Wave(abc.ABC):
    """One wave of `n` answers to one prompt, issued: each answer's index is fixed now.

    Iterating yields `(index, answer)` as each answer finishes, every index once.
    `cancel(indices)` stops answers not yet finished: each still comes back, with
    `finish_reason` "abort" and the tokens it had decoded (none where the engine cannot
    say), or as it finished if it finished before the cancel reached it. An engine's own
    abort (a weight update in `abort` mode) ends answers the same way, with "abort", or
    ends the rest of the wave with GenerationAborted where the engine hands back nothing.
    An engine that can stop only the whole wave says so (`cancels_answers` False) and
    raises NotSupported for anything less than every answer left. A wave is read once;
    a reader that leaves before the end (`close`, or its task cancelled) drops what
    still runs.
    """

    #: Whether `cancel` stops single answers, or only the whole wave.
    cancels_answers: bool = False

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[tuple[int, Completion]]: ...

    @abc.abstractmethod
    async def cancel(self, indices: Collection[int]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop reading: whatever of the wave still runs is dropped at once, without
        waiting for the engine (an engine that is down would never answer)."""

    def answers(self) -> Awaitable[list[Completion]]:
        """Every answer, in index order: the wave read to its end. A reader of whole
        waves cancels nothing, so an aborted answer is the engine's own abort and the
        wave is issued again: GenerationAborted."""
        return self._read_all()

    async def _read_all(self) -> list[Completion]:
        out: list[Completion | None] = [None] * self.n
        async for index, answer in self:
            out[index] = answer
        missing = [i for i, answer in enumerate(out) if answer is None]
        if missing:
            raise GenerationAborted(f"the wave ended without answers {missing}")
        cut = [i for i, answer in enumerate(out) if answer and answer.finish_reason == "abort"]
        if cut:
            raise GenerationAborted(f"the engine aborted answers {cut}")
        return [answer for answer in out if answer is not None]


class WholeWave(Wave):
    """A wave whose engine answers all of it at once: its answers come together when the
    engine call returns, and only the whole wave can be cancelled."""

    def __init__(self, answers: Awaitable[list[Completion]], n: int) -> None:
        super().__init__(n)
        self._call = asyncio.ensure_future(answers)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Completion]]:
        for index, answer in enumerate(await self._call):
            yield index, answer

    def answers(self) -> Awaitable[list[Completion]]:
        """The engine call itself: awaiting it, or cancelling it, needs no task of its own."""
        return self._call

    async def cancel(self, indices: Collection[int]) -> None:
        done = self._call.done()
        if not done and not set(range(self.n)) <= set(indices):
            raise NotSupported("this engine answers whole waves: it cancels all of one or none")
        if not done:
            self._call.cancel()
            await asyncio.gather(self._call, return_exceptions=True)

    def close(self) -> None:
        self._call.cancel()


class StreamedWave(Wave):
    """A wave whose engine hands over each answer as it finishes.

    The engine's side calls `put(index, answer)` once per index (a later answer for the
    same index is one the engine was told to drop, and is ignored) and `fail(error)` when
    the rest of the wave will not come. `stop(indices)`, awaited by `cancel`, asks the
    engine to end those answers early; it still puts each of them. `drop()` ends locally
    whatever still runs when the reader leaves before the end.
    """

    cancels_answers = True

    def __init__(
        self,
        n: int,
        stop: Callable[[list[int]], Awaitable[None]],
        drop: Callable[[], None],
        *,
        cancels_answers: bool = True,
    ) -> None:
        super().__init__(n)
        self.cancels_answers = cancels_answers
        self._stop = stop
        self._drop = drop
        self._ready: deque[tuple[int, Completion]] = deque()
        self._missing = set(range(n))
        self._cancelled: set[int] = set()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    @property
    def missing(self) -> frozenset[int]:
        """The indices not answered yet."""
        return frozenset(self._missing)

    @property
    def cancelled(self) -> frozenset[int]:
        """The indices `cancel` was asked to stop."""
        return frozenset(self._cancelled)

    def put(self, index: int, answer: Completion) -> None:
        if index not in self._missing:
            return
        self._missing.discard(index)
        self._ready.append((index, answer))
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self._error is None and self._missing:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Completion]]:
        try:
            while True:
                while self._ready:
                    yield self._ready.popleft()
                if not self._missing:
                    return
                if self._error is not None:
                    raise self._error
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
        finally:
            self.close()

    async def cancel(self, indices: Collection[int]) -> None:
        wanted = sorted((self._missing - self._cancelled).intersection(indices))
        if not wanted:
            return
        if not self.cancels_answers and len(wanted) < len(self._missing - self._cancelled):
            raise NotSupported("this engine answers whole waves: it cancels all of one or none")
        self._cancelled.update(wanted)
        await self._stop(wanted)

    def close(self) -> None:
        if self._missing and not self._closed:
            self._closed = True
            self._drop()


class RequestWave(StreamedWave):
    """A wave sent as one engine request per answer (vLLM, HTTP servers), each a task:
    `request(i)` runs answer i's request to its answer, `stop(indices)` aborts requests
    in the engine (they still answer, aborted), and a dropped wave cancels its tasks."""

    def __init__(
        self,
        n: int,
        request: Callable[[int], Coroutine[Any, Any, Completion]],
        stop: Callable[[list[int]], Awaitable[None]],
    ) -> None:
        super().__init__(n, stop, self._cancel_requests)
        loop = asyncio.get_running_loop()
        self._requests = [loop.create_task(self._answer(i, request(i))) for i in range(n)]

    async def _answer(self, index: int, request: Coroutine[Any, Any, Completion]) -> None:
        try:
            answer = await request
        except Exception as exc:  # noqa: BLE001 - the wave's reader gets it
            self.fail(exc)
        else:
            self.put(index, answer)

    def _cancel_requests(self) -> None:
        for task in self._requests:
            task.cancel()

    def close_requests(self, indices: Collection[int], version: int) -> None:
        """End these answers here, without the engine's word (an abort call that failed):
        their requests are cancelled, which closes their connections, and each comes back
        aborted with nothing counted."""
        for index in indices:
            self._requests[index].cancel()
            self.put(index, aborted(version))


HealthState = Literal["ok", "degraded", "failed"]


@dataclass
class BackendHealth:
    """`ok`: requests can be served now. `state` tells a pause from the end: `degraded`
    (nothing can serve now, but an engine is recovering) or `failed` (none ever will)."""

    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)
    state: HealthState | None = None

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = "ok" if self.ok else "failed"


class Backend(abc.ABC):
    """An async generation engine with hot-swappable weights.

    The whole weight surface is declared here, as each engine may offer it: tensors
    (every engine), files the engines read themselves (pools on a shared path: they set
    `reads_weight_files`) and the NCCL transfer (vLLM). What an engine lacks raises
    `NotSupported` with a message for the caller, so no caller probes for methods.
    """

    name: str = "base"
    #: `load_weight_files` is offered: the engines read weight files from paths themselves.
    reads_weight_files: bool = False

    @property
    def cancels_answers(self) -> bool:
        """Whether this engine's waves cancel single answers (`Wave.cancels_answers`);
        where not, a reader that stops early uses whole waves and cancels all of one."""
        return False

    @property
    def orders_by_priority(self) -> bool:
        """Whether queued answers are served by their `WaveRequest.priorities` (else in
        the order issued)."""
        return False

    @property
    def whole_waves_cheaper(self) -> bool:
        """Whether `generate` (a wave read whole) costs less than a streamed `wave`: an
        HTTP server parses one request of n instead of n of one. A reader that takes
        every answer and cancels none then calls `generate`."""
        return False

    @property
    def continues(self) -> frozenset[ContinueKV]:
        """The caches under which running answers can go on across a weight load (a
        `continue` update: `update_pause` is `keep` or `recompute`), each answer
        reporting its `version_spans`; empty: running answers must finish or be aborted
        first."""
        return frozenset()

    #: How the next weight load's barrier pauses the engine's running requests; the
    #: scheduler sets it before each update from its `weight_update_mode` (`wait`: none
    #: are running by then).
    update_pause: PauseMode = "wait"

    @property
    @abc.abstractmethod
    def model_name(self) -> str: ...

    @property
    @abc.abstractmethod
    def policy_version(self) -> int: ...

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the engine; /ready turns 200 after this returns."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def wave(
        self,
        prompt_token_ids: list[int],
        n: int,
        sampling: SamplingParams,
        *,
        affinity_key: str | None = None,
        priorities: tuple[int, ...] = (),
    ) -> Wave:
        """n independent answers to one prompt as a wave handle, issued now: each answer
        as it finishes, cancelled by index where the engine can; never blocks the event
        loop. `affinity_key` (the prompt's id) keeps the calls of one prompt on one
        replica, so the turns of an episode find their prefix in its cache; without it
        a multi-replica backend keys on the prompt's tokens. `priorities`: see
        `WaveRequest`."""
        return self.issue(
            WaveRequest(list(prompt_token_ids), n, sampling, affinity_key, priorities=priorities)
        )

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        sampling: SamplingParams,
        *,
        affinity_key: str | None = None,
        priorities: tuple[int, ...] = (),
    ) -> list[Completion]:
        """`wave`'s n answers read whole: nothing is cancelled alone, so an engine may
        answer them as one request (`WaveRequest.whole`)."""
        request = WaveRequest(
            list(prompt_token_ids), n, sampling, affinity_key, whole=True, priorities=priorities
        )
        return await self.issue(request).answers()

    @abc.abstractmethod
    def issue(self, request: WaveRequest) -> Wave:
        """Issue one wave: the one generation call an engine implements (`wave` and
        `generate` build its request). An engine that answers whole waves returns a
        `WholeWave`."""

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Hold new requests in the engine until `resume`; `mode` says what happens to
        the running ones. The scheduler's own gate keeps waves out either way: this is
        the engine's part of a weight update's barrier."""
        raise NotSupported(f"the {self.name} engine does not pause (mode {mode})")

    async def resume(self) -> None:
        """Serve again after `pause`."""
        raise NotSupported(f"the {self.name} engine does not pause")

    async def pause_for_load(self, mode: PauseMode) -> None:
        """The engine's part of a weight update's barrier: new requests wait (`pause`;
        NotSupported where the engine has no pause of its own) and running ones ride
        the load as `mode` says (`update_pause`, which such an engine reads itself)."""
        self.update_pause = mode
        await self.pause(mode)

    async def resume_after_load(self) -> None:
        self.update_pause = "wait"
        await self.resume()

    @abc.abstractmethod
    def weight_specs(self) -> Mapping[str, TensorSpec]:
        """Tensors a weight file may name: state_dict() keys and checkpoint names."""

    @abc.abstractmethod
    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Install a (possibly partial) state dict and serve it as `version`.

        Callers have already vetted names/shapes against weight_specs() and paused new
        requests; implementations cast floating tensors to the engine dtype.
        """

    async def load_weight_files(
        self, files: Sequence[str], version: int, names: Sequence[str]
    ) -> None:
        """Have the engines read vetted weight files themselves and serve them as `version`;
        `names` are the tensors the files hold."""
        raise NotSupported(f"the {self.name} engine does not read weight files from a path")

    def _no_nccl(self) -> NCCLUnavailable:
        return NCCLUnavailable(
            "NCCL weight transfer needs --backend vllm, or --backend http in front of vLLM "
            f"servers (not {self.name})"
        )

    async def nccl_describe(self) -> NCCLDescription:
        """Ranks, tensors and state of the NCCL transfer (GET /v1/weights/nccl)."""
        raise self._no_nccl()

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's NCCL group (vLLM `NCCLWeightTransferInitInfo` fields)."""
        raise self._no_nccl()

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        """Receive one vetted round over NCCL and serve it as `version` (new requests are
        paused by the caller)."""
        raise self._no_nccl()

    async def nccl_shutdown(self) -> None:
        """Leave the NCCL group (sampling goes on)."""
        raise self._no_nccl()

    async def abort_all(self) -> int:
        """Abort in-flight requests (weight update mode `abort`); returns how many."""
        return 0

    def health(self) -> BackendHealth:
        return BackendHealth(ok=True)


class StreamingBackend(Backend):
    """An engine whose waves stream: each answer as it finishes, a cancel by index."""

    @property
    def cancels_answers(self) -> bool:
        return True


class CheckpointBackend(Backend):
    """A backend serving one checkpoint directory: named by that path, and serving the
    version it last installed (a fresh engine serves the checkpoint as version 0)."""

    def __init__(self, model_dir: Path | str) -> None:
        self._model_dir = Path(model_dir)
        self._version = 0

    @property
    def model_name(self) -> str:
        return str(self._model_dir)

    @property
    def policy_version(self) -> int:
        return self._version
