"""The fleet written once, against fake members (fake_fleet.py): the weight barrier, the
rollback of a refused update, recovery and re-issue, the NCCL group and its staleness,
routing, and the fleet of one; the wave handle every member's `generate` returns, and
the fleet's own streamed waves (answers passed on by index, cancels forwarded, only
what a failed member did not answer issued again).

The wire of each transport is tested live elsewhere: the HTTP servers against fake
servers (test_http_*.py) and real `vllm serve` (tests/vllm_backend), the Ray replicas on
a Ray head (tests/ray).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pytest

from sampler_service.backends.base import (
    CheckpointBackend,
    Completion,
    GenerationAborted,
    SamplingParams,
    StreamedWave,
    Wave,
    WaveRequest,
    WholeWave,
)
from sampler_service.config import ReplicaSettings
from sampler_service.errors import NotSupported
from sampler_service.fleet.local import LocalFleet
from sampler_service.fleet.nccl import rank_offsets, replica_init_infos
from sampler_service.fleet.pool import Fleet
from sampler_service.weights.types import (
    NCCLDescription,
    NCCLGroupStale,
    NCCLUnavailable,
    TensorSpec,
    WeightsNotServed,
    WeightsRejected,
)

from .fake_fleet import SPECS, FakeMember, FakeTransport, trainer_init

SAMPLING = SamplingParams(max_tokens=2)
EVERY = list(SPECS)
BARRIER = [("pause", "wait"), ("load", 1, 1), ("set_label", 1), ("label",), ("resume",)]


@pytest.fixture
async def fleet() -> AsyncIterator[Callable[..., Awaitable[Fleet]]]:
    """Starts a fleet over fake members (closed after the test)."""
    fleets: list[Fleet] = []

    async def start(members: list[FakeMember], **settings: Any) -> Fleet:
        replica = ReplicaSettings(
            **{"probe_s": 0.05, "probe_timeout_s": 0.5, "max_restarts": 2, **settings}
        )
        fleets.append(Fleet(FakeTransport(members), replica))
        await fleets[-1].start()
        return fleets[-1]

    yield start
    for started in fleets:
        await started.close()


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _state(fleet: Fleet, index: int) -> str:
    return str(fleet.members()[index]["state"])


async def _versions(fleet: Fleet, waves: int = 6) -> set[int]:
    """The versions waves of new prompts come back under."""
    outs = await asyncio.gather(
        *(fleet.generate([1, i], 1, SAMPLING, affinity_key=f"p{i}") for i in range(waves))
    )
    return {c.policy_version for out in outs for c in out}


def _served(members: list[FakeMember]) -> list[int]:
    """Which members ran a wave since their calls were cleared."""
    return [i for i, m in enumerate(members) if m.named("generate")]


# -- the barrier --------------------------------------------------------------------------
async def test_the_barrier_pauses_loads_labels_confirms_and_resumes_then_commits(
    fleet: Any,
) -> None:
    members = [FakeMember(0, restartable=False), FakeMember(1, restartable=False)]
    pool = await fleet(members)
    assert pool.policy_version == 0 and pool.health().state == "ok"
    for m in members:
        m.calls.clear()
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    assert pool.policy_version == 1
    for m in members:
        assert m.calls == BARRIER
        assert m.paused is False and m.weights == 1
    assert await _versions(pool) == {1}
    assert [r["policy_version"] for r in pool.members()] == [1, 1]


async def test_a_member_serving_the_version_already_is_not_loaded_again(fleet: Any) -> None:
    """A member re-attached (or labelled by an earlier run) at the version the sampler
    restores keeps it: it is read back, not reloaded."""
    members = [FakeMember(0), FakeMember(1)]
    members[1].weights = members[1].labelled = 1
    pool = await fleet(members)
    assert pool.members()[1]["policy_version"] == 1
    for m in members:
        m.calls.clear()
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    assert members[0].calls == BARRIER
    assert members[1].calls == [("pause", "wait"), ("label",), ("resume",)]
    assert pool.policy_version == 1 and await _versions(pool) == {1}


async def test_no_member_up_serves_nothing_new(fleet: Any) -> None:
    members = [FakeMember(0, restartable=False)]
    pool = await fleet(members)
    members[0].down = True
    await _until("the member to be taken out", lambda: _state(pool, 0) == "down")
    with pytest.raises(WeightsNotServed, match="no fake engine is up"):
        await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    assert pool.policy_version == 0 and pool.health().state == "degraded"


# -- refusals and rollback ----------------------------------------------------------------
async def test_a_rejected_update_rolls_back_the_members_that_installed_it_in_place(
    fleet: Any,
) -> None:
    members = [FakeMember(i) for i in range(3)]
    pool = await fleet(members)
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    members[2].refuse = WeightsRejected
    for m in members:
        m.calls.clear()
    with pytest.raises(WeightsRejected, match="member 2 refuses v2"):
        await pool.load_weight_files(["v2.safetensors"], 2, EVERY)
    assert pool.policy_version == 1
    for m in members[:2]:  # back to the committed source, under its version
        assert m.named("load") == [("load", 2, 2), ("load", 1, 1)] and m.weights == 1
    assert members[2].weights == 1 and members[2].named("load") == [("load", 2, 2)]
    assert [m.named("recover") for m in members] == [[], [], []]  # nobody restarted
    assert pool.transport.released == [2]  # the refused update is dropped
    members[2].refuse = None
    assert await _versions(pool) == {1}


async def test_a_rollback_the_source_cannot_restore_in_place_restarts_the_member(
    fleet: Any,
) -> None:
    """The committed weights are a partial update (or the base model, which a replica
    loads only by restarting): a member that installed the refused one is restarted and
    comes back at the committed weights."""
    members = [FakeMember(0), FakeMember(1)]
    pool = await fleet(members)
    await pool.load_weight_files(["v1.safetensors"], 1, ["a.weight"])
    members[1].refuse = WeightsRejected
    with pytest.raises(WeightsRejected):
        await pool.load_weight_files(["v2.safetensors"], 2, EVERY)
    assert pool.policy_version == 1
    await _until("member 0 to come back", lambda: _state(pool, 0) == "ok")
    assert members[0].named("recover") == [("recover", True)]
    assert pool.members()[0]["restarts"] == 1
    assert members[0].weights == 1  # the restart's base model, then the committed source
    assert members[0].named("load")[-1] == ("load", 1, 1)


async def test_an_update_a_server_refuses_rolls_every_server_back_and_commits_nothing(
    fleet: Any,
) -> None:
    """Members the fleet cannot restart (servers their owners run): one that answers a
    load with an error may hold part of it, so it is rolled back too, with the others."""
    members = [FakeMember(0, restartable=False), FakeMember(1, restartable=False)]
    pool = await fleet(members)
    members[1].refuse = RuntimeError
    with pytest.raises(WeightsNotServed, match="not committed .every fake engine is back at v0"):
        await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    for m in members:  # the base model, in place
        assert m.named("load") == [("load", 1, 1), ("load", None, 0)]
    assert members[0].named("set_label") == [("set_label", 0)] and members[0].labelled == 0
    # the one that refused refuses its rollback too: out until it answers a load
    assert _state(pool, 1) == "down" and _state(pool, 0) == "ok"
    assert pool.policy_version == 0
    members[1].refuse = None
    await _until("it to be synced", lambda: _state(pool, 1) == "ok")
    assert members[1].named("load")[-1] == ("load", None, 0) and members[1].labelled == 0


async def test_a_replica_that_fails_a_load_is_restarted_and_the_others_commit(
    fleet: Any,
) -> None:
    members = [FakeMember(0), FakeMember(1)]
    pool = await fleet(members)
    members[1].refuse = RuntimeError
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    assert pool.policy_version == 1
    members[1].refuse = None
    await _until("member 1 to come back", lambda: _state(pool, 1) == "ok")
    assert members[1].named("recover") == [("recover", True)]
    assert members[1].weights == 1  # resynced with the committed source


async def test_members_whose_checksums_differ_are_not_trusted_and_a_tie_commits_nothing(
    fleet: Any,
) -> None:
    members = [FakeMember(i, restartable=False) for i in range(3)]
    pool = await fleet(members, compare_checksums=True)
    members[2].digest = "odd"
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    assert [r["weights_mismatch"] for r in pool.members()] == [False, False, True]
    for m in members:
        m.calls.clear()
    assert await _versions(pool, 12) == {1} and _served(members) == [0, 1]
    # it is reloaded until it agrees
    await _until("the odd one to be reloaded", lambda: bool(members[2].named("load")))
    members[2].digest = "same"
    await _until("the odd one to agree", lambda: not pool.members()[2]["weights_mismatch"])
    members[0].digest = "odd"
    members[2].digest = "other"
    with pytest.raises(WeightsNotServed, match="checksums disagree"):
        await pool.load_weight_files(["v2.safetensors"], 2, EVERY)
    assert pool.policy_version == 1


# -- failure, re-issue and recovery ---------------------------------------------------------
async def test_a_member_found_down_loses_its_waves_to_the_others_and_comes_back_resynced(
    fleet: Any,
) -> None:
    members = [FakeMember(0), FakeMember(1)]
    pool = await fleet(members)
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    members[0].open.clear()  # its waves hang
    members[0].back.clear()  # and its restart waits for the test
    wave = asyncio.ensure_future(pool.generate([1, 2], 4, SAMPLING, affinity_key="p"))
    await _until("the wave to reach member 0", lambda: bool(members[0].named("generate")))
    assert not members[1].named("generate")
    members[0].down = True  # its process dies: the probe finds out
    out = await asyncio.wait_for(wave, 20)
    assert len(out) == 4 and {c.policy_version for c in out} == {1}
    assert members[1].named("generate") == [("generate", 4, 1)]
    assert pool.members()[0]["reissued_waves"] == 1
    assert pool.health().state == "ok"  # member 1 served meanwhile
    assert _state(pool, 0) == "recovering"
    members[0].back.set()
    await _until("member 0 to come back", lambda: _state(pool, 0) == "ok")
    assert members[0].named("recover") == [("recover", False)]
    assert members[0].weights == 1 and pool.members()[0]["restarts"] == 1
    for m in members:
        m.calls.clear()
    assert await _versions(pool, 12) == {1} and _served(members) == [0, 1]


async def test_a_hung_member_is_killed_and_restarted(fleet: Any) -> None:
    members = [FakeMember(0), FakeMember(1)]
    pool = await fleet(members)
    started = time.monotonic()
    members[0].hung = True
    await _until("the hung member to be restarted", lambda: bool(members[0].named("recover")))
    assert time.monotonic() - started <= 3 * (0.5 + 0.05) + 30
    assert members[0].named("recover") == [("recover", True)]
    await _until("member 0 to come back", lambda: _state(pool, 0) == "ok")


async def test_a_member_that_restarted_between_probes_or_is_unhealthy_is_recycled(
    fleet: Any,
) -> None:
    members = [FakeMember(0), FakeMember(1)]
    pool = await fleet(members)
    members[0].pid = 999  # a new process the fleet did not start
    await _until("the new process to be taken in", lambda: pool.members()[0]["pid"] == 1999)
    assert members[0].named("recover") == [("recover", False)]
    members[1].healthy = False
    await _until("the unhealthy one to be killed", lambda: bool(members[1].named("recover")))
    assert members[1].named("recover") == [("recover", True)]


async def test_members_that_never_come_back_are_failed_and_so_is_the_fleet(fleet: Any) -> None:
    members = [FakeMember(0), FakeMember(1)]
    pool = await fleet(members)
    members[0].gone = members[0].down = True
    await _until("member 0 to be given up", lambda: _state(pool, 0) == "failed")
    assert pool.health().state == "ok"
    members[1].crashes = members[1].down = True  # every incarnation dies at start
    await _until("member 1 to be given up", lambda: _state(pool, 1) == "failed", 60)
    assert members[1].named("recover") == [("recover", False), ("recover", True)]
    health = pool.health()
    assert health.state == "failed" and not health.ok
    assert "used up its restarts" in health.detail["error"]


async def test_a_server_that_goes_down_is_waited_for_and_synced_when_it_answers(
    fleet: Any,
) -> None:
    members = [FakeMember(0, restartable=False)]
    pool = await fleet(members)
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    members[0].down = True
    await _until("the server to be out", lambda: _state(pool, 0) == "down")
    assert pool.health().state == "degraded"
    members[0].down = False
    members[0].weights = members[0].labelled = None  # restarted by its owner, unlabelled
    await _until("the server to be back", lambda: _state(pool, 0) == "ok")
    assert members[0].named("recover") == [("recover", False)]
    assert members[0].named("load")[-1] == ("load", 1, 1) and members[0].labelled == 1
    assert pool.health().state == "ok"


async def test_weights_moved_behind_the_fleets_back_are_reloaded(fleet: Any) -> None:
    members = [FakeMember(0, restartable=False), FakeMember(1, restartable=False)]
    pool = await fleet(members)
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    members[0].labelled = None  # someone else relabelled it
    await _until("it to be reloaded", lambda: members[0].labelled == 1)
    assert members[0].named("load")[-1] == ("load", 1, 1)


async def test_a_wave_sampled_under_foreign_weights_is_reissued_after_an_immediate_resync(
    fleet: Any,
) -> None:
    """The probes are a minute apart: only the wave's own finding can have the member
    reloaded within the test's 20 s, and the wave sent again is answered under v1."""
    members = [FakeMember(0, restartable=False)]
    members[0].spans = True
    pool = await fleet(members, probe_s=60.0)
    await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
    members[0].labelled = None  # someone else relabelled it
    out = await asyncio.wait_for(pool.generate([1, 2], 3, SAMPLING), 20)
    assert {c.policy_version for c in out} == {1} and len(out) == 3
    assert members[0].named("generate") == [("generate", 3, 1), ("generate", 3, 1)]
    assert members[0].named("load")[-1] == ("load", 1, 1) and members[0].labelled == 1
    reissued = pool.metrics.registry.get_sample_value(
        "adaptive_rollout_replica_reissued_waves_total",
        {"replica": "0", "reason": "foreign_weights"},
    )
    assert reissued == 1 and pool.members()[0]["weights_mismatch"] is False


