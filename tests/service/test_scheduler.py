"""The scheduler in-process with the real transformers backend and the toy model.

These check the sampling semantics (rules, rounds, adaptive waves, est budgets, group
and batch policies, backpressure, weight pauses; docs/architecture.md) without HTTP;
the API tests cover the networked path, tests/unit/test_grouping.py the group-building
arithmetic.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from support import unanswerable
from transformers import AutoTokenizer

from bench.common import fixed_groups
from sampler_service.backends.base import Completion
from sampler_service.backends.hf import HFBackend
from sampler_service.config import SamplerConfig, check_consistency
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.finalize import MemorySink
from sampler_service.scheduler import Scheduler, VerifyFn
from sampler_service.verifiers import exact
from sampler_service.verifiers.base import Verdict
from trainer_client.contract.protocol import Group

pytestmark = pytest.mark.timeout(600)


@pytest_asyncio.fixture
async def backend(toy) -> AsyncIterator[HFBackend]:
    tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)
    engine = HFBackend(toy.model_dir, tokenizer=tokenizer)
    await engine.start()
    yield engine
    await engine.close()


async def _verify(row: PromptRow, completions: Sequence[Completion]) -> list[Verdict]:
    return [Verdict(exact.verify(c.verified_text, row.answer, row.metadata)) for c in completions]


#: A run of `never_scheduler` must show both: the rule firing and n_max cutting a prompt off.
BOTH_REASONS = frozenset({"rule", "n_max"})


@pytest.fixture
def new_scheduler(toy, backend) -> Callable[..., tuple[Scheduler, MemorySink]]:
    """`make_scheduler` on the toy model: config knobs, and the data unless the toy's."""
    return functools.partial(make_scheduler, toy, backend)


@pytest.fixture
def never_scheduler(
    toy, new_scheduler: Callable[..., tuple[Scheduler, MemorySink]], tmp_path: Path
) -> Callable[..., tuple[Scheduler, MemorySink]]:
    """`make_scheduler` over add1 (mostly right), add2 (about 40% right) and a domain never
    answered right: both the rule's and n_max's branches of a test run."""
    data = [toy.data_files[0], toy.data_files[1], unanswerable(toy, tmp_path)]
    return functools.partial(new_scheduler, data)


#: Rounds of 6 prompts under the balanced rule (2 right and 2 wrong answers) or n_max 16.
ROUNDS: dict[str, Any] = {"mode": "rounds", "cohort_size": 6, "rule": "balanced", "n_max": 16}


def make_scheduler(
    toy, backend: HFBackend, data: list[Path] | None = None, verify: VerifyFn = _verify, **cfg: Any
) -> tuple[Scheduler, MemorySink]:
    tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)

    def tokenize(row: PromptRow) -> None:
        row.text, row.token_ids = row.prompt, tokenizer(row.prompt)["input_ids"]

    dataset = Dataset(data or toy.data_files, tokenize)
    # The tests take frames without training on them: nothing to bound unless they say.
    config = SamplerConfig(
        **{"max_tokens": 8, "max_active_prompts": 16, "max_staleness": None, **cfg}
    )
    check_consistency(config, dataset.domains)
    sink = MemorySink()
    scheduler = Scheduler(backend=backend, dataset=dataset, verify=verify, sink=sink, config=config)
    return scheduler, sink


async def run_until(
    scheduler: Scheduler,
    sink: MemorySink,
    n_groups: int,
    timeout: float = 300,
    reasons: frozenset[str] = frozenset(),
) -> list:
    """Run until `n_groups` groups are emitted and every stop reason in `reasons` was seen
    (prompts that run to n_max finish after the quick ones, so a count alone may end the
    run before any of them)."""
    scheduler.start()

    def done() -> bool:
        groups = sink.groups()
        return len(groups) >= n_groups and reasons <= {g.stop_reason for g in groups}

    try:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.05)
    except TimeoutError:
        # Say what we waited for: progress so far and where every task is parked.
        print(
            f"waited for {n_groups} groups with stop reasons {sorted(reasons)}, got",
            len(sink.groups()),
            scheduler.tally.to_dict(scheduler.replay.stats()),
            scheduler.last_error,
            file=sys.stderr,
        )
        for task in asyncio.all_tasks():
            task.print_stack(limit=6, file=sys.stderr)
        raise
    finally:
        await scheduler.stop()
    return sink.groups()


