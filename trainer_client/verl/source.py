"""Whole groups from the sampler for a trainer that asks for a fixed number per step.

`GroupSource.take(count)` leases (POST /v1/groups/lease) until it holds `count` groups,
keeping the rest of a frame for the next call (a lease returns whole batch frames), and
says what the sampler is doing while it waits, instead of hanging silently; `ack(groups)`
acknowledges what the trainer has trained on. Duplicates of groups still held (a lease
that expired and came back) are filtered by the client. No verl import.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from trainer_client.client import SamplerClient
from trainer_client.contract.protocol import Group
from trainer_client.exceptions import EngineFailed
from trainer_client.verl.settings import SamplerSettings

log = logging.getLogger(__name__)


class GroupSource:
    def __init__(self, settings: SamplerSettings, client: SamplerClient | None = None) -> None:
        self.settings = settings
        self.client = client or SamplerClient(settings.url, **settings.client_kwargs())
        self._pending: deque[Group] = deque()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(self, count: int) -> list[Group]:
        """`count` finished groups, oldest first.

        Raises EngineFailed as soon as the sampler's engine has failed and nothing is left
        to deliver, and TimeoutError after group_timeout_s without a group.
        """
        started = last_arrival = last_log = time.monotonic()
        while len(self._pending) < count:
            lease = self.client.lease(
                max_groups=count - len(self._pending),
                wait_s=self.settings.lease_wait_s,
                consumer=self.settings.consumer,
                groups_per_step=count,
            )
            now = time.monotonic()
            if lease.groups:
                self._pending.extend(lease.groups)
                last_arrival = now
                continue
            self._check_engine(count)
            timeout = self.settings.group_timeout_s
            if timeout and now - last_arrival > timeout:
                raise TimeoutError(
                    f"no group from the sampler at {self.settings.url} for {now - last_arrival:.0f}s "
                    f"(have {len(self._pending)} of {count}); sampler reports {self.describe()}"
                )
            if now - last_log > 60:
                log.warning(
                    "waiting for groups: %d of %d after %.0fs; sampler: %s",
                    len(self._pending),
                    count,
                    now - started,
                    self.describe(),
                )
                last_log = now
        return [self._pending.popleft() for _ in range(count)]

    def _check_engine(self, count: int) -> None:
        stats = self.client.stats()
        queue = stats.get("queue", {})
        error = stats.get("engine_error")
        if (
            error
            and not queue.get("ready")
            and not queue.get("active_prompts")
            and not queue.get("finalizing")
        ):
            raise EngineFailed(
                f"sampler at {self.settings.url}: engine failed: {error} "
                f"(have {len(self._pending)} of {count} groups for this step)"
            )

    def ack(self, groups: list[Group]) -> int:
        if groups:
            self.client.ack(groups)
        return len(groups)

    def describe(self) -> str:
        """One line on the sampler's queues and state, for waiting and timeout messages."""
        try:
            stats = self.client.stats()
        except Exception as exc:  # diagnostic only  # noqa: BLE001
            return f"stats unavailable ({exc})"
        queue = stats.get("queue", {})
        return (
            f"ready={queue.get('ready')} leased={queue.get('leased')} "
            f"active_prompts={queue.get('active_prompts')} paused={stats.get('paused')} "
            f"last_error={stats.get('last_error')!r} dropped={stats.get('dropped')}"
        )

    def close(self) -> None:
        self.client.close()
