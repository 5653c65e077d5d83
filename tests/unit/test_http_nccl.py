"""NCCL weight transfer through `vllm serve`'s own API (`--backend http`), without GPUs.

The servers are `fake_engines.FakeVLLM`: vLLM 0.32's request and response shapes for the
weight-transfer endpoints and what the backend's start-up reads, with the worker's session
rules; the trainer's collective is a `Rendezvous` of the servers in the round (a receive
returns once every rank arrived, as a broadcast does). What is checked is the backend's
part: the rank layout, each server's calls in order, the labels, the stale group, a failed
receive, and the versions a server is given when it must be resynced after a commit that
came over NCCL.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sampler_service.backends.base import SamplingParams
from sampler_service.backends.checkpoint import read_checkpoint
from sampler_service.backends.http.dialects import SGLANG, VLLM
from sampler_service.backends.http.member import weight_label
from sampler_service.backends.http.transport import HTTPPoolSettings, build_http_fleet
from sampler_service.config import ReplicaSettings
from sampler_service.fleet.pool import Fleet
from sampler_service.weights.types import NCCLGroupStale, NCCLUnavailable, WeightsNotServed

from .fake_engines import FakeSGLang, FakeVLLM, Rendezvous
from .fake_fleet import trainer_init

UPDATE = {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"], "shapes": [[8, 4]]}
ROUND = [
    "/pause",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/resume",
]


def label(version: int) -> str:
    """A version's label in the tests' sampler instance `t`."""
    return weight_label("t", version)


def every_tensor(toy: Any) -> list[str]:
    """A whole checkpoint's tensor names (the servers reload whole checkpoints)."""
    return list(read_checkpoint(toy.model_dir).specs)


@pytest.fixture
async def pool(
    toy: Any, tmp_path: Path, serve: Any
) -> AsyncIterator[Callable[..., Awaitable[Fleet]]]:
    """Starts the fleet in front of fake servers (closed after the test)."""
    backends: list[Fleet] = []

    async def start(fakes: list[FakeSGLang], **kw: Any) -> Fleet:
        settings = HTTPPoolSettings(
            urls=tuple([f"http://127.0.0.1:{await serve(f)}" for f in fakes]),
            instance_id="t",
            weights_dir=tmp_path / "w",
            **{"dialect": VLLM, "replica": ReplicaSettings(probe_s=0.1), **kw},
        )
        backends.append(build_http_fleet(toy.model_dir, settings))
        await backends[-1].start()
        return backends[-1]

    yield start
    for backend in backends:
        await backend.close()


def _round(fakes: list[FakeVLLM], parties: int) -> None:
    """The trainer's next collective: `parties` ranks take part."""
    trainer = Rendezvous(parties)
    for fake in fakes:
        fake.trainer = trainer


async def _commit_over_nccl(backend: Fleet, fakes: list[FakeVLLM], version: int) -> None:
    """The trainer forms the group over every server and sends `version`."""
    _round(fakes, len(fakes))
    await backend.nccl_init(trainer_init(1 + sum(f.world_size for f in fakes)))
    _round(fakes, len(fakes))
    await backend.nccl_update(UPDATE, version)


def _posts(fake: FakeVLLM) -> list[str]:
    return [p for p, _ in fake.calls]


def _bodies(fake: FakeVLLM, path: str) -> list[Any]:
    return [b for p, b in fake.calls if p == path]


async def _until(what: str, check: Callable[[], bool]) -> None:
    for _ in range(400):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(what)


async def _served_by(backend: Fleet, fakes: list[FakeVLLM]) -> list[int]:
    """Which servers a few waves of new prompts sent at once reached (least-loaded routing
    spreads them over every routable server)."""
    for fake in fakes:
        fake.calls.clear()
    sampling = SamplingParams(max_tokens=2)
    await asyncio.gather(
        *(backend.generate([1, 2], 1, sampling, affinity_key=uuid.uuid4().hex) for _ in range(12))
    )
    return [i for i, f in enumerate(fakes) if "/v1/completions" in _posts(f)]


async def _serve_everywhere(backend: Fleet, fakes: list[FakeVLLM], version: int) -> None:
    """Every server carries `version`'s label, and waves reach every one."""
    assert [f.version for f in fakes] == [label(version)] * len(fakes)
    assert await _served_by(backend, fakes) == list(range(len(fakes)))


