"""The transformers backend and weight vetting, on a tiny random Qwen2 built locally.

Logprobs are checked against an independent forward pass of the same checkpoint, so
batching, left padding and weight loads are all held to the reference model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from support import perturbed_state
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, Qwen2ForCausalLM

from sampler_service.backends.base import Completion, GenerationAborted, SamplingParams
from sampler_service.backends.hf import HFBackend
from sampler_service.errors import NotSupported
from sampler_service.weights.types import WeightsRejected
from sampler_service.weights.vetting import spec_bytes, vet_weight_file
from trainer_client.toy.model import build_config

pytestmark = pytest.mark.timeout(120)

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+-*/=abcdefghijklmn"  # ids 3..31 of a character-level vocabulary
VOCAB = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{c: i + 3 for i, c in enumerate(CHARS)}}


def _save_model(path: Path, *, eos: int | None, tokenizer: bool) -> Path:
    torch.manual_seed(0)
    # The toy's tiny Qwen2, on this vocabulary with a BOS, and the eos (or none) under test.
    config = build_config(len(VOCAB), pad_id=PAD, eos_id=EOS)
    config.bos_token_id, config.eos_token_id = BOS, eos
    Qwen2ForCausalLM(config).save_pretrained(path)
    # Defaults a real checkpoint ships; the backend must not let them shape sampling.
    GenerationConfig(
        do_sample=True,
        temperature=0.3,
        top_k=3,
        top_p=0.5,
        repetition_penalty=1.5,
        eos_token_id=eos,
    ).save_pretrained(path)
    if tokenizer:
        tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(["<pad>", "<s>", "</s>"])
        tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_model(tmp_path_factory.mktemp("tiny"), eos=EOS, tokenizer=True)


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """No eos and no tokenizer: rows only stop at max_tokens, texts are empty."""
    return _save_model(tmp_path_factory.mktemp("endless"), eos=None, tokenizer=False)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@asynccontextmanager
async def started(model_dir: Path, **kwargs: Any) -> AsyncIterator[HFBackend]:
    backend = HFBackend(model_dir, **kwargs)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture
async def backend(model_dir: Path) -> AsyncIterator[HFBackend]:
    async with started(model_dir) as backend:
        yield backend


def reference_logprobs(
    model: Any, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(response)[:, None]).squeeze(1)


def kept_cache_logprobs(
    old: Any, new: Any, prompt: list[int], response: list[int], start: int
) -> torch.Tensor:
    """Logprobs of `response[start:]` decoded by `new` over the cache `old` built for the
    tokens before (the last token before `start` is fed to `new`, as the step after a
    `keep` load feeds it)."""
    ids = torch.tensor([prompt + response])
    fed = len(prompt) + start - 1
    cache = DynamicCache()
    with torch.no_grad():
        old(input_ids=ids[:, :fed], past_key_values=cache, use_cache=True)
        logits = new(input_ids=ids[:, fed:-1], past_key_values=cache, use_cache=True).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(response[start:])[:, None]).squeeze(1)


def check_row(c: Completion, max_tokens: int) -> None:
    assert len(c.logprobs) == len(c.token_ids) <= max_tokens
    assert EOS not in c.token_ids[:-1]
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == EOS
    else:
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens
        assert EOS not in c.token_ids


PROMPTS = [[5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]  # unequal lengths: left padding


async def test_concurrent_requests_share_one_model_call(backend: HFBackend) -> None:
    warm, cold = SamplingParams(temperature=0.7, max_tokens=8), SamplingParams(max_tokens=8)
    results = await asyncio.gather(
        *(backend.generate(p, 2, warm) for p in PROMPTS), backend.generate([5], 3, cold)
    )
    # The three requests with equal params form one batch; the odd one out a second.
    assert backend.model_calls == 2
    assert [len(r) for r in results] == [2, 2, 2, 3]
    for completion in (c for r in results for c in r):
        check_row(completion, 8)
        assert completion.policy_version == 0


async def test_requests_beyond_max_batch_rows_are_split(model_dir: Path) -> None:
    async with started(model_dir, max_batch_rows=4) as backend:
        sampling = SamplingParams(max_tokens=4)
        big, small = await asyncio.gather(
            backend.generate([5], 10, sampling), backend.generate([6], 1, sampling)
        )
        assert (len(big), len(small)) == (10, 1)
        assert backend.model_calls == 3  # 11 rows in batches of 4, 4, 3


async def test_under_load_a_batch_waits_for_the_requests_still_coming(model_dir: Path) -> None:
    """After a 16-row batch, four 4-row requests arriving one by one run as one batch."""
    async with started(model_dir, max_batch_wait_s=30.0) as backend:
        sampling = SamplingParams(max_tokens=4)
        await asyncio.gather(*(backend.generate([5 + i], 4, sampling) for i in range(4)))
        assert backend.model_calls == 1

        async def late(i: int) -> list[Completion]:
            await asyncio.sleep(0.02 * i)
            return await backend.generate([5 + i], 4, sampling)

        results = await asyncio.gather(*(late(i) for i in range(4)))
        assert [len(r) for r in results] == [4] * 4
        assert backend.model_calls == 2  # not one call per request


@pytest.mark.parametrize("temperature", [0.7, 1.3, 0.0])
async def test_logprobs_match_an_independent_forward_pass(
    backend: HFBackend, reference: Any, temperature: float
) -> None:
    sampling = SamplingParams(temperature=temperature, max_tokens=12)
    results = await asyncio.gather(*(backend.generate(p, 3, sampling) for p in PROMPTS))
    assert backend.model_calls == 1
    scale = temperature or 1.0  # greedy logprobs are reported at T = 1
    for prompt, completions in zip(PROMPTS, results, strict=True):
        for c in completions:
            check_row(c, 12)
            expected = reference_logprobs(reference, prompt, c.token_ids, scale)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
            assert c.text == "".join(CHARS[t - 3] for t in c.token_ids if t >= 3)
    distinct = {tuple(c.token_ids) for c in results[0]}
    assert (len(distinct) == 1) == (temperature == 0)


async def test_greedy_is_deterministic(backend: HFBackend, reference: Any) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    alone = await backend.generate(PROMPTS[1], 1, greedy)
    batched = await asyncio.gather(*(backend.generate(p, 2, greedy) for p in PROMPTS))
    assert {tuple(c.token_ids) for c in batched[1]} == {tuple(alone[0].token_ids)}
    # And it is the argmax path of the reference model.
    ids = list(PROMPTS[1])
    for token in alone[0].token_ids:
        with torch.no_grad():
            assert token == int(reference(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)


async def test_seeded_requests_are_reproducible(backend: HFBackend) -> None:
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=16, seed=seed)

    first, again, other = await asyncio.gather(
        backend.generate([5], 2, seeded(1)),
        backend.generate([5], 2, seeded(1)),
        backend.generate([5], 2, seeded(2)),
    )
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


async def test_max_tokens_and_finish_reason(backend: HFBackend) -> None:
    completions = await backend.generate([5, 6], 16, SamplingParams(max_tokens=32, seed=0))
    for c in completions:
        check_row(c, 32)
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    (one,) = await backend.generate([5], 1, SamplingParams(temperature=0, max_tokens=1))
    assert len(one.token_ids) == 1


async def test_invalid_requests_are_rejected(backend: HFBackend) -> None:
    sampling = SamplingParams()
    for prompt, n, params in [
        ([], 1, sampling),
        ([32], 1, sampling),
        ([-1], 1, sampling),
        ([5], 0, sampling),
        ([5], 1, SamplingParams(top_p=0.0)),
        ([5], 1, SamplingParams(temperature=-1.0)),
        ([5], 1, SamplingParams(max_tokens=0)),
    ]:
        with pytest.raises(ValueError):
            await backend.generate(prompt, n, params)
    assert len(await backend.generate([5], 1, sampling)) == 1


async def test_load_weights_changes_the_policy(
    backend: HFBackend, reference: Any, model_dir: Path
) -> None:
    prompt, response = [5, 6, 7], [8, 9, 10, 11]
    before = await backend.score(prompt, response, 0.7)
    torch.testing.assert_close(
        torch.tensor(before),
        reference_logprobs(reference, prompt, response, 0.7),
        atol=1e-4,
        rtol=0,
    )

    new = perturbed_state(reference, 0.5, seed=1, names=["lm_head.weight", "model.norm.weight"])
    # A partial F16 file, one tensor under the checkpoint-of-the-base-model spelling.
    upload = {
        "lm_head.weight": new["lm_head.weight"].half(),
        "norm.weight": new["model.norm.weight"].half(),
    }
    tensors = vet_weight_file(safetensors.torch.save(upload), backend.weight_specs())
    await backend.load_weights(tensors, 3)
    assert backend.policy_version == 3

    after = await backend.score(prompt, response, 0.7)
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-2
    updated = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    updated.load_state_dict({k: v.half().float() for k, v in new.items()}, strict=False)
    torch.testing.assert_close(
        torch.tensor(after), reference_logprobs(updated, prompt, response, 0.7), atol=1e-4, rtol=0
    )
    (sample,) = await backend.generate(prompt, 1, SamplingParams(max_tokens=4))
    assert sample.policy_version == 3

    # A bad tensor anywhere in the dict changes nothing.
    with pytest.raises(WeightsRejected, match="lm_head.weight"):
        await backend.load_weights(
            {"model.norm.weight": new["model.norm.weight"], "lm_head.weight": torch.zeros(3, 3)}, 4
        )
    assert backend.policy_version == 3
    assert await backend.score(prompt, response, 0.7) == after


async def test_weight_load_waits_for_the_running_batch(endless_dir: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(endless_dir, dtype=torch.float32).eval()
    async with started(endless_dir) as backend:
        prompt, sampling = [5, 6], SamplingParams(max_tokens=200)
        running = asyncio.create_task(backend.generate(prompt, 4, sampling))
        await asyncio.sleep(0.05)
        assert not running.done() and backend.queue_depth == 0  # taken into a batch
        await backend.load_weights(
            perturbed_state(reference, 0.5, seed=1, names=["lm_head.weight"]), 1
        )
        for c in await running:
            # Every token came from the old weights: the load waited for the batch.
            assert c.policy_version == 0 and c.finish_reason == "length" and c.text == ""
            expected = reference_logprobs(reference, prompt, c.token_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        (later,) = await backend.generate(prompt, 1, SamplingParams(max_tokens=2))
        assert later.policy_version == 1


@pytest.mark.parametrize("kv", ["keep", "recompute"])
async def test_a_continue_load_lands_between_two_decode_steps(endless_dir: Path, kv: str) -> None:
    """Under a `continue` update the running rows go on under the new weights from the
    step after the load, and each answer says where they began. Under `recompute` every
    later token is exactly the new weights' own; under `keep` only approximately."""
    reference = AutoModelForCausalLM.from_pretrained(endless_dir, dtype=torch.float32).eval()
    new = perturbed_state(reference, 0.05, seed=1)  # every layer: the cache moves too
    updated = AutoModelForCausalLM.from_pretrained(endless_dir, dtype=torch.float32).eval()
    updated.load_state_dict(new, strict=False)
    async with started(endless_dir) as backend:
        assert backend.continues == {"keep", "recompute"}
        # Rows of different lengths: the recomputed cache keeps generate's left padding.
        prompt, sampling = [5, 6], SamplingParams(max_tokens=400)
        running = asyncio.create_task(backend.generate(prompt, 2, sampling))
        other = asyncio.create_task(backend.generate([7, 8, 9, 10], 1, sampling))
        await asyncio.sleep(0.2)
        assert not running.done() and backend.queue_depth == 0  # taken into a batch
        with pytest.raises(NotSupported):  # no pause of its own: it reads update_pause
            await backend.pause_for_load(kv)
        await backend.load_weights(new, 1)
        with pytest.raises(NotSupported):
            await backend.resume_after_load()
        assert backend.update_pause == "wait" and backend.policy_version == 1
        answers = [(prompt, c) for c in await running] + [([7, 8, 9, 10], c) for c in await other]
    starts = set()
    for row_prompt, c in answers:
        assert c.finish_reason == "length" and c.policy_version == 0
        assert c.version_spans is not None
        [(first, zero), (second, start)] = c.version_spans
        assert (first, zero, second) == (0, 0, 1) and 0 < start < len(c.token_ids)
        starts.add(start)
        old = reference_logprobs(reference, row_prompt, c.token_ids, 1.0)
        fresh = reference_logprobs(updated, row_prompt, c.token_ids, 1.0)
        sampled = torch.tensor(c.logprobs)
        # Tokens before the load are the old weights' own.
        torch.testing.assert_close(sampled[:start], old[:start], atol=1e-4, rtol=0)
        later = sampled[start:]
        if kv == "recompute":
            torch.testing.assert_close(later, fresh[start:], atol=1e-4, rtol=0)
        else:
            # The earlier tokens' keys and values stay the old weights' (the `keep`
            # approximation): exactly what the new weights make of the old cache, and not
            # what a fresh forward pass under them scores.
            kept = kept_cache_logprobs(reference, updated, row_prompt, c.token_ids, start)
            torch.testing.assert_close(later, kept, atol=1e-4, rtol=0)
            assert (later - fresh[start:]).abs().max() > 1e-2
    assert len(starts) == 1  # one batch: the load landed at one step for every row


