"""Transformers backend: the embedded default engine and the test backend.

Concurrent waves are queued, and one batcher coroutine turns the queued answers with
equal sampling parameters into a single left-padded `model.generate` call (up to
`max_batch_rows`, the lowest request priority first), so the prompts of a wave share
one forward pass per token instead of one each. All model
access (load, generate, weight copies, scoring) runs on one dedicated thread: the event
loop never waits on torch, and a weight load can only run between two batches.

A wave's answers come back when the batch that ran them returns (a wave larger than a
batch comes back batch by batch). A cancelled answer still queued is answered at once,
aborted with nothing decoded; one in the running batch stops at its next token (a
stopping criterion marks its row finished, and the row's tokens up to there are its
answer, aborted): `generate` cannot free a row's slot while it runs, so the batch goes
on for the other rows. `abort_all` (a weight update) ends every answer the same way.

A weight load waits for the running batch, except under a `continue` update
(`update_pause` `keep` or `recompute`): then the batch's own stopping criterion, which
runs on the model thread between two decode steps, copies the weights in, and the rows
go on under them from their next token, each answer noting where the new version began
(`version_spans`). Under `keep` their earlier tokens keep the old weights' cache; under
`recompute` the next step first recomputes that cache under the new weights (a forward
pre-hook on the model, one prefill of the batch's tokens so far), so every later token
is the new weights' own, as a fresh forward pass would score it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from sampler_service.aio import wait_event
from sampler_service.backends.base import (
    BackendHealth,
    CheckpointBackend,
    Completion,
    ContinueKV,
    FinishReason,
    SamplingParams,
    StreamedWave,
    StreamingBackend,
    WaveRequest,
    aborted,
    check_request,
    versions_of,
)
from sampler_service.weights.types import TensorSpec
from sampler_service.weights.vetting import WeightSpecs, check_tensor, tensor_spec
from trainer_client.contract.dtypes import SERVING_DTYPES, safetensors_code, torch_dtype

log = logging.getLogger(__name__)

#: Fault hook for tests (off unless set): a path; while that file exists every `generate`
#: call fails, as an engine that keeps erroring would. The file's removal ends the fault.
FAULT_ENGINE_ERRORS_ENV = "ADAPTIVE_ROLLOUT_FAULT_ENGINE_ERRORS"

_T = TypeVar("_T")


class Decoder(Protocol):
    """The part of a tokenizer the backend needs: token ids -> text."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(eq=False)
class _Request:
    """One wave as asked (its prompt, sampling and answers' priorities), its answers'
    indices not yet handed to a batch, and its handle."""

    request: WaveRequest
    queued: deque[int]
    wave: StreamedWave = field(init=False)
    #: Some of its rows went to a batch (a seeded wave seeds the RNG at its first one).
    started: bool = False

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling


@dataclass(eq=False)
class _Batch:
    rows: list[tuple[_Request, int]]  # (wave, index of the answer) of each row
    sampling: SamplingParams
    reseed: bool  # first rows of a seeded wave: seed the RNG before sampling
    abort: threading.Event = field(default_factory=threading.Event)
    #: Rows cancelled while the batch runs (added on the event loop, read by the model
    #: thread: a set's add and membership test are atomic under the GIL).
    stopped: set[int] = field(default_factory=set)
    #: Row -> the tokens it had when it was stopped (written by the model thread).
    cut: dict[int, int] = field(default_factory=dict)
    #: (version, tokens decoded when it took over) of each weight version the batch ran
    #: under; a load handed to the running batch (`_Swap`), installed at its next step.
    spans: list[tuple[int, int]] = field(default_factory=list)
    swap: _Swap | None = None
    #: The batch's tokens when a `recompute` load was installed: the next decode step
    #: recomputes their cache under the new weights first (`_CacheRebuild`).
    rebuild: torch.Tensor | None = None
    #: generate is running (guarded by the backend's swap lock).
    running: bool = False


@dataclass(eq=False)
class _Swap:
    """A weight load for the running batch to install between two decode steps."""

    plan: list[tuple[torch.Tensor, torch.Tensor]]
    version: int
    #: `recompute`: the running rows' cache is recomputed under the new weights.
    recompute: bool = False
    done: Future[None] = field(default_factory=Future)


