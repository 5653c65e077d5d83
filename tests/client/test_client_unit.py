"""SamplerClient / AsyncSamplerClient against a scripted fake server (httpx.MockTransport)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest
import torch
from client_helpers import FakeSampler, group_line, heartbeat_line
from safetensors.torch import load
from support import group

from trainer_client.client import AsyncSamplerClient, SamplerClient
from trainer_client.exceptions import (
    AuthError,
    ConflictError,
    InvalidRequest,
    PayloadTooLarge,
    SamplerUnavailable,
    ServerError,
)

pytestmark = pytest.mark.timeout(60)

URL = "http://sampler.test"


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


#: trainer_client modules that import verl, which only the verl environment has.
NEEDS_VERL = {"trainer_client.verl.v0", "trainer_client.verl.v1", "trainer_client.verl.weights"}


def test_trainer_side_imports_no_server_dependencies() -> None:
    code = (
        "import pkgutil, sys, importlib, trainer_client\n"
        f"skip = {sorted(NEEDS_VERL)!r}\n"
        "names = [m.name for m in pkgutil.walk_packages(trainer_client.__path__, 'trainer_client.')]\n"
        "for name in names:\n"
        "    if name not in skip:\n"
        "        importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sampler_service', 'fastapi', 'uvicorn', 'vllm', 'starlette', 'ray', 'verl'))\n"
        "print(len(names), ','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, bad = out.stdout.split(" ", 1)
    assert int(count) > 30, out.stdout  # every module of the package was found
    assert bad.strip() == "", f"trainer_client imported server modules: {bad}"


def test_stream_sends_credits_consumer_and_heartbeat_interval() -> None:
    fake = FakeSampler([[heartbeat_line(3), group_line(group("a"))]])
    with SamplerClient(
        URL, transport=fake.transport(), consumer="t1", max_unacked=6, watchdog_s=8
    ) as c:
        it = c.groups(max_unacked=5)
        assert next(it).group_id == "a"
        assert c.last_heartbeat is not None and c.last_heartbeat.policy_version == 3
    params = fake.stream_params[0]
    assert params["consumer"] == "t1" and params["max_unacked"] == "5"
    assert float(params["heartbeat_s"]) == 2.0  # a quarter of the watchdog


def test_reconnect_after_drop_suppresses_duplicates_and_acks_newest_delivery() -> None:
    a1, b1 = (
        group("A", batch_id="f", batch_index=0, batch_size=2),
        group("B", batch_id="f", batch_index=1, batch_size=2),
    )
    a2, b2 = dict(a1, delivery_id="a-2"), dict(b1, delivery_id="b-2")
    c = group("C", batch_id="g")
    fake = FakeSampler(
        [
            [heartbeat_line(), group_line(a1), group_line(b1), httpx.ReadError("connection reset")],
            [heartbeat_line(), group_line(a2), group_line(b2), group_line(c)],
        ]
    )
    with SamplerClient(
        URL, transport=fake.transport(), watchdog_s=10, backoff_s=(0.01, 0.05)
    ) as client:
        got = take(client.groups(), 3)
        assert [g.group_id for g in got] == ["A", "B", "C"]
        assert client.connections == 2 and client.duplicates_dropped == 2
        r = client.ack(got)
    assert r.acked == 3
    # The first delivery ids died with the first connection: acks name the newest ones.
    assert fake.acks == [["a-2", "b-2", c["delivery_id"]]]


def test_redelivered_group_that_was_already_acked_is_acked_again_and_skipped() -> None:
    a1 = group("A")
    a2 = dict(a1, delivery_id="a-again")
    b = group("B", batch_id="b1")
    fake = FakeSampler([[group_line(a1)], [heartbeat_line(), group_line(a2), group_line(b)]])
    with SamplerClient(
        URL, transport=fake.transport(), watchdog_s=10, backoff_s=(0.01, 0.05)
    ) as client:
        it = client.groups()
        first = next(it)
        client.ack([first])
        second = next(it)  # the server ended the stream; the reconnect redelivers A
    assert second.group_id == "B"
    assert fake.acks == [[a1["delivery_id"]], ["a-again"]]


def test_stream_refused_with_4xx_raises_typed_error() -> None:
    def unauthorized(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            401, json={"error": {"code": "unauthorized", "message": "missing or wrong API key"}}
        )

    transport = httpx.MockTransport(unauthorized)
    with (
        SamplerClient(URL, transport=transport, watchdog_s=5) as client,
        pytest.raises(AuthError) as err,
    ):
        next(client.groups())
    assert err.value.status == 401 and "API key" in str(err.value)


def test_http_errors_are_typed_with_message_and_field() -> None:
    calls = {"ready": 0}

    def config(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        if "k_neg" in body:
            return httpx.Response(
                422,
                json={
                    "error": {
                        "code": "invalid_config",
                        "message": "k_pos + k_neg > n_max",
                        "field": "k_neg",
                    }
                },
            )
        return httpx.Response(200, json={"config_version": 2, **body})

    def weights(request: httpx.Request) -> httpx.Response:
        if request.url.params["version"] == "1":
            return httpx.Response(
                409,
                json={
                    "error": {
                        "code": "stale_version",
                        "message": "version 1 must be greater than the served 3",
                        "field": "version",
                    }
                },
            )
        return httpx.Response(413, json={"error": {"code": "body_too_large", "message": "too big"}})

    def stats(request: httpx.Request) -> httpx.Response:
        calls["ready"] += 1
        if calls["ready"] < 3:
            return httpx.Response(503, json={"error": {"code": "not_ready", "message": "starting"}})
        return httpx.Response(200, json={"samples": 7})

    def boom(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="<html>proxy error</html>")

    fake = FakeSampler(
        [],
        routes={"/v1/config": config, "/v1/weights": weights, "/v1/stats": stats, "/health": boom},
    )
    with SamplerClient(
        URL, transport=fake.transport(), watchdog_s=10, backoff_s=(0.01, 0.02)
    ) as client:
        with pytest.raises(InvalidRequest) as err:
            client.update_config(k_pos=9, k_neg=9)
        assert (
            err.value.field == "k_neg"
            and err.value.code == "invalid_config"
            and err.value.status == 422
        )
        assert "k_pos + k_neg" in str(err.value)
        assert client.update_config(n_max=8)["n_max"] == 8
        with pytest.raises(ConflictError) as conflict:
            client.push_weights(b"not really safetensors", version=1)
        assert conflict.value.field == "version"
        with pytest.raises(PayloadTooLarge):
            client.push_weights(b"x", version=2)
        assert client.stats() == {"samples": 7}  # 503s are retried
        assert calls["ready"] == 3
        with pytest.raises(ServerError) as server_error:
            client.health()
        assert server_error.value.status == 500 and "proxy error" in server_error.value.message


def test_update_config_with_expected_version_sends_it() -> None:
    seen = {}

    def config(request: httpx.Request) -> httpx.Response:
        seen.update(orjson.loads(request.content))
        return httpx.Response(200, json={"config_version": 5})

    fake = FakeSampler([], routes={"/v1/config": config})
    with SamplerClient(URL, transport=fake.transport()) as client:
        client.update_config(expected_version=4, k_pos=3, mixing={"name": "reward_gap"})
    assert seen == {"config_version": 4, "k_pos": 3, "mixing": {"name": "reward_gap"}}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_watchdog_raises_when_nothing_answers() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with SamplerClient(url, watchdog_s=1.0, backoff_s=(0.05, 0.2)) as client:
        started = time.monotonic()
        with pytest.raises(SamplerUnavailable) as err:
            next(client.groups())
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < 3 * 1.0 + 30
        e = err.value
        assert e.attempts >= 2 and e.waited_s >= 0.9 and "heartbeat or group" in str(e)
        assert url in str(e)
        with pytest.raises(SamplerUnavailable) as req_err:
            client.stats()
        assert "GET /v1/stats" in str(req_err.value)


def test_push_weights_sends_safetensors_of_state_dict(tmp_path) -> None:
    got: dict[str, dict[str, torch.Tensor]] = {}

    def weights(request: httpx.Request) -> httpx.Response:
        got[request.url.params["version"]] = load(request.read())
        return httpx.Response(
            200,
            json={
                "policy_version": int(request.url.params["version"]),
                "tensors": 2,
                "load_s": 0.0,
            },
        )

    emb = torch.randn(4, 3)
    state = {
        "embed.weight": emb,
        "head.weight": emb,
        "bias": torch.arange(3.0),
    }  # tied: written once
    fake = FakeSampler([], routes={"/v1/weights": weights})
    with SamplerClient(URL, transport=fake.transport()) as client:
        assert client.push_weights(state, version=1).policy_version == 1
        from safetensors.torch import save_file

        path = tmp_path / "w.safetensors"
        save_file({"bias": torch.ones(3)}, path)
        client.push_weights(path, version=2)
    assert set(got["1"]) == {"embed.weight", "bias"}
    assert torch.equal(got["1"]["embed.weight"], emb)
    assert torch.equal(got["2"]["bias"], torch.ones(3))


def test_lease_filters_duplicates() -> None:
    a = group("A")

    def lease(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        assert body["consumer"] == "leaser" and body["wait_s"] == 1.5
        return httpx.Response(
            200,
            json={
                "lease_id": "l",
                "expires_at": 0.0,
                "groups": [dict(a, delivery_id=f"d{len(fake.requests)}")],
            },
        )

    fake = FakeSampler([], routes={"/v1/groups/lease": lease})
    with SamplerClient(URL, transport=fake.transport(), consumer="leaser") as client:
        first = client.lease(4, wait_s=1.5)
        assert [g.group_id for g in first.groups] == ["A"]
        client.ack(first.groups)
        assert (
            client.lease(4, wait_s=1.5).groups == []
        )  # redelivered after its ack: acked again, dropped
    assert len(fake.acks) == 2


async def test_async_client_reconnects_and_dedupes() -> None:
    a1 = group("A")
    b = group("B", batch_id="b2")
    fake = FakeSampler(
        [
            [heartbeat_line(), group_line(a1), httpx.RemoteProtocolError("peer closed")],
            [heartbeat_line(4), group_line(dict(a1, delivery_id="a-2")), group_line(b)],
        ],
        asynchronous=True,
    )
    async with AsyncSamplerClient(
        URL, transport=fake.transport(), watchdog_s=10, backoff_s=(0.01, 0.05)
    ) as client:
        got = []
        async for g in client.groups():
            got.append(g)
            if len(got) == 2:
                break
        assert [g.group_id for g in got] == ["A", "B"]
        assert client.last_heartbeat.policy_version == 4
        await client.ack(got)
    assert fake.acks == [["a-2", b["delivery_id"]]]


async def test_async_watchdog() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    async with AsyncSamplerClient(url, watchdog_s=0.8, backoff_s=(0.05, 0.2)) as client:
        with pytest.raises(SamplerUnavailable):
            async for _ in client.groups():
                pass


def test_push_whose_reply_was_lost_is_not_an_error_on_retry() -> None:
    served = {"version": 0}

    def weights(request: httpx.Request) -> httpx.Response:
        version = int(request.url.params["version"])
        if version <= served["version"]:
            return httpx.Response(
                409, json={"error": {"code": "stale_version", "message": "old", "field": "version"}}
            )
        served["version"] = version
        raise httpx.ReadError("connection reset before the reply")

    def health(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "status": "ok",
                "backend": "hf",
                "model": "m",
                "policy_version": served["version"],
                "uptime_s": 1.0,
            },
        )

    fake = FakeSampler([], routes={"/v1/weights": weights, "/health": health})
    with SamplerClient(URL, transport=fake.transport(), backoff_s=(0.01, 0.02)) as client:
        assert client.push_weights(b"weights", version=3).policy_version == 3
        with pytest.raises(ConflictError):  # a first attempt that is refused stays an error
            client.push_weights(b"weights", version=2)


def test_nccl_sender_without_vllm_says_what_to_install() -> None:
    """The core install has no vLLM: connecting names it before any request is sent."""
    from trainer_client.nccl import NCCLTransferError, NCCLWeightSender

    sender = NCCLWeightSender("http://127.0.0.1:9", master_address="127.0.0.1", master_port=1)
    with pytest.raises(NCCLTransferError, match=r"adaptive-rollout\[vllm\]"):
        sender.connect(None)


async def test_async_client_reads_events_and_uploads_files_and_weight_streams(tmp_path) -> None:
    got: dict[str, bytes] = {}

    def events(request: httpx.Request) -> httpx.Response:
        assert dict(request.url.params) == {"since": "4", "limit": "2"}
        return httpx.Response(200, json={"events": [{"seq": 5}, {"seq": 6}], "last_seq": 6})

    def weights(request: httpx.Request) -> httpx.Response:
        version = request.url.params["version"]
        got[version] = request.read()
        return httpx.Response(200, json={"policy_version": int(version), "tensors": 1, "load_s": 0})

    from safetensors.torch import save_file

    from trainer_client.uploads import WeightStream

    path = tmp_path / "w.safetensors"
    save_file({"bias": torch.ones(3)}, path)
    data = path.read_bytes()
    pieces = WeightStream(len(data), lambda: iter([data[:7], data[7:]]))
    fake = FakeSampler([], routes={"/v1/events": events, "/v1/weights": weights})
    async with AsyncSamplerClient(URL, transport=fake.transport()) as client:
        page = await client.events(since=4, limit=2)
        assert [e["seq"] for e in page["events"]] == [5, 6] and page["last_seq"] == 6
        assert (await client.push_weights(path, version=1)).policy_version == 1
        assert (await client.push_weights(pieces, version=2)).policy_version == 2
    assert got == {"1": data, "2": data}
    assert torch.equal(load(got["2"])["bias"], torch.ones(3))