async def test_abort_all_and_a_responsive_event_loop(endless_dir: Path) -> None:
    async with started(endless_dir) as backend:
        # A million tokens would take hours: the calls after the abort can only return
        # (within the test's timeout) if the abort stopped the running batch.
        running = asyncio.create_task(
            backend.generate([5], 4, SamplingParams(max_tokens=1_000_000))
        )
        queued = asyncio.create_task(backend.generate([5], 1, SamplingParams(temperature=0.5)))
        ticks = 0
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # the loop keeps running while torch works
            await asyncio.sleep(0.005)
            ticks += 1
        assert ticks >= 5 and not running.done() and not queued.done()

        assert await backend.abort_all() == 2
        for task in (running, queued):
            with pytest.raises(GenerationAborted):
                await task
        assert await backend.generate([5], 1, SamplingParams(max_tokens=3))  # still serving
        assert backend.model_calls == 2


async def _running(backend: HFBackend) -> None:
    """Until a batch runs, and a little longer: its rows have decoded tokens."""
    while backend._inflight is None:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.1)


async def test_a_cancelled_row_stops_decoding_and_keeps_what_it_decoded(
    endless_dir: Path,
) -> None:
    """Greedy twins of one wave: the cancelled one stops early, its tokens a prefix of its
    uncancelled twin's, and counted."""
    async with started(endless_dir) as backend:
        greedy = SamplingParams(temperature=0, max_tokens=1000)
        wave = backend.wave([5, 6], 3, greedy)
        assert wave.cancels_answers
        await _running(backend)
        await wave.cancel([1])
        answers = dict([pair async for pair in wave])
        cut, twin = answers[1], answers[0]
        assert cut.finish_reason == "abort" and twin.finish_reason == "length"
        assert 0 < len(cut.token_ids) < len(twin.token_ids) == 1000
        assert cut.token_ids == twin.token_ids[: len(cut.token_ids)]
        assert len(cut.logprobs) == len(cut.token_ids)
        assert answers[2].token_ids == twin.token_ids
        assert backend.generated_tokens == 2000 + len(cut.token_ids)
        assert backend.model_calls == 1


