"""A simulated inference engine behind the real `Backend` interface.

It models what decides a rollout's wall time on an engine with continuous batching
(vLLM-style):

- at most `max_num_seqs` sequences decode at once; further ones wait in a queue and
  join the running batch as soon as a slot frees (no global barrier inside the engine),
  lowest request priority first, then in arrival order (vLLM's priority scheduling; all
  priorities equal make it first come, first served);
- every decode step advances each running sequence by one token and takes
  `step_base_s + step_per_seq_s x running + kv_token_s x context` seconds, context being
  the prompt and generated tokens the running sequences hold (memory-bound decode: a
  fuller batch costs a little more per step but far less per token, and attention reads
  every cached token once per step);
- a request's prompt is prefilled once when its first sequence is scheduled (the n
  samples share the prefix), stalling the batch for `prefill_per_token_s x prompt length`;
- answer lengths are log-normal (median `length_median x (1 + difficulty_length x (1 -
  p))` for a prompt of pass rate p, log-sd `length_sigma`), a wrong answer's length times
  `wrong_length_factor`, truncated at the request's `max_tokens` (finish reason
  "length", which the scheduler scores 0 without verifying).

Rewards are Bernoulli draws from a per-prompt pass rate. The prompt is identified by its
first token id (the benchmark's tokenizer puts the prompt's index there), and the drawn
reward is written into the completion text (`REWARD_TEXT`), so the benchmark's verify fn
only reads it back: the scheduler, rules and policies are the project's real code. A
benchmark that runs a real verifier passes its own `text` function instead (an answer
text that the verifier scores as drawn).

A weight load under `continue` (`update_pause` keep or recompute) leaves the running
sequences decoding: each notes the token at which the new version took over (its
`version_spans`), and `recompute` stalls the batch for the prefill of every running
sequence's prompt and tokens so far. `abort_all` ends every sequence with the tokens it
decoded.

The engine is event-driven, not token-stepped: between two events (an arrival, a
finishing sequence) the batch size is constant, so every running sequence advances at
the same rate and the next finish is computed exactly. It runs on whatever clock the
event loop has: simulated time under `bench.virtual_clock`, or real time (the stream
benchmark uses it with tiny step times to feed the real service).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sampler_service.aio import wait_event
from sampler_service.backends.base import (
    Backend,
    BackendHealth,
    Completion,
    ContinueKV,
    Floats,
    TensorSpec,
    TokenIds,
    Wave,
    WaveRequest,
    versions_of,
)
from sampler_service.config import SamplerConfig
from sampler_service.dataset import Dataset
from sampler_service.finalize import GroupSink
from sampler_service.scheduler import Scheduler
from sampler_service.verifiers.base import Verdict

#: Completion text for a correct / incorrect simulated answer.
REWARD_TEXT = {True: "sim:correct", False: "sim:wrong"}

#: Token steps a sequence may be short of its length and still count as finished
#: (float rounding of the event arithmetic).
_EPS_STEPS = 1e-6


@dataclass(frozen=True)
class EngineSpec:
    """Throughput model of the simulated engine (defaults: a ~1.5B model on one GPU)."""

    max_num_seqs: int = 256
    step_base_s: float = 0.012
    step_per_seq_s: float = 0.00005
    prefill_per_token_s: float = 0.00002
    length_median: float = 700.0
    length_sigma: float = 0.6
    #: Multiplies the length of a wrong answer (wrong answers tend to ramble); 1 = none.
    wrong_length_factor: float = 1.0
    #: Median length grows by this fraction from the easiest (p = 1) to the hardest
    #: (p = 0) prompt; 0 = lengths independent of difficulty.
    difficulty_length: float = 0.0
    #: Seconds per decode step per token of context held by the running sequences.
    kv_token_s: float = 0.0
    #: While sequences run, the engine looks at its batch at most once per `tick_s`
    #: seconds: sequences that finished meanwhile are reported together and requests that
    #: arrived meanwhile join then, as a real engine does at its step boundaries. 0: the
    #: moment anything happens (exact; costs a wake-up per finished sequence).
    tick_s: float = 0.0

    @classmethod
    def fixed_step(
        cls, max_num_seqs: int, step_s: float, length_median: float, length_sigma: float
    ) -> EngineSpec:
        """An engine whose decode step takes `step_s` however many sequences run, with no
        prefill: when full it finishes max_num_seqs / (step_s x mean length) answers a
        second, a rate set exactly."""
        return cls(
            max_num_seqs=max_num_seqs,
            step_base_s=step_s,
            step_per_seq_s=0.0,
            prefill_per_token_s=0.0,
            length_median=length_median,
            length_sigma=length_sigma,
        )

    def step_s(self, running: int) -> float:
        return self.step_base_s + self.step_per_seq_s * running


@dataclass(eq=False)
class _Request:
    """One wave: its answers are reported as each finishes (`finished`)."""

    prompt_len: int
    n: int
    finished: asyncio.Queue[tuple[int, Completion]] = field(default_factory=asyncio.Queue)
    #: Sequences not yet finished or cancelled, by index.
    live: dict[int, _Seq] = field(default_factory=dict)
    prefilled: bool = False


@dataclass(eq=False)
class _Seq:
    request: _Request
    index: int
    length: int
    finish_reason: str
    correct: bool
    start: float = 0.0  # the engine's step count when the sequence was scheduled
    running: bool = False
    #: (version, tokens decoded when it took over) since it was scheduled.
    spans: list[tuple[int, int]] = field(default_factory=list)


class _SimWave(Wave):
    """A wave on the simulated engine: each answer as its sequence finishes; a cancelled
    sequence frees its slot at once and comes back with the tokens it decoded."""

    cancels_answers = True

    def __init__(self, engine: SimBackend, request: _Request) -> None:
        super().__init__(request.n)
        self._engine, self._request = engine, request

    async def __aiter__(self) -> AsyncIterator[tuple[int, Completion]]:
        for _ in range(self.n):
            yield await self._request.finished.get()

    async def cancel(self, indices: Collection[int]) -> None:
        self._engine.cancel(self._request, indices)

    def close(self) -> None:
        self._engine.cancel(self._request, list(self._request.live))


@dataclass
class EngineStats:
    """What the engine did, for utilization breakdowns."""

    sequences: int = 0
    tokens: int = 0
    busy_slot_s: float = 0.0  # integral of running sequences over time
    decode_s: float = 0.0  # time with at least one sequence decoding
    prefill_s: float = 0.0
    #: (time, running sequences, queued sequences) after every change, if recording.
    timeline: list[tuple[float, int, int]] = field(default_factory=list)


class SimBackend(Backend):
    """The simulated engine (see the module docstring)."""

    name = "sim"

    def __init__(
        self,
        pass_rates: Sequence[float],
        spec: EngineSpec | None = None,
        *,
        seed: int = 0,
        record_timeline: bool = False,
        payload: Callable[[np.random.Generator, int], tuple[TokenIds, Floats]] | None = None,
        text: Callable[[np.random.Generator, int, bool], str] | None = None,
    ) -> None:
        self.pass_rates = np.asarray(pass_rates, dtype=np.float64)
        self.spec = spec or EngineSpec()
        self.stats = EngineStats()
        self._rng = np.random.default_rng(seed)
        self._record = record_timeline
        self._payload = payload or _cheap_payload
        self._text = text or _reward_text
        #: Waiting sequences as (priority, arrival, sequence): a heap.
        self._queue: list[tuple[int, int, _Seq]] = []
        self._arrivals = itertools.count()
        #: Waves with sequences still to finish, in issue order: a dict, not a set, as a
        #: set of objects iterates in memory-address order, which made `abort_all`, and
        #: so every run whose drain timed out, differ between runs of one seed.
        self._requests: dict[_Request, None] = {}
        self._running: list[tuple[float, int, _Seq]] = []  # (finish step, tiebreak, seq)
        self._tiebreak = itertools.count()
        self._steps = 0.0  # decode steps done so far: a running seq's progress clock
        self._stall_s = 0.0  # prefill time owed before decoding resumes
        # Context of the running sequences is _ctx_base + running x _steps (each holds its
        # prompt plus one token per step since it started).
        self._ctx_base = 0.0
        self._arrival = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._version = 0
        #: (prompt index, answers asked, their priorities) of every wave, in arrival order.
        self.requests: list[tuple[int, int, tuple[int, ...]]] = []

    # -- Backend interface ------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return "simulated-engine"

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name="sim-engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return {}

    @property
    def continues(self) -> frozenset[ContinueKV]:
        return frozenset({"keep", "recompute"})

    @property
    def orders_by_priority(self) -> bool:
        return True

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Serve `version`; running sequences (only a `continue` update leaves any) go on
        under it from their next token, after a prefill of what they hold under
        `recompute`."""
        self._version = version
        for _, _, seq in self._running:
            decoded = int(self._steps - seq.start)
            if decoded < seq.length:
                seq.spans.append((version, decoded))
                if self.update_pause == "recompute":
                    held = seq.request.prompt_len + decoded
                    self._stall_s += self.spec.prefill_per_token_s * held
                    self.stats.prefill_s += self.spec.prefill_per_token_s * held

    def health(self) -> BackendHealth:
        return BackendHealth(ok=self._task is not None, detail={"queued": len(self._queue)})

    def issue(self, request: WaveRequest) -> Wave:
        prompt_token_ids, n, sampling = request.prompt_token_ids, request.n, request.sampling
        if self._task is None:
            raise RuntimeError("sim engine not started")
        p = float(self.pass_rates[prompt_token_ids[0]])
        self.requests.append((prompt_token_ids[0], n, request.priorities))
        spec = self.spec
        correct = self._rng.random(n) < p
        median = spec.length_median * (1.0 + spec.difficulty_length * (1.0 - p))
        lengths = np.exp(self._rng.normal(math.log(median), spec.length_sigma, n))
        lengths = np.where(correct, lengths, lengths * spec.wrong_length_factor)
        lengths = np.maximum(1, np.round(lengths)).astype(np.int64)
        queued = _Request(len(prompt_token_ids), n)
        self._requests[queued] = None
        for i in range(n):
            length = int(lengths[i])
            truncated = length > sampling.max_tokens
            seq = _Seq(
                queued,
                i,
                min(length, sampling.max_tokens),
                "length" if truncated else "stop",
                bool(correct[i]),
            )
            queued.live[i] = seq
            heapq.heappush(self._queue, (request.priority(i), next(self._arrivals), seq))
        self._arrival.set()
        return _SimWave(self, queued)

    def cancel(self, request: _Request, indices: Collection[int]) -> None:
        """Stop these sequences of a wave: a queued one never runs, a running one frees
        its slot now; each reports the tokens it decoded (finish reason `abort`)."""
        cancelled = [seq for i in indices if (seq := request.live.pop(i, None)) is not None]
        if not cancelled:
            return
        gone = {id(seq) for seq in cancelled}
        running = [entry for entry in self._running if id(entry[2]) not in gone]
        if len(running) != len(self._running):
            heapq.heapify(running)
            self._running = running
        for seq in cancelled:
            decoded = 0
            if seq.running:
                decoded = min(seq.length, int(self._steps - seq.start))
                self._ctx_base -= request.prompt_len - seq.start
            self._report(seq, decoded, "abort")
        if not request.live:
            self._requests.pop(request, None)
        self._arrival.set()  # a freed slot: the engine schedules again

    async def abort_all(self) -> int:
        """Stop every sequence (a weight update's `abort`): each comes back with the tokens
        it decoded and finish reason `abort`, and the scheduler draws it again."""
        aborted = 0
        for request in list(self._requests):
            aborted += len(request.live)
            self.cancel(request, list(request.live))
        return aborted

    # -- the engine -------------------------------------------------------------------
    def _schedule(self) -> None:
        """Move queued sequences into free slots; their prompts' prefill stalls the batch."""
        spec = self.spec
        while self._queue and len(self._running) < spec.max_num_seqs:
            _, _, seq = heapq.heappop(self._queue)
            if seq.index not in seq.request.live:  # cancelled while queued
                continue
            if not seq.request.prefilled:
                seq.request.prefilled = True
                stall = spec.prefill_per_token_s * seq.request.prompt_len
                self._stall_s += stall
                self.stats.prefill_s += stall
            seq.start, seq.running, seq.spans = self._steps, True, [(self._version, 0)]
            self._ctx_base += seq.request.prompt_len - seq.start
            heapq.heappush(self._running, (self._steps + seq.length, next(self._tiebreak), seq))

    def _finish(self, seq: _Seq) -> None:
        request = seq.request
        del request.live[seq.index]
        if not request.live:
            self._requests.pop(request, None)
        self._ctx_base -= request.prompt_len - seq.start
        self._report(seq, seq.length, seq.finish_reason)

    def _report(self, seq: _Seq, length: int, finish_reason: str) -> None:
        token_ids, logprobs = self._payload(self._rng, length)
        oldest, spans = versions_of(seq.spans, self._version, length)
        completion = Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            text=self._text(self._rng, length, seq.correct),
            finish_reason=finish_reason,  # type: ignore[arg-type]
            policy_version=oldest,
            version_spans=spans,
        )
        self.stats.sequences += 1
        self.stats.tokens += length
        seq.request.finished.put_nowait((seq.index, completion))

    def _mark(self, now: float) -> None:
        if self._record:
            self.stats.timeline.append((now, len(self._running), len(self._queue)))

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        # Decoding time runs on from one look at the batch to the next: the seconds this
        # thread spends reporting and scheduling (or waiting for the GIL) are seconds the
        # device decodes, so the engine keeps its set rate on a busy host.
        clock: float | None = None
        while True:
            self._arrival.clear()
            self._schedule()
            self._mark(loop.time())
            if not self._running:
                clock = None
                await self._arrival.wait()
                continue
            running = len(self._running)
            # Step k from now takes step + slope x k: the context grows by `running`
            # tokens per step. Time for d steps: d x step + slope x d^2 / 2.
            step = self.spec.step_s(running) + self.spec.kv_token_s * (
                self._ctx_base + running * self._steps
            )
            slope = self.spec.kv_token_s * running
            to_finish = max(0.0, self._running[0][0] - self._steps)
            horizon = self._stall_s + to_finish * step + slope * to_finish**2 / 2
            started = loop.time() if clock is None else clock
            until = started + max(horizon, self.spec.tick_s)
            await wait_event(self._arrival, max(0.0, until - loop.time()))
            if (rest := started + self.spec.tick_s - loop.time()) > 0:
                await asyncio.sleep(rest)  # woken early by an arrival: it joins at the tick
            clock = loop.time()
            elapsed = clock - started
            stalled = min(elapsed, self._stall_s)
            self._stall_s -= stalled
            decoding = elapsed - stalled
            # Steps done in `decoding` seconds: the root of slope/2 d^2 + step d = decoding.
            self._steps += 2 * decoding / (step + math.sqrt(step * step + 2 * slope * decoding))
            self.stats.busy_slot_s += running * elapsed
            self.stats.decode_s += decoding
            while self._running and self._running[0][0] <= self._steps + _EPS_STEPS:
                _, _, seq = heapq.heappop(self._running)
                self._finish(seq)


def _reward_text(rng: np.random.Generator, length: int, correct: bool) -> str:
    """The drawn reward as the whole text (`verify_reward_text` reads it back)."""
    return REWARD_TEXT[correct]


def _cheap_payload(rng: np.random.Generator, length: int) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of the right length, as cheaply as possible."""
    return [1] * length, [-1.0] * length


async def verify_reward_text(row: Any, completions: Sequence[Completion]) -> list[Verdict]:
    """The benchmark's verify fn: the engine wrote the drawn reward into the text."""
    return [Verdict(1.0 if c.text == REWARD_TEXT[True] else 0.0) for c in completions]


def sim_scheduler(
    engine: Backend, dataset: Dataset, sink: GroupSink, config: SamplerConfig, seed: int
) -> Scheduler:
    """A scheduler over a simulated engine, on the running loop's clock (a virtual clock's
    in the simulations), scoring answers by the reward their text carries."""
    return Scheduler(
        backend=engine,
        dataset=dataset,
        verify=verify_reward_text,
        sink=sink,
        config=config,
        clock=asyncio.get_running_loop().time,
        seed=seed,
    )