async def test_a_member_left_paused_is_resumed_before_it_is_routed_to(fleet: Any) -> None:
    members = [FakeMember(0, restartable=False)]
    members[0].paused = True
    pool = await fleet(members)
    assert members[0].calls == [("attach",), ("resume",)] and _state(pool, 0) == "ok"


async def test_members_that_join_are_synced_before_they_serve_and_leavers_are_gone(
    fleet: Any,
) -> None:
    members = [FakeMember(0, restartable=False)]
    transport = FakeTransport(members)
    pool = Fleet(transport, ReplicaSettings(probe_s=0.05), roster_s=0.05)
    await pool.start()
    try:
        await pool.load_weight_files(["v1.safetensors"], 1, EVERY)
        joining = FakeMember(1, restartable=False)
        joining.labelled = None
        transport.joining = {joining.name: joining}
        transport.found = [members[0].name, joining.name]
        await _until("the new member to serve", lambda: len(pool.members()) == 2)
        await _until("the new member to serve", lambda: _state(pool, 1) == "ok")
        assert joining.named("load") == [("load", 1, 1)] and joining.labelled == 1
        transport.found = [joining.name]
        await _until("the old member to leave", lambda: _state(pool, 0) == "gone")
        for m in (members[0], joining):
            m.calls.clear()
        assert await _versions(pool) == {1} and not members[0].named("generate")
    finally:
        await pool.close()