async def test_a_queued_answer_cancelled_is_answered_at_once_and_never_runs(
    endless_dir: Path,
) -> None:
    async with started(endless_dir, max_batch_rows=2) as backend:
        wave = backend.wave([5], 3, SamplingParams(max_tokens=200))
        await _running(backend)  # rows 0 and 1 run; row 2 waits for the next batch
        await wave.cancel([2])
        reading = aiter(wave)
        index, first = await anext(reading)
        assert (index, first.finish_reason, first.token_ids) == (2, "abort", [])
        rest = {index: answer.finish_reason async for index, answer in reading}
        assert rest == {0: "length", 1: "length"}
        assert backend.model_calls == 1


async def test_queued_answers_run_lowest_priority_first(endless_dir: Path) -> None:
    """Behind a running batch of two rows, the queued answers of lower priority run first,
    across waves and within one, though they were queued last; equal priorities run in
    the order queued."""

    async def finish_order(priorities: tuple[int, ...]) -> list[tuple[str, int]]:
        async with started(endless_dir, max_batch_rows=2) as backend:
            assert backend.orders_by_priority
            sampling = SamplingParams(max_tokens=8)
            finished: list[tuple[str, int]] = []

            async def read(name: str, wave: Any) -> None:
                async for index, _ in wave:
                    finished.append((name, index))

            first = asyncio.create_task(read("first", backend.wave([5], 2, sampling)))
            await _running(backend)
            later = backend.wave([6], 2, sampling, priorities=priorities[:2])
            sooner = backend.wave([7], 2, sampling, priorities=priorities[2:])
            await asyncio.gather(first, read("later", later), read("sooner", sooner))
            assert backend.model_calls == 3  # two rows a batch
            return finished[2:]

    # One of each wave's answers jumps the queue: a batch holds the two of priority 1 (a
    # batch's answers come back in its row order).
    assert await finish_order((9, 1, 5, 1)) == [
        ("later", 1), ("sooner", 1), ("sooner", 0), ("later", 0)
    ]  # fmt: skip
    assert await finish_order((3, 3, 3, 3)) == [
        ("later", 0), ("later", 1), ("sooner", 0), ("sooner", 1)
    ]  # fmt: skip


