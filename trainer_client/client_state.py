"""What the sync and async sampler clients decide, without any I/O of their own.

Each twin in `trainer_client.client` sends requests, reads bytes and sleeps; the objects
here say what a response, a chunk or a failure means and what to do next, so the two
twins cannot drift apart:

- `ClientCore`: the settings (URL, API key, consumer name, watchdog, timeouts, encoding,
  the wire features declared)
  and what a client learns across calls (the duplicate filter, the newest heartbeat,
  the stream connections opened);
- `StreamState`: one `groups()` call: reconnects with backoff and jitter, the watchdog,
  the grace for `consumer_busy`, decoding, duplicate suppression and engine failure;
- `RequestAttempts`: one plain request's retries (transient statuses and transport
  errors, bounded by the watchdog);
- `ReadyWait`: polling `/ready` until it answers 200 or the time is up.

The rules (module docstring of `trainer_client.client` for the stream's):

- delivery is at-least-once: a group id already acked is acked again and dropped; a group
  id the caller holds unacked is dropped and its newest delivery id is kept for `ack()`;
- a stream waits at most the watchdog's remaining time for anything (connect, headers,
  each read); a read that times out early, because a reconnect started with little time
  left, reconnects; only a silence of `watchdog_s` raises `SamplerUnavailable`;
- `consumer_busy` (409) is retried for 2 heartbeats + 5 s since first seen: after a lost
  connection the server may not have let go of the old stream yet.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson

from trainer_client.contract import wire
from trainer_client.contract.features import QUERY_PARAM as FEATURES_PARAM
from trainer_client.contract.features import query_value as features_query_value
from trainer_client.contract.protocol import (
    MSGPACK_MEDIA_TYPE,
    NDJSON_MEDIA_TYPE,
    Group,
    Heartbeat,
    LeaseResponse,
)
from trainer_client.exceptions import (
    EngineFailed,
    SamplerHTTPError,
    SamplerUnavailable,
    http_error,
)
from trainer_client.uploads import Upload

#: Statuses that mean "try again shortly": the server is starting or a proxy hiccuped.
TRANSIENT = frozenset({502, 503, 504})
#: Transport errors after which a request may be retried (nothing or a whole idempotent
#: request was lost). Timeouts are handled apart: they spend the watchdog.
RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
#: What ends one stream connection without ending `groups()`.
STREAM_RETRYABLE = (httpx.TimeoutException, *RETRYABLE)

STREAM_PATH = "/v1/groups/stream"
_STREAM_WAIT = "heartbeat or group on the stream"
#: What holds admission up that a consumer can release (an ack, a declared step, a knob).
_BOUNDS = ("max_staleness", "max_buffered_groups")
#: A stream that got no group for this long while a bound held admission says so once.
ADMISSION_WARNING_S = 5.0

log = logging.getLogger("trainer_client")


def default_consumer_name() -> str:
    """`<host>-<pid>-<6 hex>`: two trainers never share a name by accident."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Backoff:
    """Exponential backoff with jitter: uniform in [base/2, min(cap, base * 2**attempt)]."""

    def __init__(self, base: float = 0.2, cap: float = 5.0) -> None:
        self.base, self.cap, self.attempt = base, cap, 0

    def next(self) -> float:
        delay = random.uniform(self.base / 2, min(self.cap, self.base * 2**self.attempt))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


class Dedupe:
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
    def __init__(self, arrays: bool) -> None:
        self._unpacker = wire.stream_decoder(arrays=arrays)

    def feed(self, chunk: bytes) -> list[Any]:
        self._unpacker.feed(chunk)
        return list(self._unpacker)


def _is_msgpack(response: httpx.Response) -> bool:
    """Decode what the server sent (by its Content-Type), whatever was asked for."""
    return response.headers.get("content-type", "").startswith(MSGPACK_MEDIA_TYPE)


def _unavailable(
    core: ClientCore,
    waited_for: str,
    since: float,
    attempts: int,
    error: BaseException | str | None,
) -> SamplerUnavailable:
    return SamplerUnavailable(waited_for, time.monotonic() - since, core.base_url, attempts, error)


