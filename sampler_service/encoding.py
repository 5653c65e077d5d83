"""How stream and lease responses look in each media type a client can ask for.

Groups are stored once, as msgpack (`trainer_client.contract.wire`). A client that sends
`Accept: application/x-msgpack` (ours do) gets those bytes as they are, with only its
delivery id added; anyone else (curl, a trainer in another language) gets NDJSON on the
stream and JSON from lease, converted per send. Both carry the same values.
"""

from __future__ import annotations

from typing import Any

import msgpack
import orjson

from sampler_service.outbox import Delivered
from trainer_client.contract import wire
from trainer_client.contract.protocol import MSGPACK_MEDIA_TYPE, NDJSON_MEDIA_TYPE


class JSONEncoding:
    stream_media_type = NDJSON_MEDIA_TYPE
    lease_media_type = "application/json"

    @staticmethod
    def _group(delivered: Delivered) -> bytes:
        doc = wire.unpack(delivered.group.payload)
        doc["delivery_id"] = delivered.delivery_id
        return orjson.dumps(doc)

    def message(self, doc: dict[str, Any]) -> bytes:
        return orjson.dumps(doc) + b"\n"

    def group_message(self, delivered: Delivered) -> bytes:
        return b'{"type":"group","group":' + self._group(delivered) + b"}\n"

    def lease(self, head: dict[str, Any], delivered: list[Delivered]) -> bytes:
        return (
            orjson.dumps(head)[:-1]
            + b',"groups":['
            + b",".join(map(self._group, delivered))
            + b"]}"
        )


class MsgpackEncoding:
    stream_media_type = MSGPACK_MEDIA_TYPE
    lease_media_type = MSGPACK_MEDIA_TYPE
    _GROUP_HEAD = (
        wire.map_header(2) + msgpack.packb("type") + msgpack.packb("group") + msgpack.packb("group")
    )

    @staticmethod
    def _group(delivered: Delivered) -> bytes:
        return wire.splice_map(delivered.group.payload, "delivery_id", delivered.delivery_id)

    def message(self, doc: dict[str, Any]) -> bytes:
        return wire.pack(doc)

    def group_message(self, delivered: Delivered) -> bytes:
        return self._GROUP_HEAD + self._group(delivered)

    def lease(self, head: dict[str, Any], delivered: list[Delivered]) -> bytes:
        fields = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in head.items())
        groups = wire.array_header(len(delivered)) + b"".join(map(self._group, delivered))
        return wire.map_header(len(head) + 1) + fields + msgpack.packb("groups") + groups


Encoding = JSONEncoding | MsgpackEncoding
JSON = JSONEncoding()
MSGPACK = MsgpackEncoding()


def negotiate(accept: str | None) -> Encoding:
    """msgpack for clients that accept it, else JSON (the default for curl and browsers)."""
    return MSGPACK if accept and MSGPACK_MEDIA_TYPE in accept else JSON