async def test_a_reader_that_leaves_stops_its_rows(endless_dir: Path) -> None:
    async with started(endless_dir) as backend:
        reading = asyncio.create_task(
            backend.generate([5], 2, SamplingParams(max_tokens=1_000_000))
        )
        await _running(backend)
        reading.cancel()  # a million tokens would take hours: only a stop ends the batch
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert await backend.generate([5], 1, SamplingParams(max_tokens=3))  # still serving
        assert backend.model_calls == 2


async def test_vet_weight_file(backend: HFBackend, reference: Any, model_dir: Path) -> None:
    specs = backend.weight_specs()
    state = reference.state_dict()
    # The checkpoint save_pretrained wrote is accepted whole, by file or by directory.
    assert set(vet_weight_file(model_dir, specs)) == set(state)
    assert set(vet_weight_file(model_dir / "model.safetensors", specs)) == set(state)
    # Size limit base: every parameter once, however many names it is accepted under.
    assert spec_bytes(specs) == sum(t.numel() * t.element_size() for t in state.values())

    partial = safetensors.torch.save({"model.norm.weight": state["model.norm.weight"].bfloat16()})
    assert set(vet_weight_file(partial, specs)) == {"model.norm.weight"}

    good = safetensors.torch.save({"lm_head.weight": state["lm_head.weight"]})
    bad_files = {
        "not a safetensors file": b"garbage bytes, not a weight file at all",
        "truncated": good[:-100],
        "model.norm.weight": safetensors.torch.save({"model.norm.weight": torch.ones(64)}),
        "no_such.weight": safetensors.torch.save({"no_such.weight": torch.ones(2)}),
        "dtype I64": safetensors.torch.save(
            {"model.norm.weight": torch.ones(128, dtype=torch.int64)}
        ),
        "no tensors": safetensors.torch.save({}),
    }
    for message, data in bad_files.items():
        with pytest.raises(WeightsRejected, match=message.replace(".", r"\.")):
            vet_weight_file(data, specs)