async def test_an_nccl_round_reaches_every_server_at_its_own_ranks(
    pool: Any, toy: Any, tmp_path: Path
) -> None:
    fakes = [FakeVLLM(world_size=1), FakeVLLM(world_size=2)]
    backend = await pool(fakes)
    urls = [s["url"] for s in backend.members()]
    described = await backend.nccl_describe()
    assert described.enabled and described.inference_ranks == 3
    assert described.group == "none" and "init first" in (described.stale or "")
    assert described.replicas == [
        {"replica": 0, "url": urls[0], "workers": 1, "rank_offset": 1},
        {"replica": 1, "url": urls[1], "workers": 2, "rank_offset": 2},
    ]
    assert described.required == frozenset(every_tensor(toy))
    for fake in fakes:
        fake.calls.clear()
    _round(fakes, 2)
    await backend.nccl_init(trainer_init(4))
    assert [_bodies(f, "/init_weight_transfer_engine") for f in fakes] == [
        [{"init_info": {**trainer_init(4), "rank_offset": 1}}],
        [{"init_info": {**trainer_init(4), "rank_offset": 2}}],
    ]
    assert backend.nccl_group_state() == "ok"
    # the trainer sized the group for another layout: refused before any server joins
    with pytest.raises(ValueError, match="world_size 3"):
        await backend.nccl_init(trainer_init(3))
    assert [len(_bodies(f, "/init_weight_transfer_engine")) for f in fakes] == [1, 1]
    _round(fakes, 2)
    await backend.nccl_init(trainer_init(4))
    for fake in fakes:
        fake.calls.clear()
    _round(fakes, 2)  # both receive at once, or the broadcast never completes
    await backend.nccl_update(UPDATE, 1)
    assert backend.policy_version == 1
    for fake in fakes:
        assert _posts(fake) == ROUND
        assert _bodies(fake, "/update_weights") == [{"update_info": UPDATE}]
        assert _bodies(fake, "/finish_weight_update") == [{"weight_version": label(1)}]
    assert [s["policy_version"] for s in backend.members()] == [1, 1]
    await _serve_everywhere(backend, fakes, 1)
    out = await backend.generate([1, 2], 2, SamplingParams(max_tokens=2))
    assert {c.policy_version for c in out} == {1}
    await backend.nccl_shutdown()
    assert [_posts(f)[-1] for f in fakes] == ["/shutdown_weight_transfer_engine"] * 2
    assert backend.nccl_group_state() == "none"
    with pytest.raises(NCCLGroupStale, match="init first"):
        await backend.nccl_update(UPDATE, 2)


async def test_a_failed_receive_takes_its_server_out_and_labels_nothing_wrong(
    pool: Any, toy: Any, tmp_path: Path
) -> None:
    """The server whose /update_weights fails may hold partial weights: it is not routed
    to, is reloaded with the last file weights under their own version (the version
    committed over NCCL exists only in the other server), and serves again once the next
    NCCL round reaches it."""
    fakes = [FakeVLLM(), FakeVLLM()]
    backend = await pool(fakes)
    _round(fakes, 2)
    await backend.nccl_init(trainer_init(3))
    fakes[1].refuse_updates = True
    for fake in fakes:
        fake.calls.clear()
    _round(fakes, 1)  # only the healthy server's rank takes the broadcast
    with pytest.raises(RuntimeError, match="failed on") as failed:
        await backend.nccl_update(UPDATE, 1)
    assert backend.members()[1]["url"] in str(failed.value)
    assert "serving v1" in str(failed.value) and "form the NCCL group again" in str(failed.value)
    assert backend.policy_version == 1  # the other server installed it
    assert backend.nccl_group_state() == "none"
    # the failed session was closed under the label it had; vLLM refuses that finish (the
    # failed update ended its session), so the label stays as it was
    assert _bodies(fakes[1], "/finish_weight_update") == [{"weight_version": label(0)}]
    assert _posts(fakes[1])[:5] == [p for p in ROUND if p != "/reset_prefix_cache"]
    assert fakes[0].version == label(1)
    # resynced from the files it can read: the base model, labelled v0, never v1
    await _until(
        "the failed server is not reloaded",
        lambda: "/update_weight_version" in _posts(fakes[1]),
    )
    assert _bodies(fakes[1], "/collective_rpc")[0]["kwargs"]["weights_path"] == str(toy.model_dir)
    assert _bodies(fakes[1], "/update_weight_version") == [{"new_version": label(0)}]
    assert fakes[1].version == label(0)
    assert [s["policy_version"] for s in backend.members()] == [1, 0]
    assert await _served_by(backend, fakes) == [0]
    # it waits for the next round: the probes load nothing more meanwhile
    reloads = _posts(fakes[1]).count("/collective_rpc")
    await asyncio.sleep(0.5)
    assert _posts(fakes[1]).count("/collective_rpc") == reloads
    # the trainer forms the group again; the next round brings it the committed weights
    fakes[1].refuse_updates = False
    await _commit_over_nccl(backend, fakes, 2)
    await _serve_everywhere(backend, fakes, 2)