# -- routing --------------------------------------------------------------------------------
async def test_only_members_serving_the_committed_version_are_handed_waves(fleet: Any) -> None:
    pool = await fleet([FakeMember(0), FakeMember(1)])
    fresh, labelled = pool.table.seats
    fresh.version = None  # never labelled by this fleet
    for key in range(6):
        assert await pool._router.acquire(key, 4) is labelled
    labelled.version = 1  # its weights moved on without the fleet
    waiting = asyncio.create_task(pool._router.acquire(99, 4))
    await asyncio.sleep(0)
    assert not waiting.done()
    fresh.version = 0
    pool._router.dispatch()
    assert await asyncio.wait_for(waiting, 1) is fresh


async def test_waves_go_to_members_that_are_ok_and_charge_them(fleet: Any) -> None:
    """Re-issued waves too; a member is charged with what it runs (the router's own
    re-issue order is test_reissue_order.py's)."""
    pool = await fleet([FakeMember(0), FakeMember(1)], max_inflight=16)
    a, b = pool.table.seats
    a.state = "recovering"  # member 0 failed: no wave goes to it, re-issued ones neither
    assert await pool._router.acquire(1, 8, reissue=True) is b
    assert await pool._router.acquire(2, 8) is b
    assert (a.inflight, b.inflight) == (0, 16)
    pool._router.release(b, 8)
    assert b.inflight == 8 and not pool._router.queue


