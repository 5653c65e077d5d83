"""SamplerClient against a real sampler process: credits, acks, reconnects, watchdog."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import pytest

from trainer_client.client import SamplerClient
from trainer_client.exceptions import ConflictError, InvalidRequest, SamplerUnavailable

pytestmark = pytest.mark.timeout(180)


def consume_in_thread(client: SamplerClient, **kw) -> tuple[queue.Queue, threading.Thread]:
    """Iterate client.groups() on a thread, putting groups (or the error) on a queue."""
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            for g in client.groups(**kw):
                out.put(g)
        except Exception as exc:  # handed to the test  # noqa: BLE001
            out.put(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return out, t


def test_credits_hold_the_stream_until_acked(sampler) -> None:
    with SamplerClient(sampler.url, consumer="credits", watchdog_s=20, heartbeat_s=0.5) as client:
        got, _ = consume_in_thread(client, max_unacked=2)
        frame = [got.get(timeout=60), got.get(timeout=60)]  # one frame of 2 fills the credits
        assert {g.batch_id for g in frame} == {frame[0].batch_id}
        assert sorted(g.batch_index for g in frame) == [0, 1] and frame[0].batch_size == 2
        deadline = time.monotonic() + 60
        while client.stats()["queue"]["ready"] < 2:  # more is ready, so only credits hold it back
            assert time.monotonic() < deadline, "the sampler produced nothing more"
            time.sleep(0.2)
        with pytest.raises(queue.Empty):
            got.get(timeout=2.0)
        assert client.last_heartbeat is not None and client.last_heartbeat.unacked == 2
        r = client.ack(frame)
        assert (r.acked, r.unknown) == (2, 0)
        nxt = got.get(timeout=30)
        assert nxt.group_id not in {g.group_id for g in frame}
        assert client.ack(frame).acked == 0  # idempotent


def test_reconnect_after_the_connection_drops_redelivers_without_duplicates(sampler, proxy) -> None:
    with SamplerClient(
        proxy.url, consumer="dropper", watchdog_s=20, heartbeat_s=0.5, backoff_s=(0.05, 0.5)
    ) as client:
        got, _ = consume_in_thread(client, max_unacked=2)
        held = [got.get(timeout=60)]
        assert proxy.cut() >= 1  # the stream dies with its frame unacked
        deadline = time.monotonic() + 30
        while client.duplicates_dropped == 0:  # reconnected, and the unacked frame came again
            assert time.monotonic() < deadline, (
                f"no redelivery seen ({client.connections} connections)"
            )
            time.sleep(0.05)
        assert client.connections >= 2
        while len(held) < held[0].batch_size:  # the rest of the frame, from either connection
            held.append(got.get(timeout=30))
        assert len({g.group_id for g in held}) == len(held) and len({g.batch_id for g in held}) == 1
        r = client.ack(held)
        # The old delivery ids died with the old connection: acks must name the new ones.
        assert (r.acked, r.unknown) == (len(held), 0)
        later = [got.get(timeout=60) for _ in range(2)]
        assert not {g.group_id for g in later} & {g.group_id for g in held}
        assert not isinstance(later[-1], Exception)


def test_config_and_weight_errors_are_typed(sampler, toy) -> None:
    with SamplerClient(sampler.url) as client:
        cfg = client.get_config()
        with pytest.raises(InvalidRequest) as err:
            client.update_config(rule="balanced", k_pos=9, k_neg=9, n_max=8)
        assert err.value.status == 422 and err.value.field and "k_" in err.value.field
        with pytest.raises(InvalidRequest) as unknown:
            client.update_config(no_such_knob=1)
        assert unknown.value.field == "no_such_knob"
        with pytest.raises(ConflictError):
            client.update_config(expected_version=cfg["config_version"] + 5, k_pos=1)
        with pytest.raises(ConflictError) as stale:
            client.push_weights(toy.model_dir / "model.safetensors", version=0)
        assert stale.value.field == "version"
        with pytest.raises(InvalidRequest):
            client.push_weights(b"definitely not safetensors", version=99)
        assert client.health().policy_version == 0


def test_watchdog_fires_when_the_sampler_stops_sending(sampler) -> None:
    """SIGSTOP the server: the socket stays open but nothing arrives. No hang."""
    with SamplerClient(sampler.url, consumer="watchdog", watchdog_s=2.0) as client:
        it = client.groups(max_unacked=2)
        next(it)
        os.kill(sampler.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(SamplerUnavailable) as err:
                while True:
                    next(it)  # buffered lines first, then silence
            assert time.monotonic() - started < 3 * 2.0 + 30
            assert err.value.waited_s >= 2.0 and "heartbeat or group" in str(err.value)
        finally:
            os.kill(sampler.pid, signal.SIGCONT)
    with SamplerClient(sampler.url, watchdog_s=30) as client:
        assert client.health().status == "ok"  # it resumes


def test_the_json_encoding_delivers_what_msgpack_does(sampler) -> None:
    """`encoding="json"` (NDJSON stream, JSON lease) against the real server: the same
    groups, values and acks as the default msgpack path."""
    with (
        SamplerClient(sampler.url, consumer="as-json", encoding="json", heartbeat_s=0.5) as plain,
        SamplerClient(sampler.url, consumer="as-msgpack", heartbeat_s=0.5) as packed,
    ):
        assert plain.accept == "application/x-ndjson"
        plain.update_config(lease_ttl_s=1.0)  # applies to leases taken from now on
        try:
            first = plain.lease(max_groups=2, wait_s=60.0).groups
            assert first and all(g.delivery_id for g in first)
            held = [g.group_id for g in first]
            # Never acked: once the lease expires the msgpack client is offered the same
            # frame. Groups finished meanwhile may come first; those are acked.
            deadline = time.monotonic() + 3 * 1.0 + 30
            while True:
                assert time.monotonic() < deadline, "the JSON lease never expired"
                got = packed.lease(max_groups=8, wait_s=1.0).groups
                assert packed.ack(got).acked == len(got)
                if set(held) & {g.group_id for g in got}:
                    break
        finally:
            plain.update_config(lease_ttl_s=300.0)
        again = [g for g in got if g.group_id in set(held)]
        assert [g.group_id for g in again] == held
        for a, b in zip(first, again, strict=True):
            assert a.delivery_id != b.delivery_id
            assert a.model_dump(exclude={"delivery_id"}) == b.model_dump(exclude={"delivery_id"})
        # The stream in NDJSON: a group arrives, decoded into the same model.
        stream = plain.groups(max_unacked=2)
        group = next(stream)
        stream.close()
        assert group.samples and len(group.samples[0].logprobs) == len(
            group.samples[0].response_token_ids
        )
        assert plain.ack([group]).acked == 1
