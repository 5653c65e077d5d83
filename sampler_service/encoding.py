"""How stream and lease responses look in each media type a client can ask for.

Groups are stored once, as msgpack (`trainer_client.contract.wire`). A client that sends
`Accept: application/x-msgpack` (ours do) gets those bytes as they are, with only its
delivery id added; anyone else (curl, a trainer in another language) gets NDJSON on the
stream and JSON from lease, converted per send. Both carry the same values. A consumer
that declared `no_text` (`trainer_client.contract.features`) gets each group without its
texts, cut from the stored bytes per send (the arrays are copied, not decoded).
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import msgpack
import orjson

from sampler_service.outbox import Delivered
from trainer_client.contract import wire
from trainer_client.contract.features import NO_TEXT
from trainer_client.contract.protocol import MSGPACK_MEDIA_TYPE, NDJSON_MEDIA_TYPE


class JSONEncoding:
    stream_media_type = NDJSON_MEDIA_TYPE
    lease_media_type = "application/json"

    def __init__(self, no_text: bool = False) -> None:
        self.no_text = no_text

    def _group(self, delivered: Delivered) -> bytes:
        doc = wire.unpack(delivered.group.payload)
        if self.no_text:
            wire.drop_text(doc)
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

    def __init__(self, no_text: bool = False) -> None:
        self.no_text = no_text

    def _group(self, delivered: Delivered) -> bytes:
        payload = delivered.group.payload
        if self.no_text:
            payload = wire.without_text(payload)
        return wire.splice_map(payload, "delivery_id", delivered.delivery_id)

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
_NO_TEXT: dict[Encoding, Encoding] = {
    JSON: JSONEncoding(no_text=True),
    MSGPACK: MsgpackEncoding(no_text=True),
}


def negotiate(accept: str | None, features: Set[str] = frozenset()) -> Encoding:
    """msgpack for clients that accept it, else JSON (the default for curl and browsers);
    without texts for a consumer that declared `no_text`."""
    encoding: Encoding = MSGPACK if accept and MSGPACK_MEDIA_TYPE in accept else JSON
    return _NO_TEXT[encoding] if NO_TEXT in features else encoding
