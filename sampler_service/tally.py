"""Every figure of sampling and delivery, counted once.

Each event of a prompt's life is one record, built once where it happens: a wave's
outcome (`WaveOutcome`), a prompt's end (`PromptOutcome`), a group emitted or dropped, a
delivery, a verdict. The `Tally` adds each record to its counters in one place.
`/v1/stats` (and so the dashboard and `adaptive-rollout stats`) reads `Tally.to_dict()`,
and `/metrics` reads the same counters at each scrape through `TallyCollector`: no
figure has a second writer that could drift from the first. vLLM's `IterationStats` is
the model: a record built once, read by every view.

A verification that failed is never an answer: a wave with one is not counted (its
prompt is dropped as `verifier_error` or `verifier_unavailable`), so every answer counted
here is a positive or a negative.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from strategies.estimator import QUARTILES, UNSEEN
from strategies.selection import SELECTIONS
from strategies.stopping import StopReason

#: Known label values, exported at zero from the start: `increase()` over an absent
#: series is empty, not 0, so an alert on "no groups for N minutes" could never fire.
OUTCOMES = ("positive", "negative")
STOP_REASONS = get_args(StopReason)
#: The scheduler's own reasons to drop a group; selection policies drop under their names.
#: stale: a READY frame that fell more than max_staleness versions behind the weights.
#: verifier_error: a verification still failed after its retries (never a negative).
DROP_REASONS = (
    "engine_error",
    "env_error",
    "verifier_error",
    "verifier_unavailable",
    "too_few_samples",
    "stale",
    *SELECTIONS.names(),
)
#: crash: the verifier's worker died; unavailable: not called, its breaker is open.
VERIFIER_ERROR_KINDS = ("timeout", "error", "crash", "unavailable")
#: Why a judge's request left answers without a verdict: no reply in time, the server
#: unreachable or the connection lost, an error status, a reply with no verdict in it.
JUDGE_FAILURES = ("timeout", "transport", "status", "unreadable")
#: Why decoded tokens were never trained on. surplus: above the index at which the
#: prompt's rule first held (cancelled in the engine, or discarded once finished);
#: aborted: cut by a weight update or a drain time-out (the answer is drawn again);
#: stale: in groups dropped as too far behind the weights; prompt_dropped: in prompts
#: or groups dropped for an engine, environment or verifier failure, a selection policy
#: or too few samples; crash: lost to a restart.
WASTE_CAUSES = ("surplus", "aborted", "stale", "prompt_dropped", "crash")
#: What /v1/stats `restart` counts of the prompts a restart continued: the prompts, the
#: stored answers reused, those dropped as stale by the bound, and the indices issued
#: before the restart and not stored (decoding, or not yet written), drawn again.
RESTART_COUNTS = ("resumed_prompts", "reused_answers", "stale_answers", "regenerated_answers")
#: Last delivered groups whose lag /v1/stats `staleness` summarizes.
STALENESS_WINDOW = 100
#: Prompts' pass rates and domain shares are over this many recent prompts.
RECENT = 200

#: Histogram buckets, as /metrics has always exported them.
SAMPLES_PER_GROUP_BUCKETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
PASS_RATE_BUCKETS = tuple(i / 10 for i in range(11))
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024)
EPISODE_TURN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
#: prometheus_client's default buckets, for durations.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


@dataclass(frozen=True, slots=True)
class EpisodeCost:
    """What a wave of episodes spent beyond its answers."""

    turns: tuple[int, ...]  # model turns of each finished episode
    model_tokens: int  # sampled (loss mask 1)
    observation_tokens: int  # appended from observations (loss mask 0)
    env_errors: int  # environment failures met (each episode run again)
    env_seconds: float
    last_env_error: str | None


@dataclass(frozen=True, slots=True)
class WaveOutcome:
    """One wave's answers as they were counted."""

    domain: str
    #: The prompt's pass-rate bin (`Estimator.quartile`).
    quartile: str
    answers: int
    positives: int
    #: Sampled tokens of the answers (an episode's model tokens).
    tokens: int
    #: Generation and verification, from issue to the last verdict (None: the wave's
    #: prompt was dropped, its answers not counted).
    seconds: float | None
    episodes: EpisodeCost | None = None
    #: Answers above the index at which the rule first held, and their sampled tokens
    #: (those cancelled as far as they had decoded).
    surplus_answers: int = 0
    surplus_tokens: int = 0
    #: Sampled tokens of answers a weight update or a drain time-out cut short.
    aborted_tokens: int = 0
    #: Sampled tokens of answers not counted because the prompt was dropped.
    dropped_tokens: int = 0
    #: Answers drawn again for an index, by cause (aborted, engine_error, env_error, ...):
    #: a re-draw that favours short answers breaks the exactness of the group.
    redrawn: tuple[tuple[str, int], ...] = ()
    #: A restart's resumption of the prompt (`sampler_service.resume`): what it found
    #: stored; its tokens, decoded by the process before, enter this one's here.
    resumed: Resumed | None = None
    #: Answers a `continue` weight update ran across (several `version_spans`), and the
    #: tokens they had decoded before their last update: work an abort would have lost.
    spanning_answers: int = 0
    continued_tokens: int = 0

    @classmethod
    def resumption(
        cls, domain: str, quartile: str, found: Resumed, surplus_answers: int, surplus_tokens: int
    ) -> WaveOutcome:
        """What a restart found of a prompt, as the outcome of a wave that generated
        nothing: the stored answers above its stopping index, if any, are surplus."""
        return cls(
            domain, quartile, 0, 0, 0, None, None, surplus_answers, surplus_tokens, resumed=found
        )