class _LogprobRecorder(LogitsProcessor):
    """Collects log_softmax(raw_logits / T) of each sampled token, one step behind.

    `output_logits=True` would keep a float32 [rows, vocab] copy per generated token until
    generate returns (tens of GB for a 150k vocabulary at 256 rows x 1k tokens on a GPU).
    Custom processors run before generate's temperature/top-k/top-p warpers, so this one
    sees the raw logits; it keeps only the latest step's log-probabilities and gathers
    them on the next call, when the sampled token is the last column of `input_ids`.
    """

    def __init__(self, temperature: float) -> None:
        self._temperature = temperature
        self._pending: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._gather(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float() / self._temperature, dim=-1)
        return scores

    def _gather(self, tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self._steps.append(self._pending.gather(1, tokens[:, None]).squeeze(1))
            self._pending = None

    def finish(self, sequences: torch.Tensor) -> list[list[float]]:
        """Per row, the logprob of every generated token (one column per step)."""
        self._gather(sequences[:, -1])
        if not self._steps:
            return [[] for _ in range(sequences.shape[0])]
        return torch.stack(self._steps, dim=1).tolist()


class _StopStrings(StoppingCriteria):
    """Stops a row once its generated text contains a stop string (transformers' own
    criterion precomputes tables from the vocabulary and fails on some tokenizers)."""

    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...], width: int) -> None:
        self._tokenizer, self._stop, self._width = tokenizer, stop, width
        # each token is at least one character, so the longest stop fits in this tail
        self._tail = max(len(s) for s in stop)

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        rows = input_ids[:, self._width :][:, -self._tail :].tolist()
        texts = [self._tokenizer.decode(row, skip_special_tokens=True) for row in rows]
        stop = torch.tensor(
            [any(s in text for s in self._stop) for text in texts], device=input_ids.device
        )
        return cast(torch.BoolTensor, stop)


class _StoppedRows(StoppingCriteria):
    """Stops the rows of a running batch that were cancelled, and every row once
    `abort_all` sets the batch's event, noting how many tokens each had then: a stopped
    row is padded from there on while the others decode. Between two steps it also
    installs a weight load handed to the batch (`install`)."""

    def __init__(
        self,
        batch: _Batch,
        width: int,
        install: Callable[[_Batch, int, torch.Tensor], None],
    ) -> None:
        self._batch, self._width, self._install = batch, width, install

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        batch, rows = self._batch, input_ids.shape[0]
        if batch.swap is not None:
            self._install(batch, input_ids.shape[1] - self._width, input_ids)
        if batch.abort.is_set():
            stop = [True] * rows
        elif batch.stopped:
            stop = [row in batch.stopped for row in range(rows)]
        else:
            stop = [False] * rows
        decoded = input_ids.shape[1] - self._width
        for row in (row for row, stopped in enumerate(stop) if stopped):
            batch.cut.setdefault(row, decoded)
        # transformers' hint; torch types it a Tensor
        return cast(torch.BoolTensor, torch.tensor(stop, device=input_ids.device))


