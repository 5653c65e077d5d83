"""The one error a request to the service can end in: an HTTP status, a code, a message.

Every layer under the routes (the service and its components, such as the weights
manager) raises it for a client mistake, and the app maps it to the error body, so no
component needs to know the HTTP layer to answer 4xx with a message.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses; carries the HTTP status and an error code."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
