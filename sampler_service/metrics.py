"""Prometheus metrics, one registry per service instance.

A private registry (not the process-global default) keeps several services in one
process, as tests and benchmarks run them, from colliding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from strategies.selection import SELECTIONS
from strategies.stopping import StopReason

# `*_created` series double every counter and histogram in the text format and carry
# nothing a dashboard uses.
disable_created_metrics()

PREFIX = "adaptive_rollout_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Known label values, created at zero when the service starts (Metrics.precreate).
OUTCOMES = ("positive", "negative", "error")
STOP_REASONS = get_args(StopReason)
# crash: the verifier's worker died; unavailable: not called, its breaker is open.
VERIFIER_ERROR_KINDS = ("timeout", "error", "crash", "unavailable")
# The scheduler's own reasons to drop a finalized group; selection policies drop under
# their names.
# stale: a READY frame that fell more than max_staleness versions behind the weights.
DROP_REASONS = (
    "engine_error",
    "env_error",
    "verifier_unavailable",
    "too_few_samples",
    "stale",
    *SELECTIONS.names(),
)
# stale_version: the version did not increase (409); rejected: the file failed vetting
# (422); error: the engine failed while loading vetted weights.
WEIGHT_FAILURE_REASONS = ("stale_version", "rejected", "error")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.samples_generated = counter(
            "samples_generated", "Answers generated", "domain", "outcome"
        )
        self.generated_tokens = counter("generated_tokens", "Response tokens generated")
        self.groups_emitted = counter("groups_emitted", "Groups stored for delivery", "domain")
        self.groups_dropped = counter("groups_dropped", "Finalized groups not emitted", "reason")
        self.replayed_answers = counter(
            "replayed_answers", "Earlier right answers put into all-wrong groups (config replay)"
        )
        self.prompts_skipped = counter(
            "prompts_skipped",
            "Prompts an admission policy passed over before generating any answer",
            "domain",
        )
        self.stop_reasons = counter("stop_reasons", "Why prompts stopped sampling", "reason")
        self.samples_per_group = histogram(
            "samples_per_group",
            "Answers generated per finalized prompt",
            buckets=(1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256),
        )
        self.pass_rate = histogram(
            "pass_rate",
            "Per-prompt pass rate over all answers",
            buckets=tuple(i / 10 for i in range(11)),
        )
        self.queue_depth = gauge("queue_depth", "Stored groups by state", "state")
        self.active_prompts = gauge("active_prompts", "Prompts being sampled")
        self.policy_version = gauge("policy_version", "Served weights version")
        self.config_version = gauge("config_version", "Sampler config version")
        self.staleness = gauge(
            "staleness",
            "Policy versions between the weights served when the last group was delivered and "
            "that group's oldest sample",
        )
        self.delivered_staleness = histogram(
            "delivered_staleness",
            "Per delivered group: served policy version at delivery minus its oldest sample's",
            buckets=(0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024),
        )
        self.groups_acked = counter("groups_acked", "Groups acked by a trainer (deleted)")
        self.wave_latency = histogram(
            "wave_latency_seconds", "Time to generate and verify one wave"
        )
        self.verifier_errors = counter("verifier_errors", "Verifier failures", "kind")
        self.verifier_latency = histogram("verifier_latency_seconds", "Time per verification")
        self.mixing_share = gauge("mixing_share", "Domain shares", "domain", "kind")
        self.weight_updates = counter("weight_updates", "Weight updates applied")
        self.weight_update_seconds = histogram(
            "weight_update_seconds", "Pause-to-resume time of weight updates"
        )
        self.weight_update_failures = counter(
            "weight_update_failures", "Weight updates refused or failed", "reason"
        )
        self.engine_failed = gauge(
            "engine_failed", "1 while the engine is failed and generates nothing, else 0"
        )
        # Engine replicas behind one sampler (the Ray pool, or the HTTP servers of --backend
        # http, labelled by their index); absent series mean one engine.
        self.replica_state = gauge(
            "replica_state",
            "1 for the state each engine replica is in (ok, recovering, failed; HTTP servers: "
            "starting, ok, syncing, paused, down)",
            "replica",
            "state",
        )
        self.replica_inflight_samples = gauge(
            "replica_inflight_samples",
            "Samples requested of a replica and not yet returned",
            "replica",
        )
        self.replica_generated_tokens = counter(
            "replica_generated_tokens", "Response tokens per replica", "replica"
        )
        self.replica_wave_seconds = histogram(
            "replica_wave_seconds", "Engine time of one wave on a replica", "replica"
        )
        self.replica_policy_version = gauge(
            "replica_policy_version", "Weights version a replica serves", "replica"
        )
        self.replica_restarts = counter(
            "replica_restarts", "Replica failures that led to a restart", "replica"
        )
        self.replica_reissued_waves = counter(
            "replica_reissued_waves",
            "Waves lost with a failed replica and sent again to another",
            "replica",
            "reason",
        )
        self.replica_wasted_samples = counter(
            "replica_wasted_samples",
            "Samples of waves lost with a failed replica (generated again elsewhere)",
            "replica",
        )
        self.replica_weight_load_seconds = histogram(
            "replica_weight_load_seconds", "Time a replica took to install new weights", "replica"
        )
        self.route_decisions = counter(
            "route_decisions",
            "Replica choices: sticky (prompt's last replica), new (first wave), moved "
            "(last replica overloaded, full or gone)",
            "kind",
        )

        self.episode_turns = histogram(
            "episode_turns",
            "Model turns per finished episode",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
        )
        self.env_errors = counter(
            "env_errors",
            "Environment failures (exception or time-out); each episode was run again",
        )
        self.env_seconds = counter("env_seconds", "Seconds spent in environment calls")
        self.episode_tokens = counter(
            "episode_tokens",
            "Tokens of finished episodes: model (sampled) or observation",
            "kind",
        )

    # Every metric is named under PREFIX and registered in this instance's registry; the
    # three makers below keep each definition to its name, help text and labels.

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(
        self,
        name: str,
        doc: str,
        *labels: str,
        buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
    ) -> Histogram:
        return Histogram(PREFIX + name, doc, labels, registry=self.registry, buckets=buckets)

    def observe_episodes(self, wave: Any) -> None:
        """A wave of episodes (`sampler_service.episodes.EpisodeWave`) finished."""
        for episode in wave.completions:
            sampled = sum(episode.loss_mask) if episode.loss_mask is not None else 0
            self.episode_turns.observe(episode.num_turns)
            self.episode_tokens.labels("model").inc(sampled)
            self.episode_tokens.labels("observation").inc(len(episode.token_ids) - sampled)
        self.env_errors.inc(len(wave.env_errors))
        self.env_seconds.inc(wave.env_seconds)

    def precreate(self, domains: list[str]) -> None:
        """Create every known label set at zero.

        A labelled series is otherwise absent until its first increment, and
        `increase()`/`rate()` over an absent series is empty rather than 0, so alert rules
        such as "no groups for N minutes" could never fire on a sampler that never emitted.
        """
        for domain in domains:
            self.groups_emitted.labels(domain)
            for outcome in OUTCOMES:
                self.samples_generated.labels(domain, outcome)
        for reason in DROP_REASONS:
            self.groups_dropped.labels(reason)
        for reason in STOP_REASONS:
            self.stop_reasons.labels(reason)
        for kind in VERIFIER_ERROR_KINDS:
            self.verifier_errors.labels(kind)
        for reason in WEIGHT_FAILURE_REASONS:
            self.weight_update_failures.labels(reason)
        for kind in ("model", "observation"):
            self.episode_tokens.labels(kind)

    def render(self) -> bytes:
        return generate_latest(self.registry)
