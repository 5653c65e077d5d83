"""Every figure is counted once: the records of a few prompts go into one `Tally`, and
`/v1/stats`' figures and `/metrics`' series are both read from it, so they agree."""

from __future__ import annotations

import itertools

from prometheus_client.parser import text_string_to_metric_families

from sampler_service.metrics import Metrics
from sampler_service.tally import EpisodeCost, JudgeCall, PromptOutcome, Tally, WaveOutcome


def _series(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_stats_and_metrics_read_the_same_counts() -> None:
    clock = itertools.count().__next__
    tally = Tally(["add", "mul"], lambda: float(clock()), judges=["grader", "idle"])
    metrics = Metrics()
    metrics.follow(
        tally, active_prompts=lambda: 3, policy_version=lambda: 7, config_version=lambda: 2
    )
    tally.admitted("add")
    tally.skipped("mul")
    tally.wave(WaveOutcome("add", "q1", answers=4, positives=1, tokens=40, seconds=0.2))
    cost = EpisodeCost((1, 2), model_tokens=9, observation_tokens=5, env_errors=1,
                       env_seconds=0.5, last_env_error="boom")  # fmt: skip
    tally.wave(WaveOutcome("mul", "unseen", 2, 2, 9, 0.1, cost))
    tally.wave(WaveOutcome("mul", "q4", 0, 0, 0, None))  # a dropped wave: no latency
    tally.prompt_finished(PromptOutcome("add", 4, 1, "rule"))
    tally.prompt_finished(PromptOutcome("mul", 2, 2, "budget", budget=2, cut=True))
    tally.emitted("add")
    for _ in range(3):
        tally.dropped_group("stale", 0, "add", "q1")
    tally.delivered([0, 2])
    tally.acked(1, 40)
    tally.verified("ok", 0.01)
    tally.verified("timeout", 10.0)
    tally.verifier_retried(1)
    tally.judged(JudgeCall("grader", 8, 0.5))
    tally.judged(JudgeCall("grader", 8, 0.3, "unreadable", 2, "unreadable: no verdict"))
    tally.judged(JudgeCall("grader", 1, 60.0, "timeout", 1, "timeout: no reply"))
    tally.judge_retried("grader", 3)

    stats = tally.to_dict({"prompts": 0})
    series = _series(metrics)
    assert (stats["samples"], stats["tokens"], stats["groups_emitted"]) == (6, 49, 1)
    assert series["adaptive_rollout_generated_tokens_total", ()] == stats["tokens"]
    answers = {
        outcome: series["adaptive_rollout_samples_generated_total", (("domain", "add"), ("outcome", outcome))]
        for outcome in ("positive", "negative")
    }  # fmt: skip
    # Every answer counted is a positive or a negative: a failed verification never is one.
    assert answers == {"positive": 1, "negative": 3}
    assert not [key for key in series if ("outcome", "error") in key[1]]
    assert series["adaptive_rollout_groups_dropped_total", (("reason", "stale"),)] == 3
    for reason in ("engine_error", "verifier_error", "verifier_unavailable"):
        assert series["adaptive_rollout_groups_dropped_total", (("reason", reason),)] == 0
    assert series["adaptive_rollout_stop_reasons_total", (("reason", "budget"),)] == 1
    assert series["adaptive_rollout_prompts_skipped_total", (("domain", "mul"),)] == 1
    assert series["adaptive_rollout_samples_per_group_count", ()] == 2
    assert series["adaptive_rollout_samples_per_group_bucket", (("le", "2.0"),)] == 1
    assert series["adaptive_rollout_wave_latency_seconds_count", ()] == 2  # not the dropped one
    assert series["adaptive_rollout_delivered_staleness_bucket", (("le", "1.0"),)] == 1
    assert series["adaptive_rollout_staleness", ()] == tally.staleness()["last"] == 2
    assert series["adaptive_rollout_groups_acked_total", ()] == 1
    assert series["adaptive_rollout_verifier_errors_total", (("kind", "timeout"),)] == 1
    assert series["adaptive_rollout_verifier_latency_seconds_count", ()] == 2
    assert stats["verifier_errors"]["timeout"] == 1
    assert series["adaptive_rollout_verifier_retries_total", ()] == stats["verifier_retries"] == 1
    judge, idle = stats["judges"]["grader"], stats["judges"]["idle"]
    assert (judge["requests"], judge["answers"], judge["verdicts"], judge["retries"]) == (
        3,
        17,
        14,
        3,
    )
    assert judge["failures"] == {"timeout": 1, "transport": 0, "status": 0, "unreadable": 2}
    assert judge["last_error"] == "timeout: no reply"
    assert judge["mean_request_s"] == (0.5 + 0.3 + 60.0) / 3
    grader = (("judge", "grader"),)
    assert series["adaptive_rollout_judge_requests_total", grader] == judge["requests"]
    assert series["adaptive_rollout_judge_answers_total", grader] == judge["answers"]
    assert series["adaptive_rollout_judge_verdicts_total", grader] == judge["verdicts"]
    assert series["adaptive_rollout_judge_retries_total", grader] == judge["retries"]
    for cause, count in judge["failures"].items():
        key = ("adaptive_rollout_judge_failures_total", (("cause", cause), ("judge", "grader")))
        assert series[key] == count
    assert series["adaptive_rollout_judge_request_seconds_count", grader] == 3
    assert series["adaptive_rollout_judge_request_seconds_bucket", (*grader, ("le", "0.5"))] == 2
    # A judge with no request yet has its series, at zero.
    assert (
        idle["requests"]
        == series["adaptive_rollout_judge_requests_total", (("judge", "idle"),)]
        == 0
    )
    assert stats["episodes"]["episodes"] == 2 and stats["episodes"]["last_env_error"] == "boom"
    assert series["adaptive_rollout_episode_tokens_total", (("kind", "model"),)] == 9
    assert series["adaptive_rollout_env_errors_total", ()] == 1
    assert series["adaptive_rollout_active_prompts", ()] == 3
    assert (
        series["adaptive_rollout_policy_version", ()],
        series["adaptive_rollout_config_version", ()],
    ) == (7, 2)
    assert tally.allocation.to_dict()["cut"] == 1


def test_a_dropped_group_takes_its_left_out_answers_into_its_waste() -> None:
    """A group built and then dropped (stale once stored, or by a batch policy) wasted
    every answer its prompt counted: the answers down-sampling left out move from
    `downsampled` into the drop's waste, so the fates still add up to what was decoded
    and the stale waste is what the drop cost. A group stored before a restart moves at
    most what this process counted."""
    tally = Tally(["add"], lambda: 0.0)
    tally.wave(WaveOutcome("add", "q1", 30, 1, 3000, 1.0))
    tally.grouped(400, 2600)
    tally.dropped_group("stale", 400, "add", "q1", downsampled=2600)
    fates = tally.tokens_by_fate()
    assert (fates["decoded"], fates["downsampled"], fates["waste"]["stale"]) == (3000, 0, 3000)
    assert fates["pending"] == 0
    assert tally.to_dict({})["waste_by_quartile"]["q1"]["stale"] == 3000
    # Nothing of it was counted here: the drop wastes its kept tokens alone.
    tally.dropped_group("stale", 100, "add", "q1", downsampled=500)
    fates = tally.tokens_by_fate()
    assert (fates["downsampled"], fates["waste"]["stale"]) == (0, 3100)


def test_waste_by_domain_and_pass_rate_bin_adds_up_to_the_waste() -> None:
    """Every waste cause lands in one writer, split by domain and by the prompt's
    pass-rate bin: each split sums to the totals, in /v1/stats and in /metrics."""
    tally = Tally(["add", "mul"], lambda: 0.0)
    metrics = Metrics()
    metrics.follow(
        tally, active_prompts=lambda: 0, policy_version=lambda: 0, config_version=lambda: 0
    )
    tally.wave(WaveOutcome("add", "q1", 8, 1, 80, 0.5, surplus_answers=2, surplus_tokens=30,
                           aborted_tokens=7))  # fmt: skip
    tally.wave(WaveOutcome("mul", "q4", 0, 0, 0, None, dropped_tokens=11))
    tally.dropped_group("stale", 50, "mul", "q1")
    tally.dropped_group("stale", 20, "add", "unseen")
    tally.dropped_group("too_few_samples", 4, "add", "q3")
    tally.lost(9, "mul", "q2")
    stats = tally.to_dict({})
    totals = stats["waste"]["waste"]
    assert totals == {"surplus": 30, "aborted": 7, "stale": 70, "prompt_dropped": 15, "crash": 9}
    for split in ("waste_by_domain", "waste_by_quartile"):
        for cause, total in totals.items():
            assert sum(by[cause] for by in stats[split].values()) == total, (split, cause)
    assert set(stats["waste_by_quartile"]) == {"q1", "q2", "q3", "q4", "unseen"}
    assert stats["waste_by_quartile"]["q1"]["stale"] == 50
    assert stats["waste_by_domain"]["add"]["stale"] == 20
    series = _series(metrics)
    waste = {
        labels: value
        for (name, labels), value in series.items()
        if name == "adaptive_rollout_waste_tokens_total"
    }
    assert sum(waste.values()) == sum(totals.values())
    key = (("cause", "stale"), ("domain", "mul"), ("quartile", "q1"))
    assert waste[key] == 50
