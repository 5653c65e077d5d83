"""HTTP clients for the sampler service: sync `SamplerClient` and `AsyncSamplerClient`.

Both speak the sampler's HTTP API (README, "HTTP API") over httpx and share everything that is not
I/O (`_Core`): URL and header handling, error mapping, duplicate suppression, the
reconnect/watchdog clock and weight encoding. Nothing here imports the server.

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
  instead of hanging forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson

from trainer_client import wire
from trainer_client.protocol import (
    MSGPACK_MEDIA_TYPE,
    NDJSON_MEDIA_TYPE,
    AckResponse,
    Group,
    Health,
    Heartbeat,
    LeaseResponse,
    WeightsResponse,
)

__all__ = [
    "AsyncSamplerClient",
    "AuthError",
    "ConflictError",
    "EngineFailed",
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "SamplerClient",
    "SamplerError",
    "SamplerHTTPError",
    "SamplerUnavailable",
    "ServerError",
    "encode_weights",
]


# -- errors -------------------------------------------------------------------------------
class SamplerError(Exception):
    """Base class of every error this client raises."""


class SamplerUnavailable(SamplerError):
    """The sampler stopped answering: nothing arrived for `waited_s` seconds.

    `waited_for` says what was awaited (e.g. "a heartbeat or group on the stream"),
    `url` where, `attempts` how many connections were tried, and `last_error` the last
    transport error seen, if any.
    """

    def __init__(
        self,
        waited_for: str,
        waited_s: float,
        url: str,
        attempts: int = 0,
        last_error: BaseException | str | None = None,
    ) -> None:
        self.waited_for, self.waited_s, self.url = waited_for, waited_s, url
        self.attempts, self.last_error = attempts, last_error
        msg = f"sampler at {url} unavailable: no {waited_for} for {waited_s:.1f}s"
        if attempts:
            msg += f" ({attempts} connection attempt{'s' if attempts != 1 else ''})"
        if last_error is not None:
            detail = (
                last_error
                if isinstance(last_error, str)
                else f"{type(last_error).__name__}: {last_error}"
            )
            msg += f"; last error: {detail}"
        super().__init__(msg)


class EngineFailed(SamplerError):
    """The sampler answers but its engine has failed: no new groups will come.

    Raised by `groups()` once a heartbeat says the engine failed and nothing more can
    reach this stream: no READY group and no prompt still finishing. Groups leased to
    other consumers are not waited for (their leases may last minutes). Every group
    finished before the failure is delivered first. The message carries the engine's error.
    """


class SamplerHTTPError(SamplerError):
    """The server refused a request; carries the status and its JSON error body."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        method: str = "",
        path: str = "",
    ) -> None:
        self.status, self.code, self.message, self.field = status, code, message, field
        self.method, self.path = method, path
        self.attempts = 1  # requests made, retries included
        where = f"{method} {path}: " if method else ""
        super().__init__(
            f"{where}{status} {code}: {message}" + (f" (field: {field})" if field else "")
        )


class InvalidRequest(SamplerHTTPError):
    """400 or 422: a malformed request or a config/weight file the server rejects."""


class AuthError(SamplerHTTPError):
    """401 or 403: missing or wrong API key."""


class NotFound(SamplerHTTPError):
    """404."""


class ConflictError(SamplerHTTPError):
    """409: e.g. a weight version that does not increase, or a stale config_version."""


class PayloadTooLarge(SamplerHTTPError):
    """413: the body is over the server's limit."""


class ServerError(SamplerHTTPError):
    """5xx other than a transient 502/503/504 (those are retried)."""