async def test_positive_rule_stops_at_first_correct_answer(never_scheduler) -> None:
    scheduler, sink = never_scheduler(
        rule="positive",
        k_pos=1,
        n_max=16,
        wave_size=1,
        group_size=0,
        downsample="none",
    )
    groups = await run_until(scheduler, sink, 12, reasons=BOTH_REASONS)
    assert {g.stop_reason for g in groups} == BOTH_REASONS
    for g in groups:
        rewards = [s.reward for s in g.samples]
        assert len(rewards) == g.stats.n_generated  # group_size 0 keeps everything
        if g.stop_reason == "rule":
            # One answer per wave: the rule fires on exactly the first positive.
            assert rewards[-1] > 0.5 and all(r <= 0.5 for r in rewards[:-1])
        else:
            assert g.stop_reason == "n_max" and g.stats.n_pos == 0 and g.stats.n_generated == 16


async def test_rounds_mode_uses_whole_waves(never_scheduler) -> None:
    scheduler, sink = never_scheduler(**ROUNDS, wave_size=4)
    groups = await run_until(scheduler, sink, 12, reasons=BOTH_REASONS)
    assert {g.stop_reason for g in groups} == BOTH_REASONS
    for g in groups:
        assert g.stats.n_generated % 4 == 0 and g.stats.n_generated <= 16
        if g.stop_reason == "rule":
            assert g.stats.n_pos >= 2 and g.stats.n_neg >= 2


async def test_rounds_run_on_until_every_prompt_meets_its_rule_budget_or_n_max(
    never_scheduler,
) -> None:
    # A pilot cuts the first wave to 4, so a prompt that earns more needs more rounds
    # than n_max / wave_size.
    scheduler, sink = never_scheduler(**ROUNDS, wave_size=8, allocation={"name": "posterior"})
    groups = await run_until(scheduler, sink, 18, reasons=frozenset({"budget", "rule"}))
    for g in groups:
        if g.stop_reason == "n_max":
            assert g.stats.n_generated == 16
        elif g.stop_reason == "rule":
            assert g.stats.n_pos >= 2 and g.stats.n_neg >= 2
        else:
            assert g.stop_reason == "budget" and g.stats.n_generated < 16
            assert g.stats.n_generated == 4 or g.stats.n_pos > 0  # a pilot, or it earned more


async def test_adaptive_waves_respect_budget_and_rule(never_scheduler) -> None:
    scheduler, sink = never_scheduler(rule="balanced", wave="adaptive", n_max=12, wave_size=8)
    groups = await run_until(scheduler, sink, 20, reasons=BOTH_REASONS)
    assert {g.stop_reason for g in groups} == BOTH_REASONS
    sizes = {g.stats.n_generated for g in groups}
    assert max(sizes) <= 12
    assert any(n % 8 for n in sizes), f"adaptive waves never cut a wave short: {sizes}"
    for g in groups:
        if g.stop_reason == "rule":
            assert g.stats.n_pos >= 2 and g.stats.n_neg >= 2


async def test_est_rule_spends_budgets_and_learns(new_scheduler) -> None:
    scheduler, sink = new_scheduler(
        rule="est",
        advantage="est",
        group_size=0,
        downsample="none",
        n_max=16,
        wave_size=8,
        est={"mean_budget": 6, "n_min": 2},
    )
    groups = await run_until(scheduler, sink, 12)
    for g in groups:
        assert g.stop_reason == "budget"
        assert 2 <= g.stats.n_generated <= 16
        # Est: A = (r - rbar) / sqrt(rbar + 1e-6), rbar over every answer (all kept here).
        rewards = np.array([s.reward for s in g.samples])
        rbar = rewards.sum() / len(rewards)
        expected = [(r - rbar) / (rbar + 1e-6) ** 0.5 for r in rewards]
        np.testing.assert_allclose([s.advantage for s in g.samples], expected, atol=1e-9)
    assert any(scheduler.live.estimator.seen(g.prompt_id) for g in groups)


