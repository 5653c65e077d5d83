"""HTTP clients for the sampler service: sync `SamplerClient` and `AsyncSamplerClient`.

Both speak the sampler's HTTP API (docs/api.md) over httpx. They are twins with
the same methods: each method here only sends requests, reads bytes and sleeps, and asks
`trainer_client.client_state` what a response means and what comes next (retries, the
stream's reconnects, watchdog and duplicate filter), so the two cannot drift apart.
Errors are `trainer_client.exceptions`. Nothing here imports the server.

The group stream (`groups()`) is the main path:

- credits: the server sends the next batch frame only while the stream's unacked groups
  plus the frame fit in `max_unacked`, so a consumer must `ack()` what it has used;
- reconnects: when the connection drops or the server ends the stream, the client
  reconnects with exponential backoff and jitter; the server puts every unacked group back
  to READY and offers it again (with a new delivery id);
- duplicates: delivery is at-least-once. A group id already acked is acked again and
  skipped; a group id the caller holds but has not acked yet is skipped, and `ack()` uses
  its newest delivery id (the older one died with the old connection);
- names: each client streams under its own consumer name (by default
  `<host>-<pid>-<6 hex>`, unique per process); the server refuses a second live stream
  under a name (409 `consumer_busy`), which a reconnect retries for a short while, until
  the server has let go of the old connection;
- watchdog: if no heartbeat and no group arrives for `watchdog_s` (a SIGSTOPped or dead
  server, a wedged network), `SamplerUnavailable` says what it waited for and for how long,
  instead of hanging forever. Time the caller spends between two groups does not count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Generator, Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

from trainer_client.client_state import STREAM_PATH, STREAM_RETRYABLE, ClientCore
from trainer_client.contract.protocol import (
    AckResponse,
    Group,
    Health,
    LeaseResponse,
    WeightsResponse,
)
from trainer_client.exceptions import ConflictError
from trainer_client.uploads import Weights, encode_weights, upload

__all__ = ["AsyncSamplerClient", "SamplerClient"]

_ACK_PATH = "/v1/groups/ack"


def _landed(version: int) -> WeightsResponse:
    """The answer to a retried upload whose first attempt landed (its reply was lost)."""
    return WeightsResponse(policy_version=version, tensors=0, load_s=0.0)


class SamplerClient(ClientCore):
    """Blocking client. Use as a context manager, or call `close()`.

    >>> with SamplerClient("http://127.0.0.1:8000", consumer="trainer-0") as client:
    ...     for group in client.groups():
    ...         train_on(group)
    ...         client.ack([group])
    """

    def __init__(
        self, base_url: str, *, transport: httpx.BaseTransport | None = None, **kw: Any
    ) -> None:
        super().__init__(base_url, **kw)
        self._http = httpx.Client(transport=transport, **self._http_options())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SamplerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, retry: bool = True, **kw: Any) -> httpx.Response:
        """One request; transient failures are retried with backoff for up to `watchdog_s`."""
        attempts = self._attempts(method, path, retry)
        while True:
            try:
                response = self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                time.sleep(attempts.failed(exc))
                continue
            if (delay := attempts.answered(response)) is None:
                return response
            time.sleep(delay)

    def health(self) -> Health:
        return Health.model_validate_json(self._request("GET", "/health").content)

    def ready(self) -> bool:
        """True once the engine is loaded and the dataset open (no retries)."""
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout_s: float | None = None) -> Health:
        """Block until /ready answers 200; `SamplerUnavailable` after `timeout_s` (default: watchdog)."""
        waiting = self._ready_wait(timeout_s)
        while (delay := waiting.answered(self.ready())) is not None:
            time.sleep(delay)
        return self.health()

    def get_config(self) -> dict[str, Any]:
        """The live sampler config, flat keys plus `config_version`."""
        config: dict[str, Any] = self._request("GET", "/v1/config").json()
        return config

    def update_config(self, expected_version: int | None = None, **knobs: Any) -> dict[str, Any]:
        """PATCH the config (`update_config(k_pos=4, n_max=16)`); returns the new config.

        With `expected_version`, the server refuses (409) if someone else changed it first.
        Invalid values raise `InvalidRequest` whose `field` names the knob.
        """
        patch = self._config_patch(knobs, expected_version)
        config: dict[str, Any] = self._request("PATCH", "/v1/config", json=patch).json()
        return config

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._request("GET", "/v1/stats").json()
        return stats

    def events(
        self, since: int = 0, limit: int = 1000, kinds: Iterable[str] = ()
    ) -> dict[str, Any]:
        """Event log entries after `since` (of `kinds`, when given): `{"events": [...],
        "last_seq": N}`, oldest first."""
        params = {"since": since, "limit": limit, "kind": list(kinds)}
        events: dict[str, Any] = self._request("GET", "/v1/events", params=params).json()
        return events

    def ack(self, items: Iterable[Group | str]) -> AckResponse:
        """Ack groups (by their newest delivery id) or raw delivery ids. Idempotent."""
        ids = self.dedupe.resolve(items)
        if not ids:
            return AckResponse(acked=0, unknown=0)
        r = self._request("POST", _ACK_PATH, json={"delivery_ids": ids})
        return AckResponse.model_validate_json(r.content)

    def _ack_quietly(self, delivery_id: str) -> None:
        """Ack a redelivered duplicate; a failure only means it comes back once more."""
        with contextlib.suppress(httpx.HTTPError):
            self._http.post(_ACK_PATH, json={"delivery_ids": [delivery_id]})

    def lease(
        self,
        max_groups: int = 8,
        wait_s: float = 0.0,
        consumer: str | None = None,
        groups_per_step: int | None = None,
    ) -> LeaseResponse:
        """Lease whole frames without a stream; duplicates are filtered as on the stream."""
        r = self._request(
            "POST",
            "/v1/groups/lease",
            **self._lease_args(max_groups, wait_s, consumer, groups_per_step),
        )
        lease, ack_now = self._leased(r)
        for delivery_id in ack_now:
            self._ack_quietly(delivery_id)
        return lease

    def groups(
        self, max_unacked: int | None = None, consumer: str | None = None
    ) -> Generator[Group, None, None]:
        """Finished groups from the stream, forever; see the module docstring."""
        stream = self._stream(max_unacked, consumer)
        while True:
            request = stream.connection_args()
            try:
                with self._http.stream("GET", STREAM_PATH, **request) as response:
                    if response.status_code >= 400:
                        response.read()
                        stream.refused(response)
                    else:
                        stream.opened(response)
                        for chunk in response.iter_bytes():
                            for arrival in stream.received(chunk):
                                if arrival.ack_now:
                                    self._ack_quietly(arrival.ack_now)
                                if arrival.group is not None:
                                    yield arrival.group
                                    stream.resumed()
                        stream.ended()
            except STREAM_RETRYABLE as exc:
                stream.failed(exc)
            time.sleep(stream.retry_delay())

    def push_weights(self, weights: Weights, version: int) -> WeightsResponse:
        """Upload weights (a state_dict, safetensors bytes, a .safetensors path or a
        `WeightStream`) as `version`.

        Returns once the sampler serves them. A version that does not increase raises
        `ConflictError`; a file the model cannot take raises `InvalidRequest`.
        """
        body = upload(weights)
        try:
            r = self._request(
                "PUT", "/v1/weights", content=body.content(), **self._push_args(body, version)
            )
        except ConflictError as exc:
            if exc.attempts > 1 and self.health().policy_version == version:
                return _landed(version)
            raise
        return WeightsResponse.model_validate_json(r.content)

    def load_weights(self, path: str | Path, version: int) -> WeightsResponse:
        """Have the sampler load a safetensors file or HF checkpoint dir from shared storage."""
        r = self._request("POST", "/v1/weights/load", **self._load_args(path, version))
        return WeightsResponse.model_validate_json(r.content)


class AsyncSamplerClient(ClientCore):
    """The asyncio twin of `SamplerClient`: the same methods, awaitable (`groups()` is an
    async iterator, `aclose()` and `async with` close it)."""

    def __init__(
        self, base_url: str, *, transport: httpx.AsyncBaseTransport | None = None, **kw: Any
    ) -> None:
        super().__init__(base_url, **kw)
        self._http = httpx.AsyncClient(transport=transport, **self._http_options())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSamplerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self, method: str, path: str, *, retry: bool = True, **kw: Any
    ) -> httpx.Response:
        attempts = self._attempts(method, path, retry)
        while True:
            try:
                response = await self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                await asyncio.sleep(attempts.failed(exc))
                continue
            if (delay := attempts.answered(response)) is None:
                return response
            await asyncio.sleep(delay)

    async def health(self) -> Health:
        return Health.model_validate_json((await self._request("GET", "/health")).content)

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def wait_ready(self, timeout_s: float | None = None) -> Health:
        waiting = self._ready_wait(timeout_s)
        while (delay := waiting.answered(await self.ready())) is not None:
            await asyncio.sleep(delay)
        return await self.health()

    async def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = (await self._request("GET", "/v1/config")).json()
        return config

    async def update_config(
        self, expected_version: int | None = None, **knobs: Any
    ) -> dict[str, Any]:
        patch = self._config_patch(knobs, expected_version)
        config: dict[str, Any] = (await self._request("PATCH", "/v1/config", json=patch)).json()
        return config

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = (await self._request("GET", "/v1/stats")).json()
        return stats

    async def events(
        self, since: int = 0, limit: int = 1000, kinds: Iterable[str] = ()
    ) -> dict[str, Any]:
        params = {"since": since, "limit": limit, "kind": list(kinds)}
        events: dict[str, Any] = (await self._request("GET", "/v1/events", params=params)).json()
        return events

    async def ack(self, items: Iterable[Group | str]) -> AckResponse:
        ids = self.dedupe.resolve(items)
        if not ids:
            return AckResponse(acked=0, unknown=0)
        r = await self._request("POST", _ACK_PATH, json={"delivery_ids": ids})
        return AckResponse.model_validate_json(r.content)

    async def _ack_quietly(self, delivery_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post(_ACK_PATH, json={"delivery_ids": [delivery_id]})

    async def lease(
        self,
        max_groups: int = 8,
        wait_s: float = 0.0,
        consumer: str | None = None,
        groups_per_step: int | None = None,
    ) -> LeaseResponse:
        args = self._lease_args(max_groups, wait_s, consumer, groups_per_step)
        r = await self._request("POST", "/v1/groups/lease", **args)
        lease, ack_now = self._leased(r)
        for delivery_id in ack_now:
            await self._ack_quietly(delivery_id)
        return lease

    async def groups(
        self, max_unacked: int | None = None, consumer: str | None = None
    ) -> AsyncGenerator[Group, None]:
        stream = self._stream(max_unacked, consumer)
        while True:
            request = stream.connection_args()
            try:
                async with self._http.stream("GET", STREAM_PATH, **request) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        stream.refused(response)
                    else:
                        stream.opened(response)
                        async for chunk in response.aiter_bytes():
                            for arrival in stream.received(chunk):
                                if arrival.ack_now:
                                    await self._ack_quietly(arrival.ack_now)
                                if arrival.group is not None:
                                    yield arrival.group
                                    stream.resumed()
                        stream.ended()
            except STREAM_RETRYABLE as exc:
                stream.failed(exc)
            await asyncio.sleep(stream.retry_delay())

    async def push_weights(self, weights: Weights, version: int) -> WeightsResponse:
        if isinstance(weights, Mapping):  # serializing a large model must not block the loop
            weights = await asyncio.get_running_loop().run_in_executor(
                None, encode_weights, weights
            )
        body = upload(weights)
        try:
            r = await self._request(
                "PUT", "/v1/weights", content=body.acontent(), **self._push_args(body, version)
            )
        except ConflictError as exc:
            if exc.attempts > 1 and (await self.health()).policy_version == version:
                return _landed(version)
            raise
        return WeightsResponse.model_validate_json(r.content)

    async def load_weights(self, path: str | Path, version: int) -> WeightsResponse:
        r = await self._request("POST", "/v1/weights/load", **self._load_args(path, version))
        return WeightsResponse.model_validate_json(r.content)