# -- NCCL -----------------------------------------------------------------------------------
UPDATE = {"names": EVERY, "dtype_names": ["float32"] * 2, "shapes": [[2], [2]]}


def test_member_ranks_follow_the_trainer_in_member_order() -> None:
    assert rank_offsets([1, 1]) == [1, 2]
    assert rank_offsets([2, 4, 1]) == [1, 3, 7]  # TP 2, TP 4, TP 1
    with pytest.raises(ValueError):
        rank_offsets([2, 0])


def test_each_member_gets_its_offset_and_the_whole_world() -> None:
    # What vLLM's trainer engine sends for one engine: rank_offset 1, world = 1 + ranks.
    sent = {"master_address": "10.0.0.5", "master_port": 29600, "rank_offset": 1}
    infos = replica_init_infos({**sent, "world_size": 7}, [2, 4])
    assert [i["rank_offset"] for i in infos] == [1, 3]
    assert all(i["world_size"] == 7 and i["master_port"] == 29600 for i in infos)
    # Every rank 1..6 is held by exactly one replica worker.
    ranks = [i["rank_offset"] + w for i, n in zip(infos, [2, 4], strict=True) for w in range(n)]
    assert sorted(ranks) == list(range(1, 7))
    with pytest.raises(ValueError, match="world_size 3 does not match"):
        replica_init_infos({**sent, "world_size": 3}, [2, 4])
    with pytest.raises(ValueError, match="rank_offset must be 1"):
        replica_init_infos({**sent, "world_size": 7, "rank_offset": 2}, [2, 4])