@dataclass(frozen=True)
class Arrival:
    """What one message of the stream asks of the client: hand `group` to the caller
    (None: nothing new), and ack `ack_now` at once (a redelivered, already acked group)."""

    group: Group | None
    ack_now: str | None


class ClientCore:
    """The settings and the I/O-free logic that the sync and async clients share."""

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
        groups_per_step: int | None = None,
        features: Iterable[str] = (),
        arrays: bool = False,
    ) -> None:
        if watchdog_s <= 0:
            raise ValueError("watchdog_s must be positive")
        if arrays and encoding != "msgpack":
            raise ValueError("arrays=True needs the msgpack encoding (JSON carries lists)")
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
        #: Groups the caller trains on per step, declared on each stream and lease: the
        #: sampler's max_staleness counts in steps, and without it a step is one frame.
        self.groups_per_step = groups_per_step
        #: The wire features this consumer handles (`trainer_client.contract.features`),
        #: declared on each stream and lease; e.g. `no_text`: groups come without texts.
        #: An unknown name is a ValueError here, not a 422 at the first request.
        self.features = features_query_value(features)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Groups and leases come as msgpack (a third of JSON's bytes, half its decoding
        # time) unless "json" is asked for; either way the same Group objects result.
        self.accept = {"msgpack": MSGPACK_MEDIA_TYPE, "json": NDJSON_MEDIA_TYPE}[encoding]
        #: Groups' token ids, logprobs, token weights and loss masks as read-only numpy
        #: arrays instead of lists: a 700-token answer then costs the consumer about a
        #: third of the CPU (no Python number per token to make, validate and free), and
        #: `torch.from_numpy` takes them as they are. Test lengths with `len`, not `bool`.
        self.arrays = arrays
        self.dedupe = Dedupe()
        #: The newest heartbeat seen on the stream (policy/config version, queue depths).
        self.last_heartbeat: Heartbeat | None = None
        #: Stream connections opened so far (1 + reconnects).
        self.connections = 0
        #: Whether this client said that its stream waits on an admission bound.
        self.admission_warned = False

    @property
    def duplicates_dropped(self) -> int:
        return self.dedupe.duplicates

    def _stream(self, max_unacked: int | None, consumer: str | None) -> StreamState:
        """The state of one `groups()` call."""
        return StreamState(
            self,
            {
                "consumer": consumer or self.consumer,
                "max_unacked": max_unacked or self.max_unacked,
                "heartbeat_s": self.heartbeat_s,
                **self._query_params(None),
            },
        )

    def _query_params(self, groups_per_step: int | None) -> dict[str, int | str]:
        """What a stream or lease declares: the step size and the features handled."""
        step = groups_per_step or self.groups_per_step
        params: dict[str, int | str] = {"groups_per_step": step} if step else {}
        if self.features:
            params[FEATURES_PARAM] = self.features
        return params

    def _http_options(self) -> dict[str, Any]:
        """What both twins build their httpx client with, the transport aside."""
        return {"base_url": self.base_url, "headers": self.headers, "timeout": self.timeout_s}

    def _attempts(self, method: str, path: str, retry: bool) -> RequestAttempts:
        return RequestAttempts(self, method, path, retry)

    def _ready_wait(self, timeout_s: float | None) -> ReadyWait:
        return ReadyWait(self, self.watchdog_s if timeout_s is None else timeout_s)

    def _lease_args(
        self, max_groups: int, wait_s: float, consumer: str | None, groups_per_step: int | None
    ) -> dict[str, Any]:
        """The request arguments of `POST /v1/groups/lease` but the method and path."""
        body = {"max_groups": max_groups, "wait_s": wait_s, "consumer": consumer or self.consumer}
        return {
            "json": body,
            "params": self._query_params(groups_per_step),
            "headers": {"Accept": self.accept},
            "timeout": self.timeout_s + wait_s,
        }

    def _push_args(self, body: Upload, version: int) -> dict[str, Any]:
        """The request arguments of `PUT /v1/weights` but the method, path and content:
        a body that is a stream is sent once, never retried."""
        return {
            "params": {"version": version},
            "headers": body.headers,
            "timeout": self.weights_timeout_s,
            "retry": body.repeatable,
        }

    def _load_args(self, path: str | Path, version: int) -> dict[str, Any]:
        """The request arguments of `POST /v1/weights/load` but the method and path."""
        return {"json": {"path": str(path), "version": version}, "timeout": self.weights_timeout_s}

    def _leased(self, response: httpx.Response) -> tuple[LeaseResponse, list[str]]:
        """A lease's groups without the duplicates, and the delivery ids to ack at once
        (duplicates are filtered as on the stream)."""
        if _is_msgpack(response):
            lease = LeaseResponse.model_validate(wire.unpack(response.content, arrays=self.arrays))
        else:
            lease = LeaseResponse.model_validate_json(response.content)
        keep, ack_now = [], []
        for group in lease.groups:
            fresh, ack = self.dedupe.admit(group)
            if ack:
                ack_now.append(ack)
            if fresh:
                keep.append(group)
        lease.groups = keep
        return lease, ack_now

    @staticmethod
    def _config_patch(knobs: dict[str, Any], expected_version: int | None) -> dict[str, Any]:
        patch = dict(knobs)
        if expected_version is not None:
            patch["config_version"] = expected_version
        return patch


class StreamState:
    """One `groups()` call: the client connects, feeds what it reads and reports how a
    connection ended; this decides what is handed on, acked, retried or raised.

    The twin's loop: `connection_args()` (the request, its timeout the time the
    connection may take, or `SamplerUnavailable`), then `refused(response)` for a status >= 400 (its body read)
    or `opened(response)` and `received(chunk)` for each chunk, `resumed()` after the
    caller took a group, `ended()` when the server closed the stream, `failed(exc)` for a
    `STREAM_RETRYABLE` error, and `retry_delay()` before the next connection.
    """

    def __init__(self, core: ClientCore, params: dict[str, Any]) -> None:
        self.core, self.params = core, params
        self.headers = {"Accept": core.accept}
        self.last_seen = time.monotonic()  # last heartbeat or group, or the caller's return
        self.backoff = Backoff(*core.backoff_s)
        self.attempts = 0
        self.error: BaseException | str | None = None
        self.busy_since: float | None = None
        #: When the caller last got a group (or the stream began).
        self.last_group = time.monotonic()
        self._decoder: _LineDecoder | _MsgpackDecoder = _LineDecoder()

    def _silence(self) -> float:
        return time.monotonic() - self.last_seen

    def connecting(self) -> float:
        """Seconds the next connection may wait for anything (connect, headers, each read)."""
        remaining = self.core.watchdog_s - self._silence()
        if remaining <= 0:
            raise _unavailable(self.core, _STREAM_WAIT, self.last_seen, self.attempts, self.error)
        self.attempts += 1
        return remaining

    def connection_args(self) -> dict[str, Any]:
        """The next connection's request arguments but the method and path: its timeout is
        `connecting()`, so this raises once the watchdog has run out."""
        timeout = httpx.Timeout(self.connecting())
        return {"params": self.params, "headers": self.headers, "timeout": timeout}

    def refused(self, response: httpx.Response) -> None:
        """A stream refused with a status: transient ones are retried, others raised."""
        error = http_error(response)
        now = time.monotonic()
        if error.code != "consumer_busy":
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = now
        in_grace = (
            self.busy_since is not None and now - self.busy_since < 2 * self.core.heartbeat_s + 5.0
        )
        if response.status_code not in TRANSIENT and not in_grace:
            raise error
        self.error = error

    def opened(self, response: httpx.Response) -> None:
        self.busy_since = None
        self.core.connections += 1
        self._decoder = (
            _MsgpackDecoder(self.core.arrays) if _is_msgpack(response) else _LineDecoder()
        )

    def received(self, chunk: bytes) -> list[Arrival]:
        """What `chunk` completes: one arrival per group message (heartbeats are noted)."""
        self.last_seen = time.monotonic()
        self.backoff.reset()
        arrivals = []
        for message in self._decoder.feed(chunk):
            group = self._message(message)
            if group is not None:
                fresh, ack_now = self.core.dedupe.admit(group)
                arrivals.append(Arrival(group if fresh else None, ack_now))
                if fresh:
                    self.last_group = self.last_seen
        return arrivals

    def resumed(self) -> None:
        """The caller is back from a group: time it spent does not count as silence."""
        self.last_seen = max(self.last_seen, time.monotonic())

    def ended(self) -> None:
        self.error = "the server ended the stream"

    def failed(self, exc: httpx.TransportError) -> None:
        """A connection failed; only a timeout after a silence of `watchdog_s` raises."""
        self.error = exc
        if isinstance(exc, httpx.TimeoutException) and (
            self._silence() >= self.core.watchdog_s * 0.999
        ):
            raise _unavailable(self.core, _STREAM_WAIT, self.last_seen, self.attempts, exc) from exc

    def retry_delay(self) -> float:
        return min(self.backoff.next(), max(self.core.watchdog_s - self._silence(), 0.0))

    def _message(self, msg: Any) -> Group | None:
        """A group to hand on, or None (a heartbeat or an unknown message type)."""
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "group":
            return Group.model_validate(msg["group"])
        if kind == "heartbeat":
            beat = self.core.last_heartbeat = Heartbeat.model_validate(msg)
            # Only what this consumer can still receive counts: groups leased to other
            # consumers may never come back to READY (or only when their lease expires).
            if beat.engine_error and not beat.ready and not beat.active_prompts:
                raise EngineFailed(
                    f"sampler at {self.core.base_url}: engine failed: {beat.engine_error}"
                )
            self._check_admission(beat)
        return None

    def _check_admission(self, beat: Heartbeat) -> None:
        """Say once when this stream gets nothing because the sampler's admission waits on
        a bound that only a consumer can release: otherwise heartbeats keep the watchdog
        quiet and the caller waits forever, silently."""
        wait = beat.admission
        if self.core.admission_warned or wait is None or wait.blocked_by not in _BOUNDS:
            return
        idle = time.monotonic() - self.last_group
        if idle < ADMISSION_WARNING_S or beat.time - wait.since < ADMISSION_WARNING_S:
            return
        self.core.admission_warned = True
        log.warning(
            "sampler at %s: no group for %.0f s, and no prompt admitted: admission waits "
            "on %s (%s); this consumer holds %d groups unacked",
            self.core.base_url,
            idle,
            wait.blocked_by,
            wait.detail,
            beat.unacked,
        )


class RequestAttempts:
    """The retries of one plain request.

    The caller performs the request and sleeps; `answered` and `failed` return the delay
    before the next try (None: the response is the answer) or raise the error to report
    (a typed 4xx/5xx, or `SamplerUnavailable` once the watchdog is spent).
    """

    def __init__(self, core: ClientCore, method: str, path: str, retry: bool) -> None:
        self.core, self.retry = core, retry
        self.what = f"reply to {method} {path}"
        self.started, self.count = time.monotonic(), 0
        self.backoff = Backoff(*core.backoff_s)

    def answered(self, response: httpx.Response) -> float | None:
        self.count += 1
        if response.status_code < 400:
            return None
        error = http_error(response, self.count)
        if response.status_code not in TRANSIENT or not self.retry:
            raise error
        return self._delay(error)

    def failed(self, exc: httpx.TransportError) -> float:
        self.count += 1
        if (
            isinstance(exc, httpx.TimeoutException)
            or not isinstance(exc, RETRYABLE)
            or not self.retry
        ):
            raise _unavailable(self.core, self.what, self.started, self.count, exc) from exc
        return self._delay(exc)

    def _delay(self, error: SamplerHTTPError | httpx.TransportError) -> float:
        delay = self.backoff.next()
        if time.monotonic() + delay - self.started > self.core.watchdog_s:
            raise _unavailable(self.core, self.what, self.started, self.count, error)
        return delay


class ReadyWait:
    """Polling `/ready`: `answered(ready)` is None once it said 200, else the delay before
    the next poll; `SamplerUnavailable` after `limit_s`."""

    def __init__(self, core: ClientCore, limit_s: float) -> None:
        self.core, self.limit_s = core, limit_s
        self.started, self.attempts = time.monotonic(), 0
        self.backoff = Backoff(*core.backoff_s)

    def answered(self, ready: bool) -> float | None:
        self.attempts += 1
        if ready:
            return None
        if time.monotonic() - self.started > self.limit_s:
            raise _unavailable(self.core, "200 from /ready", self.started, self.attempts, None)
        return min(self.backoff.next(), 1.0)
