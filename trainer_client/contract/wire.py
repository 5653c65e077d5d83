"""The msgpack encoding of groups: the service stores and streams groups in it.

A group is mostly numbers: 4 answers of 1,024 tokens are 8,192 token ids and logprobs.
As JSON text that is ~110 KB that both sides must format and parse digit by digit. Here
every number list of a group travels as one msgpack extension holding the raw
little-endian array, which the reader turns into a list with one numpy call: a third of
the bytes and about half the decoding time of JSON (BENCHMARKS.md, section 3).

Arrays are exact: int32 where the ids fit (int64 otherwise), float32 where every value
survives the round trip (engine logprobs are float32), float64 otherwise. Anything else
in a message is plain msgpack, so a message decodes to the same dict as its JSON form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from trainer_client.contract.protocol import Group

_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<i4"),
    2: np.dtype("<i8"),
    3: np.dtype("<f4"),
    4: np.dtype("<f8"),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_NARROW = {"int": _DTYPES[1], "float": _DTYPES[3]}
_WIDE = {"int": _DTYPES[2], "float": _DTYPES[4]}
_INT_FIELDS = ("prompt_token_ids",)
_SAMPLE_INT_FIELDS = ("response_token_ids", "loss_mask")
_SAMPLE_FLOAT_FIELDS = ("logprobs", "token_weights")


def narrow_array(values: Sequence[float] | np.ndarray, kind: str) -> np.ndarray:
    """`values` as the narrowest exact little-endian array: int32 where the ids fit (int64
    otherwise), float32 where every value survives (float64 otherwise).

    An array that is int32 (`kind` "int") or float32 ("float") already is returned as it
    is: an engine that hands its answers packed (`sampler_service.backends.base.packed`)
    costs the store's encoder one `tobytes` per array, not a pass over Python numbers.
    """
    narrow_dtype = _NARROW[kind]
    if isinstance(values, np.ndarray) and values.dtype == narrow_dtype:
        return values
    wide = np.asarray(values, dtype=_WIDE[kind])
    narrow = wide.astype(narrow_dtype)
    return narrow if np.array_equal(narrow, wide) else wide


def _array(values: Sequence[float] | np.ndarray, kind: str) -> msgpack.ExtType:
    array = narrow_array(values, kind)
    return msgpack.ExtType(_CODES[array.dtype], array.tobytes())


def _array_hook(code: int, data: bytes) -> Any:
    """An array as a read-only numpy view of its bytes: no Python object per number, the
    cost that dominated a consumer's CPU with 700-token answers (BENCHMARKS.md section 8)."""
    dtype = _DTYPES.get(code)
    if dtype is None:
        return msgpack.ExtType(code, data)
    return np.frombuffer(data, dtype=dtype)


def _ext_hook(code: int, data: bytes) -> Any:
    """An array as a list: the same value as its JSON form."""
    value = _array_hook(code, data)
    return value.tolist() if isinstance(value, np.ndarray) else value


def _fields(model: Any) -> dict[str, Any]:
    """A model's field values as a new dict (a shallow `model_dump`): the group's
    number lists go into arrays as they are, without pydantic copying each one first."""
    return dict(model.__dict__)


def pack_group(group: Group) -> bytes:
    """A group's stored and streamed bytes, without its per-delivery `delivery_id`."""
    doc = _fields(group)
    doc.pop("delivery_id", None)
    doc["stats"] = _fields(group.stats)
    for name in _INT_FIELDS:
        doc[name] = _array(doc[name], "int")
    samples = []
    for model in group.samples:
        sample = _fields(model)
        for name in _SAMPLE_INT_FIELDS:
            if sample.get(name) is not None:
                sample[name] = _array(sample[name], "int")
        for name in _SAMPLE_FLOAT_FIELDS:
            if sample.get(name) is not None:
                sample[name] = _array(sample[name], "float")
        samples.append(sample)
    doc["samples"] = samples
    packed: bytes = msgpack.packb(doc)
    return packed


def drop_text(doc: dict[str, Any]) -> dict[str, Any]:
    """A decoded group without its texts, what a consumer that declared `no_text` gets
    (`trainer_client.contract.features`); changed in place and returned."""
    doc.pop("prompt_text", None)
    for sample in doc["samples"]:
        sample.pop("response_text", None)
    return doc


def without_text(payload: bytes) -> bytes:
    """A packed group without its texts; its arrays are copied as they are, not decoded."""
    packed: bytes = msgpack.packb(drop_text(msgpack.unpackb(payload)))
    return packed


def pack(message: Any) -> bytes:
    """Any other message (heartbeats, envelopes) as plain msgpack."""
    packed: bytes = msgpack.packb(message)
    return packed


def unpack(data: bytes, *, arrays: bool = False) -> Any:
    """One msgpack document, arrays as lists (the same value as its JSON form), or as
    read-only numpy arrays with `arrays`."""
    return msgpack.unpackb(data, ext_hook=_array_hook if arrays else _ext_hook)


def unpack_group(data: bytes) -> Group:
    return Group.model_validate(unpack(data))


def stream_decoder(*, arrays: bool = False) -> msgpack.Unpacker:
    """An incremental decoder: `feed()` it chunks, iterate it for whole messages (arrays
    as in `unpack`)."""
    return msgpack.Unpacker(ext_hook=_array_hook if arrays else _ext_hook, max_buffer_size=1 << 30)


def splice_map(packed_map: bytes, key: str, value: Any) -> bytes:
    """`packed_map` (a msgpack map) with one more entry, without decoding the map.

    The stored bytes of a group stay untouched; only each delivery's id is added.
    """
    head = packed_map[0]
    if 0x80 <= head <= 0x8F:
        count, start = head - 0x80, 1
    elif head == 0xDE:
        count, start = int.from_bytes(packed_map[1:3], "big"), 3
    elif head == 0xDF:
        count, start = int.from_bytes(packed_map[1:5], "big"), 5
    else:
        raise ValueError(f"not a msgpack map (first byte 0x{head:02x})")
    entry: bytes = msgpack.packb(key) + msgpack.packb(value)
    return map_header(count + 1) + packed_map[start:] + entry


def map_header(size: int) -> bytes:
    header: bytes = msgpack.Packer().pack_map_header(size)
    return header


def array_header(size: int) -> bytes:
    header: bytes = msgpack.Packer().pack_array_header(size)
    return header
