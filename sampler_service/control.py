"""The live config and what changes it: PATCHes, the schedule's steps, and the event log
that records every change.

A config change, the schedule's progress and its event are one store transaction, so a
crash never leaves a step applied but unrecorded (or recorded twice).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sampler_service.aio import TaskSet
from sampler_service.config import (
    ConfigError,
    SamplerConfig,
    apply_step,
    check_consistency,
    check_context,
    merge_patch,
    parse_patch,
    validate_config,
)
from sampler_service.errors import ServiceError
from sampler_service.live_config import LiveConfig
from sampler_service.scheduler import Scheduler
from sampler_service.store import AsyncStore

log = logging.getLogger(__name__)


class EventLog:
    """The persisted event log: config changes, schedule steps, weights, engine trouble."""

    def __init__(self, store: AsyncStore) -> None:
        self._store = store
        self._tasks = TaskSet()

    async def record(
        self, kind: str, source: str, data: dict[str, Any], state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Append an event (with `state` written in the same transaction)."""
        return await self._store.call(self._store.sync.add_event, kind, source, data, state)

    async def page(self, since: int, limit: int, kinds: Sequence[str] = ()) -> dict[str, Any]:
        """Events after `since` (of `kinds`, when given), oldest first; `last_seq` is where
        the next poll starts."""
        return await self._store.call(self._store.sync.event_page, since, limit, kinds)

    def replica_changed(self, detail: dict[str, Any]) -> None:
        """Log a replica's or a server's state change; the fleet reports it from the event
        loop."""

        async def record() -> None:
            try:
                await self.record("replica", "engine", detail)
            except Exception as exc:  # noqa: BLE001 - the store may be closing; the log says so
                log.warning("replica event not recorded (%s): %s", exc, detail)

        self._tasks.spawn(record())


@dataclass(eq=False)
class Control:
    """PATCH /v1/config and the live schedule, over the live config.

    Schedule steps key on groups trained on (acked, counted here) or on the served policy
    version; each applies once, in order. `after_change` runs after every config or
    weight change, since a lowered max_staleness applies to frames already READY and a
    feature a change makes required applies to streams already open.
    """

    live: LiveConfig
    scheduler: Scheduler
    events: EventLog
    domains: list[str]
    context_length: int | None
    policy_version: Callable[[], int]
    after_change: Callable[[], Awaitable[None]]
    #: Groups acked since the state dir was created (schedules key on it).
    trained_groups: int
    #: Steps of the live schedule already applied (or skipped); they never run again.
    schedule_applied: int
    #: Checks a config against what the sampler was started with (its judges' servers,
    #: the judges its data names); a ConfigError names the knob.
    check_started: Callable[[SamplerConfig], None]
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    def get_config(self) -> dict[str, Any]:
        return {"config_version": self.live.version, **self.live.config.model_dump()}

    async def patch_config(self, body: Any) -> dict[str, Any]:
        """Apply a PATCH body (its model: `config.ConfigPatch`) on top of the live config."""
        async with self._lock:
            try:
                patch, expected = parse_patch(body)
            except ConfigError as exc:
                raise ServiceError(422, "invalid_config", str(exc), exc.field) from exc
            if expected is not None and expected != self.live.version:
                raise ServiceError(
                    409,
                    "config_version_conflict",
                    f"config_version is {self.live.version}, not {expected}",
                    "config_version",
                )
            old = self.live.config
            merged = merge_patch(old.model_dump(), patch)
            # Judged on what it changes (a knob it does not name is not held against it)
            # and on whether the result is consistent, as the start-up config is.
            try:
                cfg = validate_config(merged)
                check_consistency(cfg, self.domains)
                self.check_started(cfg)
                if "max_tokens" in patch:
                    check_context(cfg, self.context_length)
            except ConfigError as exc:
                raise ServiceError(422, "invalid_config", str(exc), exc.field) from exc
            # A new schedule starts from its first step; steps already due apply below.
            applied = 0 if cfg.schedule != old.schedule else self.schedule_applied
            await self._commit(cfg, "api", applied)
        await self.advance_schedule()
        return self.get_config()

    async def acked(self, groups: int) -> None:
        """Groups trained on: schedule steps keyed on them may be due."""
        self.trained_groups += groups
        await self.advance_schedule()

    async def weights_installed(
        self, version: int, transport: str, seconds: float, paused_s: float
    ) -> None:
        """Log a weight update and apply schedule steps keyed on the new policy version."""
        data = {"version": version, "transport": transport, "seconds": seconds}
        await self.events.record("weights", "api", {**data, "paused_s": paused_s})
        await self.after_change()
        await self.advance_schedule()

    async def _commit(
        self, cfg: SamplerConfig, source: str, applied: int, detail: dict[str, Any] | None = None
    ) -> None:
        """Persist and install `cfg` as the next version, logged with its diff, in one
        transaction with the schedule's progress. Callers hold the lock."""
        old = self.live.config.model_dump(mode="json")
        new = cfg.model_dump(mode="json")
        diff = {k: [old.get(k), v] for k, v in new.items() if old.get(k) != v}
        version = self.live.version + 1
        record = {"config": new, "version": version, "schedule_applied": applied}
        await self.events.record(
            "config",
            source,
            {"config_version": version, "diff": diff, **(detail or {})},
            {"config": record},
        )
        self.schedule_applied = applied
        await self.live.install(cfg, version)
        self.scheduler.poke()
        await self.scheduler.form_frames()
        log.info("config v%d (%s): %s", version, source, diff)
        await self.after_change()

    def _schedule_due(self) -> bool:
        schedule = self.live.config.schedule
        if self.schedule_applied >= len(schedule):
            return False
        kind, threshold = schedule[self.schedule_applied].at.key()
        progress = self.trained_groups if kind == "trained_groups" else self.policy_version()
        return progress >= threshold

    async def advance_schedule(self) -> None:
        """Apply, in order and once each, every schedule step whose condition now holds.

        A step that is no longer valid on top of the live config (a PATCH changed other
        knobs since) is skipped and logged rather than retried forever.
        """
        if not self._schedule_due():
            return
        async with self._lock:
            while self._schedule_due():
                cfg, i = self.live.config, self.schedule_applied
                step = cfg.schedule[i]
                kind, threshold = step.at.key()
                detail = {"step": i, "at": {kind: threshold}}
                try:
                    new = apply_step(cfg.model_dump(mode="json"), step.set, self.domains)
                    self.check_started(new)
                except ConfigError as exc:
                    record = {
                        "config": cfg.model_dump(mode="json"),
                        "version": self.live.version,
                        "schedule_applied": i + 1,
                    }
                    await self.events.record(
                        "schedule_skipped",
                        "schedule",
                        {**detail, "error": str(exc), "field": exc.field},
                        {"config": record},
                    )
                    self.schedule_applied = i + 1
                    log.warning("schedule step %d skipped: %s", i, exc)
                    continue
                await self._commit(
                    new.model_copy(update={"schedule": cfg.schedule}), "schedule", i + 1, detail
                )
