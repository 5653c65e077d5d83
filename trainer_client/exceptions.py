"""Every error the sampler clients raise, one tree under `SamplerError`:

    SamplerError
    ├── SamplerUnavailable     nothing came back for `watchdog_s`: a dead, stopped or
    │                          unreachable sampler (says what was awaited, how long, where)
    ├── EngineFailed           the sampler answers, but its engine failed: no new groups
    └── SamplerHTTPError       the server refused a request: `status`, `code`, `message`,
        │                      `field` from its JSON error body
        ├── InvalidRequest     400, 422: a malformed request, a config or weights refused
        ├── AuthError          401, 403: missing or wrong API key
        ├── NotFound           404
        ├── ConflictError      409: a version that does not increase, a stale
        │                      config_version, a consumer name in use, a wire feature
        │                      the sampler's groups need (`feature_required`)
        ├── PayloadTooLarge    413
        └── ServerError        5xx (502, 503 and 504 are retried before they are raised)

A failure never looks like a slow sampler: every wait ends in one of these. `http_error`
turns a refused response into its typed error.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

__all__ = [
    "AuthError",
    "ConflictError",
    "EngineFailed",
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "SamplerError",
    "SamplerHTTPError",
    "SamplerUnavailable",
    "ServerError",
    "http_error",
]


class SamplerError(Exception):
    """Base class of every error the clients raise."""


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


def http_error(response: httpx.Response, attempts: int = 1) -> SamplerHTTPError:
    """The typed error for a 4xx/5xx response, message and field from its error body."""
    try:
        err: dict[str, Any] = orjson.loads(response.content)["error"]
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