async def test_prompts_admitted_under_one_config_share_its_plan_until_the_next(
    new_scheduler,
) -> None:
    """The plan (sampling, policies, stopping rule) is built per config version, not per
    prompt; a prompt keeps the plan it was admitted under, and a new estimator (n_max
    changed) reaches the rule of the prompts admitted after it."""
    scheduler, _ = new_scheduler(
        rule="est", n_max=8, wave_size=4, est={"mean_budget": 4, "n_min": 2}
    )
    first, second = scheduler._admit(), scheduler._admit()
    assert first.plan is second.plan
    old_estimator = scheduler.live.estimator
    await scheduler.live.install(scheduler.config.model_copy(update={"n_max": 6}), 1)
    third = scheduler._admit()
    assert third.plan is not first.plan
    assert (third.plan.config_version, third.plan.rule.params.n_max) == (1, 6)
    assert (first.plan.config_version, first.plan.rule.params.n_max) == (0, 8)
    assert scheduler.live.estimator is not old_estimator
    assert third.plan.rule.params.estimator is scheduler.live.estimator
    assert first.plan.rule.params.estimator is old_estimator


async def test_a_patch_rebuilds_only_the_policies_whose_knobs_it_changes(new_scheduler) -> None:
    """What the mixer, the admission and the allocation policies learned survives a PATCH
    of other knobs; each is built anew when its own knobs change (the allocation also
    with a new estimator, which it calibrates on)."""
    scheduler, _ = new_scheduler(
        n_max=16,
        mixing={"name": "reward_gap"},
        admission_policies=[{"name": "history_skip"}],
        allocation={"name": "knapsack"},
    )

    async def patch(version: int, **knobs: Any) -> None:
        cfg = SamplerConfig.model_validate({**scheduler.config.model_dump(), **knobs})
        await scheduler.live.install(cfg, version)

    live = scheduler.live
    mixer, admission, allocation = live.mixer, live.admission, live.allocation
    await patch(1, temperature=0.5)
    assert live.plan.sampling.temperature == 0.5
    assert live.mixer is mixer
    assert live.admission is admission and live.allocation is allocation
    await patch(2, mixing={"name": "static"})
    assert live.mixer is not mixer and scheduler.config.mixing.name == "static"
    assert live.admission is admission and live.allocation is allocation
    await patch(3, n_max=12)  # a new estimator: the allocation calibrates afresh
    assert live.allocation is not allocation and live.admission is admission
    await patch(4, admission_policies=[])
    assert live.admission == [] and live.plan.config_version == 4


async def test_pilot_commit_commits_only_after_an_informative_or_promising_pilot(
    never_scheduler,
) -> None:
    # Waves of 4 are the pilot; the rule alone would take 8 of every prompt.
    scheduler, sink = never_scheduler(
        **fixed_groups(8, wave_size=4, downsample="none", allocation={"name": "pilot_commit"})
    )
    groups = await run_until(scheduler, sink, 16, reasons=frozenset({"budget", "fixed"}))
    for g in groups:
        pilot = {s.reward > 0.5 for s in g.samples[:4]}
        assert g.stats.n_generated in (4, 8)
        if len(pilot) == 2:  # both kinds in the pilot: committed
            assert (g.stats.n_generated, g.stop_reason) == (8, "fixed")
        if g.stats.n_generated == 4:
            assert len(pilot) == 1 and g.stop_reason == "budget"
    stats = scheduler.allocation_stats()
    assert stats["policy"] == {"name": "pilot_commit", "params": {}}
    assert stats["cut"] == scheduler.tally.stop_reasons["budget"] > 0


