"""`adaptive-rollout serve --backend http` in front of two real `vllm serve` servers.

Two servers start once for the module (on loopback, the toy model; the first with
`--scheduling-policy priority`, the second on vLLM's default fcfs) and one sampler drives
them; the tests run in order: groups, the NCCL group the servers would form (refused:
they run without a weight-transfer config), weight pushes (wait and abort modes), kill -9 of
one server mid-run, that server coming back with other weights, which is not routed to
until it serves the committed version, and then refusing a load, which rolls the other
server back to the committed weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import cancelled_twin, collect, perturbed_file
from vllm_suite import CONFIG, REPORT

from trainer_client.launch import EngineServer, SamplerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT = [5, 6, 7, 8]


class Fleet:
    def __init__(
        self, servers: list[EngineServer], sampler: SamplerProcess, state: Path, weights: Path
    ) -> None:
        self.servers = servers
        self.sampler = sampler
        self.weights_dir = weights
        self.instance = (state / "instance_id").read_text().strip()

    def label(self, version: int) -> str:
        return f"adaptive-rollout/{self.instance}/v{version}"


@pytest.fixture(scope="module")
def fleet(toy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    pytest.importorskip("vllm.entrypoints.openai.api_server")
    root = tmp_path_factory.mktemp("http-engine")
    started = time.monotonic()
    policies = [("--scheduling-policy", "priority"), ()]
    servers = [
        EngineServer(
            toy.model_dir, root / f"vllm-{i}.log", args=("--enable-scale-out", *policy)
        ).start()
        for i, policy in enumerate(policies)
    ]
    try:
        for server in servers:
            server.wait_ready()
        REPORT["two vllm serve servers to /health (s)"] = round(time.monotonic() - started, 1)
        urls = [a for s in servers for a in ("--engine-url", s.url)]
        state = root / "state"
        sampler = SamplerProcess(
            toy.model_dir,
            toy.data_files,
            state,
            CONFIG,
            root / "sampler.log",
            heartbeat_s=0.5,
            extra=["--backend", "http", *urls, "--weights-dir", str(root / "weights"),
                   "--replica-probe-s", "0.5", "--engine-compare-checksums"],
        )  # fmt: skip
        began = time.monotonic()
        sampler.start(120)
        REPORT["sampler start to /ready, --backend http (s)"] = round(time.monotonic() - began, 1)
        yield Fleet(servers, sampler, state, root / "weights")
        sampler.stop()
    finally:
        for server in servers:
            server.stop()


def _check_group(g: dict) -> None:
    st = g["stats"]
    assert st["n_generated"] <= CONFIG["n_max"]
    assert st["n_pos"] + st["n_neg"] == st["n_generated"]
    if g["stop_reason"] == "rule":
        assert st["n_pos"] >= 2 and st["n_neg"] >= 2
    else:
        assert g["stop_reason"] == "n_max" and st["n_generated"] == CONFIG["n_max"]
    assert 2 <= len(g["samples"]) <= CONFIG["group_size"]
    # a group may span versions (waves around an update), each sample carries its own
    assert {s["policy_version"] for s in g["samples"]} <= set(
        range(g["policy_version_min"], g["policy_version_max"] + 1)
    )
    for s in g["samples"]:
        assert len(s["logprobs"]) == len(s["response_token_ids"]) <= CONFIG["max_tokens"]
        assert all(lp <= 0 for lp in s["logprobs"])
        assert s["finish_reason"] in ("stop", "length")


def _servers(client: httpx.Client) -> list[dict[str, Any]]:
    return client.get("/v1/stats").json()["engine"]["servers"]


def _weight_label(server: EngineServer) -> str:
    return httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"]


def _greedy(server: EngineServer) -> list[float]:
    """The server's own greedy answer's logprobs for a fixed prompt (its weights' print)."""
    r = httpx.post(
        server.url + "/v1/completions",
        json={
            "model": httpx.get(server.url + "/v1/models").json()["data"][0]["id"],
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return [float(v) for v in r.json()["choices"][0]["logprobs"]["token_logprobs"]]


def _check_logprobs_on(server: EngineServer, groups: list[dict]) -> None:
    """Each sample's logprobs are those of the weights its version names: rescored by a
    server that serves them (prompt logprobs at temperature 1, the groups' setting)."""
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    samples = [(g, s) for g in groups for s in g["samples"]]
    for at in range(0, len(samples), 64):
        batch = samples[at : at + 64]
        r = httpx.post(
            server.url + "/v1/completions",
            json={
                "model": model,
                "prompt": [g["prompt_token_ids"] + s["response_token_ids"] for g, s in batch],
                "max_tokens": 1,
                "prompt_logprobs": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        for (g, s), choice in zip(batch, choices, strict=True):
            positions = choice["prompt_logprobs"][len(g["prompt_token_ids"]) :]
            expected = [
                p[str(t)]["logprob"]
                for p, t in zip(positions, s["response_token_ids"], strict=True)
            ]
            assert s["logprobs"] == pytest.approx(expected, abs=2e-4), g["group_id"]


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def test_groups_stream_from_both_servers_and_obey_the_rule(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.sampler.url, timeout=60) as c:
        health = c.get("/health").json()
        assert health["backend"] == "http" and health["policy_version"] == 0
        started = time.monotonic()
        groups = collect(c, 12, timeout_s=180, wait_s=20)
        REPORT["12 balanced groups via two HTTP servers (s)"] = round(time.monotonic() - started, 1)
        servers = _servers(c)
    for g in groups:
        _check_group(g)
        assert g["policy_version_min"] == g["policy_version_max"] == 0
    assert "rule" in {g["stop_reason"] for g in groups}
    assert [s["url"] for s in servers] == [s.url for s in fleet.servers]
    assert all(s["state"] == "ok" and s["policy_version"] == 0 for s in servers)
    assert sum(s["waves"] for s in servers) > 0
    # Each server's scheduling policy was read at attach (answers carry their priority to
    # the first only; the cancelled-twin test below sends them there).
    assert [s["scheduling_policy"] for s in servers] == ["priority", "fcfs"]
    # the sampler labelled the servers' start-up weights as its version 0
    assert [_weight_label(s) for s in fleet.servers] == [fleet.label(0)] * 2


@pytest.fixture(scope="module")
def local(toy, loop_thread) -> Iterator[Any]:
    """The in-process vLLM backend on the same weights as the servers, beside them."""
    from sampler_service.backends.vllm import VLLMBackend

    engine = VLLMBackend(toy.model_dir, seed=0, max_model_len=64)
    started = time.monotonic()
    loop_thread.run(engine.start(), timeout=600)
    REPORT["in-process engine start beside the servers (s)"] = round(time.monotonic() - started, 1)
    yield engine
    loop_thread.run(engine.close(), timeout=120)


@contextlib.contextmanager
def _http_backend(
    fleet: Fleet, toy, loop_thread, weights_dir: Path, **settings: Any
) -> Iterator[Any]:
    """A second client of server 0 under the fleet's instance, started for the block and
    closed after it: its label is the fleet's committed one, so this client resyncs
    nothing."""
    from sampler_service.backends.http.transport import HTTPPoolSettings, build_http_fleet

    http = build_http_fleet(
        toy.model_dir,
        HTTPPoolSettings(
            urls=(fleet.servers[0].url,),
            instance_id=fleet.instance,
            weights_dir=weights_dir,
            **settings,
        ),
    )
    try:
        loop_thread.run(http.start())
        yield http
    finally:
        loop_thread.run(http.close())


def test_seeded_answers_match_the_in_process_backend(
    fleet: Fleet, toy, local, loop_thread, tmp_path: Path
) -> None:
    """Same weights, same seed: the HTTP hop returns the in-process engine's tokens."""
    from sampler_service.backends.base import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    with _http_backend(fleet, toy, loop_thread, tmp_path) as http:
        for prompt in (PROMPT, [9, 10, 11]):
            there = loop_thread.run(http.generate(prompt, 4, sampling))
            here = loop_thread.run(local.generate(prompt, 4, sampling))
            assert [c.token_ids for c in there] == [c.token_ids for c in here]
            for a, b in zip(there, here, strict=True):
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
        assert _weight_label(fleet.servers[0]) == fleet.label(0)


@pytest.mark.parametrize("name", ["vllm", "vllm-generate"])
def test_a_cancelled_answer_decodes_fewer_tokens_than_its_twin_over_http(
    fleet: Fleet, toy, local, loop_thread, tmp_path: Path, name: str
) -> None:
    """One request per answer under the server's own ids: greedy twins of one wave, the
    cancelled one aborted through the dialect's abort call comes back with the tokens it
    had decoded, a prefix of its twin's; a seeded wave's answers each have their own
    seed, so they differ, and are the in-process engine's answers index by index, sent
    whole or one request per answer, each with its priority (server 0 runs priority
    scheduling)."""
    from transformers import AutoTokenizer

    from sampler_service.backends.base import SamplingParams
    from sampler_service.backends.http.dialects import DIALECTS

    tokenizer = AutoTokenizer.from_pretrained(str(toy.model_dir))
    prompt = tokenizer("1234567890")["input_ids"]  # no `=` to answer: the toy never ends
    longest = 64 - len(prompt)
    with _http_backend(fleet, toy, loop_thread, tmp_path, dialect=DIALECTS[name]) as http:  # type: ignore[index]
        cut, _ = loop_thread.run(cancelled_twin(http, prompt, longest))
        assert len(cut.logprobs) == len(cut.token_ids)
        REPORT[f"cancelled twin over HTTP ({name}): tokens of its twin's"] = (
            f"{len(cut.token_ids)}/{longest}"
        )
        seeded = SamplingParams(temperature=1.0, max_tokens=longest, seed=9)
        priorities = (8, 6, 4, 2)
        assert http.orders_by_priority
        there = loop_thread.run(http.generate(prompt, 4, seeded, priorities=priorities))
        here = loop_thread.run(local.generate(prompt, 4, seeded))
        assert len({tuple(c.token_ids) for c in there}) == 4
        assert [c.token_ids for c in there] == [c.token_ids for c in here]

        async def one_by_one() -> dict[int, Any]:
            return {i: c async for i, c in http.wave(prompt, 4, seeded, priorities=priorities)}

        apart = loop_thread.run(one_by_one())
        assert [apart[i].token_ids for i in range(4)] == [c.token_ids for c in here]


def test_answers_sampled_under_a_foreign_label_are_reissued_not_kept(
    fleet: Fleet, toy, local, loop_thread, tmp_path: Path
) -> None:
    """The `vllm-generate` dialect (/inference/v1/generate, served with
    --enable-scale-out) returns the tokens /v1/completions does, and each answer's
    weight_versions spans: a server someone else relabelled is caught by the first wave
    it answers, which is sent again once the server is resynced, never kept. This client
    probes a minute apart, and the fleet's own sampler (which probes server 0 every half
    second and would resync it first) is frozen from the relabel to the resync, so the
    wave alone finds it."""
    from sampler_service.backends.base import SamplingParams
    from sampler_service.backends.http.dialects import VLLM_GENERATE
    from sampler_service.config import ReplicaSettings

    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    with _http_backend(
        fleet,
        toy,
        loop_thread,
        tmp_path,
        dialect=VLLM_GENERATE,
        replica=ReplicaSettings(probe_s=60.0),
    ) as http:

        def reissued() -> float | None:
            return http.metrics.registry.get_sample_value(
                "adaptive_rollout_replica_reissued_waves_total",
                {"replica": "0", "reason": "foreign_weights"},
            )

        there = loop_thread.run(http.generate(PROMPT, 4, sampling))
        here = loop_thread.run(local.generate(PROMPT, 4, sampling))
        assert [c.token_ids for c in there] == [c.token_ids for c in here]
        assert not reissued()
        os.kill(fleet.sampler.pid, signal.SIGSTOP)
        try:
            r = httpx.post(
                fleet.servers[0].url + "/update_weight_version",
                json={"new_version": "someone-else"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            again = loop_thread.run(http.generate(PROMPT, 4, sampling), timeout=120)
        finally:
            os.kill(fleet.sampler.pid, signal.SIGCONT)
        assert reissued() == 1
        assert [c.token_ids for c in again] == [c.token_ids for c in here]
        assert {c.policy_version for c in again} == {0}
        assert _weight_label(fleet.servers[0]) == fleet.label(0)


def test_the_http_hop_benchmark_measures_both_arms(
    fleet: Fleet, toy, local, loop_thread, tmp_path: Path
) -> None:
    """bench/http_hop.py's alternating windows, briefly, on the in-process engine and a
    server (which the fleet's sampler shares meanwhile: no rates are judged here)."""
    from transformers import AutoTokenizer

    from bench import http_hop

    tokenizer = AutoTokenizer.from_pretrained(str(toy.model_dir))
    with _http_backend(fleet, toy, loop_thread, tmp_path) as http:
        runs = loop_thread.run(
            http_hop.alternate(
                {"in-process": (local, lambda: 0.0), "http": (http, lambda: 0.0)},
                toy.data_files,
                tokenizer,
                answers=["toy"],
                stop_id=tokenizer.eos_token_id,
                pairs=2,
                max_tokens=8,
                n=4,
                warmup_s=1.0,
                measure_s=2.0,
            ),
            timeout=120,
        )
    assert [(r["arm"], r["pair"]) for r in runs] == [
        ("in-process", 0), ("http", 0), ("http", 1), ("in-process", 1)
    ]  # fmt: skip
    for r in runs:
        assert r["groups"] > 0 and r["waves"] > 0 and r["driver_cpu_s"] > 0
        assert r["answers"] == 4 * r["groups"] and r["tokens"] >= r["answers"]
    (row,) = http_hop.summarize(runs)
    assert row["answers"] == "toy" and len(row["pair_ratios"]) == 2
    REPORT["HTTP hop, toy answers, 2 s windows (http / in-process tokens/s)"] = round(
        row["ratio"], 2
    )


def test_nccl_describes_the_servers_and_is_refused_without_a_transfer_config(
    fleet: Fleet,
) -> None:
    """The servers' own /get_world_size and /server_info say what an NCCL group over them
    would be; started without --weight-transfer-config (CPU), forming it is refused with
    a 409 that says so, before any server is asked to join."""
    with httpx.Client(base_url=fleet.sampler.url, timeout=60) as c:
        r = c.get("/v1/weights/nccl")
        assert r.status_code == 200, r.text
        described = r.json()
        assert described["enabled"] is False and described["inference_ranks"] == 2
        assert described["group"] == "none"
        assert described["replicas"] == [
            {"replica": i, "url": s.url, "workers": 1, "rank_offset": 1 + i}
            for i, s in enumerate(fleet.servers)
        ]
        assert set(described["required"]) <= set(described["tensors"])
        init_info = {"master_address": "127.0.0.1", "master_port": 29600, "world_size": 3}
        r = c.post("/v1/weights/nccl/init", json={"init_info": init_info})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "nccl_unavailable"
        assert "--weight-transfer-config" in error["message"]
        assert all(s.url in error["message"] for s in fleet.servers)
        update = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}
        r = c.post("/v1/weights/nccl/update", json={"update_info": update, "version": 1})
        assert r.status_code == 409 and r.json()["error"]["code"] == "nccl_group_stale", r.text
        # nothing changed for sampling
        assert c.get("/health").json()["policy_version"] == 0
        assert all(s["state"] == "ok" for s in _servers(c))


def test_a_weight_push_reaches_both_servers(fleet: Fleet, toy) -> None:
    before = [_greedy(s) for s in fleet.servers]
    assert before[0] == pytest.approx(before[1], abs=1e-5)
    with httpx.Client(base_url=fleet.sampler.url, timeout=120) as c:
        started = time.monotonic()
        r = c.put("/v1/weights", params={"version": 1}, content=perturbed_file(toy.model_dir, 0.05))
        assert r.status_code == 200, r.text
        REPORT["PUT /v1/weights to two HTTP servers (s)"] = round(time.monotonic() - started, 2)
        assert c.get("/health").json()["policy_version"] == 1
        assert [_weight_label(s) for s in fleet.servers] == [fleet.label(1)] * 2
        # the servers' /weight_checker checksums were compared after the load: they agree
        checked = _servers(c)
        assert checked[0]["weights_checksum"] == checked[1]["weights_checksum"] is not None
        assert not any(s["weights_mismatch"] for s in checked)
        after = [_greedy(s) for s in fleet.servers]
        assert after[0] == pytest.approx(after[1], abs=1e-5)
        assert after[0] != pytest.approx(before[0], abs=1e-3)
        for _ in range(40):
            got = collect(c, 4, timeout_s=180, wait_s=20)
            for g in got:
                _check_group(g)
            if any(g["policy_version_min"] == 1 for g in got):
                break
        else:
            raise AssertionError("no groups from the pushed weights after 160 groups")
        assert all(s["policy_version"] == 1 for s in _servers(c))


def test_a_weight_push_in_abort_mode_reissues_the_aborted_waves(fleet: Fleet, toy) -> None:
    with httpx.Client(base_url=fleet.sampler.url, timeout=120) as c:
        assert c.patch("/v1/config", json={"weight_update_mode": "abort"}).status_code == 200
        collect(c, 2, timeout_s=180, wait_s=20)  # sampling is busy when the update lands
        r = c.put("/v1/weights", params={"version": 2}, content=perturbed_file(toy.model_dir, 0.04))
        assert r.status_code == 200, r.text
        assert [_weight_label(s) for s in fleet.servers] == [fleet.label(2)] * 2
        for _ in range(40):
            got = collect(c, 4, timeout_s=180, wait_s=20)
            for g in got:  # aborted requests are re-issued, never delivered as samples
                _check_group(g)
            if any(g["policy_version_min"] == 2 for g in got):
                break
        else:
            raise AssertionError("no groups from the weights pushed in abort mode")
        assert c.patch("/v1/config", json={"weight_update_mode": "wait"}).status_code == 200
        # Both servers serve on: a probe that timed out on a busy machine while the aborts
        # landed may hold one out for a probe interval, never for good.
        deadline = time.monotonic() + 60
        while (states := [(s["state"], s.get("error")) for s in _servers(c)]) != [("ok", None)] * 2:
            assert time.monotonic() < deadline, states
            time.sleep(0.25)


def test_continue_needs_the_generate_dialect_whose_answers_carry_their_spans(
    fleet: Fleet, toy, loop_thread, tmp_path: Path
) -> None:
    """`/v1/completions` reports no spans, so a sampler on the `vllm` dialect says it
    drains instead. On `vllm-generate` (a server of its own, which no other sampler
    resyncs meanwhile) a `recompute` update lets running answers go on, and each token's
    logprob is its own version's: the base model's for the first span, the new weights'
    for the second (scored by transformers in float32, vLLM's within 1e-5 here)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sampler_service.backends.base import SamplingParams
    from sampler_service.backends.http.dialects import VLLM_GENERATE
    from sampler_service.backends.http.transport import HTTPPoolSettings, build_http_fleet

    with httpx.Client(base_url=fleet.sampler.url, timeout=120) as c:
        assert c.patch("/v1/config", json={"weight_update_mode": "continue"}).status_code == 200
        updates = c.get("/v1/stats").json()["weight_updates"]
        assert updates["engine_continues"] == []
        assert "cannot continue" in updates["drains_instead"]
        # ... and warns where an operator looks: /health (the dashboard's badge row and
        # `adaptive-rollout stats`) and /v1/stats.
        warning = f"weight_update_mode continue: {updates['drains_instead']}"
        assert warning in c.get("/health").json()["warnings"]
        assert warning in c.get("/v1/stats").json()["warnings"]
        assert c.patch("/v1/config", json={"weight_update_mode": "wait"}).status_code == 200
    tokenizer = AutoTokenizer.from_pretrained(str(toy.model_dir))
    prompt = tokenizer("1234567890")["input_ids"]  # no `=` to answer: greedy runs long
    greedy = SamplingParams(temperature=0.0, max_tokens=64 - len(prompt))
    state = load_file(str(toy.model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    new = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    base = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32).eval()
    reloaded.load_state_dict(new)

    def scored(model: Any, tokens: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
        picked = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        return picked.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()

    server = EngineServer(toy.model_dir, tmp_path / "vllm.log", args=("--enable-scale-out",))
    server.start()
    try:
        server.wait_ready()
        http = build_http_fleet(
            toy.model_dir,
            HTTPPoolSettings(
                urls=(server.url,),
                instance_id="continue",
                weights_dir=tmp_path,
                dialect=VLLM_GENERATE,
            ),
        )
        loop_thread.run(http.start())
        assert http.continues == {"keep", "recompute"}

        async def across(version: int) -> list[Any]:
            reading = asyncio.ensure_future(http.wave(prompt, 4, greedy).answers())
            member = http.table.seats[0].member
            while len(member.requests) < 4 and not reading.done():
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)  # a few tokens in
            http.update_pause = "recompute"
            try:
                await http.load_weights(new, version)
            finally:
                http.update_pause = "wait"
            return await reading

        try:
            # A try whose answers finished before the load (a loaded machine) is made again,
            # running across the same new weights under the next version.
            version = 1
            answers = loop_thread.run(across(version))
            while not all(a.version_spans for a in answers) and version < 5:
                version += 1
                answers = loop_thread.run(across(version))
        finally:
            loop_thread.run(http.close())
    finally:
        server.stop()
    for a in answers:
        [(first, zero), (second, start)] = a.version_spans or [(None, None), (None, None)]
        assert (first, zero, second) == (version - 1, 0, version), a.version_spans
        assert 0 < start < len(a.token_ids)
        before = scored(base if first == 0 else reloaded, a.token_ids)
        assert a.logprobs[:start] == pytest.approx(before[:start], abs=2e-4)
        assert a.logprobs[start:] == pytest.approx(scored(reloaded, a.token_ids)[start:], abs=2e-4)


@pytest.mark.parametrize("name", ["vllm", "vllm-generate"])
def test_an_abort_reaches_the_requests_it_names(fleet: Fleet, name: str) -> None:
    """A weight update in `abort` mode aborts the sampler's in-flight requests by id; vLLM
    runs them under ids of its own making, so the dialect's abort body must name those:
    requests sent as the backend sends them are aborted by the bodies it builds."""
    from sampler_service.backends.base import SamplingParams
    from sampler_service.backends.http.dialects import DIALECTS

    dialect = DIALECTS[name]  # type: ignore[index]
    server = fleet.servers[0]
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def send_then_abort(after_s: float) -> list[Any]:
        ids = [f"ar-abort-{name}-{after_s}-{i}" for i in range(48)]
        bodies = [dialect.request(model, PROMPT, 4, SamplingParams(max_tokens=56), i) for i in ids]
        for body in bodies:  # run to max_tokens: the toy's own answers end after ~3 tokens
            body.get("sampling_params", body)["ignore_eos"] = True
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            calls = [asyncio.ensure_future(c.post(dialect.generate, json=b)) for b in bodies]
            await asyncio.sleep(after_s)
            for body in dialect.abort_bodies(ids):
                assert (await c.post(dialect.abort, json=body)).status_code == 200
            return [(await call).json() for call in calls]

    # An abort must land after the server took the requests and before their 56 decode
    # steps end; how long that is depends on the machine, so up to three tries.
    for after_s in (0.1, 0.03, 0.3):
        responses = asyncio.run(send_then_abort(after_s))
        reasons = Counter(c["finish_reason"] for r in responses for c in r["choices"])
        if reasons["abort"]:
            break
    assert set(reasons) <= {"abort", "length"} and reasons["abort"] > 0, reasons


def test_kill_9_of_one_server_mid_run_loses_no_group(fleet: Fleet) -> None:
    victim = fleet.servers[1]
    assert victim.proc is not None
    groups: list[dict] = []
    with httpx.Client(base_url=fleet.sampler.url, timeout=60) as c:
        # Frozen first, so that waves are in flight on it (they hang) when it dies.
        victim.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while _servers(c)[1]["inflight_samples"] == 0:
            assert time.monotonic() < deadline, "no wave went to the frozen server"
            groups += collect(c, 1, timeout_s=180, wait_s=20)
        victim.kill()
        groups += collect(c, 16, timeout_s=180, wait_s=20)  # one server serves everything now
        _wait(lambda: _servers(c)[1]["state"] == "down", 30, "the dead server is not taken out")
        servers = _servers(c)
        assert c.get("/ready").status_code == 200
        metrics = c.get("/metrics").text
        # a wave lost with the server was re-issued, not reported as an engine error
        assert c.get("/v1/stats").json()["last_error"] is None
    assert 'adaptive_rollout_replica_state{replica="1",state="down"} 1.0' in metrics
    assert 'adaptive_rollout_replica_state{replica="0",state="ok"} 1.0' in metrics
    for g in groups:
        _check_group(g)
    _check_logprobs_on(fleet.servers[0], [g for g in groups if g["policy_version_min"] == 2])
    assert servers[0]["state"] == "ok"
    assert servers[1]["reissued_waves"] >= 1 and servers[1]["inflight_samples"] == 0
    REPORT["waves re-issued after kill -9"] = servers[1]["reissued_waves"]


def test_a_server_with_other_weights_serves_only_after_it_loads_the_committed_ones(
    fleet: Fleet, toy, tmp_path: Path
) -> None:
    other = tmp_path / "other-model"
    other.mkdir()
    for file in toy.model_dir.iterdir():
        if file.suffix != ".safetensors":
            (other / file.name).write_bytes(file.read_bytes())
    (other / "model.safetensors").write_bytes(perturbed_file(toy.model_dir, 0.3, seed=7))
    old = fleet.servers[1]
    back = EngineServer(other, old.log_path, port=old.port)
    fleet.servers[1] = back
    started = time.monotonic()
    back.start()
    groups: list[dict] = []
    with httpx.Client(base_url=fleet.sampler.url, timeout=60) as c:
        while _servers(c)[1]["state"] != "ok":  # sampling goes on while it starts and syncs
            assert time.monotonic() - started < 300, "the restarted server is not synced"
            groups += collect(c, 2, timeout_s=180, wait_s=20)
            time.sleep(1.0)
        REPORT["restarted server to routable (s)"] = round(time.monotonic() - started, 1)
        assert _weight_label(back) == fleet.label(2)
        # synced, it was checked against the checksums the servers agreed on at v2
        synced = _servers(c)
        assert synced[1]["weights_checksum"] == synced[0]["weights_checksum"] is not None
        # it serves the committed weights now, not the ones it was started with
        assert _greedy(back) == pytest.approx(_greedy(fleet.servers[0]), abs=1e-5)
        groups += collect(c, 8, timeout_s=180, wait_s=20)
    for g in groups:
        _check_group(g)
    # no sample came from the weights the server was started with
    _check_logprobs_on(fleet.servers[0], [g for g in groups if g["policy_version_min"] == 2])


def _stale_volume_python(snapshot: Path, weights: Path, where: Path) -> str:
    """An interpreter that runs in its own mount namespace, where `weights` shows the
    `snapshot` taken now: the server sees the versions committed so far, never a newer
    one, as a pod whose copy of the shared weights volume stopped syncing would."""
    script = where / "python-with-stale-weights"
    script.write_text(
        "#!/bin/sh\n"
        "exec unshare -m --propagation private -- /bin/sh -c "
        '\'mount --bind "$1" "$2" || exit 97; shift 2; exec "$@"\' '
        f"sh {' '.join(shlex.quote(str(p)) for p in (snapshot, weights, sys.executable))} "
        '"$@"\n'
    )
    script.chmod(0o755)
    return str(script)


def test_a_server_that_refuses_a_load_is_rolled_back_with_the_rest(
    fleet: Fleet, toy, tmp_path: Path
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here (util-linux)")
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"no mount namespaces here: {probe.stderr.decode().strip()}")
    snapshot = tmp_path / "weights-snapshot"
    shutil.copytree(fleet.weights_dir, snapshot, symlinks=True)
    old = fleet.servers[1]
    old.stop()
    stale = EngineServer(
        old.model_dir,
        old.log_path,
        port=old.port,
        python=_stale_volume_python(snapshot, fleet.weights_dir, tmp_path),
        args=old.args,
    )
    fleet.servers[1] = stale
    stale.start()
    with httpx.Client(base_url=fleet.sampler.url, timeout=120) as c:
        committed = c.get("/health").json()["policy_version"]
        # The sampler may not have noticed the stop yet (it still says "ok" of the old
        # server): synced means the new server itself carries the committed label.
        stale.wait_ready()
        _wait(
            lambda: (
                _weight_label(stale) == fleet.label(committed) and _servers(c)[1]["state"] == "ok"
            ),
            300,
            "the restarted server is not synced",
        )
        before = [_greedy(s) for s in fleet.servers]
        assert before[0] == pytest.approx(before[1], abs=1e-5)
        r = c.put(
            "/v1/weights",
            params={"version": committed + 1},
            content=perturbed_file(toy.model_dir, 0.05, seed=11),
        )
        # The stale server cannot find the new files and answers its reload with an
        # error; the server that did load them is given the committed weights back.
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "weights_not_served"
        assert f"v{committed + 1} not committed" in error["message"]
        assert stale.url in error["message"] and fleet.servers[0].url not in error["message"]
        assert c.get("/health").json()["policy_version"] == committed
        assert _weight_label(fleet.servers[0]) == fleet.label(committed)
        assert _greedy(fleet.servers[0]) == pytest.approx(before[0], abs=1e-5)
        # vLLM 0.32's engine core may not survive a failed reload: it then dies at the next
        # step it runs (EngineDeadError; its /health answers 200 until then). A step on it
        # says which it is: a dead core must leave routing and the other server carry the
        # run; a live one must serve the committed weights it was rolled back to.
        try:
            alive = _greedy(stale)
        except (AssertionError, httpx.HTTPError):
            _wait(
                lambda: _servers(c)[1]["state"] == "down",
                120,
                "the refusing server's dead engine is still routed",
            )
        else:
            assert alive == pytest.approx(before[1], abs=1e-5)
            assert _weight_label(stale) == fleet.label(committed)
        assert _servers(c)[0]["state"] == "ok" and c.get("/ready").status_code == 200
        groups = collect(c, 8, timeout_s=180, wait_s=20)
    for g in groups:
        _check_group(g)
        assert g["policy_version_max"] <= committed
    _check_logprobs_on(
        fleet.servers[0], [g for g in groups if g["policy_version_min"] == committed]
    )
