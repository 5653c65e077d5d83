"""Small asyncio helpers shared by the scheduler and the service."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for `event` at most `timeout` seconds; True if it was set.

    Uses asyncio.timeout rather than asyncio.wait_for: on Python 3.11, wait_for can
    swallow a cancellation that races with the inner wait finishing, which left a
    cancelled scheduler loop running forever.
    """
    try:
        async with asyncio.timeout(max(timeout, 0.0)):
            await event.wait()
    except TimeoutError:
        return False
    return True
