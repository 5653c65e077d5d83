"""The features handshake against a real sampler: a consumer that declares `no_text` gets
groups without texts (stream and lease, msgpack and JSON), one that declares nothing gets
them as before, and an unknown feature is a 422 naming it. A client that asks for arrays
gets the same numbers as numpy arrays."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from trainer_client.client import AsyncSamplerClient, SamplerClient
from trainer_client.contract.features import NO_TEXT, UnknownFeatures
from trainer_client.contract.protocol import Group

pytestmark = pytest.mark.timeout(180)


def _stream(client: SamplerClient, n: int) -> list[Group]:
    out: list[Group] = []
    for group in client.groups(max_unacked=n):
        out.append(group)
        if len(out) == n:
            break
    client.ack(out)
    return out


def _has_numbers(group: Group) -> bool:
    return len(group.prompt_token_ids) > 0 and all(
        len(s.response_token_ids) and len(s.logprobs) == len(s.response_token_ids)
        for s in group.samples
    )


def test_a_stream_that_declares_no_text_gets_no_texts_and_others_still_do(sampler) -> None:
    with SamplerClient(sampler.url, consumer="no-text", features=[NO_TEXT]) as client:
        bare = _stream(client, 2)
    with SamplerClient(sampler.url, consumer="texts") as client:
        full = _stream(client, 2)
    assert all(g.prompt_text is None for g in bare)
    assert all(s.response_text is None for g in bare for s in g.samples)
    assert all(_has_numbers(g) for g in bare)
    assert all(isinstance(g.prompt_text, str) and g.prompt_text for g in full)
    assert all(isinstance(s.response_text, str) for g in full for s in g.samples)


def test_a_lease_that_declares_no_text_gets_no_texts_in_msgpack_and_json(sampler) -> None:
    async def lease() -> list[Group]:
        async with AsyncSamplerClient(sampler.url, features=[NO_TEXT]) as client:
            leased = await client.lease(max_groups=2, wait_s=60, consumer="async-no-text")
            await client.ack(leased.groups)
            return leased.groups

    groups = asyncio.run(lease())
    assert groups and all(_has_numbers(g) for g in groups)
    assert all(g.prompt_text is None for g in groups)
    assert all(s.response_text is None for g in groups for s in g.samples)

    with httpx.Client(base_url=sampler.url, timeout=90) as http:
        body = {"max_groups": 2, "wait_s": 60, "consumer": "json-no-text"}
        r = http.post("/v1/groups/lease", params={"features": NO_TEXT}, json=body)
        assert r.status_code == 200, r.text
        raw = r.json()["groups"]
        http.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in raw]})
    assert raw and all("prompt_text" not in g and g["prompt_token_ids"] for g in raw)
    assert all("response_text" not in s and s["logprobs"] for g in raw for s in g["samples"])


def _numbers(group: Group) -> list[list[float]]:
    return [list(group.prompt_token_ids)] + [
        list(values) for s in group.samples for values in (s.response_token_ids, s.logprobs)
    ]


def test_a_client_that_asks_for_arrays_gets_the_same_numbers_as_numpy_arrays(sampler) -> None:
    """Stream (sync) and lease (async) alike; each group's JSON form, what a list client
    gets, holds the same numbers."""
    with SamplerClient(sampler.url, consumer="arrays", arrays=True) as client:
        streamed = _stream(client, 2)

    async def lease() -> list[Group]:
        async with AsyncSamplerClient(sampler.url, arrays=True) as client:
            leased = await client.lease(max_groups=2, wait_s=60, consumer="async-arrays")
            await client.ack(leased.groups)
            return leased.groups

    leased = asyncio.run(lease())
    for group in streamed + leased:
        assert isinstance(group.prompt_token_ids, np.ndarray)
        for s in group.samples:
            assert isinstance(s.response_token_ids, np.ndarray)
            assert s.response_token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert not s.response_token_ids.flags.writeable  # views of the received bytes
        # the JSON form (what the NDJSON stream and a list client carry) is the same
        as_lists = Group.model_validate_json(group.model_dump_json())
        assert isinstance(as_lists.samples[0].logprobs, list)
        assert _numbers(as_lists) == _numbers(group)
        assert all(_has_numbers(g) for g in (group, as_lists))


def test_arrays_need_the_msgpack_encoding() -> None:
    with pytest.raises(ValueError, match="msgpack"):
        SamplerClient("http://127.0.0.1:9", arrays=True, encoding="json")


@pytest.mark.parametrize("method, path", [("GET", "stream"), ("POST", "lease")])
def test_an_unknown_feature_is_a_422_that_names_it(sampler, method: str, path: str) -> None:
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        r = http.request(
            method,
            f"/v1/groups/{path}",
            params={"features": "no_text,sparkles", "consumer": "unknown-feature"},
            json={"consumer": "unknown-feature"} if method == "POST" else None,
        )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "unknown_feature" and error["field"] == "features"
    assert "sparkles" in error["message"] and "no_text" not in error["message"].split("(")[0]


def test_the_client_refuses_an_unknown_feature_before_any_request() -> None:
    with pytest.raises(UnknownFeatures, match="sparkles"):
        SamplerClient("http://127.0.0.1:9", features=["sparkles"])
