"""Exact stopping: the groups the sampler forms are distributed as under sequential
sampling, however long each answer takes.

The real scheduler drives the simulated engine in simulated time, with right answers much
shorter than wrong ones, so they finish first: a rule that counted answers in the order
they finish would see the positives early and stop on them. Over thousands of prompts of
one pass rate, the groups' mean n_pos, n_neg and answers must match the closed form of
sequential sampling (each answer drawn after the last, the rule asked from `min_answers`
on) within 4 standard errors; the same check fails for a finishing-order rule, which an
engine that numbers answers as they finish reproduces. Weight pushes in `wait` mode keep
the groups exact; `abort` mode re-draws the long answers it cuts, and the bias it causes
is measured and printed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from bench import adaptive_sim, virtual_clock
from bench.sim_backend import EngineSpec, SimBackend, sim_scheduler
from sampler_service.backends.base import Completion, Wave, WaveRequest
from sampler_service.config import SamplerConfig, check_consistency
from sampler_service.finalize import MemorySink

pytestmark = pytest.mark.timeout(900)

PASS_RATE = 0.3
PROMPTS = 3000
#: Balanced 2/2 in waves of 8, as Reinforce-Ada: answers past the rule are common.
CONFIG = {
    "rule": "balanced",
    "k_pos": 2,
    "k_neg": 2,
    "n_max": 16,
    "wave_size": 8,
    "group_size": 4,
    "downsample": "balanced",
    "advantage": "grpo",
    "max_tokens": 4096,
    "max_active_prompts": 64,
    "max_buffered_groups": 100_000,
    "max_staleness": None,
}
#: Right answers ~100 tokens, wrong ones ~4x longer: they finish in a very different order.
SPEC = dataclasses.replace(
    EngineSpec.fixed_step(max_num_seqs=256, step_s=0.01, length_median=100.0, length_sigma=0.3),
    wrong_length_factor=4.0,
)
SE = 4.0


def sequential(p: float, cfg: SamplerConfig) -> dict[str, tuple[float, float]]:
    """(mean, variance) of a group's n_pos, n_neg and answers under sequential sampling:
    answers drawn one at a time, the rule asked after each from `min_answers` on."""
    rule = cfg.build_rule(None)
    min_answers = min(cfg.min_answers or cfg.group_size, cfg.n_max)
    alive = {(0, 0): 1.0}
    ended: Counter[tuple[int, int]] = Counter()
    while alive:
        nxt: Counter[tuple[int, int]] = Counter()
        for (pos, neg), prob in alive.items():
            n = pos + neg
            if n >= cfg.n_max or (n >= min_answers and rule.next_wave(pos, neg) == 0):
                ended[pos, neg] += prob
                continue
            nxt[pos + 1, neg] += prob * p
            nxt[pos, neg + 1] += prob * (1 - p)
        alive = dict(nxt)
    out = {}
    for name, value in (
        ("n_pos", lambda a, b: a),
        ("n_neg", lambda a, b: b),
        ("answers", lambda a, b: a + b),
    ):
        mean = sum(pr * value(a, b) for (a, b), pr in ended.items())
        var = sum(pr * (value(a, b) - mean) ** 2 for (a, b), pr in ended.items())
        out[name] = (mean, var)
    return out


class _Renumbered(Wave):
    """A wave whose answers are numbered in the order they finish."""

    cancels_answers = True

    def __init__(self, inner: Wave) -> None:
        super().__init__(inner.n)
        self._inner = inner
        self._yielded: set[int] = set()

    async def __aiter__(self) -> AsyncIterator[tuple[int, Completion]]:
        async for index, completion in self._inner:
            self._yielded.add(index)
            yield len(self._yielded) - 1, completion

    async def cancel(self, indices: Collection[int]) -> None:
        # The answers not yet finished, whatever their original numbers.
        left = [i for i in range(self.n) if i not in self._yielded]
        await self._inner.cancel(left[: len(indices)])

    def close(self) -> None:
        self._inner.close()


class FinishingOrder(SimBackend):
    """The simulated engine, its answers numbered as they finish: a rule reading them in
    index order then reads them in finishing order."""

    def issue(self, request: WaveRequest) -> Wave:
        return _Renumbered(super().issue(request))


async def _groups(
    engine_cls: type[SimBackend],
    cfg: SamplerConfig,
    pushes: str | None,
    seed: int,
    pass_rate: float = PASS_RATE,
    history_epochs: int = 0,
    **knobs: Any,
) -> dict[str, Any]:
    """Run until PROMPTS groups are formed under more config `knobs`; weight pushes every
    2 simulated seconds in `pushes` mode (`wait`, `abort` or `continue`), if given; with
    `history_epochs`, the estimator has seen every prompt that often."""
    with tempfile.TemporaryDirectory() as tmp:
        data = adaptive_sim.write_dataset(Path(tmp), PROMPTS)
        dataset = adaptive_sim.simulated_dataset(data, PROMPTS, seed)
    rates = np.full(PROMPTS, pass_rate)
    engine = engine_cls(rates, SPEC, seed=seed)
    await engine.start()
    sink = MemorySink()
    if pushes is not None:
        knobs = {"weight_update_mode": pushes, **knobs}
    cfg = cfg.model_copy(update=knobs)
    check_consistency(cfg, dataset.domains)
    scheduler = sim_scheduler(engine, dataset, sink, cfg, seed)
    if history_epochs:
        adaptive_sim.load_history(scheduler, rates, history_epochs, seed)
    scheduler.start()

    async def push() -> None:
        version = 0
        while True:
            await asyncio.sleep(2.0)
            async with scheduler.paused_for_weights():
                version += 1
                await engine.load_weights({}, version)

    pusher = asyncio.create_task(push()) if pushes is not None else None
    try:
        while len(sink.groups()) < PROMPTS:
            await asyncio.sleep(1.0)
    finally:
        if pusher is not None:
            pusher.cancel()
        await scheduler.stop()
        await engine.close()
    groups = sink.groups()[:PROMPTS]
    stats = scheduler.tally.tokens_by_fate()
    return {
        "n_pos": [g.stats.n_pos for g in groups],
        "n_neg": [g.stats.n_neg for g in groups],
        "answers": [g.stats.n_generated for g in groups],
        "ordered": all(
            [s.index for s in g.samples] == sorted(s.index for s in g.samples) for g in groups
        ),
        "indices": [sorted(s.index for s in g.samples) for g in groups],
        "waste": stats,
        "dropped": dict(scheduler.tally.dropped),
        "spanning": [sum(s.version_spans is not None for s in g.samples) for g in groups],
        "continued_tokens": scheduler.tally.continued_tokens,
        "wave_sizes": Counter(n for _, n, _ in engine.requests),
    }


def _z(measured: list[int], mean: float, var: float) -> float:
    return (float(np.mean(measured)) - mean) / math.sqrt(var / len(measured))


def _zs(result: dict[str, Any], cfg: SamplerConfig, p: float = PASS_RATE) -> dict[str, float]:
    closed = sequential(p, cfg)
    return {name: _z(result[name], *closed[name]) for name in ("n_pos", "n_neg", "answers")}


CFG = SamplerConfig(**CONFIG, stopping="exact")


def test_the_closed_form_is_sequential_sampling() -> None:
    # Balanced 2/2 from 4 answers on: P(stop at 4) = C(4,2) p^2 q^2.
    closed = sequential(0.5, CFG)
    assert closed["answers"][0] == pytest.approx(
        sum(
            j * prob
            for j, prob in _stop_distribution(0.5).items()  # brute force over every sequence
        )
    )


def _stop_distribution(p: float) -> dict[int, float]:
    """Where balanced 2/2 (from 4 on, n_max 16) stops, by enumerating answer sequences."""
    out: Counter[int] = Counter()

    def walk(pos: int, neg: int, prob: float) -> None:
        n = pos + neg
        if n >= 16 or (n >= 4 and pos >= 2 and neg >= 2):
            out[n] += prob
            return
        walk(pos + 1, neg, prob * p)
        walk(pos, neg + 1, prob * (1 - p))

    walk(0, 0, 1.0)
    return dict(out)


def test_groups_match_sequential_sampling_and_a_finishing_order_rule_does_not() -> None:
    exact = virtual_clock.run(_groups(SimBackend, CFG, None, seed=1))
    z = _zs(exact, CFG)
    print(f"exact stopping, {PROMPTS} prompts at p={PASS_RATE}: z {z}; waste {exact['waste']}")
    assert all(abs(v) <= SE for v in z.values()), z
    # Each group is answers 1..j of its prompt (down-sampled), every index below j drawn once.
    assert exact["ordered"] and all(ix[-1] < 16 for ix in exact["indices"])
    assert exact["waste"]["surplus_answers"] > 0  # waves of 8 overshoot the rule
    assert not exact["waste"]["redrawn"] and not exact["dropped"]

    wave = virtual_clock.run(
        _groups(SimBackend, CFG.model_copy(update={"stopping": "wave"}), None, seed=1)
    )
    print(
        f"wave stopping: mean answers {np.mean(wave['answers']):.2f} against exact {np.mean(exact['answers']):.2f}"
    )
    assert np.mean(wave["answers"]) > np.mean(exact["answers"])  # whole waves are counted

    by_finish = virtual_clock.run(_groups(FinishingOrder, CFG, None, seed=1))
    z_finish = _zs(by_finish, CFG)
    print(f"finishing-order rule: z {z_finish}")
    assert max(abs(v) for v in z_finish.values()) > SE, z_finish


def test_hard_prompts_issue_wider_waves_and_their_groups_stay_exact() -> None:
    # Seen before at p = 0.1, most prompts are in the hardest quartile: their waves widen
    # from 8 to hard_wave_size (16, n_max here), and only add indices.
    hard = 0.1
    wide = virtual_clock.run(
        _groups(SimBackend, CFG, None, seed=3, pass_rate=hard, history_epochs=2, hard_wave_size=16)
    )
    z = _zs(wide, CFG, hard)
    print(
        f"hard prompts at p={hard}, waves {dict(wide['wave_sizes'])}: z {z}; waste {wide['waste']}"
    )
    assert all(abs(v) <= SE for v in z.values()), z
    assert wide["ordered"] and not wide["waste"]["redrawn"]
    assert wide["wave_sizes"][16] > PROMPTS / 2
    narrow = virtual_clock.run(
        _groups(SimBackend, CFG, None, seed=3, pass_rate=hard, history_epochs=2)
    )
    assert max(narrow["wave_sizes"]) == 8
    assert wide["waste"]["surplus_answers"] > narrow["waste"]["surplus_answers"]
    assert sum(wide["wave_sizes"].values()) < sum(narrow["wave_sizes"].values())


def test_waves_cut_at_need_decode_less_surplus_and_their_groups_stay_exact() -> None:
    # Balanced 2/2 from answer 4 under a uniform belief needs answer 5 with chance 4/5 and
    # answer 6 with 4/6, answer 7 only with 4/7: at wave_min_need 0.6 a first wave is 6.
    cut = virtual_clock.run(_groups(SimBackend, CFG, None, seed=3, wave_min_need=0.6))
    z = _zs(cut, CFG)
    print(f"waves cut at need 0.6 {dict(cut['wave_sizes'])}: z {z}; waste {cut['waste']}")
    assert all(abs(v) <= SE for v in z.values()), z
    assert cut["ordered"] and not cut["waste"]["redrawn"]
    assert cut["wave_sizes"][6] >= PROMPTS  # every prompt's first wave
    whole = virtual_clock.run(_groups(SimBackend, CFG, None, seed=3))
    assert cut["waste"]["surplus_answers"] < whole["waste"]["surplus_answers"] / 2
    assert sum(cut["wave_sizes"].values()) > sum(whole["wave_sizes"].values())


def test_weight_pushes_in_wait_mode_stay_exact_and_abort_mode_redraws() -> None:
    waited = virtual_clock.run(_groups(SimBackend, CFG, "wait", seed=2))
    z = _zs(waited, CFG)
    print(f"pushes every 2 s, wait: z {z}")
    assert all(abs(v) <= SE for v in z.values()), z
    assert not waited["waste"]["redrawn"] and waited["waste"]["waste"]["aborted"] == 0
    aborted = virtual_clock.run(_groups(SimBackend, CFG, "abort", seed=2))
    z_abort = _zs(aborted, CFG)
    print(f"pushes every 2 s, abort: z {z_abort}; redrawn {aborted['waste']['redrawn']}")
    assert aborted["waste"]["redrawn"].get("aborted", 0) > 0
    assert aborted["waste"]["waste"]["aborted"] > 0


def test_weight_pushes_in_continue_mode_stay_exact_and_a_version_cap_redraws() -> None:
    continued = virtual_clock.run(_groups(SimBackend, CFG, "continue", seed=2))
    z = _zs(continued, CFG)
    spanning = sum(continued["spanning"])
    print(f"pushes every 2 s, continue: z {z}; {spanning} spanning answers in the groups")
    assert all(abs(v) <= SE for v in z.values()), z
    assert not continued["waste"]["redrawn"] and continued["waste"]["waste"]["aborted"] == 0
    assert spanning > 0 and continued["continued_tokens"] > 0
    capped = virtual_clock.run(
        _groups(SimBackend, CFG, "continue", seed=2, max_versions_per_answer=1)
    )
    print(f"continue, at most 1 version per answer: redrawn {capped['waste']['redrawn']}")
    assert capped["waste"]["redrawn"].get("version_cap", 0) > 0
    assert sum(capped["spanning"]) == 0 and capped["continued_tokens"] == 0


class WholeWavesCheaper(SimBackend):
    """The simulated engine as an HTTP server looks: a wave read whole is cheaper as one
    request (`generate`) than streamed; it counts which way each wave came."""

    calls: ClassVar[Counter[str]] = Counter()

    @property
    def whole_waves_cheaper(self) -> bool:
        return True

    def issue(self, request: WaveRequest) -> Wave:
        self.calls["generate" if request.whole else "wave"] += 1
        return super().issue(request)


def test_an_engine_that_answers_whole_waves_cheaper_gets_them_unless_the_rule_is_exact() -> None:
    """Whole-wave stopping reads every answer and cancels none, so an engine that says
    whole waves cost it less (one HTTP request of n, not n) is sent `generate`; exact
    stopping streams, to cancel the surplus, unless the rule is fixed."""
    WholeWavesCheaper.calls.clear()
    whole = virtual_clock.run(
        _groups(WholeWavesCheaper, CFG.model_copy(update={"stopping": "wave"}), None, seed=3)
    )
    assert WholeWavesCheaper.calls["generate"] >= PROMPTS and not WholeWavesCheaper.calls["wave"]
    assert whole["waste"]["waste"]["surplus"] == 0
    WholeWavesCheaper.calls.clear()
    exact = virtual_clock.run(_groups(WholeWavesCheaper, CFG, None, seed=3))
    assert WholeWavesCheaper.calls["wave"] >= PROMPTS and not WholeWavesCheaper.calls["generate"]
    assert exact["waste"]["waste"]["surplus"] > 0
    # A fixed group cannot hold inside a wave: counting in order would form the same
    # group, so it is read whole under exact stopping too.
    WholeWavesCheaper.calls.clear()
    fixed = SamplerConfig(**{**CONFIG, "rule": "fixed", "downsample": "none"}, stopping="exact")
    assert not fixed.counts_in_order and fixed.engine_order == "oldest_prompt"
    grpo = virtual_clock.run(_groups(WholeWavesCheaper, fixed, None, seed=3))
    assert WholeWavesCheaper.calls["generate"] >= PROMPTS and not WholeWavesCheaper.calls["wave"]
    assert grpo["waste"]["waste"]["surplus"] == 0 and set(grpo["answers"]) == {4}


class _DiesAfterOne(Wave):
    """A wave whose engine dies after its first answer: the rest are lost, not answered."""

    cancels_answers = True

    def __init__(self, inner: Wave) -> None:
        super().__init__(inner.n)
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[tuple[int, Completion]]:
        async for item in self._inner:
            yield item
            break
        await self._inner.cancel(range(self.n))
        raise RuntimeError("the engine died mid-wave")

    async def cancel(self, indices: Collection[int]) -> None:
        await self._inner.cancel(indices)

    def close(self) -> None:
        self._inner.close()


class DiesMidWave(SimBackend):
    """The simulated engine, every third wave of which dies after one answer (never twice
    in a row for one prompt, so no prompt is dropped and the groups can be compared)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.issued = 0
        self.died: set[int] = set()

    def issue(self, request: WaveRequest) -> Wave:
        wave = super().issue(request)
        self.issued += 1
        prompt = request.prompt_token_ids[0]
        if self.issued % 3 or prompt in self.died or request.n < 2:
            self.died.discard(prompt)
            return wave
        self.died.add(prompt)
        return _DiesAfterOne(wave)


def test_an_engine_that_dies_mid_wave_adds_no_negative() -> None:
    """What a dying engine did not answer is drawn again at its indices, never counted: the
    groups are still those of sequential sampling, n_neg included."""
    result = virtual_clock.run(_groups(DiesMidWave, CFG, None, seed=4))
    z = _zs(result, CFG)
    print(f"an engine dying in every third wave: z {z}; redrawn {result['waste']['redrawn']}")
    assert all(abs(v) <= SE for v in z.values()), z
    assert result["waste"]["redrawn"].get("engine_error", 0) > 0 and not result["dropped"]
    assert result["ordered"]
