"""The msgpack encoding of groups: exact round trips, compact arrays, delivery-id splicing."""

from __future__ import annotations

import msgpack
import numpy as np
import orjson
import pytest
from support import group, sample

from trainer_client.contract import features, wire
from trainer_client.contract.protocol import Group


def _group(**sample_kw) -> Group:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 151_000, 1024).tolist()
    logprobs = np.log(rng.random(1024)).astype(np.float32).astype(float).tolist()
    return Group.model_validate(
        group("g", [sample(tokens, logprobs, **sample_kw) for _ in range(4)])
    )


def test_round_trip_is_exact_and_compact() -> None:
    for g in (_group(), _group(token_weights=[0.1 * i for i in range(1024)])):  # float64 weights
        packed = wire.pack_group(g)
        assert wire.unpack_group(packed) == g.model_copy(update={"delivery_id": None})
        as_json = g.model_dump_json(exclude={"delivery_id"}).encode()
        assert wire.unpack(packed) == orjson.loads(as_json)  # the same values, key for key
    g = _group()
    assert (
        len(wire.pack_group(g)) < len(g.model_dump_json()) / 2
    )  # ids and float32 logprobs as raw arrays


def test_arrays_widen_only_when_needed() -> None:
    def dtype_code(values: list, kind: str) -> int:
        return wire._array(values, kind).code

    assert dtype_code([1, 2, 2**31 - 1], "int") == dtype_code([0], "int")
    assert dtype_code([2**40], "int") != dtype_code([0], "int")  # int64, not truncated
    assert dtype_code([-0.5, 0.25], "float") != dtype_code([0.1], "float")  # float32 vs float64
    for values, kind in [
        ([2**40, -3], "int"),
        ([0.1, 1 / 3], "float"),
        ([-0.5, 0.25], "float"),
        ([], "int"),
    ]:
        assert wire.unpack(msgpack.packb(wire._array(values, kind))) == values


def test_packed_answers_encode_to_the_same_bytes_as_lists() -> None:
    """An engine that hands int32 / float32 arrays (packed at its process boundary) gets
    the bytes a list-handing engine gets, and the encoder takes its arrays as they are."""
    listed = _group()
    arrays = listed.model_copy(deep=True)
    for s in arrays.samples:
        s.response_token_ids = np.asarray(s.response_token_ids, dtype=np.int32)
        s.logprobs = np.asarray(s.logprobs, dtype=np.float32)
    assert wire.pack_group(arrays) == wire.pack_group(listed)
    ids = arrays.samples[0].response_token_ids
    assert wire.narrow_array(ids, "int") is ids  # no copy, no pass over the numbers
    wide = np.array([2**40, 1], dtype=np.int64)  # an array wider than narrow stays exact
    assert wire.narrow_array(wide, "int").dtype == np.int64
    assert wire.narrow_array(np.array([1, 2], dtype=np.int64), "int").dtype == np.int32
    assert wire.narrow_array(np.array([0.1], dtype=np.float64), "float").dtype == np.float64


@pytest.mark.parametrize("entries", [1, 14, 15, 16, 70_000])
def test_splice_map_adds_one_entry_for_every_map_size(entries: int) -> None:
    doc = {f"k{i}": i for i in range(entries)}
    spliced = wire.splice_map(msgpack.packb(doc), "delivery_id", "abc")
    assert wire.unpack(spliced) == {**doc, "delivery_id": "abc"}


def test_splice_map_refuses_what_is_not_a_map() -> None:
    with pytest.raises(ValueError, match="not a msgpack map"):
        wire.splice_map(msgpack.packb([1, 2]), "delivery_id", "x")


def test_stream_decoder_reassembles_messages_cut_anywhere() -> None:
    g = _group()
    messages = [
        wire.pack({"type": "heartbeat", "ready": 1}),
        wire.pack_group(g),
        wire.pack({"type": "x"}),
    ]
    stream = b"".join(messages)
    decoder, out = wire.stream_decoder(), []
    for start in range(0, len(stream), 997):  # chunks that split messages mid-array
        decoder.feed(stream[start : start + 997])
        out.extend(decoder)
    assert out[0] == {"type": "heartbeat", "ready": 1} and out[2] == {"type": "x"}
    assert Group.model_validate(out[1]) == g.model_copy(update={"delivery_id": None})


def test_a_group_without_text_is_the_same_group_minus_its_texts() -> None:
    group = _group()
    payload = wire.pack_group(group)
    stripped = wire.unpack(wire.without_text(payload))
    expected = wire.unpack(payload)
    del expected["prompt_text"]
    for answer in expected["samples"]:
        del answer["response_text"]
    assert stripped == expected
    parsed = wire.unpack_group(wire.without_text(payload))
    assert parsed.prompt_text is None and parsed.samples[0].response_text is None
    assert parsed.samples[0].response_token_ids == group.samples[0].response_token_ids
    assert features.parse(["no_text", ""]) == {features.NO_TEXT}
    with pytest.raises(features.UnknownFeatures, match="a, b"):
        features.parse(["b,no_text", "a"])


def test_arrays_decode_to_the_same_group_as_lists() -> None:
    listed = _group(token_weights=[0.1 * i for i in range(1024)])
    packed = wire.pack_group(listed)
    doc = wire.unpack(packed, arrays=True)
    arrays = Group.model_validate(doc)
    # taken as they are (validation tries no list of numbers first, which costs 10x)
    assert arrays.samples[0].response_token_ids is doc["samples"][0]["response_token_ids"]
    assert arrays.prompt_token_ids is doc["prompt_token_ids"]
    assert arrays.samples[0].token_weights.dtype == np.float64  # widened as on the wire
    assert arrays.model_dump_json() == wire.unpack_group(packed).model_dump_json()
    decoder = wire.stream_decoder(arrays=True)
    decoder.feed(packed)
    (streamed,) = list(decoder)
    assert isinstance(streamed["samples"][0]["logprobs"], np.ndarray)