async def test_knapsack_spends_its_budgets_under_a_rule_that_never_stops_early(
    never_scheduler,
) -> None:
    scheduler, sink = never_scheduler(
        **fixed_groups(
            8, downsample="none", allocation={"name": "knapsack", "params": {"mean_budget": 4.0}}
        )
    )
    groups = await run_until(scheduler, sink, 12)
    # The dataset is mostly unseen, at the prior: its budget is about the mean.
    assert all(2 <= g.stats.n_generated < 8 and g.stop_reason == "budget" for g in groups)
    stats = scheduler.allocation_stats()
    assert stats["planned_mean_budget"] <= 4.0 and 0 < stats["threshold"] < 1
    assert stats["cut"] == stats["groups"] >= len(groups)


async def test_maxvar_keeps_half_and_recomputes_grpo_advantages(new_scheduler) -> None:
    scheduler, sink = new_scheduler(
        **fixed_groups(
            8,
            downsample="none",
            advantage="grpo",
            group_policies=[{"name": "maxvar", "params": {"keep_fraction": 0.5}}],
        ),
    )
    for g in await run_until(scheduler, sink, 8):
        assert len(g.samples) == 4
        # Rewards are 0/1: the 4 of 8 with the largest variance are as balanced as the
        # 8 allow, i.e. clamp(2, 4 - n_neg, n_pos) positives.
        positives = sum(s.reward > 0.5 for s in g.samples)
        assert positives == min(max(2, 4 - g.stats.n_neg), g.stats.n_pos)
        # GRPO on the 4 kept: (r - mean) / (ddof-1 std + 1e-6).
        rewards = [s.reward for s in g.samples]
        mean = sum(rewards) / 4
        std = (sum((r - mean) ** 2 for r in rewards) / 3) ** 0.5
        expected = [(r - mean) / (std + 1e-6) for r in rewards]
        np.testing.assert_allclose([s.advantage for s in g.samples], expected, atol=1e-9)


async def test_batch_frames_topk_and_weights(new_scheduler) -> None:
    scheduler, sink = new_scheduler(
        rule="balanced",
        n_max=16,
        batch_groups=4,
        batch_policies=[
            {"name": "topk", "params": {"fraction": 0.75}},
            {"name": "per", "params": {}},
            {"name": "ar"},
        ],
    )
    await run_until(scheduler, sink, 12)
    for frame in sink.frames:
        assert len({g.batch_id for g in frame}) == 1
        assert [g.batch_index for g in frame] == list(range(len(frame)))
        assert all(g.batch_size == len(frame) for g in frame)
        weights = [s.weight for g in frame for s in g.samples]
        assert np.mean(weights) == pytest.approx(1.0)
        tokens = [w for g in frame for s in g.samples for w in s.token_weights]
        assert np.mean(tokens) == pytest.approx(1.0)
        assert all(len(g.samples) >= 2 for g in frame)
    # Every group enters its frame with 4 samples; topk keeps 3/4 of a frame's samples
    # and drops a group left with one, so count the dropped groups' samples as entered.
    total = sum(len(g.samples) for f in sink.frames for g in f)
    entered = 4 * (len(sink.groups()) + len(sink.dropped))
    assert total < entered, "topk 0.75 must drop samples"


async def test_staleness_zero_admits_one_prompt_at_a_time(new_scheduler) -> None:
    scheduler, sink = new_scheduler(**fixed_groups(2, max_staleness=0))

    def admitted() -> int:
        return sum(d.admitted for d in scheduler.tally.domains.values())

    scheduler.start()
    try:
        async with asyncio.timeout(60):
            while len(sink.groups()) < 1:
                await asyncio.sleep(0.01)
        # One buffered group and nothing acked: (0 + 1) x 1 - (1 buffered + 0 running)
        # leaves no capacity, however often the admission loop looks. Counted by
        # admissions, not by sampling the running prompts (a fast prompt slips between
        # samples).
        for _ in range(20):
            scheduler.poke()
            await asyncio.sleep(0)
        assert scheduler.capacity() == 0
        assert scheduler.active_prompts == 0 and len(sink.groups()) == 1 and admitted() == 1
        sink.frames.clear()  # the trainer consumed it
        scheduler.poke()
        async with asyncio.timeout(60):
            while not sink.groups():
                await asyncio.sleep(0.01)
        assert admitted() == 2
    finally:
        await scheduler.stop()


