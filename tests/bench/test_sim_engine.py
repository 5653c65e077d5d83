"""The simulated continuous-batching engine, and the real scheduler driving it in
simulated time (bench/adaptive_sim.py). Simulated times are exact, so they are checked
exactly; nothing here depends on how fast this machine is."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import pytest
from sim_waves import waves_until_every_prompt_asked

from bench import adaptive_sim, virtual_clock
from bench.sim_backend import REWARD_TEXT, EngineSpec, SimBackend, verify_reward_text
from sampler_service.backends.base import SamplingParams

# Every answer exactly `length_median` tokens long, no prefill: times are easy to predict.
FLAT = dataclasses.replace(
    EngineSpec.fixed_step(max_num_seqs=2, step_s=0.01, length_median=100, length_sigma=0.0),
    step_per_seq_s=0.001,
)


def _generate(
    spec: EngineSpec,
    requests: list[tuple[int, int]],
    pass_rates: list[float],
    max_tokens: int = 1000,
) -> tuple[list[list], list[float], SimBackend]:
    """Submit (prompt index, n) requests at t=0; return completions and finish times."""

    async def main() -> tuple[list[list], list[float], SimBackend]:
        loop = asyncio.get_running_loop()
        engine = SimBackend(pass_rates, spec, seed=0, record_timeline=True)
        await engine.start()

        async def one(prompt: int, n: int) -> tuple[list, float]:
            out = await engine.generate([prompt, 0, 0], n, SamplingParams(max_tokens=max_tokens))
            return out, loop.time()

        try:
            results = await asyncio.gather(*(one(p, n) for p, n in requests))
        finally:
            await engine.close()
        return [r[0] for r in results], [r[1] for r in results], engine

    return virtual_clock.run(main())


def test_one_request_within_the_concurrency_limit_takes_length_times_step() -> None:
    (completions,), (t,), _ = _generate(FLAT, [(0, 2)], [0.5])
    assert len(completions) == 2
    assert all(len(c.token_ids) == len(c.logprobs) == 100 for c in completions)
    assert t == pytest.approx(100 * FLAT.step_s(2))


def test_sequences_beyond_the_limit_queue_for_a_free_slot() -> None:
    # 4 sequences, 2 slots: two generations of 100 steps with 2 running.
    (_,), (t,), engine = _generate(FLAT, [(0, 4)], [0.5])
    assert t == pytest.approx(200 * FLAT.step_s(2))
    assert max(running for _, running, _ in engine.stats.timeline) == 2
    assert engine.stats.sequences == 4 and engine.stats.tokens == 400
    assert engine.stats.busy_slot_s == pytest.approx(2 * t)


def test_a_lone_sequence_decodes_faster_per_step() -> None:
    (_, _), (t1, t2), _ = _generate(FLAT, [(0, 1), (1, 1)], [0.5, 0.5])
    assert t1 == t2 == pytest.approx(100 * FLAT.step_s(2))
    (_,), (t_alone,), _ = _generate(FLAT, [(0, 1)], [0.5])
    assert t_alone == pytest.approx(100 * FLAT.step_s(1))


def _finish_times(spec: EngineSpec, arrivals: list[tuple[float, int]]) -> list[float]:
    """When each one-answer request (arrival time, max_tokens) gets its answer."""

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        engine = SimBackend([0.5], spec, seed=0)
        await engine.start()

        async def one(at: float, max_tokens: int) -> float:
            await asyncio.sleep(at)
            await engine.generate([0], 1, SamplingParams(max_tokens=max_tokens))
            return loop.time()

        try:
            return list(await asyncio.gather(*(one(at, m) for at, m in arrivals)))
        finally:
            await engine.close()

    return virtual_clock.run(main())


def test_a_tick_reports_answers_at_its_boundaries_never_before_they_are_done() -> None:
    spec = dataclasses.replace(FLAT, max_num_seqs=4, step_per_seq_s=0.0)  # 10 ms per step
    # 30 and 100 tokens from t=0; 10 tokens arriving at t=0.1.
    arrivals = [(0.0, 30), (0.0, 1000), (0.1, 10)]
    assert _finish_times(spec, arrivals) == pytest.approx([0.3, 1.0, 0.2])
    # Looking once per 0.25 s: the late request joins at 0.25, and each answer is reported
    # at the first look after it is done.
    ticked = dataclasses.replace(spec, tick_s=0.25)
    assert _finish_times(ticked, arrivals) == pytest.approx([0.5, 1.0, 0.5])


def test_prefill_is_paid_once_per_request() -> None:
    spec = dataclasses.replace(
        FLAT, max_num_seqs=8, step_per_seq_s=0.0, prefill_per_token_s=0.5, length_median=10
    )
    (_,), (t,), engine = _generate(spec, [(0, 4)], [0.5])
    assert engine.stats.prefill_s == pytest.approx(1.5)  # 3 prompt tokens, once for the 4 samples
    assert t == pytest.approx(1.5 + 10 * 0.01)


def test_rewards_follow_pass_rates_and_truncation_is_reported() -> None:
    spec = EngineSpec(max_num_seqs=64, length_median=100, length_sigma=0.0)
    (right, wrong), _, _ = _generate(spec, [(0, 16), (1, 16)], [1.0, 0.0])
    assert {c.text for c in right} == {REWARD_TEXT[True]}
    assert {c.text for c in wrong} == {REWARD_TEXT[False]}
    rewards = [v.reward for v in asyncio.run(verify_reward_text(None, right + wrong))]
    assert rewards == [1.0] * 16 + [0.0] * 16
    (short,), _, _ = _generate(spec, [(0, 2)], [1.0], max_tokens=40)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 40 for c in short)


def test_lengths_are_log_normal_around_the_median() -> None:
    spec = EngineSpec(max_num_seqs=4096, length_median=500, length_sigma=0.5)
    (completions,), _, _ = _generate(spec, [(0, 2000)], [0.5], max_tokens=100_000)
    logs = np.log([len(c.token_ids) for c in completions])
    assert np.median(logs) == pytest.approx(np.log(500), abs=0.05)
    assert logs.std() == pytest.approx(0.5, abs=0.05)


def test_pass_rate_mixes_match_their_buckets() -> None:
    rates = adaptive_sim.draw_pass_rates("hard", 20_000, np.random.default_rng(0))
    assert rates.min() > 0.0 and rates.max() <= 1.0
    shares = [np.mean((rates > lo) & (rates <= hi)) for _, (lo, hi) in adaptive_sim.MIXES["hard"]]
    assert shares == pytest.approx([0.197, 0.617, 0.174, 0.013], abs=0.01)


def _simulate(key: str, batch: int = 16, batches: int = 2, **overrides: object) -> dict:
    method = next(m for m in adaptive_sim.methods(batch) if m.key == key)
    method = adaptive_sim.Method(method.key, method.label, {**method.config, **overrides})
    rates = adaptive_sim.draw_pass_rates("hard", 256, np.random.default_rng(1))
    spec = EngineSpec(max_num_seqs=32)
    with tempfile.TemporaryDirectory() as tmp:
        data = adaptive_sim.write_dataset(Path(tmp), 256)
        return virtual_clock.run(
            adaptive_sim.simulate(
                method,
                rates,
                data,
                batch=batch,
                batches=batches,
                warmup=1,
                spec=spec,
                seed=0,
                history_epochs=1,
                record_timeline=True,
            )
        )


def test_real_scheduler_runs_grpo_in_simulated_time() -> None:
    r = _simulate("grpo4")
    assert r["groups_per_batch"] == 16
    assert r["answers"] == 64 and r["prompts_admitted"] == 16  # exactly n=4 per prompt
    # The fraction is a count of groups over the 2 x 16 emitted, and answers per
    # informative group divides the same answers by that count.
    informative = r["informative_frac"] * r["groups_per_batch"] * r["batches"]
    assert informative == pytest.approx(round(informative)) and 0 < round(informative) < 32
    assert r["answers_per_informative"] == pytest.approx(
        r["answers"] / (r["informative_frac"] * r["groups_per_batch"])
    )
    # Synchronous GRPO waits for each batch's slowest answer: the engine idles part of it.
    assert r["wall_s"] > 0 and 0 < r["engine_occupancy"] < 1


def test_dapo_emits_only_informative_groups() -> None:
    r = _simulate("dapo4")
    assert r["informative_frac"] == 1.0
    assert r["prompts_admitted"] >= 16  # dropped groups are refilled with new prompts


def test_rounds_mode_generates_whole_waves_and_breaks_down_by_round() -> None:
    r = _simulate("seqbal_rounds")
    assert (r["answers"] * r["batches"]) % 8 == 0  # every round asks 8 answers of each live prompt
    assert r["rounds"] and {x["round"] for x in r["rounds"]} <= {1, 2, 3, 4}
    # Every round waits for its slowest answer, so no round keeps the engine full.
    assert all(
        0 < x["occupancy"] < 1 and 0 < x["below_full_s"] <= x["duration_s"] for x in r["rounds"]
    )


def test_continuous_and_adaptive_modes_respect_the_rule_caps() -> None:
    for key in ("seqbal_cont", "seqbal_adaptive", "est"):
        r = _simulate(key)
        assert r["groups_per_batch"] == 16
        assert r["generated_per_emitted_group"] <= 32


def test_queued_answers_run_lowest_priority_first() -> None:
    """Two slots, held by a first wave; of the four answers queued behind it, the two with
    the lower priority run first, though they were issued last; equal priorities run in
    the order issued."""

    def finish_order(priorities: tuple[int, ...]) -> list[int]:
        async def main() -> list[int]:
            engine = SimBackend([0.5] * 2, FLAT, seed=0)
            await engine.start()
            try:
                first = asyncio.create_task(engine.generate([0, 0, 0], 2, SamplingParams()))
                await asyncio.sleep(FLAT.step_s(2))  # it holds both slots now
                wave = engine.wave([1, 0, 0], 4, SamplingParams(), priorities=priorities)
                order = [index async for index, _ in wave]
                await first
            finally:
                await engine.close()
            return order

        return virtual_clock.run(main())

    assert finish_order((9, 9, 1, 1)) == [2, 3, 0, 1]
    assert finish_order((3, 3, 3, 3)) == [0, 1, 2, 3]


def _wave_priorities(**config: object) -> dict[int, list[tuple[int, ...]]]:
    """The priorities each prompt's waves carried, by prompt, in the order the prompts
    first reached the engine, while the real scheduler samples 24 prompts, 8 at a time."""
    prompts = 24
    cfg = {"rule": "positive", "k_pos": 1, "n_max": 16, "wave_size": 4, "group_size": 4}
    cfg |= {"max_active_prompts": 8, "batch_groups": prompts, **config}
    asked, _ = waves_until_every_prompt_asked([0.2] * prompts, cfg, 8, lambda scheduler: None)
    waves: dict[int, list[tuple[int, ...]]] = {}
    for index, _, priorities in asked:
        waves.setdefault(index, []).append(priorities)
    return waves


def test_wave_stopping_puts_the_earliest_admitted_prompt_first_in_the_engine() -> None:
    # Under a staleness bound (the default, 1): every answer of a prompt carries its place
    # in the admission order, so an old prompt's later waves go before a new prompt's.
    waves = _wave_priorities(stopping="wave")
    places = []
    for prompt_waves in waves.values():
        answers = {p for priorities in prompt_waves for p in priorities}
        assert len(answers) == 1
        places.append(answers.pop())
    assert places == sorted(places) and len(set(places)) == len(places) and min(places) >= 1
    # Under max_staleness 0 every running prompt is due at the same push: arrival order,
    # as it is when asked for.
    for config in ({"max_staleness": 0}, {"engine_priority": "arrival"}):
        waves = _wave_priorities(stopping="wave", **config)
        assert all(p == () for w in waves.values() for p in w)


def test_exact_stopping_puts_every_prompts_earlier_answers_first_in_the_engine() -> None:
    # Answer i of a prompt (admitted at version 0: nothing pushes weights here) has
    # priority i, across its waves: a later answer, the likelier surplus, waits behind
    # the earlier answers of every prompt.
    waves = _wave_priorities()  # exact stopping, the default
    for prompt_waves in waves.values():
        answers = [p for priorities in prompt_waves for p in priorities]
        assert answers == list(range(len(answers))) and len(answers) >= 4


def test_abort_all_stops_waves_in_the_order_they_were_issued() -> None:
    """A weight update's abort reports the waves' answers in issue order, so a run whose
    drain times out repeats exactly under its seed (engines hold waves in issue order,
    not in a set, whose order follows memory addresses)."""

    async def main() -> list[int]:
        engine = SimBackend([0.5] * 40, FLAT, seed=0)
        await engine.start()
        reported: list[int] = []

        async def one(prompt: int) -> None:
            wave = engine.wave([prompt, 0, 0], 1, SamplingParams())
            async for _, completion in wave:
                assert completion.finish_reason == "abort"
                reported.append(prompt)

        try:
            waves = [asyncio.create_task(one(p)) for p in range(40)]
            await asyncio.sleep(FLAT.step_s(2))  # two run, the rest are queued
            assert await engine.abort_all() == 40
            await asyncio.gather(*waves)
        finally:
            await engine.close()
        return reported

    assert virtual_clock.run(main()) == list(range(40))
