"""The errors every layer may end a request in, defined below all of them.

- `ServiceError`: a request the service refuses, with an HTTP status, a code and a
  message. Every layer under the routes (the service and its components, such as the
  weights manager) raises it for a client mistake, and the app maps it to the error
  body, so no component needs to know the HTTP layer to answer 4xx with a message.
- `NotSupported`: a capability an engine does not offer (a pause mode, weights read
  from files, the NCCL transfer). Engines raise it from the calls they lack, the fleet
  skips what its members lack, and the weights manager answers it as a 409.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses; carries the HTTP status and an error code."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


class NotSupported(RuntimeError):
    """The engine does not offer this capability; the message says what would (maps to
    HTTP 409)."""