async def test_weight_update_waits_for_in_flight_and_tags_versions(new_scheduler, backend) -> None:
    scheduler, sink = new_scheduler(**fixed_groups(4))
    scheduler.start()
    try:
        async with asyncio.timeout(60):
            while not sink.groups():
                await asyncio.sleep(0.01)
        tensors = {name: t.clone() for name, t in backend._model.state_dict().items()}
        async with scheduler.paused_for_weights():
            assert scheduler._in_flight == 0 and scheduler.capacity() == 0
            await backend.load_weights(tensors, 1)
        seen = len(sink.groups())
        async with asyncio.timeout(60):
            while not [g for g in sink.groups()[seen:] if g.policy_version_min == 1]:
                await asyncio.sleep(0.01)
    finally:
        await scheduler.stop()
    # One wave per prompt and the barrier between waves: no group mixes versions.
    groups = sink.groups()
    assert all(g.policy_version_min == g.policy_version_max for g in groups)
    assert {g.policy_version_min for g in groups} == {0, 1}


async def test_weight_drain_timeout_aborts_waves_still_running(new_scheduler, caplog) -> None:
    """Waves still running when the drain timeout passes are aborted and issued again."""
    scheduler, sink = new_scheduler(
        **fixed_groups(4, weight_drain_timeout_s=1e-6),
    )
    scheduler.start()
    try:
        async with asyncio.timeout(60):
            while not scheduler._in_flight:
                await asyncio.sleep(0)
        async with scheduler.paused_for_weights():
            assert scheduler._in_flight == 0
        seen = len(sink.groups())
        async with asyncio.timeout(60):
            while len(sink.groups()) < seen + 4:
                await asyncio.sleep(0.01)
    finally:
        await scheduler.stop()
    assert "aborting them" in caplog.text
    assert "engine_error" not in scheduler.tally.dropped
    assert all(g.stats.n_generated == 4 for g in sink.groups())


class SlowSink(MemorySink):
    """A store that takes 50 ms per write: the engine must not wait for it. Records how
    many frames each write took."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int] = []

    async def add_pending(self, group: Any, state: Any) -> None:
        await asyncio.sleep(0.05)

    async def add_frames(self, frames: Any, state: Any = None) -> None:
        # Frames of one group are stored by this call alone (no pending write first).
        await asyncio.sleep(0.05)
        self.writes.append(len(frames))
        await super().add_frames(frames, state)


async def test_finished_prompts_free_their_slot_and_are_stored_before_stop(new_scheduler) -> None:
    scheduler, _ = new_scheduler(
        **fixed_groups(2, max_active_prompts=4, max_buffered_groups=1000),
    )
    sink = scheduler.finalizer.sink = SlowSink()
    scheduler.start()
    try:
        async with asyncio.timeout(120):
            # Finished groups pile up behind the slow store while generation goes on:
            # their prompts no longer hold the 4 engine slots.
            while scheduler.finalizing < 8:
                assert scheduler.active_prompts <= 4
                await asyncio.sleep(0.01)
            assert scheduler.buffered() >= 8  # waiting groups count for backpressure
    finally:
        await scheduler.stop()
    # Every prompt whose answers were all in got its group stored.
    assert scheduler.finalizing == 0
    finished = sum(scheduler.tally.stop_reasons.values())
    assert finished >= 8 and len(sink.groups()) + len(scheduler.finalizer.unframed) == finished
    # Groups that finished while a write ran went into the next one together.
    assert max(sink.writes) > 1 and sum(sink.writes) == len(sink.groups())


class FailingOnceSink(MemorySink):
    """A store whose first write fails (a full disk, a value it cannot encode)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def add_pending(self, group: Any, state: Any) -> None:
        self._fail_once()

    async def add_frames(self, frames: Any, state: Any = None) -> None:
        self._fail_once()
        await super().add_frames(frames, state)

    def _fail_once(self) -> None:
        if not self.failed:
            self.failed = True
            raise OSError("database or disk is full")


