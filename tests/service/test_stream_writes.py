"""A stream hands the socket every READY frame its consumer's credit allows in one write:
a burst of frames (a finalizer's batch of groups) costs the event loop one send, not one
per frame. The real service on the toy model, its stream read as the route reads it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench.common import fixed_groups
from sampler_service.config import SamplerConfig, ServeSettings
from sampler_service.encoding import MSGPACK
from sampler_service.service import SamplerService
from trainer_client.contract import wire

pytestmark = pytest.mark.timeout(300)

READY = 6


def _groups(message: bytes) -> list[dict[str, Any]]:
    decoder = wire.stream_decoder()
    decoder.feed(message)
    return [m["group"] for m in decoder if m["type"] == "group"]


async def _ready(service: SamplerService, groups: int, timeout_s: float = 120.0) -> None:
    async with asyncio.timeout(timeout_s):
        while service.outbox.ready_groups < groups:
            await asyncio.sleep(0.05)


async def test_ready_frames_go_out_together_up_to_the_credit(toy: Any, tmp_path: Path) -> None:
    settings = ServeSettings(
        model=toy.model_dir, data=[toy.data_files[0]], state_dir=tmp_path / "state", port=0
    )
    # max_staleness None: no trainer here, so groups may wait for the stream
    config = SamplerConfig(**fixed_groups(2, max_tokens=4, batch_groups=1, max_staleness=None))
    service = await SamplerService.build(settings, config)
    try:
        await _ready(service, READY)
        stream = service.delivery.open_stream("small", 2, 30.0, MSGPACK)
        await anext(stream)  # the opening heartbeat
        assert len(_groups(await anext(stream))) == 2  # the credit, though more are READY
        await stream.aclose()

        await _ready(service, READY)
        ready = service.outbox.ready_groups
        stream = service.delivery.open_stream("large", 1000, 30.0, MSGPACK)
        await anext(stream)
        first_write = _groups(await anext(stream))
        assert len(first_write) >= ready  # every READY frame, one write
        assert len({g["group_id"] for g in first_write}) == len(first_write)
        await stream.aclose()
    finally:
        await service.stop()
