"""What the sampler says about itself: alive, starting, degraded or failed, and what
works badly while it still serves. /health, /ready, heartbeats and /v1/stats read it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sampler_service.backends.base import Backend
from sampler_service.config import ServeSettings
from sampler_service.scheduler import Scheduler
from sampler_service.verifiers.judge import Judges
from sampler_service.verifiers.pool import VerifierPool
from trainer_client.contract.protocol import Health


def starting_health(settings: ServeSettings, started_at: float) -> Health:
    """/health before the service is built: the engine as the start-up log will name it
    (`ray` for replicas of an hf or vLLM engine: which one is the `--backend` flag)."""
    return Health(
        status="starting",
        replicas=None,
        backend="ray" if settings.transport.kind == "ray" else settings.backend,
        model=str(settings.model),
        policy_version=0,
        uptime_s=time.time() - started_at,
        engine_error=None,
        warnings=[],
        auth_required=settings.api_key is not None,
    )


@dataclass(eq=False)
class ServiceHealth:
    """The health of a built service; while it is not `ready` (stopping) it reports none
    of its engine's troubles, which its own shutdown causes."""

    settings: ServeSettings
    started_at: float
    backend: Backend
    scheduler: Scheduler
    verifiers: VerifierPool
    judges: Judges
    ready: bool = field(default=False, init=False)

    def engine_error(self) -> str | None:
        """Why the engine cannot generate any more (it died or failed), or None."""
        if not self.ready:
            return None
        health = self.backend.health()
        return (
            str(health.detail.get("error", "the engine reports it is unhealthy"))
            if health.state == "failed"
            else None
        )

    def engine_degraded(self) -> bool:
        """No engine replica can serve now, but one is recovering (admission is paused)."""
        return self.ready and self.backend.health().state == "degraded"

    def replicas(self) -> list[dict[str, Any]] | None:
        """Per-replica state when engines run as replicas, else None."""
        if not self.ready:
            return None
        return self.backend.health().detail.get("replicas")

    def warnings(self) -> list[str]:
        """Verifier specs failing or cut off, judges failing, an engine failing most of
        its calls, finished groups a failed write lost, and a `weight_update_mode:
        continue` the engine cannot honour (it drains instead: the run still works,
        slower than asked)."""
        if not self.ready:
            return []
        engine = self.scheduler.engine_warning()
        drains = self.scheduler.continue_unsupported()
        store = self.scheduler.store_warning()
        return [
            *self.verifiers.warnings(),
            *self.judges.warnings(),
            *([engine] if engine else []),
            *([store] if store else []),
            *([f"weight_update_mode continue: {drains}"] if drains else []),
        ]

    def health(self) -> Health:
        if not self.ready:
            return starting_health(self.settings, self.started_at).model_copy(
                update={"backend": str(self.backend.name)}
            )
        error = self.engine_error()
        status = "engine_failed" if error else "degraded" if self.engine_degraded() else "ok"
        return Health(
            status=status,
            replicas=self.replicas(),
            backend=str(self.backend.name),
            model=str(self.settings.model),
            policy_version=self.backend.policy_version,
            uptime_s=time.time() - self.started_at,
            engine_error=error,
            warnings=self.warnings(),
            auth_required=self.settings.api_key is not None,
        )