async def test_a_failed_write_is_a_warning_and_the_groups_after_it_are_stored(
    new_scheduler,
) -> None:
    scheduler, _ = new_scheduler(
        **fixed_groups(2, max_active_prompts=4, max_buffered_groups=1000),
    )
    sink = scheduler.finalizer.sink = FailingOnceSink()
    assert scheduler.store_warning() is None
    scheduler.start()
    try:
        async with asyncio.timeout(120):
            while len(sink.groups()) < 8:
                await asyncio.sleep(0.01)
    finally:
        await scheduler.stop()
    lost = scheduler.finalizer.unstored
    finished = sum(scheduler.tally.stop_reasons.values())
    assert lost >= 1 and len(sink.groups()) + len(scheduler.finalizer.unframed) + lost == finished
    warning = scheduler.store_warning()
    assert warning is not None and f"of {lost} finished prompts" in warning
    assert "database or disk is full" in warning


async def test_an_estimator_rebuilt_off_the_loop_keeps_every_finished_group(new_scheduler) -> None:
    """A change of n_max rebuilds the estimator in a worker thread while prompts keep
    finishing: each finished group is counted once by whichever estimator serves after."""
    scheduler, sink = new_scheduler(
        rule="est", group_size=0, downsample="none", n_max=8, wave_size=4
    )
    scheduler.start()
    try:
        async with asyncio.timeout(300):
            for version in range(2, 12):  # n_max 8, 12, 8, ... while groups finish
                while len(sink.groups()) < version * 2:
                    await asyncio.sleep(0.05)
                n_max = 12 if version % 2 else 8
                cfg = scheduler.config.model_copy(update={"n_max": n_max})
                await scheduler.live.install(cfg, version)
                assert scheduler.live.estimator.params.n_max == n_max
    finally:
        await scheduler.stop()
    finished = sum(scheduler.tally.samples_per_group.values())
    assert finished >= 22
    assert scheduler.live.estimator.state_dict()["finalized"] == finished


async def test_the_next_groups_are_built_while_a_write_is_in_the_store(new_scheduler) -> None:
    """A burst of finished prompts pays the slower of building and writing, not their sum:
    while one write waits in the store, another finalizer builds the next groups."""
    scheduler, sink = new_scheduler(**fixed_groups(2))
    writing, release = asyncio.Event(), asyncio.Event()
    in_first_write: list[int] = []
    add_frames = sink.add_frames

    async def slow_store(frames: Sequence[Any], state: dict[str, Any] | None = None) -> None:
        if not writing.is_set():
            in_first_write.append(sum(len(f.kept) + len(f.dropped) for f in frames))
            writing.set()
            await release.wait()
        await add_frames(frames, state)

    sink.add_frames = slow_store  # type: ignore[method-assign]

    def built() -> int:
        return sum(scheduler.tally.samples_per_group.values())

    scheduler.start()
    try:
        async with asyncio.timeout(120):
            await writing.wait()
            while built() <= in_first_write[0]:
                await asyncio.sleep(0.01)
        assert not sink.groups(), "the first write is still held"
        release.set()
        async with asyncio.timeout(120):
            while len(sink.groups()) <= in_first_write[0]:
                await asyncio.sleep(0.01)
    finally:
        release.set()
        await scheduler.stop()