async def test_a_restart_after_an_nccl_commit_makes_the_group_stale_and_is_not_mislabelled(
    pool: Any, toy: Any, tmp_path: Path
) -> None:
    """A server that restarts between two probes comes back with the weights it was
    started with: it leaves the group (the next update is refused before any transfer),
    and its resync labels the file weights it reloads with their own version; a file
    push brings it the committed weights again."""
    fakes = [FakeVLLM(), FakeVLLM()]
    backend = await pool(fakes)
    await _commit_over_nccl(backend, fakes, 1)
    fakes[1].calls.clear()
    fakes[1].restart()
    await _until("the restart is not seen", lambda: backend.nccl_group_state() == "stale")
    url = backend.members()[1]["url"]
    assert url in ((await backend.nccl_describe()).stale or "")
    fakes[0].calls.clear()
    with pytest.raises(NCCLGroupStale, match=url):
        await backend.nccl_update(UPDATE, 2)
    assert not fakes[0].calls  # refused before any server was paused or asked to receive
    await _until("the restarted server is not resynced", lambda: fakes[1].version != "default")
    assert [b["new_version"] for b in _bodies(fakes[1], "/update_weight_version")] == [label(0)]
    assert backend.policy_version == 1
    assert await _served_by(backend, fakes) == [0]
    # a file push reaches every server up, the waiting one too
    weights = tmp_path / "v2.safetensors"
    weights.write_bytes(b"")
    await backend.load_weight_files([str(weights)], 2, every_tensor(toy))
    await _serve_everywhere(backend, fakes, 2)


async def test_a_refused_file_push_after_an_nccl_commit_rolls_back_under_the_files_version(
    pool: Any, toy: Any, tmp_path: Path
) -> None:
    """A file push that one server refuses is rolled back to the last file weights; the
    committed version came over NCCL, so the servers rolled back carry the files' own
    version (not routed to until the next NCCL round), never the committed one."""
    fakes = [FakeVLLM(), FakeVLLM()]
    backend = await pool(fakes)
    await _commit_over_nccl(backend, fakes, 1)
    fakes[1].refuse_loads = True
    fakes[0].calls.clear()
    weights = tmp_path / "v2.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(WeightsNotServed, match="v1 came over NCCL"):
        await backend.load_weight_files([str(weights)], 2, every_tensor(toy))
    assert backend.policy_version == 1
    assert [b["new_version"] for b in _bodies(fakes[0], "/update_weight_version")] == [label(0)]
    assert _bodies(fakes[0], "/collective_rpc")[-1]["kwargs"]["weights_path"] == str(toy.model_dir)
    assert backend.members()[0]["policy_version"] == 0


async def test_a_server_that_comes_up_after_the_group_was_formed_makes_it_stale(
    pool: Any, toy: Any, tmp_path: Path
) -> None:
    fakes = [FakeVLLM(), FakeVLLM()]
    fakes[1].healthy = False
    backend = await pool(fakes)
    assert [s["state"] for s in backend.members()] == ["ok", "down"]
    assert (await backend.nccl_describe()).inference_ranks == 1
    _round(fakes, 1)
    await backend.nccl_init(trainer_init(2))
    assert backend.nccl_group_state() == "ok"
    fakes[1].healthy = True
    await _until("the late server is not attached", lambda: backend.members()[1]["state"] == "ok")
    described = await backend.nccl_describe()
    assert described.group == "stale" and "came up after" in (described.stale or "")
    assert described.inference_ranks == 2
    fakes[0].calls.clear()
    with pytest.raises(NCCLGroupStale, match="came up after"):
        await backend.nccl_update(UPDATE, 1)
    assert not fakes[0].calls


async def test_servers_without_a_weight_transfer_config_refuse_the_group(
    pool: Any, toy: Any, tmp_path: Path
) -> None:
    fakes = [FakeVLLM(), FakeVLLM(world_size=2, transfer=None)]
    backend = await pool(fakes)
    described = await backend.nccl_describe()
    assert not described.enabled and described.inference_ranks == 3
    with pytest.raises(NCCLUnavailable, match="weight-transfer-config") as refused:
        await backend.nccl_init(trainer_init(4))
    assert backend.members()[1]["url"] in str(refused.value)
    assert backend.members()[0]["url"] not in str(refused.value)
    assert not any(_bodies(f, "/init_weight_transfer_engine") for f in fakes)


async def test_sglang_servers_refuse_nccl_saying_why(pool: Any) -> None:
    backend = await pool([FakeSGLang()], dialect=SGLANG)
    for call in (backend.nccl_describe(), backend.nccl_init(trainer_init(2))):
        with pytest.raises(NCCLUnavailable, match="SGLang's distributed update"):
            await call