async def test_the_nccl_group_spans_every_member_and_goes_stale_when_one_restarts(
    fleet: Any,
) -> None:
    members = [FakeMember(0, workers=1), FakeMember(1, workers=2)]
    pool = await fleet(members)
    described = await pool.nccl_describe()
    assert described.enabled and described.inference_ranks == 3
    assert described.group == "none" and "init first" in (described.stale or "")
    rows = [(r["replica"], r["workers"], r["rank_offset"]) for r in described.replicas or []]
    assert rows == [(0, 1, 1), (1, 2, 2)] and len(described.replicas[0]) == 3  # type: ignore[index]
    with pytest.raises(NCCLGroupStale, match="init first"):
        await pool.nccl_update(UPDATE, 1)
    with pytest.raises(ValueError, match="world_size 3"):
        await pool.nccl_init(trainer_init(3))
    assert not any(m.named("join") for m in members)  # refused before any member joins
    await pool.nccl_init(trainer_init(4))
    assert [m.named("join") for m in members] == [[("join", 1, 4)], [("join", 2, 4)]]
    assert pool.nccl_group_state() == "ok"
    for m in members:
        m.calls.clear()
    await pool.nccl_update(UPDATE, 1)
    for m in members:  # one barrier: all paused, all receive at once, read back, resumed
        assert m.calls == [("pause", "wait"), ("receive", 1), ("label",), ("resume",)]
    assert pool.policy_version == 1 and await _versions(pool) == {1}

    # Member 1 dies: it comes back with the base model (v0), the only file weights there
    # are; it waits unrouted for the next round, and the group is stale.
    members[1].down = True
    await _until("member 1 to come back", lambda: members[1].pid > 1000 and _state(pool, 1) == "ok")
    assert pool.nccl_group_state() == "stale"
    assert pool.members()[1]["policy_version"] == 0
    loads = len(members[1].named("load"))
    await asyncio.sleep(0.5)  # probes see it at v0: it waits, it is not reloaded or recycled
    assert len(members[1].named("load")) == loads and pool.members()[1]["restarts"] == 1
    for m in members:
        m.calls.clear()
    assert await _versions(pool, 12) == {1} and _served(members) == [0]
    with pytest.raises(NCCLGroupStale, match="member 1 restarted"):
        await pool.nccl_update(UPDATE, 2)
    assert not any(m.named("receive") or m.named("pause") for m in members)

    # The trainer forms the group again; the next round reaches both.
    await pool.nccl_init(trainer_init(4))
    await pool.nccl_update(UPDATE, 2)
    assert [r["policy_version"] for r in pool.members()] == [2, 2]
    await pool.nccl_shutdown()
    assert [m.named("leave") for m in members] == [[("leave",)], [("leave",)]]
    assert pool.nccl_group_state() == "none"


