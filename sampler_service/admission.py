"""How many prompts may start now, and what holds admission up when none may.

Admission stops while weights are being installed, while the engine cannot serve, while
`max_buffered_groups` groups wait for a trainer, and, with `max_staleness` s set, once
(s + 1) trainer steps of groups are generating or not yet acked (AReaL's rule: nothing is
generated more than s weight versions ahead of what the trainer consumes). A full engine
(`max_active_prompts`) holds nothing up: it is busy. Whatever holds admission at 0 is
`wait`, with since when and what releases it, for `/v1/stats`, heartbeats and clients.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sampler_service.live_config import LiveConfig
from trainer_client.contract.protocol import AdmissionWait


class Admission:
    """The admission bound over the live config (see the module docstring)."""

    def __init__(self, live: LiveConfig, consumer_step: Callable[[], int]) -> None:
        self.live = live
        #: Groups per step as the consumers show it (`consumers.ConsumerSteps.step`).
        self._consumer_step = consumer_step
        #: What holds admission at 0 and since when (None: nothing).
        self.wait: AdmissionWait | None = None

    @property
    def step_groups(self) -> int:
        """Groups the trainer takes per step, what `max_staleness` counts in: the most any
        consumer declared or, declaring none, held unacked at once, and at least a frame
        (`batch_groups`)."""
        return max(self.live.config.batch_groups, self._consumer_step())

    def room(self, *, paused: bool, healthy: bool, active: int, buffered: int) -> int:
        """Prompts that may start now, given the prompts `active` and the groups
        `buffered` (finished, not acked); keeps `wait` current."""
        room, blocked_by, detail = self._room(paused, healthy, active, buffered)
        wait = self.wait
        if blocked_by is None:
            self.wait = None
        elif wait is None or wait.blocked_by != blocked_by:
            self.wait = AdmissionWait(blocked_by=blocked_by, since=time.time(), detail=detail)
        elif wait.detail != detail:
            self.wait = wait.model_copy(update={"detail": detail})
        return room

    def _room(
        self, paused: bool, healthy: bool, active: int, buffered: int
    ) -> tuple[int, str | None, str]:
        cfg = self.live.config
        if paused:
            return 0, "weight_update", "new weights are being installed"
        if not healthy:  # a dead engine would only burn prompts
            return 0, "engine", "no engine can serve"
        if buffered >= cfg.max_buffered_groups:
            return (
                0,
                "max_buffered_groups",
                f"{buffered} groups wait for a trainer's ack (READY, LEASED or being stored), "
                f"max_buffered_groups is {cfg.max_buffered_groups}: ack the groups you hold, "
                "or raise max_buffered_groups",
            )
        room = cfg.max_active_prompts - active
        if cfg.max_staleness is not None:
            ahead, step = buffered + active, self.step_groups
            allowed = (cfg.max_staleness + 1) * step
            if ahead >= allowed:
                return (
                    0,
                    "max_staleness",
                    f"{ahead} groups are generating or not yet acked, and max_staleness "
                    f"{cfg.max_staleness} allows {cfg.max_staleness + 1} steps of {step} "
                    "groups ahead of the trainer: ack the groups you hold, or declare the "
                    "groups you train on per step (groups_per_step)",
                )
            room = min(room, allowed - ahead)
        return max(room, 0), None, ""
