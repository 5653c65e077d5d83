"""The sync and async clients are twins: the same public names, each method the same
parameters, every method of the async one awaitable."""

from __future__ import annotations

import inspect

from trainer_client.client import AsyncSamplerClient, SamplerClient
from trainer_client.client_state import ClientCore

#: The one pair that differs by name, as in httpx: close() / aclose().
CLOSE = {"close": "aclose"}


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_twins_expose_the_same_public_names() -> None:
    sync, asynchronous = _public(SamplerClient), _public(AsyncSamplerClient)
    assert sync - set(CLOSE) == asynchronous - set(CLOSE.values())
    assert set(CLOSE) <= sync and set(CLOSE.values()) <= asynchronous
    # Each twin defines its I/O methods itself: nothing public is left to the shared core
    # but settings and counters.
    own = {name for name in vars(SamplerClient) if not name.startswith("_")}
    assert own == sync - _public(ClientCore)
    assert {"groups", "lease", "ack", "push_weights", "wait_ready", "events"} <= own


def test_each_method_takes_the_same_parameters_and_the_async_one_is_awaitable() -> None:
    for name in sorted(n for n in vars(SamplerClient) if not n.startswith("_")):
        sync = getattr(SamplerClient, name)
        asynchronous = getattr(AsyncSamplerClient, CLOSE.get(name, name))
        assert inspect.signature(sync).parameters.keys() == (
            inspect.signature(asynchronous).parameters.keys()
        ), name
        assert inspect.iscoroutinefunction(asynchronous) or inspect.isasyncgenfunction(
            asynchronous
        ), name
        assert inspect.isgeneratorfunction(sync) == inspect.isasyncgenfunction(asynchronous), name
    for context in ("__enter__", "__exit__"):
        assert inspect.iscoroutinefunction(
            getattr(AsyncSamplerClient, context.replace("__", "__a", 1))
        )