async def test_a_failed_receive_distrusts_a_member_holding_part_of_the_round(
    fleet: Any,
) -> None:
    """A member that holds part of a round is reloaded with the file weights under
    their own version and waits for the next round; one that restored itself is read
    back and waits as it is. The version is committed where a member installed it."""
    from sampler_service.fleet.member import PartialWeights

    members = [FakeMember(i, restartable=False) for i in range(3)]
    pool = await fleet(members)
    await pool.nccl_init(trainer_init(4))
    members[1].refuse_receive = PartialWeights
    members[2].refuse_receive = RuntimeError
    with pytest.raises(RuntimeError, match="failed on member 1") as failed:
        await pool.nccl_update(UPDATE, 1)
    assert "serving v1" in str(failed.value) and "form the NCCL group again" in str(failed.value)
    assert pool.policy_version == 1 and pool.nccl_group_state() == "none"
    await _until("member 1 to be reloaded", lambda: bool(members[1].named("load")))
    assert members[1].named("load") == [("load", None, 0)] and members[1].labelled == 0
    assert not members[2].named("load") and members[2].named("label")
    await asyncio.sleep(0.3)  # both wait for the next round, neither is loaded again
    assert members[1].named("load") == [("load", None, 0)] and not members[2].named("load")
    for m in members:
        m.calls.clear()
    assert await _versions(pool, 12) == {1} and _served(members) == [0]


async def test_a_group_is_refused_while_a_member_has_the_transfer_off(fleet: Any) -> None:
    members = [FakeMember(0), FakeMember(1)]
    members[1].nccl = False
    pool = await fleet(members)
    assert not (await pool.nccl_describe()).enabled
    with pytest.raises(NCCLUnavailable, match="off on member 1: turn the transfer on") as off:
        await pool.nccl_init(trainer_init(3))
    assert "member 0" not in str(off.value)
    assert not any(m.named("join") for m in members)


# -- waves ----------------------------------------------------------------------------------
async def test_a_whole_wave_yields_its_answers_in_order_and_cancels_only_whole() -> None:
    answers = [Completion([i], [-1.0], str(i), "stop") for i in range(3)]
    release = asyncio.Event()

    async def engine() -> list[Completion]:
        await release.wait()
        return answers

    wave = WholeWave(engine(), 3)
    assert not wave.cancels_answers
    with pytest.raises(NotSupported, match="whole waves"):
        await wave.cancel([2])
    release.set()
    assert [(i, c.text) async for i, c in wave] == [(0, "0"), (1, "1"), (2, "2")]
    held = WholeWave(asyncio.Event().wait(), 2)  # type: ignore[arg-type]
    await held.cancel(range(2))
    with pytest.raises(asyncio.CancelledError):
        await held.answers()


async def _next(reading: AsyncIterator[tuple[int, Completion]]) -> tuple[int, str]:
    index, answer = await asyncio.wait_for(anext(reading), 20)
    return index, answer.finish_reason


async def test_a_fleet_wave_passes_answers_on_as_they_finish_and_forwards_cancels(
    fleet: Any,
) -> None:
    members = [FakeMember(0, streams=True)]
    pool = await fleet(members)
    assert pool.cancels_answers
    members[0].open.clear()  # the test finishes each answer
    wave = pool.wave([1, 2], 4, SAMPLING, affinity_key="p")
    assert wave.cancels_answers
    await _until("the wave to reach the member", lambda: bool(members[0].waves))
    assert pool.members()[0]["inflight_samples"] == 4
    reading = aiter(wave)
    members[0].answer(2)
    assert await _next(reading) == (2, "stop")
    assert pool.members()[0]["inflight_samples"] == 3
    await wave.cancel([1, 2])  # 2 is back already: only 1 is cancelled on the member
    assert members[0].named("cancel") == [("cancel", [1])]
    assert pool.members()[0]["inflight_samples"] == 2  # freed at the cancel
    assert await _next(reading) == (1, "abort")  # with the token it had decoded
    members[0].answer(3)
    members[0].answer(0)
    assert [await _next(reading) for _ in range(2)] == [(3, "stop"), (0, "stop")]
    with pytest.raises(StopAsyncIteration):
        await anext(reading)
    assert pool.members()[0]["inflight_samples"] == 0
    assert pool.members()[0]["waves"] == 1


