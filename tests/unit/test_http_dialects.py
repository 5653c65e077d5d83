"""The HTTP engine fleet against SGLang's native API, and headless-Service discovery.

SGLang cannot be installed here, so its server is `fake_engines.FakeSGLang`, a small
aiohttp app on loopback that answers with the request and response shapes of SGLang's
http_server.py and io_struct.py; the fleet is the real one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from pathlib import Path
from typing import Any

import pytest

from sampler_service.backends.base import SamplingParams
from sampler_service.backends.checkpoint import read_checkpoint
from sampler_service.backends.http.dialects import SGLANG
from sampler_service.backends.http.discovery import ServiceName, membership, resolve_service
from sampler_service.backends.http.member import weight_label
from sampler_service.backends.http.transport import HTTPPoolSettings, build_http_fleet
from sampler_service.config import ReplicaSettings
from sampler_service.fleet.pool import Fleet
from sampler_service.weights.types import WeightsNotServed

from .fake_engines import FakeSGLang


def _backend(toy: Any, tmp_path: Path, **kw: Any) -> Fleet:
    settings = HTTPPoolSettings(
        instance_id="t",
        weights_dir=tmp_path / "w",
        **{"dialect": SGLANG, "replica": ReplicaSettings(probe_s=0.2), **kw},
    )
    return build_http_fleet(toy.model_dir, settings)


def label(version: int) -> str:
    return weight_label("t", version)


async def test_sglang_waves_come_back_as_token_ids_and_logprobs(
    toy: Any, tmp_path: Path, serve: Any
) -> None:
    fake = FakeSGLang()
    port = await serve(fake)
    backend = _backend(toy, tmp_path, urls=(f"http://127.0.0.1:{port}",))
    await backend.start()
    try:
        assert fake.version == label(0)  # a fresh server is labelled v0
        sampling = SamplingParams(
            max_tokens=3, temperature=0.7, top_p=0.9, seed=11, stop=("</a>",), stop_token_ids=(9,)
        )
        # A streamed wave is one request per answer, each with its own seed (the wave's
        # plus its index); a wave read whole (`generate`) is one request of n, which
        # draws the same answers.
        streamed = await backend.wave([1, 2, 3], 2, sampling).answers()
        out = await backend.generate([1, 2, 3], 2, sampling)
        for answers in (streamed, out):
            assert [c.token_ids for c in answers] == [[16, 6, 7], [17, 6, 7]]
            assert [c.logprobs for c in answers] == [[-11.5] * 3, [-12.5] * 3]
            assert {c.finish_reason for c in answers} == {"length"}
            assert {c.policy_version for c in answers} == {0}
        (one,) = await backend.generate(
            [1, 2], 1, sampling, affinity_key="p1"
        )  # one answer: an object
        assert one.token_ids == [16, 6, 7]
        bodies = [b for p, b in fake.calls if p == "/generate"]
        assert [b["sampling_params"]["n"] for b in bodies] == [1, 1, 2, 1]
        assert {b["sampling_params"]["sampling_seed"] for b in bodies[:2]} == {11, 12}
        assert bodies[2]["sampling_params"]["sampling_seed"] == 11
        assert len({b["rid"] for b in bodies}) == 4
        body = bodies[0]
        assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
        params = body["sampling_params"]
        assert params["max_new_tokens"] == 3 and params["top_k"] == -1
        assert params["stop"] == ["</a>"] and params["no_stop_trim"] is True
        assert params["stop_token_ids"][-1] == 9 and len(params["stop_token_ids"]) > 1  # EOS too
    finally:
        await backend.close()


async def test_sglang_weight_load_pauses_loads_from_disk_labels_and_continues(
    toy: Any, tmp_path: Path, serve: Any
) -> None:
    fakes = [FakeSGLang(), FakeSGLang()]
    urls = tuple([f"http://127.0.0.1:{await serve(f)}" for f in fakes])
    backend = _backend(toy, tmp_path, urls=urls)
    await backend.start()
    try:
        weights = tmp_path / "v1.safetensors"
        weights.write_bytes(b"")
        names = list(read_checkpoint(toy.model_dir).specs)
        for fake in fakes:
            fake.calls.clear()
        await backend.load_weight_files([str(weights)], 1, names)
        assert backend.policy_version == 1
        for fake in fakes:
            paths = [p for p, _ in fake.calls]
            assert paths == [
                "/pause_generation",
                "/update_weights_from_disk",
                "/update_weight_version",
                "/continue_generation",
            ]
            model_path = Path(fake.calls[1][1]["model_path"])
            assert [p.resolve() for p in model_path.iterdir()] == [weights.resolve()]
            assert fake.version == label(1)
        # one server refuses the next load: both go back to v1, nothing is committed
        fakes[1].refuse_loads = True
        with pytest.raises(WeightsNotServed, match="not committed"):
            await backend.load_weight_files([str(weights)], 2, names)
        assert backend.policy_version == 1
        assert [f.version for f in fakes] == [label(1)] * 2
        assert [p for p, _ in fakes[0].calls][-3:] == [
            "/update_weights_from_disk",
            "/update_weight_version",
            "/continue_generation",
        ]
    finally:
        await backend.close()


async def test_a_server_left_paused_by_a_load_is_resumed_before_it_is_routed_to(
    toy: Any, tmp_path: Path, serve: Any
) -> None:
    """The sampler pauses its servers only inside a load; a server that dropped out of
    one before its resume (a failed reload, a lost connection) comes back still paused,
    and would hold every wave routed to it."""
    fake = FakeSGLang()
    fake.paused = True
    port = await serve(fake)
    dialect = dataclasses.replace(SGLANG, is_paused="/is_paused")
    backend = _backend(toy, tmp_path, urls=(f"http://127.0.0.1:{port}",), dialect=dialect)
    await backend.start()
    try:
        assert fake.paused is False
        assert [p for p, _ in fake.calls] == ["/update_weight_version", "/continue_generation"]
        assert [s["state"] for s in backend.members()] == ["ok"]
        fake.paused, fake.version = True, "someone-else"  # dropped out, then relabelled
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not fake.paused and fake.version == label(0):
                break
        assert fake.paused is False and fake.version == label(0)
        assert [s["state"] for s in backend.members()] == ["ok"]
    finally:
        await backend.close()


async def test_a_server_whose_weight_checksums_disagree_is_taken_out_of_routing(
    toy: Any, tmp_path: Path, serve: Any
) -> None:
    """The pool's checksum comparison (--engine-compare-checksums), on fakes whose dialect
    names vLLM's /weight_checker: after a load the servers are compared with each other,
    the odd one out is not routed to until a reload makes it agree; two servers that
    disagree commit nothing."""
    fakes = [FakeSGLang() for _ in range(3)]
    urls = tuple([f"http://127.0.0.1:{await serve(f)}" for f in fakes])
    backend = _backend(
        toy,
        tmp_path,
        urls=urls,
        dialect=dataclasses.replace(SGLANG, weight_checker="/weight_checker"),
        replica=ReplicaSettings(probe_s=0.2, compare_checksums=True),
    )
    await backend.start()
    try:
        weights = tmp_path / "v1.safetensors"
        weights.write_bytes(b"")
        names = list(read_checkpoint(toy.model_dir).specs)
        fakes[2].checksums = {"model.layers.0.qkv_proj.weight": "0bad"}
        await backend.load_weight_files([str(weights)], 1, names)
        assert backend.policy_version == 1
        servers = backend.members()
        assert [s["weights_mismatch"] for s in servers] == [False, False, True]
        assert servers[0]["weights_checksum"] == servers[1]["weights_checksum"] is not None
        assert "differ" in servers[2]["error"]
        fakes[2].calls.clear()
        for i in range(6):
            await backend.generate([1, 2, i], 2, SamplingParams(max_tokens=2))
        assert "/generate" not in [p for p, _ in fakes[2].calls]
        # its reloads keep failing the comparison until it serves what the others serve
        for _ in range(50):
            if [p for p, _ in fakes[2].calls].count("/update_weights_from_disk") >= 2:
                break
            await asyncio.sleep(0.1)
        assert backend.members()[2]["weights_mismatch"]
        fakes[2].checksums = dict(fakes[0].checksums)
        for _ in range(50):
            if not backend.members()[2]["weights_mismatch"]:
                break
            await asyncio.sleep(0.1)
        assert backend.members()[2]["weights_mismatch"] is False
        assert backend.members()[2]["policy_version"] == 1
        # two servers that disagree: neither is trusted, nothing is committed
        await backend.close()
        backend = _backend(
            toy,
            tmp_path,
            urls=urls[:2],
            dialect=dataclasses.replace(SGLANG, weight_checker="/weight_checker"),
            replica=ReplicaSettings(probe_s=0.2, compare_checksums=True),
        )
        await backend.start()
        fakes[1].checksums = {"model.layers.0.qkv_proj.weight": "0bad"}
        before = backend.policy_version
        with pytest.raises(WeightsNotServed, match="checksums disagree"):
            await backend.load_weight_files([str(weights)], 2, names)
        assert backend.policy_version == before
        assert [s["weights_mismatch"] for s in backend.members()] == [True, True]
    finally:
        await backend.close()


def test_service_names_resolve_to_one_url_per_address() -> None:
    service = ServiceName.parse("vllm-headless.ns.svc:8000")
    assert (service.host, service.port) == ("vllm-headless.ns.svc", 8000)
    for bad in ("vllm", "vllm:http", "http://vllm:8000", ":8000", "vllm:0"):
        with pytest.raises(ValueError, match="NAME:PORT"):
            ServiceName.parse(bad)
    pods = {"vllm": ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::1"]}
    assert resolve_service(ServiceName("vllm", 8000), lambda h, p: pods[h]) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://[fd00::1]:8000",
    ]
    # the system resolver on a name every host resolves
    assert "http://127.0.0.1:9" in resolve_service(ServiceName("localhost", 9))
    assert membership(["a", "b"], ["b", "c"]) == (["c"], ["a"])


async def test_servers_join_and_leave_with_the_service(
    toy: Any, tmp_path: Path, serve: Any
) -> None:
    first = FakeSGLang()
    port = await serve(first)
    second = FakeSGLang()
    try:
        await serve(second, "127.0.0.2", port)
    except OSError:
        pytest.skip("127.0.0.2 is not a loopback address here")
    pods = ["127.0.0.1"]

    def resolver(host: str, p: int) -> list[str]:
        if host != "engines":
            raise socket.gaierror("unknown")
        return list(pods)

    backend = _backend(
        toy,
        tmp_path,
        urls=(),
        services=(ServiceName("engines", port),),
        resolve_s=0.1,
        resolver=resolver,
    )
    await backend.start()
    try:
        assert [s["url"] for s in backend.members()] == [f"http://127.0.0.1:{port}"]
        second.version = "adaptive-rollout/other/v7"  # started with other weights
        pods.append("127.0.0.2")
        for _ in range(100):
            states = {s["url"]: s["state"] for s in backend.members()}
            if states.get(f"http://127.0.0.2:{port}") == "ok":
                break
            await asyncio.sleep(0.05)
        assert states[f"http://127.0.0.2:{port}"] == "ok"
        # synced to the committed weights (the base model) before its label made it routable
        assert [p for p, _ in second.calls][:2] == [
            "/update_weights_from_disk",
            "/update_weight_version",
        ]
        assert second.calls[0][1]["model_path"] == str(toy.model_dir)
        assert second.version == label(0)
        pods.remove("127.0.0.1")
        for _ in range(100):
            if backend.members()[0]["state"] == "gone":
                break
            await asyncio.sleep(0.05)
        assert [s["state"] for s in backend.members()] == ["gone", "ok"]
        first.calls.clear()
        await backend.generate([1, 2], 1, SamplingParams(max_tokens=2))
        assert not first.calls and second.calls[-1][0] == "/generate"
    finally:
        await backend.close()


def test_vllm_generate_answers_carry_their_weight_labels_and_must_add_up() -> None:
    """/inference/v1/generate's tokens-mode choice, as vLLM's protocol.py shapes it."""
    from sampler_service.backends.http.dialects import VLLM_GENERATE

    def choice(index: int, ids: list[int], spans: list[tuple[str, int, int]] | None) -> dict:
        return {
            "index": index,
            "finish_reason": "length",
            "token_ids": ids,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.25 * t} for t in ids]},
            "weight_versions": None
            if spans is None
            else [{"version": v, "start": a, "end": b} for v, a, b in spans],
        }

    body = {
        "choices": [
            choice(1, [4, 5, 6], [("a/v1", 0, 2), ("a/v2", 2, 3)]),
            choice(0, [7, 8], [("a/v1", 0, 2)]),
        ]
    }
    assert VLLM_GENERATE.answers(body) == [
        ([7, 8], [-1.75, -2.0], "length", (("a/v1", 0),)),
        ([4, 5, 6], [-1.0, -1.25, -1.5], "length", (("a/v1", 0), ("a/v2", 2))),
    ]
    assert VLLM_GENERATE.answers({"choices": [choice(0, [7], None)]})[0][3] is None
    with pytest.raises(RuntimeError, match="do not cover"):
        VLLM_GENERATE.answers({"choices": [choice(0, [7, 8], [("a/v1", 0, 1)])]})
    request = VLLM_GENERATE.request("toy", [1, 2], 4, SamplingParams(max_tokens=3, seed=9), "r")
    assert request["token_ids"] == [1, 2] and request["output_mode"] == "tokens"
    assert request["sampling_params"]["n"] == 4 and request["sampling_params"]["seed"] == 9


def test_vllm_completions_answers_take_the_lists_as_parsed_and_check_they_line_up() -> None:
    """/v1/completions' choice with `return_token_ids` and `return_tokens_as_token_ids`,
    as vLLM's protocol shapes it; an abort names vLLM's own id for the request."""
    from sampler_service.backends.http.dialects import VLLM

    def choice(index: int, ids: list[int], tokens: list[int]) -> dict:
        return {
            "index": index,
            "finish_reason": "stop",
            "token_ids": ids,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in tokens],
                "token_logprobs": [-0.5 * t for t in tokens],
            },
        }

    body = {"choices": [choice(1, [4, 5], [4, 5]), choice(0, [7, 8, 9], [7, 8, 9])]}
    assert VLLM.answers(body) == [
        ([7, 8, 9], [-3.5, -4.0, -4.5], "stop", None),
        ([4, 5], [-2.0, -2.5], "stop", None),
    ]
    without_ids = choice(0, [], [3, 4])
    del without_ids["token_ids"]
    assert VLLM.answers({"choices": [without_ids]})[0][0] == [3, 4]
    for ids, tokens in (([7, 8], [7, 8, 9]), ([7, 8, 9], [7, 8, 1])):  # short, or not its end
        with pytest.raises(RuntimeError, match="logprob tokens differ"):
            VLLM.answers({"choices": [choice(0, ids, tokens)]})
    assert VLLM.abort_bodies(["b", "a"]) == [{"request_ids": ["cmpl-a-0", "cmpl-b-0"]}]