class _CacheRebuild:
    """A forward pre-hook on the model while a batch runs: after a `recompute` load (the
    batch's `rebuild`), the step about to run first gets its cache recomputed under the
    new weights, from the batch's tokens so far, with the attention mask and positions
    generate uses (the cache holds every token but the one this step feeds)."""

    def __init__(self, batch: _Batch) -> None:
        self._batch = batch

    def __call__(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tokens, self._batch.rebuild = self._batch.rebuild, None
        if tokens is None:
            return
        cache, mask = kwargs["past_key_values"], kwargs["attention_mask"]
        cached = tokens.shape[1] - 1
        prefix_mask = mask[:, :cached]
        positions = prefix_mask.long().cumsum(-1) - 1
        positions.masked_fill_(prefix_mask == 0, 1)
        fresh = DynamicCache(config=model.config)
        model.base_model(
            input_ids=tokens[:, :cached],
            attention_mask=prefix_mask,
            position_ids=positions,
            past_key_values=fresh,
            use_cache=True,
        )
        cache.layers[:] = fresh.layers  # in place: generate holds this cache


class HFBackend(CheckpointBackend, StreamingBackend):
    """A transformers causal LM served on token ids, batching concurrent requests.

    `tokenizer` only turns responses into `Completion.text`; when omitted it is loaded from
    `model_dir` if one is saved there, else texts are empty (the service tokenizes prompts
    itself). `max_batch_rows` bounds rows (sum of n) per `model.generate` call; a request
    with a larger n is split over consecutive calls.

    A generate call cannot take new rows once it runs. Under steady load a batch started
    the moment the previous one ends would hold only the few requests that arrived during
    it, while the previous batch's prompts come back a few ms later and must wait a whole
    batch: the engine then alternates a nearly empty batch with a full one. So, as a
    dynamic batcher's queue delay (Triton's `max_queue_delay`), a batch waits up to
    `max_batch_wait_s` for as many rows as the recent batches had. Without recent load
    (one request at a time) nothing waits.
    """

    name = "hf"

    def __init__(
        self,
        model_dir: Path | str,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_rows: int = 256,
        tokenizer: Decoder | None = None,
        max_batch_wait_s: float = 0.05,
    ) -> None:
        if dtype not in SERVING_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(SERVING_DTYPES)}, got {dtype!r}")
        if max_batch_rows < 1:
            raise ValueError("max_batch_rows must be >= 1")
        super().__init__(model_dir)
        self._device = torch.device(device)
        self._dtype_name = dtype
        self._max_batch_rows = max_batch_rows
        self._max_batch_wait_s = max_batch_wait_s
        self._recent_rows: deque[int] = deque(maxlen=4)
        self._tokenizer = tokenizer
        # One thread owns the model: generate batches, weight copies and scoring are
        # serialized on it, which is what keeps a weight load out of a running batch.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-model")
        # The causal LM once loaded (Any: transformers' hints of its generate() and to() do
        # not type-check against the model classes they decorate).
        self._model: Any = None
        self._queue: deque[_Request] = deque()
        self._wakeup = asyncio.Event()
        self._batcher: asyncio.Task[None] | None = None
        self._inflight: _Batch | None = None
        self._failure: BaseException | None = None
        self._eos_ids: list[int] = []
        self._pad_id = 0
        self._vocab_size = 0
        self._swap_lock = threading.Lock()
        self._targets: dict[str, torch.Tensor] = {}  # state_dict key -> tensor sharing storage
        self._names: dict[str, str] = {}  # accepted weight name -> state_dict key
        self._specs = WeightSpecs({})
        self.model_calls = 0  # model.generate calls made; shows batching at work
        self.generated_tokens = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch (not counting the one running)."""
        return len(self._queue)

    async def start(self) -> None:
        await self._in_model_thread(self._load)
        self._batcher = asyncio.create_task(self._serve(), name="hf-backend-batcher")
        self._batcher.add_done_callback(self._on_batcher_exit)

    async def close(self) -> None:
        error = RuntimeError("hf backend closed")
        self._failure = self._failure or error
        self._fail_all(error)
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._model = None

    def health(self) -> BackendHealth:
        ok = self._model is not None and self._failure is None
        detail: dict[str, Any] = {
            "device": str(self._device),
            "dtype": self._dtype_name,
            "policy_version": self._version,
            "queued_requests": len(self._queue),
            "model_calls": self.model_calls,
        }
        if self._failure is not None:
            detail["error"] = repr(self._failure)
        return BackendHealth(ok=ok, detail=detail)

    def _load(self) -> None:
        model: Any = AutoModelForCausalLM.from_pretrained(
            self._model_dir, dtype=torch_dtype(self._dtype_name)
        )
        model.to(self._device).eval()
        config, defaults = model.config, model.generation_config
        eos: list[int] = []
        for ids in (getattr(config, "eos_token_id", None), defaults.eos_token_id):
            for token in [ids] if isinstance(ids, int) else ids or []:
                if token not in eos:
                    eos.append(token)
        pad = getattr(config, "pad_token_id", None)
        if pad is None:
            pad = defaults.pad_token_id
        self._eos_ids = eos
        self._pad_id = pad if pad is not None else (eos[0] if eos else 0)
        # A checkpoint's generation_config.json (top_k=20, repetition_penalty=1.05, ...)
        # would otherwise fill every knob a request leaves unset and skew the logprobs.
        model.generation_config = GenerationConfig(
            eos_token_id=eos or None, pad_token_id=self._pad_id, bos_token_id=defaults.bos_token_id
        )
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._targets = dict(model.state_dict())
        self._names = {key: key for key in self._targets}
        prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
        for key in self._targets:
            # Checkpoints saved from the bare base model name tensors without its prefix.
            if prefix and key.startswith(prefix):
                self._names.setdefault(key[len(prefix) :], key)
        storages: dict[tuple[int, tuple[int, ...]], str] = {}
        tied = {
            key
            for key, t in self._targets.items()
            if t.numel() and storages.setdefault((t.data_ptr(), tuple(t.shape)), key) != key
        }
        self._specs = WeightSpecs(
            {name: tensor_spec(self._targets[key]) for name, key in self._names.items()},
            aliases=[name for name, key in self._names.items() if name != key or key in tied],
        )
        if self._tokenizer is None and any(
            (self._model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
        ):
            # decode() of a flat id list is one str (transformers types it str | list[str]).
            self._tokenizer = cast(Decoder, AutoTokenizer.from_pretrained(self._model_dir))
        self._model = model
        log.info(
            "hf backend loaded %s on %s (%s): %d tensors, eos %s, pad %d",
            self._model_dir,
            self._device,
            self._dtype_name,
            len(self._targets),
            eos,
            self._pad_id,
        )

    # ------------------------------------------------------------------ generation

    def issue(self, request: WaveRequest) -> StreamedWave:
        prompt_token_ids, n, sampling = request.prompt_token_ids, request.n, request.sampling
        self._require_running()
        check_request(prompt_token_ids, n, sampling, vocab_size=self._vocab_size)
        if (hook := os.environ.get(FAULT_ENGINE_ERRORS_ENV)) and Path(hook).exists():
            raise RuntimeError(f"fault hook: {FAULT_ENGINE_ERRORS_ENV} file {hook} exists")
        queued = _Request(request, deque(range(n)))
        queued.wave = StreamedWave(
            n,
            lambda indices: self._cancel(queued, indices),
            lambda: self._stop(queued, queued.wave.missing),
        )
        self._queue.append(queued)
        self._wakeup.set()
        return queued.wave

    async def _cancel(self, request: _Request, indices: list[int]) -> None:
        self._stop(request, indices)

    def _stop(self, request: _Request, indices: Collection[int]) -> None:
        """Queued answers are answered at once, aborted with nothing decoded; running
        ones stop at their batch's next token (the batch answers them)."""
        wanted = set(indices)
        unsent = [i for i in request.queued if i in wanted]
        request.queued = deque(i for i in request.queued if i not in wanted)
        for index in unsent:
            request.wave.put(index, aborted(self._version))
        batch = self._inflight
        if batch is not None:
            batch.stopped.update(
                row for row, (req, i) in enumerate(batch.rows) if req is request and i in wanted
            )

    async def abort_all(self) -> int:
        """End every queued and running answer, for re-issue: queued ones at once with
        nothing decoded, running ones at their batch's next token with what they had (so
        a weight update in `abort` mode waits for at most one token instead of a whole
        batch). Returns how many waves it cut."""
        cut = {req for req in self._queue if req.queued}
        for req in cut:
            self._stop(req, list(req.queued))
        self._queue.clear()
        if self._inflight is not None:
            self._inflight.abort.set()
            cut.update(req for req, _ in self._inflight.rows)
        return len(cut)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while True:
                await self._let_batch_fill()
                if (batch := self._next_batch()) is None:
                    break
                self._recent_rows.append(len(batch.rows))
                # Stays set until the batch is delivered, so close() or a crash of this
                # task can still fail the batch's callers instead of leaving them waiting.
                self._inflight = batch
                try:
                    answers = await loop.run_in_executor(self._executor, self._run_batch, batch)
                except Exception as exc:  # a failed batch fails its waves, not the service
                    log.exception("hf generate failed for %d rows", len(batch.rows))
                    for req, _ in batch.rows:
                        req.wave.fail(exc)
                else:
                    for (req, index), answer in zip(batch.rows, answers, strict=True):
                        req.wave.put(index, answer)
                self._inflight = None

    def _queued_rows(self) -> int:
        return sum(len(req.queued) for req in self._queue)

    async def _let_batch_fill(self) -> None:
        """See the class docstring: wait (bounded) for the rows recent batches had."""
        loop = asyncio.get_running_loop()
        target = min(self._max_batch_rows, max(self._recent_rows, default=0))
        deadline = loop.time() + self._max_batch_wait_s
        while 0 < self._queued_rows() < target and (remaining := deadline - loop.time()) > 0:
            self._wakeup.clear()  # wave() sets it for each new wave
            await wait_event(self._wakeup, remaining)

    def _next_batch(self) -> _Batch | None:
        """Take up to max_batch_rows queued answers, the lowest priority first (ties in
        arrival order), among those sharing the sampling params of the first of them.

        A wave with a seed runs alone, its answers in index order, so its samples depend
        only on its own seed.
        """
        self._queue = deque(req for req in self._queue if req.queued)
        if not self._queue:
            return None
        line = sorted(
            ((req.request.priority(i), place, i) for place, req in enumerate(self._queue)
             for i in req.queued)
        )  # fmt: skip
        head = self._queue[line[0][1]]
        sampling, seeded = head.sampling, head.sampling.seed is not None
        batch = _Batch([], sampling, reseed=seeded and not head.started)
        if seeded:
            rows = [(head, i) for i in head.queued]
        else:
            rows = [
                (req, i) for _, place, i in line if (req := self._queue[place]).sampling == sampling
            ]
        batch.rows = rows[: self._max_batch_rows]
        for req, i in batch.rows:
            req.queued.remove(i)
            req.started = True
        self._queue = deque(req for req in self._queue if req.queued)
        return batch

    def _run_batch(self, batch: _Batch) -> list[Completion]:
        """Model thread: one left-padded generate call; returns completions in row order."""
        model = self._model
        assert model is not None
        sampling = batch.sampling
        prompts = [req.prompt for req, _ in batch.rows]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        recorder = _LogprobRecorder(sampling.temperature if sampling.temperature > 0 else 1.0)
        if batch.reseed:
            torch.manual_seed(sampling.seed)
        criteria: list[StoppingCriteria] = [_StoppedRows(batch, width, self._install_swap)]
        if sampling.stop and self._tokenizer is not None:
            criteria.append(_StopStrings(self._tokenizer, sampling.stop, width))
        with self._swap_lock:
            batch.running, batch.spans = True, [(self._version, 0)]
        rebuild = model.register_forward_pre_hook(_CacheRebuild(batch), with_kwargs=True)
        try:
            with torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids.to(self._device),
                    attention_mask=attention_mask.to(self._device),
                    generation_config=self._generation_config(sampling),
                    logits_processor=LogitsProcessorList([recorder]),
                    stopping_criteria=StoppingCriteriaList(criteria),
                )
        finally:
            rebuild.remove()
            with self._swap_lock:
                batch.running = False
                if batch.swap is not None:  # it came after the last step: between batches
                    self._install_swap(batch, None)
        self.model_calls += 1
        logprobs = recorder.finish(out.sequences)
        completions = []
        rows = out.sequences[:, width:].tolist()
        for row, (tokens, lps) in enumerate(zip(rows, logprobs, strict=True)):
            cut = batch.cut.get(row)
            tokens = tokens if cut is None else tokens[:cut]
            completions.append(self._completion(tokens, lps, sampling, batch.spans))
        self.generated_tokens += sum(len(c.token_ids) for c in completions)
        return completions

    def _generation_config(self, sampling: SamplingParams) -> GenerationConfig:
        """Every knob that shapes the distribution is explicit: nothing comes from defaults
        (transformers would otherwise apply its global top_k=50)."""
        if sampling.stop and self._tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer, which was not found")
        common: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "eos_token_id": [*self._eos_ids, *sampling.stop_token_ids] or None,
            "pad_token_id": self._pad_id,
            "return_dict_in_generate": True,
        }
        if sampling.temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k and sampling.top_k > 0 else 0,
            **common,
        )

    def _completion(
        self,
        tokens: list[int],
        logprobs: list[float],
        sampling: SamplingParams,
        spans: list[tuple[int, int]],
    ) -> Completion:
        """Cut a generated row after its first stop (the rest is padding) and label it
        with the versions that decoded its tokens."""
        stop = self._stop_index(tokens, sampling)
        reason: FinishReason
        if stop is not None:
            tokens, reason = tokens[: stop + 1], "stop"
        else:  # without a stop a row is only short of max_tokens when it was stopped
            reason = "length" if len(tokens) >= sampling.max_tokens else "abort"
        text = self._tokenizer.decode(tokens, skip_special_tokens=True) if self._tokenizer else ""
        oldest, mine = versions_of(spans, self._version, len(tokens))
        return Completion(tokens, logprobs[: len(tokens)], text, reason, oldest, version_spans=mine)

    def _stop_index(self, tokens: list[int], sampling: SamplingParams) -> int | None:
        """Index of the token that ended the row: an eos or stop id, or the token that
        completed a stop string (found by decoding growing prefixes, as generate did)."""
        stop_ids = {*self._eos_ids, *sampling.stop_token_ids}
        at_id = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
        if not sampling.stop or self._tokenizer is None:
            return at_id
        for i in range(len(tokens) if at_id is None else at_id):
            text = self._tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)
            if any(s in text for s in sampling.stop):
                return i
        return at_id

    # ------------------------------------------------------------------ weights

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Copy a (partial) state dict into the live parameters and serve it as `version`.

        Everything is checked before the first copy, so a bad tensor changes nothing. The
        copy is queued on the model thread, so it lands between two generate batches.
        """
        self._require_running()
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, value in tensors.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            check_tensor(name, tuple(tensor.shape), safetensors_code(tensor.dtype), self._specs)
            plan.append((self._targets[self._names[name]], tensor))
        swap = _Swap(plan, version, recompute=self.update_pause == "recompute")
        with self._swap_lock:
            batch = self._inflight
            handed = self.update_pause in self.continues and batch is not None and batch.running
            if handed:
                assert batch is not None
                batch.swap = swap
        if handed:
            await asyncio.wrap_future(swap.done)
        else:
            await self._in_model_thread(self._install, plan, version)

    @property
    def orders_by_priority(self) -> bool:
        return True

    @property
    def continues(self) -> frozenset[ContinueKV]:
        return frozenset({"keep", "recompute"})

    def _install_swap(
        self, batch: _Batch, decoded: int | None, tokens: torch.Tensor | None = None
    ) -> None:
        """Model thread: install the load handed to `batch`, its rows going on under it
        from token `decoded`, their `tokens` so far (None: the batch has ended)."""
        swap, batch.swap = batch.swap, None
        assert swap is not None
        try:
            self._install(swap.plan, swap.version)
        except BaseException as exc:
            swap.done.set_exception(exc)
            raise
        if decoded is not None:
            batch.spans.append((swap.version, decoded))
            if swap.recompute:
                batch.rebuild = tokens
        swap.done.set_result(None)

    def _install(self, plan: list[tuple[torch.Tensor, torch.Tensor]], version: int) -> None:
        with torch.no_grad():
            for target, tensor in plan:
                target.copy_(tensor)  # casts floats to the model dtype, moves to its device
        self._version = version
        log.info("hf backend serving policy version %d (%d tensors updated)", version, len(plan))

    async def score(
        self, prompt_token_ids: list[int], response_token_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """The current policy's log_softmax(logits / T) of each token of a fixed response.

        Same convention as generation (T = 0 means greedy, scored at T = 1); used to check
        logprob parity and to see that a weight load changed the policy.
        """
        self._require_running()
        check_request(
            [*prompt_token_ids, *response_token_ids],
            1,
            SamplingParams(temperature=temperature),
            vocab_size=self._vocab_size,
        )
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        return await self._in_model_thread(
            self._score, list(prompt_token_ids), list(response_token_ids), temperature or 1.0
        )

    def _score(self, prompt: list[int], response: list[int], temperature: float) -> list[float]:
        assert self._model is not None
        if not response:
            return []
        ids = torch.tensor([prompt + response], device=self._device)
        with torch.inference_mode():
            logits = self._model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return logprobs.gather(1, ids[0, len(prompt) :, None]).squeeze(1).tolist()

    # ------------------------------------------------------------------ helpers

    def _require_running(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"hf backend is not serving: {self._failure!r}")
        if self._model is None:
            raise RuntimeError("hf backend not started")

    async def _in_model_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _on_batcher_exit(self, task: asyncio.Task[None]) -> None:
        """A batcher that died must fail its callers loudly rather than leave them hanging."""
        if task.cancelled() or task.exception() is None:
            return
        self._failure = task.exception()
        log.error("hf backend batcher died", exc_info=self._failure)
        self._fail_all(RuntimeError(f"hf backend batcher died: {self._failure!r}"))

    def _fail_all(self, error: BaseException) -> None:
        pending = list(self._queue)
        if self._inflight is not None:
            self._inflight.abort.set()
            pending += [req for req, _ in self._inflight.rows]
        self._queue.clear()
        for req in pending:
            req.wave.fail(error)