async def test_a_member_that_fails_mid_wave_has_only_what_it_did_not_answer_reissued(
    fleet: Any,
) -> None:
    members = [FakeMember(0, streams=True), FakeMember(1, streams=True)]
    pool = await fleet(members)
    members[0].open.clear()
    members[0].back.clear()  # its restart waits for the test
    wave = pool.wave([1, 2], 4, SAMPLING, affinity_key="p", priorities=(10, 11, 12, 13))
    await _until("the wave to reach member 0", lambda: bool(members[0].waves))
    assert members[0].requests[-1].priorities == (10, 11, 12, 13)
    reading = aiter(wave)
    members[0].answer(0)
    members[0].answer(2)
    assert {await _next(reading) for _ in range(2)} == {(0, "stop"), (2, "stop")}
    members[0].down = True  # its process dies: the probe finds out
    rest = {await _next(reading) for _ in range(2)}
    assert rest == {(1, "stop"), (3, "stop")}
    assert members[1].named("generate") == [("generate", 2, 0)]  # indices 1 and 3 alone
    assert members[1].requests[-1].priorities == (11, 13)  # theirs, not the wave's first two
    # Queues are ordered only where every member orders its own.
    assert not pool.orders_by_priority
    for member in members:
        member.orders_by_priority = True
    assert pool.orders_by_priority
    assert ("drop",) in members[0].calls  # its wave was dropped, not cancelled over the wire
    row = pool.members()[0]
    assert row["reissued_waves"] == 1 and row["inflight_samples"] == 0
    assert pool.metrics.replica_wasted_samples.labels("0")._value.get() == 2
    members[0].back.set()


async def test_a_weight_updates_abort_passes_aborted_answers_on_and_fails_a_whole_read(
    fleet: Any,
) -> None:
    members = [FakeMember(0, streams=True)]
    pool = await fleet(members)
    members[0].open.clear()
    wave = pool.wave([1, 2], 2, SAMPLING, affinity_key="p")
    whole = asyncio.ensure_future(pool.generate([1, 3], 2, SAMPLING, affinity_key="q"))
    await _until("both waves to reach the member", lambda: len(members[0].waves) == 2)
    members[0].answer(0)  # the whole read's second answer is aborted below
    await pool.abort_all()
    assert sorted([(i, a.finish_reason) async for i, a in wave]) == [(0, "abort"), (1, "abort")]
    with pytest.raises(GenerationAborted, match=r"aborted answers \[1\]"):
        await asyncio.wait_for(whole, 20)


async def test_a_fleet_of_whole_wave_members_cancels_only_whole_waves(fleet: Any) -> None:
    members = [FakeMember(0)]
    pool = await fleet(members)
    assert not pool.cancels_answers
    members[0].open.clear()
    wave = pool.wave([1, 2], 3, SAMPLING, affinity_key="p")
    await _until("the wave to reach the member", lambda: bool(members[0].named("generate")))
    with pytest.raises(NotSupported, match="whole waves"):
        await wave.cancel([0])
    await wave.cancel(range(3))
    answers = sorted([(i, a.finish_reason, len(a.token_ids)) async for i, a in wave])
    assert answers == [(0, "abort", 0), (1, "abort", 0), (2, "abort", 0)]
    assert pool.members()[0]["inflight_samples"] == 0


