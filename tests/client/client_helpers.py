"""Wire lines and a scripted fake stream, for client tests without a server."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson

from sampler_service.encoding import MSGPACK
from sampler_service.outbox import Delivered
from sampler_service.store import StoredGroup
from trainer_client.contract import wire
from trainer_client.contract.protocol import MSGPACK_MEDIA_TYPE, NDJSON_MEDIA_TYPE, Group


def group_line(g: dict[str, Any]) -> bytes:
    return orjson.dumps({"type": "group", "group": g}) + b"\n"


def heartbeat_line(policy_version: int = 0) -> bytes:
    return (
        orjson.dumps(
            {
                "type": "heartbeat",
                "time": 0.0,
                "policy_version": policy_version,
                "config_version": 0,
                "ready": 0,
                "leased": 0,
                "active_prompts": 0,
                "unacked": 0,
            }
        )
        + b"\n"
    )


def as_msgpack(line: bytes) -> bytes:
    """An NDJSON stream line as the service sends it to a client that accepts msgpack."""
    msg = orjson.loads(line)
    if msg.get("type") != "group":
        return wire.pack(msg)
    g = Group.model_validate(msg["group"])
    return MSGPACK.group_message(
        Delivered(g.delivery_id, StoredGroup(0, g.group_id, wire.pack_group(g)))
    )


class FakeSampler:
    """A scripted sampler behind httpx.MockTransport.

    `connections` is a list of scripts, one per stream connection: each a list of byte
    lines, or an exception instance to raise at that point (a dropped connection). After
    the scripts run out, a connection just ends. Acks and other requests are recorded.
    Lines go out as written (NDJSON), or as msgpack when the client accepts it.
    """

    def __init__(
        self,
        connections: list[list[Any]],
        routes: dict[str, Callable[[httpx.Request], httpx.Response]] | None = None,
        asynchronous: bool = False,
    ) -> None:
        self.asynchronous = asynchronous
        self.connections = list(connections)
        self.routes = routes or {}
        self.acks: list[list[str]] = []
        self.stream_params: list[dict[str, str]] = []
        self.requests: list[httpx.Request] = []
        self.lock = threading.Lock()

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/v1/groups/stream":
            self.stream_params.append(dict(request.url.params))
            script = self.connections.pop(0) if self.connections else []
            media_type = NDJSON_MEDIA_TYPE
            if MSGPACK_MEDIA_TYPE in request.headers.get("accept", ""):
                media_type = MSGPACK_MEDIA_TYPE
                script = [
                    item if isinstance(item, BaseException) else as_msgpack(item) for item in script
                ]
            content = _aplay(script) if self.asynchronous else _play(script)
            return httpx.Response(200, content=content, headers={"content-type": media_type})
        if path == "/v1/groups/ack":
            ids = orjson.loads(request.content)["delivery_ids"]
            self.acks.append(ids)
            return httpx.Response(200, json={"acked": len(ids), "unknown": 0})
        if path in self.routes:
            return self.routes[path](request)
        return httpx.Response(404, json={"error": {"code": "not_found", "message": path}})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    @property
    def acked_ids(self) -> list[str]:
        return [i for batch in self.acks for i in batch]


def _play(script: list[Any]) -> Iterator[bytes]:
    for item in script:
        if isinstance(item, BaseException):
            raise item
        yield item


async def _aplay(script: list[Any]) -> AsyncIterator[bytes]:
    for item in script:
        if isinstance(item, BaseException):
            raise item
        yield item
