"""The fleet's wave router (no engines), the `--backend http` flags, the HTTP fleet's
refusal of partial updates before any server sees them, and the answer priorities it
sends by each server's scheduling policy. The rule that only members serving the
committed version are handed waves is the fleet suite's (test_fleet.py)."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sampler_service.backends.base import SamplingParams
from sampler_service.backends.http.transport import HTTPPoolSettings, build_http_fleet
from sampler_service.cli import add_serve_arguments
from sampler_service.config import ReplicaSettings, ServeSettings
from sampler_service.fleet.routing import STICKY_SLACK_SAMPLES, WaveRouter, choose
from sampler_service.weights.types import WeightsRejected
from trainer_client.contract.flags import model_from_args

from .fake_engines import FakeVLLM


@dataclass(eq=False)
class _Engine:
    index: int
    inflight: int = 0


def test_a_prompt_goes_back_to_its_engine_while_loads_are_even() -> None:
    a, b = _Engine(0, inflight=40), _Engine(1, inflight=0)
    target, kind, _ = choose(a, 8, [a, b], set(), max_inflight=64)
    assert (target, kind) == (a, "sticky")
    target, kind, _ = choose(a, 8, [a, b], set(), max_inflight=64, route="least-loaded")
    assert (target, kind) == (b, "moved")


def test_an_overloaded_engine_gives_the_prompt_to_the_least_loaded() -> None:
    a, b = _Engine(0, inflight=STICKY_SLACK_SAMPLES + 20), _Engine(1, inflight=10)
    target, kind, _ = choose(a, 4, [a, b], set(), max_inflight=1000)
    assert (target, kind) == (b, "moved")


def test_a_full_engine_makes_its_prompt_wait_and_a_new_prompt_goes_elsewhere() -> None:
    a, b = _Engine(0, inflight=60), _Engine(1, inflight=60)
    assert choose(a, 8, [a, b], set(), max_inflight=64) == (None, "sticky", a)
    assert choose(None, 8, [a, b], set(), max_inflight=64) == (None, "new", None)
    # an idle engine takes a wave larger than the cap; a re-issued wave may overshoot it
    assert choose(None, 100, [_Engine(0)], set(), max_inflight=64)[0] is not None
    target, _, _ = choose(None, 8, [a, b], set(), max_inflight=64, reissue=True)
    assert target is a


def test_a_gone_engine_loses_its_prompts() -> None:
    a, b = _Engine(0), _Engine(1, inflight=8)
    target, kind, _ = choose(a, 4, [b], set(), max_inflight=64)
    assert (target, kind) == (b, "moved")


async def test_router_keeps_fifo_order_and_reissued_waves_first() -> None:
    engines = [_Engine(0)]
    router: WaveRouter[_Engine] = WaveRouter(
        lambda: engines,
        lambda e: True,
        lambda e, n: setattr(e, "inflight", e.inflight + n),
        max_inflight=8,
    )
    first = await router.acquire(1, 8)
    order: list[str] = []
    waits = []
    for name, key, reissue in (("fresh", 2, False), ("again", 3, True)):
        task = asyncio.create_task(router.acquire(key, 8, reissue))
        task.add_done_callback(lambda _, name=name: order.append(name))
        waits.append(task)
        await asyncio.sleep(0)
    router.release(first, 8)
    await asyncio.wait_for(waits[1], 1)
    assert order == ["again"]
    router.release(engines[0], 8)
    await asyncio.wait_for(waits[0], 1)
    assert order == ["again", "fresh"] and router.affinity[3] == 0


def _serve(*flags: str) -> ServeSettings:
    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    return model_from_args(
        parser, ServeSettings, parser.parse_args(["--model", "m", "--data", "d.jsonl", *flags])
    )


def test_http_backend_flags(tmp_path: Path) -> None:
    wd = ["--weights-dir", str(tmp_path)]
    urls = ["--engine-url", "http://10.0.0.1:8000", "--engine-url", "http://10.0.0.2:8000/"]
    settings = _serve("--backend", "http", *urls, *wd)
    assert settings.engine_url == ["http://10.0.0.1:8000", "http://10.0.0.2:8000/"]
    found = _serve("--backend", "http", "--engine-service", "engines.ns.svc:8000", *wd)
    assert found.engine_service == ["engines.ns.svc:8000"] and found.engine_dialect == "vllm"
    assert (
        _serve("--backend", "http", *urls, *wd, "--engine-dialect", "sglang").engine_dialect
        == "sglang"
    )
    checked = _serve("--backend", "http", *urls, *wd, "--engine-compare-checksums")
    assert checked.replica.compare_checksums
    for bad in (
        ["--backend", "http", *wd],  # no server
        ["--backend", "http", *urls],  # no shared weights dir
        ["--backend", "http", "--engine-url", "10.0.0.1:8000", *wd],  # no scheme
        ["--backend", "http", "--engine-url", "http://h:1/v1", *wd],  # a path
        ["--backend", "http", *urls, "--engine-url", "http://10.0.0.1:8000", *wd],  # twice
        ["--backend", "http", *urls, *wd, "--replicas", "2"],
        ["--backend", "vllm", *urls],  # URLs without the http backend
        ["--backend", "http", "--engine-service", "engines", *wd],  # no port
        ["--backend", "vllm", "--engine-service", "engines:8000"],
        ["--backend", "vllm", "--engine-dialect", "sglang"],
        ["--backend", "vllm", "--engine-compare-checksums"],
        [
            "--backend",
            "http",
            *urls,
            *wd,
            "--engine-dialect",
            "sglang",
            "--engine-compare-checksums",
        ],
    ):
        with pytest.raises(SystemExit):
            _serve(*bad)


async def _started_fleet(toy: Any, tmp_path: Path, serve: Any, fake: FakeVLLM) -> Any:
    """An HTTP fleet of the one fake server, started (no probe runs during a test)."""
    settings = HTTPPoolSettings(
        urls=(f"http://127.0.0.1:{await serve(fake)}",),
        instance_id="t",
        weights_dir=tmp_path / "w",
        replica=ReplicaSettings(probe_s=60.0),
    )
    backend = build_http_fleet(toy.model_dir, settings)
    await backend.start()
    return backend


async def test_http_fleet_refuses_a_partial_update_before_any_server_sees_it(
    toy: Any, tmp_path: Path, serve: Any
) -> None:
    fake = FakeVLLM()
    backend = await _started_fleet(toy, tmp_path, serve, fake)
    try:
        fake.calls.clear()
        with pytest.raises(WeightsRejected, match="whole checkpoints"):
            await backend.load_weight_files(["w.safetensors"], 1, ["model.norm.weight"])
        assert backend.policy_version == 0 and not list((tmp_path / "w").iterdir())
        assert not fake.calls
    finally:
        await backend.close()


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_answers_carry_their_priority_to_a_server_on_priority_scheduling_only(
    toy: Any, tmp_path: Path, serve: Any, policy: str
) -> None:
    """The scheduling policy a server reports in /server_info decides: under `priority`
    each answer's request carries its priority (a wave sent whole: its first answer's) and
    the fleet orders by priority; under fcfs no request carries one."""
    fake = FakeVLLM(scheduling_policy=policy)
    backend = await _started_fleet(toy, tmp_path, serve, fake)
    try:
        assert backend.orders_by_priority == (policy == "priority")
        sampling = SamplingParams(max_tokens=2)
        answers = [a async for a in backend.wave([5, 6], 2, sampling, priorities=(7, 3))]
        assert sorted(index for index, _ in answers) == [0, 1]
        await backend.generate([5, 6], 2, sampling, priorities=(4, 9))
    finally:
        await backend.close()
    sent = [body.get("priority") for path, body in fake.calls if path == "/v1/completions"]
    if policy == "priority":
        assert sorted(sent[:2]) == [3, 7] and sent[2:] == [4]
    else:
        assert sent == [None, None, None]