async def test_a_streamed_wave_yields_each_index_once_and_drops_what_runs_when_left() -> None:
    stopped: list[list[int]] = []
    dropped: list[bool] = []

    async def stop(indices: list[int]) -> None:
        stopped.append(indices)

    wave = StreamedWave(3, stop, lambda: dropped.append(True))
    wave.put(1, Completion([5], [-1.0], "5", "stop"))
    wave.put(1, Completion([6], [-1.0], "6", "stop"))  # a late second answer is ignored
    reading = aiter(wave)
    assert await anext(reading) == (1, Completion([5], [-1.0], "5", "stop"))
    await wave.cancel([0, 1])
    assert stopped == [[0]] and wave.cancelled == {0}
    await wave.cancel([0])  # asked once
    assert stopped == [[0]]
    await reading.aclose()  # the reader leaves with answers 0 and 2 still out
    assert dropped == [True]


# -- a fleet of one -------------------------------------------------------------------------
class _Engine(CheckpointBackend):
    """An in-process engine: answers at once, loads what it is given, has no pause."""

    name = "toy"

    def __init__(self) -> None:
        super().__init__("toy")
        self.loads: list[int] = []
        self.file_version = 0
        self.broken = False

    async def start(self) -> None:
        """Nothing to load."""

    async def close(self) -> None:
        """Nothing to free."""

    def weight_specs(self) -> Mapping[str, TensorSpec]:
        return SPECS

    async def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        self.loads.append(version)
        if "bad" in tensors:
            raise RuntimeError("the reload failed (previous weights restored)")
        self._version = self.file_version = version

    async def nccl_describe(self) -> NCCLDescription:
        return NCCLDescription(True, 1, SPECS, frozenset(SPECS))

    async def nccl_init(self, init_info: dict[str, Any]) -> None:
        """Joins at once: no trainer here."""

    async def nccl_update(self, update_info: dict[str, Any], version: int) -> None:
        if self.broken:  # vLLM reloads the last file weights, under their version
            self._version = self.file_version
            raise RuntimeError(f"NCCL weight update to version {version} failed")
        self._version = version

    def issue(self, request: WaveRequest) -> Wave:
        return WholeWave(self._answers(request.n), request.n)

    async def _answers(self, n: int) -> list[Completion]:
        if self.broken:
            raise GenerationAborted("the engine dropped it")
        return [Completion([1], [-1.0], "a", "stop", self._version) for _ in range(n)]


async def test_a_fleet_of_one_barriers_its_engine_and_keeps_its_own_errors() -> None:
    engine = _Engine()
    pool = LocalFleet(engine)
    await pool.start()
    try:
        assert pool.name == "toy" and pool.health() == engine.health()
        await pool.load_weights({"a.weight": 0}, 1)  # no pause: the scheduler's gate holds
        assert pool.policy_version == 1 and engine.loads == [1]
        out = await pool.generate([1], 2, SAMPLING)
        assert [c.policy_version for c in out] == [1, 1]
        with pytest.raises(WeightsNotServed, match="previous weights restored"):
            await pool.load_weights({"bad": 0}, 2)
        assert pool.policy_version == 1 and await _versions(pool) == {1}  # still routed
        with pytest.raises(NotSupported, match="weight files"):
            await pool.load_weight_files(["w.safetensors"], 3, EVERY)
        engine.broken = True
        with pytest.raises(GenerationAborted):  # the engine's own errors reach the caller
            await pool.generate([1], 1, SAMPLING)
        engine.broken = False
        # NCCL: one member at rank offset 1; a failed round leaves it at its file weights
        described = await pool.nccl_describe()
        assert described.inference_ranks == 1 and described.group == "none"
        await pool.nccl_init(trainer_init(2))
        await pool.nccl_update(UPDATE, 2)
        assert pool.policy_version == 2 and pool.health().ok
        await pool.nccl_update(UPDATE, 3)
        engine.broken = True  # a later round fails: the engine restores its file weights
        with pytest.raises(RuntimeError, match="form the NCCL group again"):
            await pool.nccl_update(UPDATE, 4)
        engine.broken = False
        health = pool.health()
        assert pool.policy_version == 3 and health.state == "degraded" and not health.ok
        assert "serves v1, not the committed v3" in health.detail["error"]
        await pool.load_weights({"a.weight": 0, "b.weight": 0}, 5)  # a file push serves again
        assert pool.health().ok and await _versions(pool) == {5}
    finally:
        await pool.close()
