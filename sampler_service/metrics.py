"""Prometheus metrics (DESIGN.md section 9), one registry per service instance.

A private registry (not the process-global default) keeps several services in one
process, as tests and benchmarks run them, from colliding.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# `*_created` series double every counter and histogram in the text format and carry
# nothing a dashboard uses.
disable_created_metrics()

PREFIX = "adaptive_rollout_"
CONTENT_TYPE = CONTENT_TYPE_LATEST


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
            "Policy versions between the served weights and the oldest sample of the last group",
            registry=r,
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

        # Known label values have a series (at 0) before their first event, so a rate or
        # an alert on them is defined from the start.
        for kind in ("error", "timeout", "crash", "unavailable"):
            self.verifier_errors.labels(kind)
        for reason in ("engine_error", "verifier_unavailable"):
            self.groups_dropped.labels(reason)
        for reason in ("rule", "n_max", "budget", "fixed"):
            self.stop_reasons.labels(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