_ERROR_TYPES: dict[int, type[SamplerHTTPError]] = {
    400: InvalidRequest,
    401: AuthError,
    403: AuthError,
    404: NotFound,
    409: ConflictError,
    413: PayloadTooLarge,
    422: InvalidRequest,
}
#: Statuses that mean "try again shortly": the server is starting or a proxy hiccuped.
_TRANSIENT = frozenset({502, 503, 504})
#: Transport errors after which a request may be retried (nothing or a whole idempotent
#: request was lost). Timeouts are handled separately: they spend the watchdog.
_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _http_error(response: httpx.Response, attempts: int = 1) -> SamplerHTTPError:
    """The typed error for a 4xx/5xx response, message and field from its error body."""
    try:
        body = orjson.loads(response.content)
        err = body["error"]
        code, message, field = (
            str(err.get("code", "error")),
            str(err.get("message", "")),
            err.get("field"),
        )
    except Exception:  # not our JSON error body (a proxy's page, an empty reply)  # noqa: BLE001
        code, message, field = "http_error", response.text[:500] or response.reason_phrase, None
    cls = _ERROR_TYPES.get(
        response.status_code, ServerError if response.status_code >= 500 else SamplerHTTPError
    )
    error = cls(
        response.status_code,
        code,
        message,
        field,
        response.request.method,
        response.request.url.path,
    )
    error.attempts = attempts
    return error


# -- weights -------------------------------------------------------------------------------
def encode_weights(state_dict: Mapping[str, Any]) -> bytes:
    """A safetensors file of a model's `state_dict()` (tensor names as the model has them).

    Tensors that share storage (tied embeddings) are written once, under their first
    name; the server loads a subset of tensors as a partial update.
    """
    import torch
    from safetensors.torch import save

    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state_dict.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.to("cpu").contiguous()
    return save(out)


@dataclass(frozen=True)
class WeightStream:
    """A weights body made piece by piece (`length` bytes from `chunks()`): uploaded as it
    is produced, never built whole in memory."""

    length: int
    chunks: Callable[[], Iterator[bytes]]


def _weights_body(
    weights: Mapping[str, Any] | str | Path | bytes | WeightStream,
) -> tuple[Any, int | None]:
    """(content, length) for a PUT /v1/weights: bytes in memory, a file streamed from disk,
    or a `WeightStream`."""
    if isinstance(weights, WeightStream):
        return weights, weights.length
    if isinstance(weights, bytes | bytearray):
        return bytes(weights), len(weights)
    if isinstance(weights, str | Path):
        path = Path(weights)
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if len(files) != 1:
                raise ValueError(
                    f"{path} holds {len(files)} .safetensors files; push one file, or use "
                    "load_weights() to load a sharded checkpoint from shared storage"
                )
            path = files[0]
        return path, path.stat().st_size
    return encode_weights(weights), None


def _file_chunks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with path.open("rb") as fh:
        while chunk := fh.read(size):
            yield chunk


async def _afile_chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    with path.open("rb") as fh:
        while chunk := await loop.run_in_executor(None, fh.read, size):
            yield chunk


# -- what sync and async share --------------------------------------------------------------
class _Dedupe:
    """At-least-once -> exactly-once for the caller, by group id.

    `held` maps a group the caller has been given but not acked to its newest delivery
    id; `acked` remembers recently acked group ids (bounded) so that a redelivery of one
    (its ack was lost with a connection) is acked again and dropped.
    """

    def __init__(self, remember: int = 100_000) -> None:
        self.held: dict[str, str] = {}
        self.acked: OrderedDict[str, None] = OrderedDict()
        self.remember = remember
        self.duplicates = 0

    def admit(self, group: Group) -> tuple[bool, str | None]:
        """(give it to the caller?, delivery id to ack right away)."""
        gid, did = group.group_id, group.delivery_id or ""
        if gid in self.acked:
            self.duplicates += 1
            return False, did or None
        if gid in self.held:
            self.duplicates += 1
            if did:
                self.held[gid] = did
            return False, None
        self.held[gid] = did
        return True, None

    def resolve(self, items: Iterable[Group | str]) -> list[str]:
        """Delivery ids to ack for groups (their newest delivery) or raw delivery ids."""
        ids: list[str] = []
        for item in items:
            if isinstance(item, str):
                ids.append(item)
                continue
            did = self.held.pop(item.group_id, None) or item.delivery_id
            self.acked[item.group_id] = None
            while len(self.acked) > self.remember:
                self.acked.popitem(last=False)
            if did:
                ids.append(did)
        return ids