@dataclass(frozen=True, slots=True)
class Resumed:
    """A prompt a restart continues from its stored answers."""

    #: Answers found stored; those stale by the bound now (dropped, drawn again).
    answers: int
    stale_answers: int
    #: Sampled tokens of the stored answers counted at once, and of the stale ones.
    counted_tokens: int
    stale_tokens: int
    #: Indices issued before the restart and not stored, drawn again.
    regenerated: int


_NOT_RESUMED = Resumed(0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class PromptOutcome:
    """A prompt whose sampling ended (its group is built next, and may still be dropped)."""

    domain: str
    answers: int
    positives: int
    stop_reason: str
    #: The allocation budget it ended with (None: no allocation policy).
    budget: int | None = None
    #: The allocation budget, not the rule or n_max, ended it.
    cut: bool = False


@dataclass(frozen=True, slots=True)
class JudgeCall:
    """One request to a judge (`sampler_service.verifiers.judge`)."""

    judge: str
    #: Answers the request asked a verdict for.
    answers: int
    seconds: float
    #: Why some answers got no verdict (one of JUDGE_FAILURES), None when all did.
    cause: str | None = None
    #: Answers without a verdict: all of them unless the cause is `unreadable`.
    failed: int = 0
    error: str | None = None


class Buckets:
    """A histogram of a continuous value: counts per bucket and the sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, count at or below it), as Prometheus histograms carry them."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), total))
        return out

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        return HistogramMetricFamily(name, doc, buckets=self.cumulative(), sum_value=self.sum)


def _histogram(
    name: str, doc: str, values: Counter[Any], bounds: Sequence[float]
) -> HistogramMetricFamily:
    """A histogram family of exactly counted values (`values`: value -> count)."""
    cumulative = []
    for bound in (*bounds, float("inf")):
        cumulative.append((floatToGoString(bound), sum(n for v, n in values.items() if v <= bound)))
    total = sum(float(v) * n for v, n in values.items())
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


@dataclass
class DomainTally:
    admitted: int = 0
    emitted: int = 0
    skipped: int = 0  # prompts an admission policy passed over (no answer generated)
    samples: int = 0
    positives: int = 0
    recent_pass_rates: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


@dataclass
class AllocationTally:
    """Prompts finished under an allocation policy (since start, whichever policy)."""

    groups: int = 0
    cut: int = 0  # stopped by the allocation budget (stop reason `budget`)
    answers: int = 0
    budgets: int = 0  # sum of the budgets the prompts ended with

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": self.groups,
            "cut": self.cut,
            "answers": self.answers,
            "mean_answers": self.answers / self.groups if self.groups else None,
            "mean_budget": self.budgets / self.groups if self.groups else None,
        }


@dataclass
class EpisodeTally:
    """Multi-turn episodes finished, and what they spent (since start)."""

    episodes: int = 0
    turns: Counter[int] = field(default_factory=Counter)  # model turns -> episodes
    env_errors: int = 0
    env_seconds: float = 0.0
    model_tokens: int = 0
    observation_tokens: int = 0
    last_env_error: str | None = None

    def add(self, cost: EpisodeCost) -> None:
        self.episodes += len(cost.turns)
        self.turns.update(cost.turns)
        self.model_tokens += cost.model_tokens
        self.observation_tokens += cost.observation_tokens
        self.env_errors += cost.env_errors
        self.env_seconds += cost.env_seconds
        if cost.last_env_error is not None:
            self.last_env_error = cost.last_env_error

    def to_dict(self) -> dict[str, Any]:
        turns = sum(k * v for k, v in self.turns.items())
        return {
            "episodes": self.episodes,
            "turns_per_episode": turns / self.episodes if self.episodes else None,
            "turns": {str(k): v for k, v in sorted(self.turns.items())},
            "env_errors": self.env_errors,
            "last_env_error": self.last_env_error,
            "env_seconds": self.env_seconds,
            "model_tokens": self.model_tokens,
            "observation_tokens": self.observation_tokens,
        }


@dataclass
class JudgeTally:
    """One judge's requests and what came of them (since start)."""

    requests: int = 0
    #: Answers asked a verdict for, every try counted.
    answers: int = 0
    verdicts: int = 0
    #: Answers left without a verdict, by cause (JUDGE_FAILURES).
    failures: Counter[str] = field(default_factory=Counter)
    #: Answers asked again after a failure.
    retries: int = 0
    seconds: Buckets = field(default_factory=lambda: Buckets(SECONDS_BUCKETS))
    last_error: str | None = None

    def add(self, call: JudgeCall) -> None:
        self.requests += 1
        self.answers += call.answers
        self.verdicts += call.answers - call.failed
        if call.cause is not None:
            self.failures[call.cause] += call.failed
        if call.error is not None:
            self.last_error = call.error
        self.seconds.add(call.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "answers": self.answers,
            "verdicts": self.verdicts,
            "failures": {cause: self.failures[cause] for cause in JUDGE_FAILURES},
            "retries": self.retries,
            "mean_request_s": self.seconds.sum / self.requests if self.requests else None,
            "last_error": self.last_error,
        }


class Tally:
    """The counters every view reads (see the module docstring)."""

    def __init__(
        self, domains: Iterable[str], clock: Callable[[], float], judges: Iterable[str] = ()
    ) -> None:
        """`judges`: the judges' names, whose series exist from the start."""
        self._clock = clock
        self.started = clock()
        self.domains = {d: DomainTally() for d in domains}
        #: (domain, outcome) -> answers: positive, negative or a verifier error.
        self.answers: Counter[tuple[str, str]] = Counter()
        self.samples = 0
        self.tokens = 0
        self.wave_seconds = Buckets(SECONDS_BUCKETS)
        self.episodes = EpisodeTally()
        self.samples_per_group: Counter[int] = Counter()
        self.pass_rates: Counter[float] = Counter()
        self.stop_reasons: Counter[str] = Counter()
        self.allocation = AllocationTally()
        self.groups_emitted = 0
        self.dropped: Counter[str] = Counter()
        self.replayed = 0
        self.recent_emitted: deque[str] = deque(maxlen=RECENT)
        self.recent_admitted: deque[str] = deque(maxlen=RECENT)
        self.groups_delivered = 0
        #: Lag of every delivered group (served version at delivery minus its oldest
        #: sample's), and of the last STALENESS_WINDOW in order.
        self.lags: Counter[int] = Counter()
        self.recent_lags: deque[int] = deque(maxlen=STALENESS_WINDOW)
        self.groups_acked = 0
        self.verifier_errors: Counter[str] = Counter()
        self.verifier_seconds = Buckets(SECONDS_BUCKETS)
        #: Answers a program verifier was asked again after a failure (a judge's retries
        #: are its own: `judges`).
        self.verifier_retries = 0
        self.judges = {name: JudgeTally() for name in judges}
        #: Sampled tokens by where they went: every one the engines returned is decoded,
        #: and becomes trained (acked), downsampled (not kept by down-sampling), waste (by
        #: cause) or is still pending (in a prompt or group not yet acked).
        self.decoded = 0
        self.trained = 0
        self.downsampled = 0
        self.waste: Counter[str] = Counter()
        #: The same by (domain, pass-rate bin, cause).
        self.waste_by: Counter[tuple[str, str, str]] = Counter()
        self.surplus_answers = 0
        self.redrawn: Counter[str] = Counter()
        #: Prompts continued after a restart, from their stored answers (`RESTART_COUNTS`).
        self.restart: Counter[str] = Counter()
        #: Answers `continue` weight updates ran across, and the tokens kept by it.
        self.spanning_answers = 0
        self.continued_tokens = 0
        #: Hand-outs that waited for late prompts (`handout_hold_s`), the seconds they
        #: waited, and the groups that joined their frames instead of going stale.
        self.handout_holds = 0
        self.handout_hold_s = 0.0
        self.late_groups_framed = 0

    # -- records ------------------------------------------------------------------------
    def admitted(self, domain: str) -> None:
        self.domains[domain].admitted += 1
        self.recent_admitted.append(domain)

    def skipped(self, domain: str) -> None:
        self.domains[domain].skipped += 1

    def wave(self, outcome: WaveOutcome) -> None:
        domain = self.domains[outcome.domain]
        self.answers[outcome.domain, "positive"] += outcome.positives
        self.answers[outcome.domain, "negative"] += outcome.answers - outcome.positives
        domain.samples += outcome.answers
        domain.positives += outcome.positives
        self.samples += outcome.answers
        self.tokens += outcome.tokens
        if outcome.seconds is not None:
            self.wave_seconds.add(outcome.seconds)
        if outcome.episodes is not None:
            self.episodes.add(outcome.episodes)
        resumed = outcome.resumed or _NOT_RESUMED
        self.decoded += (
            outcome.tokens
            + outcome.surplus_tokens
            + outcome.aborted_tokens
            + outcome.dropped_tokens
            + resumed.counted_tokens
            + resumed.stale_tokens
        )
        where = outcome.domain, outcome.quartile
        self._wasted("surplus", outcome.surplus_tokens, *where)
        self._wasted("aborted", outcome.aborted_tokens, *where)
        self._wasted("prompt_dropped", outcome.dropped_tokens, *where)
        self._wasted("stale", resumed.stale_tokens, *where)
        self.surplus_answers += outcome.surplus_answers
        self.redrawn.update(dict(outcome.redrawn))
        self.spanning_answers += outcome.spanning_answers
        self.continued_tokens += outcome.continued_tokens
        if outcome.resumed is not None:
            self.restart.update(
                resumed_prompts=1,
                reused_answers=resumed.answers - resumed.stale_answers,
                stale_answers=resumed.stale_answers,
                regenerated_answers=resumed.regenerated,
            )

    def prompt_finished(self, outcome: PromptOutcome) -> None:
        rate = outcome.positives / outcome.answers
        self.samples_per_group[outcome.answers] += 1
        self.stop_reasons[outcome.stop_reason] += 1
        self.pass_rates[rate] += 1
        self.domains[outcome.domain].recent_pass_rates.append(rate)
        if outcome.budget is not None:
            self.allocation.groups += 1
            self.allocation.cut += outcome.cut
            self.allocation.answers += outcome.answers
            self.allocation.budgets += outcome.budget

    def emitted(self, domain: str) -> None:
        self.groups_emitted += 1
        self.domains[domain].emitted += 1
        self.recent_emitted.append(domain)

    def grouped(self, kept_tokens: int, downsampled_tokens: int) -> None:
        """A group built from a prompt's counted answers: what down-sampling left out."""
        self.downsampled += downsampled_tokens

    def dropped_group(
        self, reason: str, tokens: int, domain: str, quartile: str, downsampled: int = 0
    ) -> None:
        """A group not delivered, by reason (at finalizing, framing, or once stored), with
        the sampled tokens it held: a stale one is `stale` waste, the rest
        `prompt_dropped`. `downsampled`: the tokens of its answers that down-sampling left
        out, counted `downsampled` when it was built; they were spent on a group nobody
        trains on, so they move to the same waste (a hard prompt's group keeps 4 of its
        20-30 answers: its kept tokens alone understate what the drop cost several
        times). No more moves than this process counted (a group stored before a
        restart was counted by the process before it)."""
        moved = min(downsampled, self.downsampled)
        self.downsampled -= moved
        self.dropped[reason] += 1
        cause = "stale" if reason == "stale" else "prompt_dropped"
        self._wasted(cause, tokens + moved, domain, quartile)

    def _wasted(self, cause: str, tokens: int, domain: str, quartile: str) -> None:
        """Every waste is written here: in all, by domain and by pass-rate bin."""
        if tokens:
            self.waste[cause] += tokens
            self.waste_by[domain, quartile, cause] += tokens

    def replayed_answer(self) -> None:
        self.replayed += 1

    def delivered(self, lags: Iterable[int]) -> None:
        for lag in lags:
            self.groups_delivered += 1
            self.lags[lag] += 1
            self.recent_lags.append(lag)

    def handout_held(self, seconds: float, joined: int) -> None:
        """A hand-out that waited `seconds` for late prompts; `joined` groups moved to an
        earlier frame for it (late groups, out of waiting or from a later frame)."""
        self.handout_holds += 1
        self.handout_hold_s += seconds
        self.late_groups_framed += joined

    def lost(self, tokens: int, domain: str, quartile: str) -> None:
        """Decoded tokens of a prompt a stop abandons: a restart samples it again."""
        self._wasted("crash", tokens, domain, quartile)

    def acked(self, groups: int, tokens: int) -> None:
        """Groups a trainer acked, with their fresh tokens: those are what it trained on."""
        self.groups_acked += groups
        self.trained += tokens

    def verified(self, kind: str, seconds: float) -> None:
        """A verdict: its kind (`ok` or a failure) and the time the verifier took."""
        self.verifier_seconds.add(seconds)
        if kind != "ok":
            self.verifier_errors[kind] += 1

    def verifier_retried(self, answers: int) -> None:
        """Answers a program verifier is asked again after a failure."""
        self.verifier_retries += answers

    def judged(self, call: JudgeCall) -> None:
        """A request to a judge."""
        self.judges[call.judge].add(call)

    def judge_retried(self, judge: str, answers: int) -> None:
        """Answers a judge is asked again after a failure."""
        self.judges[judge].retries += answers

    # -- views --------------------------------------------------------------------------
    def staleness(self) -> dict[str, Any]:
        """The recently delivered groups' lag behind the served weights."""
        lags = self.recent_lags
        return {
            "last": lags[-1] if lags else None,
            "mean": sum(lags) / len(lags) if lags else None,
            "max": max(lags) if lags else None,
            "window": len(lags),
            "histogram": {str(lag): n for lag, n in sorted(Counter(lags).items())},
            "dropped_stale": self.dropped.get("stale", 0),
            "hold": {
                "handouts": self.handout_holds,
                "seconds": self.handout_hold_s,
                "late_groups_framed": self.late_groups_framed,
            },
        }

    def tokens_by_fate(self) -> dict[str, Any]:
        """Where the decoded tokens went: decoded = trained + downsampled + waste + pending,
        pending being what prompts still sampling and groups not yet acked hold."""
        waste = {cause: self.waste[cause] for cause in WASTE_CAUSES}
        wasted = sum(waste.values())
        return {
            "decoded": self.decoded,
            "trained": self.trained,
            "downsampled": self.downsampled,
            "waste": waste,
            "pending": self.decoded - self.trained - self.downsampled - wasted,
            "wasted_share": wasted / self.decoded if self.decoded else None,
            "surplus_answers": self.surplus_answers,
            "redrawn": dict(self.redrawn),
        }

    def waste_by_key(self, index: int, keys: Iterable[str]) -> dict[str, dict[str, int]]:
        """Waste tokens by cause for each domain (`index` 0) or pass-rate bin (1)."""
        out = {key: dict.fromkeys(WASTE_CAUSES, 0) for key in keys}
        for where, tokens in self.waste_by.items():
            out.setdefault(where[index], dict.fromkeys(WASTE_CAUSES, 0))[where[2]] += tokens
        return out

    def to_dict(self, replay: dict[str, Any]) -> dict[str, Any]:
        """The sampling figures of /v1/stats (`replay`: the replay store's own)."""
        elapsed = max(self._clock() - self.started, 1e-9)
        return {
            "elapsed_s": elapsed,
            "samples": self.samples,
            "tokens": self.tokens,
            "groups_emitted": self.groups_emitted,
            "samples_per_s": self.samples / elapsed,
            "tokens_per_s": self.tokens / elapsed,
            "groups_per_s": self.groups_emitted / elapsed,
            "samples_per_group": {str(k): v for k, v in sorted(self.samples_per_group.items())},
            "stop_reasons": dict(self.stop_reasons),
            "dropped": dict(self.dropped),
            "skipped": {d: t.skipped for d, t in self.domains.items()},
            "episodes": self.episodes.to_dict(),
            "replay": {**replay, "replayed": self.replayed},
            "verifier_errors": {kind: self.verifier_errors[kind] for kind in VERIFIER_ERROR_KINDS},
            "verifier_retries": self.verifier_retries,
            "judges": {name: judge.to_dict() for name, judge in self.judges.items()},
            "waste": self.tokens_by_fate(),
            "restart": {key: self.restart[key] for key in RESTART_COUNTS},
            "continue": {
                "spanning_answers": self.spanning_answers,
                "continued_tokens": self.continued_tokens,
            },
            "waste_by_domain": self.waste_by_key(0, self.domains),
            "waste_by_quartile": self.waste_by_key(1, (*QUARTILES, UNSEEN)),
        }


class TallyCollector(Collector):
    """/metrics' view of a `Tally`: its counters as Prometheus families at each scrape."""

    def __init__(self, tally: Tally, prefix: str) -> None:
        self.tally, self.prefix = tally, prefix

    def _counter(
        self, name: str, doc: str, labels: Sequence[str] = (), value: float | None = None
    ) -> CounterMetricFamily:
        """A counter family: labelled (its samples added by the caller), or one `value`."""
        if value is not None:
            return CounterMetricFamily(self.prefix + name, doc, value=value)
        return CounterMetricFamily(self.prefix + name, doc, labels=labels)

    def collect(self) -> Iterator[Metric]:
        t, p = self.tally, self.prefix
        answers = self._counter("samples_generated", "Answers generated", ("domain", "outcome"))
        skipped = self._counter(
            "prompts_skipped",
            "Prompts an admission policy passed over before generating any answer",
            ("domain",),
        )
        emitted = self._counter("groups_emitted", "Groups stored for delivery", ("domain",))
        for domain, counts in t.domains.items():
            for outcome in OUTCOMES:
                answers.add_metric([domain, outcome], t.answers[domain, outcome])
            skipped.add_metric([domain], counts.skipped)
            emitted.add_metric([domain], counts.emitted)
        yield from (answers, skipped, emitted)
        yield self._counter("generated_tokens", "Response tokens generated", value=t.tokens)
        dropped = self._counter("groups_dropped", "Finalized groups not emitted", ("reason",))
        for reason in sorted({*DROP_REASONS, *t.dropped}):
            dropped.add_metric([reason], t.dropped[reason])
        yield dropped
        reasons = self._counter("stop_reasons", "Why prompts stopped sampling", ("reason",))
        for reason in sorted({*STOP_REASONS, *t.stop_reasons}):
            reasons.add_metric([reason], t.stop_reasons[reason])
        yield reasons
        yield self._counter(
            "replayed_answers",
            "Earlier right answers put into all-wrong groups (config replay)",
            value=t.replayed,
        )
        yield _histogram(
            p + "samples_per_group",
            "Answers generated per finalized prompt",
            t.samples_per_group,
            SAMPLES_PER_GROUP_BUCKETS,
        )
        yield _histogram(
            p + "pass_rate",
            "Per-prompt pass rate over all answers",
            t.pass_rates,
            PASS_RATE_BUCKETS,
        )
        yield t.wave_seconds.family(
            p + "wave_latency_seconds", "Time to generate and verify one wave"
        )
        yield _histogram(
            p + "delivered_staleness",
            "Per delivered group: served policy version at delivery minus its oldest sample's",
            t.lags,
            STALENESS_BUCKETS,
        )
        last_lag = GaugeMetricFamily(
            p + "staleness",
            "Policy versions between the weights served when the last group was delivered and "
            "that group's oldest sample",
            value=t.recent_lags[-1] if t.recent_lags else 0,
        )
        yield last_lag
        yield self._counter(
            "groups_acked", "Groups acked by a trainer (deleted)", value=t.groups_acked
        )
        verifier = self._counter("verifier_errors", "Verifier failures", ("kind",))
        for kind in sorted({*VERIFIER_ERROR_KINDS, *t.verifier_errors}):
            verifier.add_metric([kind], t.verifier_errors[kind])
        yield verifier
        yield t.verifier_seconds.family(p + "verifier_latency_seconds", "Time per verification")
        yield self._counter(
            "verifier_retries",
            "Answers a program verifier was asked again after a failure",
            value=t.verifier_retries,
        )
        yield from self._judges()
        yield from self._episodes()
        yield from self._tokens()

    def _tokens(self) -> Iterator[Metric]:
        t = self.tally
        decoded = self._counter(
            "decoded_tokens", "Sampled tokens the engines returned", value=t.decoded
        )
        fates = self._counter(
            "token_fates",
            "Decoded tokens by what became of them: trained, downsampled, or a waste cause",
            ("fate",),
        )
        fates.add_metric(["trained"], t.trained)
        fates.add_metric(["downsampled"], t.downsampled)
        for cause in WASTE_CAUSES:
            fates.add_metric([cause], t.waste[cause])
        surplus = self._counter(
            "surplus_answers",
            "Answers above the index at which their prompt's rule first held",
            value=t.surplus_answers,
        )
        redrawn = self._counter("redrawn_answers", "Answers drawn again for an index", ("cause",))
        for cause, count in sorted(t.redrawn.items()):
            redrawn.add_metric([cause], count)
        wasted = self._counter(
            "waste_tokens",
            "Wasted decoded tokens by cause, domain and pass-rate bin of the prompt's estimate "
            "(q1 below 0.25 ... q4 from 0.75; unseen: no estimate yet)",
            ("cause", "domain", "quartile"),
        )
        for (domain, quartile, cause), tokens in sorted(t.waste_by.items()):
            wasted.add_metric([cause, domain, quartile], tokens)
        restart = self._counter(
            "restart", "Prompts continued after a restart, and their answers", ("count",)
        )
        for key in RESTART_COUNTS:
            restart.add_metric([key], t.restart[key])
        spanning = self._counter(
            "spanning_answers",
            "Answers a continue weight update ran across (decoded under several versions)",
            value=t.spanning_answers,
        )
        continued = self._counter(
            "continued_tokens",
            "Tokens spanning answers had decoded before their last weight update: kept, "
            "where abort would have lost them",
            value=t.continued_tokens,
        )
        held = self._counter(
            "handout_hold_seconds",
            "Seconds hand-outs waited for prompts the next weight push would make too stale "
            "(handout_hold_s), so their groups went out instead of being dropped",
            value=t.handout_hold_s,
        )
        yield from (decoded, fates, surplus, redrawn, wasted, restart, spanning, continued, held)

    def _judges(self) -> Iterator[Metric]:
        judges, p = self.tally.judges, self.prefix
        requests = self._counter("judge_requests", "Requests sent to a judge", ("judge",))
        answers = self._counter(
            "judge_answers", "Answers a judge was asked to grade, every try", ("judge",)
        )
        verdicts = self._counter("judge_verdicts", "Verdicts a judge gave", ("judge",))
        failures = self._counter(
            "judge_failures", "Answers a judge's request left without a verdict", ("judge", "cause")
        )
        retries = self._counter(
            "judge_retries", "Answers a judge was asked again after a failure", ("judge",)
        )
        seconds = HistogramMetricFamily(
            p + "judge_request_seconds", "Time of one request to a judge", labels=("judge",)
        )
        for name, judge in judges.items():
            requests.add_metric([name], judge.requests)
            answers.add_metric([name], judge.answers)
            verdicts.add_metric([name], judge.verdicts)
            retries.add_metric([name], judge.retries)
            for cause in JUDGE_FAILURES:
                failures.add_metric([name, cause], judge.failures[cause])
            seconds.add_metric([name], judge.seconds.cumulative(), judge.seconds.sum)
        yield from (requests, answers, verdicts, failures, retries, seconds)

    def _episodes(self) -> Iterator[Metric]:
        e, p = self.tally.episodes, self.prefix
        yield _histogram(
            p + "episode_turns", "Model turns per finished episode", e.turns, EPISODE_TURN_BUCKETS
        )
        errors = self._counter(
            "env_errors",
            "Environment failures (exception or time-out); each episode was run again",
            value=e.env_errors,
        )
        seconds = self._counter(
            "env_seconds", "Seconds spent in environment calls", value=e.env_seconds
        )
        tokens = self._counter(
            "episode_tokens",
            "Tokens of finished episodes: model (sampled) or observation",
            ("kind",),
        )
        tokens.add_metric(["model"], e.model_tokens)
        tokens.add_metric(["observation"], e.observation_tokens)
        yield from (errors, seconds, tokens)
