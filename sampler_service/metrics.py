"""Prometheus metrics, one registry per service instance.

A private registry (not the process-global default) keeps several services in one
process, as tests and benchmarks run them, from colliding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sampler_service.tally import Tally, TallyCollector

# `*_created` series double every counter and histogram in the text format and carry
# nothing a dashboard uses.
disable_created_metrics()

PREFIX = "adaptive_rollout_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: stale_version: the version did not increase (409); rejected: the file failed vetting
#: (422); error: the engine failed while loading vetted weights.
WEIGHT_FAILURE_REASONS = ("stale_version", "rejected", "error")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.queue_depth = gauge("queue_depth", "Stored groups by state", "state")
        self.active_prompts = gauge("active_prompts", "Prompts being sampled")
        self.policy_version = gauge("policy_version", "Served weights version")
        self.config_version = gauge("config_version", "Sampler config version")
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

    def follow(
        self,
        tally: Tally,
        *,
        active_prompts: Callable[[], int],
        policy_version: Callable[[], int],
        config_version: Callable[[], int],
    ) -> None:
        """Read the sampling figures from `tally` and these gauges from their owners at
        each scrape: nothing here is written twice."""
        self.registry.register(TallyCollector(tally, PREFIX))
        self.active_prompts.set_function(active_prompts)
        self.policy_version.set_function(policy_version)
        self.config_version.set_function(config_version)
        for reason in WEIGHT_FAILURE_REASONS:  # every reason's series from the start
            self.weight_update_failures.labels(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