class _LineDecoder:
    """NDJSON split on bytes (no text decoding of ~100 KB lines); feed() returns messages."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[Any]:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        return [orjson.loads(line) for line in lines if line.strip()]


class _MsgpackDecoder:
    def __init__(self) -> None:
        self._unpacker = wire.stream_decoder()

    def feed(self, chunk: bytes) -> list[Any]:
        self._unpacker.feed(chunk)
        return list(self._unpacker)


def _decoder(response: httpx.Response) -> _LineDecoder | _MsgpackDecoder:
    """Decode what the server sent (by its Content-Type), whatever was asked for."""
    if response.headers.get("content-type", "").startswith(MSGPACK_MEDIA_TYPE):
        return _MsgpackDecoder()
    return _LineDecoder()


def _lease_response(response: httpx.Response) -> LeaseResponse:
    if response.headers.get("content-type", "").startswith(MSGPACK_MEDIA_TYPE):
        return LeaseResponse.model_validate(wire.unpack(response.content))
    return LeaseResponse.model_validate_json(response.content)


class _Backoff:
    """Exponential backoff with jitter: uniform in [base/2, min(cap, base * 2**attempt)]."""

    def __init__(self, base: float = 0.2, cap: float = 5.0) -> None:
        self.base, self.cap, self.attempt = base, cap, 0

    def next(self) -> float:
        delay = random.uniform(self.base / 2, min(self.cap, self.base * 2**self.attempt))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


class _Attempts:
    """Retry bookkeeping of one plain request, shared by the sync and async clients.

    Sans-I/O: the caller performs the request and sleeps; this decides. `answered` and
    `failed` return the delay before the next try (None: the response is the answer) or
    raise the error to report (a typed 4xx/5xx, or SamplerUnavailable once the watchdog
    is spent).
    """

    def __init__(self, client: Any, method: str, path: str, retry: bool) -> None:
        self.client, self.retry = client, retry
        self.what = f"reply to {method} {path}"
        self.started, self.count = time.monotonic(), 0
        self.backoff = _Backoff(*client.backoff_s)

    def answered(self, response: httpx.Response) -> float | None:
        self.count += 1
        if response.status_code < 400:
            return None
        error = _http_error(response, self.count)
        if response.status_code not in _TRANSIENT or not self.retry:
            raise error
        return self._delay(error)

    def failed(self, exc: httpx.TransportError) -> float:
        self.count += 1
        if (
            isinstance(exc, httpx.TimeoutException)
            or not isinstance(exc, _RETRYABLE)
            or not self.retry
        ):
            raise self.client._unavailable(self.what, self.started, self.count, exc) from exc  # noqa: SLF001
        return self._delay(exc)

    def _delay(self, error: Any) -> float:
        delay = self.backoff.next()
        if time.monotonic() + delay - self.started > self.client.watchdog_s:
            raise self.client._unavailable(self.what, self.started, self.count, error)  # noqa: SLF001
        return delay


def default_consumer_name() -> str:
    """`<host>-<pid>-<6 hex>`: two trainers never share a name by accident."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class _Core:
    """Configuration and the I/O-free logic shared by both clients."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        consumer: str | None = None,
        max_unacked: int = 8,
        watchdog_s: float = 60.0,
        heartbeat_s: float | None = None,
        timeout_s: float = 30.0,
        weights_timeout_s: float = 600.0,
        backoff_s: tuple[float, float] = (0.2, 5.0),
        encoding: Literal["msgpack", "json"] = "msgpack",
    ) -> None:
        if watchdog_s <= 0:
            raise ValueError("watchdog_s must be positive")
        self.base_url = base_url.rstrip("/")
        self.consumer = consumer or default_consumer_name()
        self.max_unacked = max_unacked
        self.watchdog_s = watchdog_s
        # Heartbeats must come well inside the watchdog, or an idle but healthy sampler
        # would look dead.
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else min(5.0, watchdog_s / 4)
        self.timeout_s = timeout_s
        self.weights_timeout_s = weights_timeout_s
        self.backoff_s = backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Groups and leases come as msgpack (a third of JSON's bytes, half its decoding
        # time) unless "json" is asked for; either way the same Group objects result.
        self.accept = {"msgpack": MSGPACK_MEDIA_TYPE, "json": NDJSON_MEDIA_TYPE}[encoding]
        self.dedupe = _Dedupe()
        #: The newest heartbeat seen on the stream (policy/config version, queue depths).
        self.last_heartbeat: Heartbeat | None = None
        #: Stream connections opened so far (1 + reconnects).
        self.connections = 0

    @property
    def duplicates_dropped(self) -> int:
        return self.dedupe.duplicates

    def _stream_params(self, max_unacked: int | None, consumer: str | None) -> dict[str, Any]:
        return {
            "consumer": consumer or self.consumer,
            "max_unacked": max_unacked or self.max_unacked,
            "heartbeat_s": self.heartbeat_s,
        }

    # Stream connections wait at most the watchdog's remaining time for anything (connect,
    # headers, each read). A read that times out early, because a reconnect started with
    # little time left, reconnects; only a silence of watchdog_s raises.
    def _watchdog_fired(self, last_seen: float) -> bool:
        return time.monotonic() - last_seen >= self.watchdog_s * 0.999

    def _retry_delay(self, backoff: _Backoff, last_seen: float) -> float:
        return min(backoff.next(), max(self.watchdog_s - (time.monotonic() - last_seen), 0.0))

    def _refused(self, response: httpx.Response, busy_since: float | None) -> SamplerHTTPError:
        """A stream refused with a status: transient ones are returned (retry), others raised.

        `consumer_busy` (409) is transient for 2 heartbeats + 5 s since it was first seen:
        after a lost connection the server may not have let go of the old stream yet.
        """
        error = _http_error(response)
        if response.status_code in _TRANSIENT:
            return error
        if error.code == "consumer_busy" and (
            busy_since is None or time.monotonic() - busy_since < 2 * self.heartbeat_s + 5.0
        ):
            return error
        raise error

    @staticmethod
    def _busy_since(error: Any, busy_since: float | None) -> float | None:
        """When the current run of `consumer_busy` refusals began, or None if not in one."""
        if getattr(error, "code", None) != "consumer_busy":
            return None
        return busy_since if busy_since is not None else time.monotonic()

    def _message(self, msg: Any) -> Group | None:
        """A group to hand on, or None (a heartbeat or an unknown message type)."""
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "group":
            return Group.model_validate(msg["group"])
        if kind == "heartbeat":
            self.last_heartbeat = Heartbeat.model_validate(msg)
            beat = self.last_heartbeat
            # Only what this consumer can still receive counts: groups leased to other
            # consumers may never come back to READY (or only when their lease expires).
            if beat.engine_error and not beat.ready and not beat.active_prompts:
                raise EngineFailed(
                    f"sampler at {self.base_url}: engine failed: {beat.engine_error}"
                )
        return None

    def _arrivals(
        self, decoder: _LineDecoder | _MsgpackDecoder, chunk: bytes
    ) -> Iterator[tuple[Group | None, str | None]]:
        """For each group in `chunk`: (the group if it is new, else None; a delivery id to ack now)."""
        for msg in decoder.feed(chunk):
            group = self._message(msg)
            if group is not None:
                fresh, ack_now = self.dedupe.admit(group)
                yield (group if fresh else None), ack_now

    def _unavailable(
        self, waited_for: str, since: float, attempts: int, error: Any
    ) -> SamplerUnavailable:
        return SamplerUnavailable(
            waited_for, time.monotonic() - since, self.base_url, attempts, error
        )

    @staticmethod
    def _config_patch(knobs: dict[str, Any], expected_version: int | None) -> dict[str, Any]:
        patch = dict(knobs)
        if expected_version is not None:
            patch["config_version"] = expected_version
        return patch


_STREAM_WAIT = "heartbeat or group on the stream"


class SamplerClient(_Core):
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
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=self.headers,
            timeout=self.timeout_s,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SamplerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain requests -----------------------------------------------------------------
    def _request(self, method: str, path: str, *, retry: bool = True, **kw: Any) -> httpx.Response:
        """One request; transient failures are retried with backoff for up to `watchdog_s`."""
        attempts = _Attempts(self, method, path, retry)
        while True:
            try:
                response = self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                delay = attempts.failed(exc)
            else:
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
        limit = self.watchdog_s if timeout_s is None else timeout_s
        started, backoff, attempts = time.monotonic(), _Backoff(*self.backoff_s), 0
        while True:
            attempts += 1
            if self.ready():
                return self.health()
            if time.monotonic() - started > limit:
                raise self._unavailable("200 from /ready", started, attempts, None)
            time.sleep(min(backoff.next(), 1.0))

    def get_config(self) -> dict[str, Any]:
        """The live sampler config, flat keys plus `config_version`."""
        return self._request("GET", "/v1/config").json()

    def update_config(self, expected_version: int | None = None, **knobs: Any) -> dict[str, Any]:
        """PATCH the config (`update_config(k_pos=4, n_max=16)`); returns the new config.

        With `expected_version`, the server refuses (409) if someone else changed it first.
        Invalid values raise `InvalidRequest` whose `field` names the knob.
        """
        return self._request(
            "PATCH", "/v1/config", json=self._config_patch(knobs, expected_version)
        ).json()

    def stats(self) -> dict[str, Any]:
        return self._request("GET", "/v1/stats").json()

    def events(self, since: int = 0, limit: int = 1000) -> dict[str, Any]:
        """Event log entries after `since`: `{"events": [...], "last_seq": N}`, oldest first."""
        return self._request("GET", "/v1/events", params={"since": since, "limit": limit}).json()

    # -- groups -------------------------------------------------------------------------
    def ack(self, items: Iterable[Group | str]) -> AckResponse:
        """Ack groups (by their newest delivery id) or raw delivery ids. Idempotent."""
        ids = self.dedupe.resolve(items)
        if not ids:
            return AckResponse(acked=0, unknown=0)
        return AckResponse.model_validate_json(
            self._request("POST", "/v1/groups/ack", json={"delivery_ids": ids}).content
        )

    def _ack_quietly(self, delivery_id: str) -> None:
        """Ack a redelivered duplicate; a failure only means it comes back once more."""
        with contextlib.suppress(httpx.HTTPError):
            self._http.post("/v1/groups/ack", json={"delivery_ids": [delivery_id]})

    def lease(
        self, max_groups: int = 8, wait_s: float = 0.0, consumer: str | None = None
    ) -> LeaseResponse:
        """Lease whole frames without a stream; duplicates are filtered as on the stream."""
        body = {"max_groups": max_groups, "wait_s": wait_s, "consumer": consumer or self.consumer}
        r = self._request(
            "POST",
            "/v1/groups/lease",
            json=body,
            headers={"Accept": self.accept},
            timeout=self.timeout_s + wait_s,
        )
        lease = _lease_response(r)
        keep = []
        for group in lease.groups:
            fresh, ack_now = self.dedupe.admit(group)
            if ack_now:
                self._ack_quietly(ack_now)
            if fresh:
                keep.append(group)
        lease.groups = keep
        return lease

    def groups(
        self, max_unacked: int | None = None, consumer: str | None = None
    ) -> Iterator[Group]:
        """Finished groups from the stream, forever; see the module docstring.

        Time the caller spends between two groups does not count against the watchdog.
        """
        params = self._stream_params(max_unacked, consumer)
        last_seen = time.monotonic()  # last heartbeat or group, or the caller's return
        backoff, attempts, error = _Backoff(*self.backoff_s), 0, None
        busy_since: float | None = None
        while True:
            remaining = self.watchdog_s - (time.monotonic() - last_seen)
            if remaining <= 0:
                raise self._unavailable(_STREAM_WAIT, last_seen, attempts, error)
            attempts += 1
            try:
                with self._http.stream(
                    "GET",
                    "/v1/groups/stream",
                    params=params,
                    headers={"Accept": self.accept},
                    timeout=httpx.Timeout(remaining),
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        error = self._refused(response, busy_since)
                        busy_since = self._busy_since(error, busy_since)
                    else:
                        busy_since = None
                        self.connections += 1
                        decoder = _decoder(response)
                        for chunk in response.iter_bytes():
                            last_seen = time.monotonic()
                            backoff.reset()
                            for group, ack_now in self._arrivals(decoder, chunk):
                                if ack_now:
                                    self._ack_quietly(ack_now)
                                if group is not None:
                                    yield group
                                    last_seen = max(last_seen, time.monotonic())
                        error = "the server ended the stream"
            except httpx.TimeoutException as exc:
                error = exc
                if self._watchdog_fired(last_seen):
                    raise self._unavailable(_STREAM_WAIT, last_seen, attempts, exc) from exc
            except _RETRYABLE as exc:
                error = exc
            time.sleep(self._retry_delay(backoff, last_seen))

    # -- weights ------------------------------------------------------------------------
    def push_weights(
        self, weights: Mapping[str, Any] | str | Path | bytes | WeightStream, version: int
    ) -> WeightsResponse:
        """Upload weights (a state_dict, safetensors bytes, a .safetensors path or a
        `WeightStream`) as `version`.

        Returns once the sampler serves them. A version that does not increase raises
        `ConflictError`; a file the model cannot take raises `InvalidRequest`.
        """
        content, length = _weights_body(weights)
        headers = {"Content-Type": "application/octet-stream"}
        if isinstance(content, Path | WeightStream):
            headers["Content-Length"] = str(length)
            content = _file_chunks(content) if isinstance(content, Path) else content.chunks()
        try:
            r = self._request(
                "PUT",
                "/v1/weights",
                params={"version": version},
                content=content,
                headers=headers,
                timeout=self.weights_timeout_s,
                retry=not isinstance(content, Iterator),
            )
        except ConflictError as exc:
            # A retried upload whose first attempt landed (its reply was lost) is a success.
            if exc.attempts > 1 and self.health().policy_version == version:
                return WeightsResponse(policy_version=version, tensors=0, load_s=0.0)
            raise
        return WeightsResponse.model_validate_json(r.content)

    def load_weights(self, path: str | Path, version: int) -> WeightsResponse:
        """Have the sampler load a safetensors file or HF checkpoint dir from shared storage."""
        r = self._request(
            "POST",
            "/v1/weights/load",
            json={"path": str(path), "version": version},
            timeout=self.weights_timeout_s,
        )
        return WeightsResponse.model_validate_json(r.content)


class AsyncSamplerClient(_Core):
    """The asyncio twin of `SamplerClient` (same methods, awaitable; `groups()` is async)."""

    def __init__(
        self, base_url: str, *, transport: httpx.AsyncBaseTransport | None = None, **kw: Any
    ) -> None:
        super().__init__(base_url, **kw)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=self.headers,
            timeout=self.timeout_s,
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSamplerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self, method: str, path: str, *, retry: bool = True, **kw: Any
    ) -> httpx.Response:
        attempts = _Attempts(self, method, path, retry)
        while True:
            try:
                response = await self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                delay = attempts.failed(exc)
            else:
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
        limit = self.watchdog_s if timeout_s is None else timeout_s
        started, backoff, attempts = time.monotonic(), _Backoff(*self.backoff_s), 0
        while True:
            attempts += 1
            if await self.ready():
                return await self.health()
            if time.monotonic() - started > limit:
                raise self._unavailable("200 from /ready", started, attempts, None)
            await asyncio.sleep(min(backoff.next(), 1.0))

    async def get_config(self) -> dict[str, Any]:
        return (await self._request("GET", "/v1/config")).json()

    async def update_config(
        self, expected_version: int | None = None, **knobs: Any
    ) -> dict[str, Any]:
        patch = self._config_patch(knobs, expected_version)
        return (await self._request("PATCH", "/v1/config", json=patch)).json()

    async def stats(self) -> dict[str, Any]:
        return (await self._request("GET", "/v1/stats")).json()

    async def ack(self, items: Iterable[Group | str]) -> AckResponse:
        ids = self.dedupe.resolve(items)
        if not ids:
            return AckResponse(acked=0, unknown=0)
        r = await self._request("POST", "/v1/groups/ack", json={"delivery_ids": ids})
        return AckResponse.model_validate_json(r.content)

    async def _ack_quietly(self, delivery_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post("/v1/groups/ack", json={"delivery_ids": [delivery_id]})

    async def lease(
        self, max_groups: int = 8, wait_s: float = 0.0, consumer: str | None = None
    ) -> LeaseResponse:
        body = {"max_groups": max_groups, "wait_s": wait_s, "consumer": consumer or self.consumer}
        r = await self._request(
            "POST",
            "/v1/groups/lease",
            json=body,
            headers={"Accept": self.accept},
            timeout=self.timeout_s + wait_s,
        )
        lease = _lease_response(r)
        keep = []
        for group in lease.groups:
            fresh, ack_now = self.dedupe.admit(group)
            if ack_now:
                await self._ack_quietly(ack_now)
            if fresh:
                keep.append(group)
        lease.groups = keep
        return lease

    async def groups(
        self, max_unacked: int | None = None, consumer: str | None = None
    ) -> AsyncIterator[Group]:
        params = self._stream_params(max_unacked, consumer)
        last_seen = time.monotonic()
        backoff, attempts, error = _Backoff(*self.backoff_s), 0, None
        busy_since: float | None = None
        while True:
            remaining = self.watchdog_s - (time.monotonic() - last_seen)
            if remaining <= 0:
                raise self._unavailable(_STREAM_WAIT, last_seen, attempts, error)
            attempts += 1
            try:
                async with self._http.stream(
                    "GET",
                    "/v1/groups/stream",
                    params=params,
                    headers={"Accept": self.accept},
                    timeout=httpx.Timeout(remaining),
                ) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        error = self._refused(response, busy_since)
                        busy_since = self._busy_since(error, busy_since)
                    else:
                        busy_since = None
                        self.connections += 1
                        decoder = _decoder(response)
                        async for chunk in response.aiter_bytes():
                            last_seen = time.monotonic()
                            backoff.reset()
                            for group, ack_now in self._arrivals(decoder, chunk):
                                if ack_now:
                                    await self._ack_quietly(ack_now)
                                if group is not None:
                                    yield group
                                    last_seen = max(last_seen, time.monotonic())
                        error = "the server ended the stream"
            except httpx.TimeoutException as exc:
                error = exc
                if self._watchdog_fired(last_seen):
                    raise self._unavailable(_STREAM_WAIT, last_seen, attempts, exc) from exc
            except _RETRYABLE as exc:
                error = exc
            await asyncio.sleep(self._retry_delay(backoff, last_seen))

    async def push_weights(
        self, weights: Mapping[str, Any] | str | Path | bytes, version: int
    ) -> WeightsResponse:
        if isinstance(weights, WeightStream):
            raise TypeError("a WeightStream is uploaded with SamplerClient.push_weights")
        loop = asyncio.get_running_loop()
        if isinstance(weights, Mapping):  # serializing a large model must not block the loop
            weights = await loop.run_in_executor(None, encode_weights, weights)
        content, length = _weights_body(weights)
        headers = {"Content-Type": "application/octet-stream"}
        streamed = isinstance(content, Path)
        if streamed:
            headers["Content-Length"] = str(length)
            content = _afile_chunks(content)
        try:
            r = await self._request(
                "PUT",
                "/v1/weights",
                params={"version": version},
                content=content,
                headers=headers,
                timeout=self.weights_timeout_s,
                retry=not streamed,
            )
        except ConflictError as exc:
            if exc.attempts > 1 and (await self.health()).policy_version == version:
                return WeightsResponse(policy_version=version, tensors=0, load_s=0.0)
            raise
        return WeightsResponse.model_validate_json(r.content)

    async def load_weights(self, path: str | Path, version: int) -> WeightsResponse:
        r = await self._request(
            "POST",
            "/v1/weights/load",
            json={"path": str(path), "version": version},
            timeout=self.weights_timeout_s,
        )
        return WeightsResponse.model_validate_json(r.content)
