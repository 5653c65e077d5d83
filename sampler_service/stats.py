"""/v1/stats and the gauges /metrics reads at each scrape: queue depths, pass rates and
mixing shares per domain, throughput over a window, and delivered groups' staleness."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from sampler_service.backends.base import Backend
from sampler_service.control import Control
from sampler_service.health import ServiceHealth
from sampler_service.metrics import Metrics
from sampler_service.outbox import Outbox, StoreSink
from sampler_service.scheduler import Scheduler
from sampler_service.sessions.hub import SessionHub
from sampler_service.verifiers.pool import VerifierPool

#: /v1/stats `rates` are averaged over this window.
RATE_WINDOW_S = 60.0


@dataclass(eq=False)
class Stats:
    """Reads every part of a running sampler; keeps only the window its rates need."""

    scheduler: Scheduler
    outbox: Outbox
    sink: StoreSink
    backend: Backend
    verifiers: VerifierPool
    metrics: Metrics
    health: ServiceHealth
    control: Control
    #: Prompts left out at start-up for having no room for an answer in the context.
    filtered_overlong: int = 0
    #: Harness sessions, when rows are answered by them.
    sessions: SessionHub | None = None
    #: (monotonic time, groups emitted, answers, tokens, groups acked), once a second.
    _samples: deque[tuple[float, int, int, int, int]] = field(
        default_factory=lambda: deque(maxlen=int(RATE_WINDOW_S) + 1), init=False
    )

    def sample(self) -> None:
        """Called once a second: the rate window's next point."""
        self._samples.append(self._counters())

    def _counters(self) -> tuple[float, int, int, int, int]:
        st = self.scheduler.tally
        acked = self.control.trained_groups
        return (time.monotonic(), st.groups_emitted, st.samples, st.tokens, acked)

    def _rates(self) -> dict[str, float]:
        """Per-second rates over the last RATE_WINDOW_S seconds (since start when younger)."""
        now = self._counters()
        then = self._samples[0] if self._samples else now
        dt = now[0] - then[0]
        names = ("groups_per_s", "samples_per_s", "tokens_per_s", "acked_per_s")
        rates = {
            n: (a - b) / dt if dt > 0 else 0.0
            for n, a, b in zip(names, now[1:], then[1:], strict=True)
        }
        return {"window_s": dt, **rates}

    def _domain_shares(self) -> dict[str, dict[str, Any]]:
        st = self.scheduler.tally
        targets = self.scheduler.live.mixer.proportions()
        out = {}
        for domain, ds in st.domains.items():
            rates = ds.recent_pass_rates
            out[domain] = {
                "pass_rate": sum(rates) / len(rates) if rates else None,
                "target_share": targets[domain],
                "admitted_share": st.recent_admitted.count(domain)
                / max(len(st.recent_admitted), 1),
                "emitted_share": st.recent_emitted.count(domain) / max(len(st.recent_emitted), 1),
                "admitted": ds.admitted,
                "emitted": ds.emitted,
                "samples": ds.samples,
            }
        return out

    def _staleness(self) -> dict[str, Any]:
        """Delivered groups' lag behind the served weights (over the last ones delivered)
        and what bounds it."""
        return {
            **self.scheduler.tally.staleness(),
            "max_staleness": self.scheduler.config.max_staleness,
            "handout_hold_s": self.scheduler.config.handout_hold,
            "step_groups": self.scheduler.admission.step_groups,
            "pacing": self.scheduler.pacer.to_dict(),
            "engine_priority": {
                "order": self.scheduler.config.engine_order,
                "engine_orders": self.backend.orders_by_priority,
            },
        }

    def document(self) -> dict[str, Any]:
        """The /v1/stats body."""
        scheduler, outbox = self.scheduler, self.outbox
        return {
            "policy_version": self.backend.policy_version,
            "config_version": scheduler.live.version,
            "queue": {
                "ready": outbox.ready_groups,
                "leased": outbox.leased_groups,
                "pending": self.sink.pending,
                "active_prompts": scheduler.active_prompts,
                "finalizing": scheduler.finalizing,
            },
            "paused": scheduler.paused,
            "admission": _admission(scheduler),
            "last_error": scheduler.last_error,
            "engine_error": self.health.engine_error(),
            "warnings": self.health.warnings(),
            "verifiers": asdict(self.verifiers.stats),
            "engine": self.backend.health().detail,
            "replicas": self.health.replicas(),
            "domains": self._domain_shares(),
            "prompts": {
                "served": self.scheduler.dataset.size,
                "filtered_overlong": self.filtered_overlong,
            },
            **scheduler.tally.to_dict(scheduler.replay.stats()),
            # What the pending tokens should be, counted where they are held.
            "held_tokens": scheduler.held_tokens() + self.outbox.held_tokens(),
            "rates": self._rates(),
            "staleness": self._staleness(),
            "weight_updates": {
                "mode": scheduler.config.weight_update_mode,
                "kv": scheduler.config.weight_update_kv,
                "engine_continues": sorted(self.backend.continues),
                "drains_instead": scheduler.continue_unsupported(),
            },
            "allocation": scheduler.allocation_stats(),
            "sessions": self.sessions.stats() if self.sessions is not None else None,
            "trained_groups": self.control.trained_groups,
            "schedule": {
                "steps": len(scheduler.config.schedule),
                "applied": self.control.schedule_applied,
            },
        }

    def update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.labels("ready").set(self.outbox.ready_groups)
        m.queue_depth.labels("leased").set(self.outbox.leased_groups)
        m.queue_depth.labels("pending").set(self.sink.pending)
        m.engine_failed.set(self.health.engine_error() is not None)
        for domain, shares in self._domain_shares().items():
            for kind in ("target", "admitted", "emitted"):
                m.mixing_share.labels(domain, kind).set(shares[f"{kind}_share"])

    def metrics_text(self) -> bytes:
        """The Prometheus exposition, its gauges current."""
        self.update_gauges()
        return self.metrics.render()


def _admission(scheduler: Scheduler) -> dict[str, Any]:
    """What new prompts wait on; `blocked_by` null while nothing holds them up."""
    wait = scheduler.admission.wait
    if wait is None:
        return {"blocked_by": None, "since": None, "detail": None}
    return wait.model_dump()