async def test_a_failed_verification_drops_its_prompt_and_is_never_a_negative(toy, backend) -> None:
    """A verifier that crashes on every right answer once turned each into a negative
    (reward 0): groups of all-wrong answers that were not. Its failures now drop their
    prompts as verifier_error; the groups emitted hold no right answer scored 0, and the
    answers counted are those with a verdict."""

    async def crashes_on_right(row: PromptRow, completions: Sequence[Completion]) -> list[Verdict]:
        verdicts = await _verify(row, completions)
        return [Verdict(0.0, "crashed", kind="crash") if v.reward else v for v in verdicts]

    # add2 is about 40% right: prompts with a right answer and all-wrong ones, both.
    scheduler, sink = make_scheduler(
        toy, backend, [toy.data_files[1]], verify=crashes_on_right, **fixed_groups(4)
    )
    scheduler.start()
    try:
        async with asyncio.timeout(300):
            while len(sink.groups()) < 3 or scheduler.tally.dropped["verifier_error"] < 3:
                await asyncio.sleep(0.05)
    finally:
        await scheduler.stop()
    for group in sink.groups():
        assert group.stats.n_pos == 0 and group.stats.n_neg == group.stats.n_generated == 4
        for s in group.samples:
            assert exact.verify(s.response_text or "", group.answer) == 0.0, group.prompt_id
            assert s.verifier_error is None
    tally = scheduler.tally
    assert sum(tally.answers[d, "positive"] for d in tally.domains) == 0
    # Every counted answer is in a group: those of dropped prompts were never counted.
    assert tally.samples == sum(g.stats.n_generated for g in sink.groups())


class _FramingSink(MemorySink):
    """Remembers each framed group's lag behind the served weights when it was framed."""

    def __init__(self, backend: HFBackend) -> None:
        super().__init__()
        self.backend = backend
        self.lags: list[int] = []

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        served = self.backend.policy_version
        self.lags += [served - g.policy_version_min for g in groups]
        await super().add_frame(groups, dropped, state)


async def test_a_group_past_the_bound_when_it_finishes_is_dropped_alone_and_served_again(
    toy, backend, tmp_path: Path
) -> None:
    """Prompts that never meet the rule run 16 one-answer waves, across two weight
    pushes (the rule is asked from the 4th on): their groups keep all 16 (down-sampling
    cannot leave the oldest out), so they start at v0 and end with v2 served, past
    `max_staleness` 1. Each is dropped on its own (framed, it would take its frame-mates
    down with it) as stale waste, and its prompt is served again; no group is framed past
    the bound."""
    one_answer_waves = {
        **ROUNDS,
        "mode": "continuous",
        "wave_size": 1,
        "group_size": 16,
        "min_answers": 4,
    }
    bound = {"max_staleness": 1, "batch_groups": 2, "max_active_prompts": 4}
    data = [unanswerable(toy, tmp_path)]
    scheduler, _ = make_scheduler(toy, backend, data, **one_answer_waves, **bound)
    sink = scheduler.finalizer.sink = _FramingSink(backend)
    served_again: list[str] = []
    serve_again = scheduler.dataset.serve_again

    def recorded(domain: str, prompt_id: str) -> None:
        served_again.append(prompt_id)
        serve_again(domain, prompt_id)

    scheduler.finalizer._serve_again = recorded
    tensors = {name: t.clone() for name, t in backend._model.state_dict().items()}
    scheduler.start()
    try:
        async with asyncio.timeout(120):
            while scheduler.tally.samples < 8:  # every prompt is part-way through
                await asyncio.sleep(0.01)
            for version in (1, 2):
                async with scheduler.paused_for_weights():
                    await backend.load_weights(tensors, version)
            while not scheduler.tally.dropped["stale"] or not any(
                g.policy_version_min == 2 for g in sink.groups()
            ):
                await asyncio.sleep(0.01)
    finally:
        await scheduler.stop()
    stale = scheduler.tally.dropped["stale"]
    assert stale >= 1 and len(served_again) == stale
    assert scheduler.tally.waste["stale"] > 0
    assert sink.lags and max(sink.lags) <= 1
