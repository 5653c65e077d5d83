"""Prometheus metrics, one registry per service instance.

A private registry (not the process-global default) keeps several services in one
process, as tests and benchmarks run them, from colliding.
"""

from __future__ import annotations

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
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.samples_generated = Counter(
            PREFIX + "samples_generated", "Answers generated", ["domain", "outcome"], registry=r
        )
        self.generated_tokens = Counter(
            PREFIX + "generated_tokens", "Response tokens generated", registry=r
        )
        self.groups_emitted = Counter(
            PREFIX + "groups_emitted", "Groups stored for delivery", ["domain"], registry=r
        )
        self.groups_dropped = Counter(
            PREFIX + "groups_dropped", "Finalized groups not emitted", ["reason"], registry=r
        )
        self.replayed_answers = Counter(
            PREFIX + "replayed_answers",
            "Earlier right answers put into all-wrong groups (config replay)",
            registry=r,
        )
        self.prompts_skipped = Counter(
            PREFIX + "prompts_skipped",
            "Prompts an admission policy passed over before generating any answer",
            ["domain"],
            registry=r,
        )
        self.stop_reasons = Counter(
            PREFIX + "stop_reasons", "Why prompts stopped sampling", ["reason"], registry=r
        )
        self.samples_per_group = Histogram(
            PREFIX + "samples_per_group",
            "Answers generated per finalized prompt",
            buckets=(1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256),
            registry=r,
        )
        self.pass_rate = Histogram(
            PREFIX + "pass_rate",
            "Per-prompt pass rate over all answers",
            buckets=tuple(i / 10 for i in range(11)),
            registry=r,
        )
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", "Stored groups by state", ["state"], registry=r
        )
        self.active_prompts = Gauge(PREFIX + "active_prompts", "Prompts being sampled", registry=r)
        self.policy_version = Gauge(PREFIX + "policy_version", "Served weights version", registry=r)
        self.config_version = Gauge(PREFIX + "config_version", "Sampler config version", registry=r)
        self.staleness = Gauge(
            PREFIX + "staleness",
            "Policy versions between the weights served when the last group was delivered and "
            "that group's oldest sample",
            registry=r,
        )
        self.delivered_staleness = Histogram(
            PREFIX + "delivered_staleness",
            "Per delivered group: served policy version at delivery minus its oldest sample's",
            buckets=(0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=r,
        )
        self.groups_acked = Counter(
            PREFIX + "groups_acked", "Groups acked by a trainer (deleted)", registry=r
        )
        self.wave_latency = Histogram(
            PREFIX + "wave_latency_seconds", "Time to generate and verify one wave", registry=r
        )
        self.verifier_errors = Counter(
            PREFIX + "verifier_errors", "Verifier failures", ["kind"], registry=r
        )
        self.verifier_latency = Histogram(
            PREFIX + "verifier_latency_seconds", "Time per verification", registry=r
        )
        self.mixing_share = Gauge(
            PREFIX + "mixing_share", "Domain shares", ["domain", "kind"], registry=r
        )
        self.weight_updates = Counter(
            PREFIX + "weight_updates", "Weight updates applied", registry=r
        )
        self.weight_update_seconds = Histogram(
            PREFIX + "weight_update_seconds", "Pause-to-resume time of weight updates", registry=r
        )
        self.weight_update_failures = Counter(
            PREFIX + "weight_update_failures",
            "Weight updates refused or failed",
            ["reason"],
            registry=r,
        )
        self.engine_failed = Gauge(
            PREFIX + "engine_failed",
            "1 while the engine is failed and generates nothing, else 0",
            registry=r,
        )
        # Engine replicas behind one sampler (the Ray pool, or the HTTP servers of --backend
        # http, labelled by their index); absent series mean one engine.
        self.replica_state = Gauge(
            PREFIX + "replica_state",
            "1 for the state each engine replica is in (ok, recovering, failed; HTTP servers: "
            "starting, ok, syncing, paused, down)",
            ["replica", "state"],
            registry=r,
        )
        self.replica_inflight_samples = Gauge(
            PREFIX + "replica_inflight_samples",
            "Samples requested of a replica and not yet returned",
            ["replica"],
            registry=r,
        )
        self.replica_generated_tokens = Counter(
            PREFIX + "replica_generated_tokens",
            "Response tokens per replica",
            ["replica"],
            registry=r,
        )
        self.replica_wave_seconds = Histogram(
            PREFIX + "replica_wave_seconds",
            "Engine time of one wave on a replica",
            ["replica"],
            registry=r,
        )
        self.replica_policy_version = Gauge(
            PREFIX + "replica_policy_version",
            "Weights version a replica serves",
            ["replica"],
            registry=r,
        )
        self.replica_restarts = Counter(
            PREFIX + "replica_restarts",
            "Replica failures that led to a restart",
            ["replica"],
            registry=r,
        )
        self.replica_reissued_waves = Counter(
            PREFIX + "replica_reissued_waves",
            "Waves lost with a failed replica and sent again to another",
            ["replica", "reason"],
            registry=r,
        )
        self.replica_wasted_samples = Counter(
            PREFIX + "replica_wasted_samples",
            "Samples of waves lost with a failed replica (generated again elsewhere)",
            ["replica"],
            registry=r,
        )
        self.replica_weight_load_seconds = Histogram(
            PREFIX + "replica_weight_load_seconds",
            "Time a replica took to install new weights",
            ["replica"],
            registry=r,
        )
        self.route_decisions = Counter(
            PREFIX + "route_decisions",
            "Replica choices: sticky (prompt's last replica), new (first wave), moved "
            "(last replica overloaded, full or gone)",
            ["kind"],
            registry=r,
        )

        self.episode_turns = Histogram(
            PREFIX + "episode_turns",
            "Model turns per finished episode",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.env_errors = Counter(
            PREFIX + "env_errors",
            "Environment failures (exception or time-out); each episode was run again",
            registry=r,
        )
        self.env_seconds = Counter(
            PREFIX + "env_seconds", "Seconds spent in environment calls", registry=r
        )
        self.episode_tokens = Counter(
            PREFIX + "episode_tokens",
            "Tokens of finished episodes: model (sampled) or observation",
            ["kind"],
            registry=r,
        )

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
