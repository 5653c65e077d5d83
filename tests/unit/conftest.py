"""The `serve` fixture: the fake inference servers of fake_engines.py on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from .fake_engines import FakeSGLang


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []

    async def start(fake: FakeSGLang, host: str = "127.0.0.1", port: int = 0) -> int:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        runners.append(runner)
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    yield start
    for runner in runners:
        await runner.cleanup()
