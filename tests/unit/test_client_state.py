"""The clients' decisions without I/O: the stream's reconnects, watchdog, `consumer_busy`
grace, decoding and duplicate filter; a plain request's retries; the wait for /ready.

Responses and chunks are built by hand; the clock is the real one, moved by setting the
state's last-seen time back (never by sleeping)."""

from __future__ import annotations

import time
import uuid

import httpx
import orjson
import pytest

from trainer_client.client_state import ClientCore, ReadyWait, RequestAttempts, StreamState
from trainer_client.contract import wire
from trainer_client.contract.protocol import MSGPACK_MEDIA_TYPE, Group
from trainer_client.exceptions import (
    AuthError,
    ConflictError,
    EngineFailed,
    NotFound,
    SamplerUnavailable,
    ServerError,
)

URL = "http://sampler.test"


def _core(**kw) -> ClientCore:
    return ClientCore(URL, **{"watchdog_s": 10.0, "backoff_s": (0.01, 0.05), **kw})


def _group(gid: str, delivery_id: str | None = None) -> dict:
    return {
        "group_id": gid,
        "prompt_id": f"p-{gid}",
        "domain": "d",
        "prompt_token_ids": [1, 2],
        "prompt_text": "1+1=",
        "config_version": 0,
        "policy_version_min": 0,
        "policy_version_max": 0,
        "stop_reason": "rule",
        "stats": {"n_generated": 2, "n_pos": 1, "n_neg": 1, "reward_mean": 0.5, "reward_std": 0.5},
        "samples": [],
        "batch_id": "b",
        "batch_index": 0,
        "batch_size": 1,
        "delivery_id": delivery_id or uuid.uuid4().hex,
    }


def _heartbeat(**kw) -> dict:
    return {
        "type": "heartbeat",
        "time": 0.0,
        "policy_version": 0,
        "config_version": 0,
        "ready": 0,
        "leased": 0,
        "active_prompts": 0,
        "unacked": 0,
        **kw,
    }


def _line(message: dict) -> bytes:
    return orjson.dumps(message) + b"\n"


def _refusal(status: int, code: str = "error") -> httpx.Response:
    request = httpx.Request("GET", f"{URL}/v1/groups/stream")
    return httpx.Response(status, json={"error": {"code": code, "message": "no"}}, request=request)


def _opened(stream: StreamState, media_type: str = "application/x-ndjson") -> None:
    stream.opened(httpx.Response(200, headers={"content-type": media_type}))


def test_stream_params_name_the_consumer_credits_and_heartbeat() -> None:
    core = _core(consumer="t1", max_unacked=6, watchdog_s=8.0)
    stream = core._stream(5, None)
    assert stream.params == {"consumer": "t1", "max_unacked": 5, "heartbeat_s": 2.0}
    assert stream.headers == {"Accept": MSGPACK_MEDIA_TYPE}


def test_chunks_split_anywhere_decode_to_groups_and_heartbeats() -> None:
    core = _core()
    stream = core._stream(None, None)
    _opened(stream)
    data = _line(_heartbeat(policy_version=3)) + _line({"type": "group", "group": _group("A")})
    first = stream.received(data[:17])
    rest = stream.received(data[17:])
    assert first == [] and [a.group.group_id for a in rest if a.group] == ["A"]
    assert core.last_heartbeat is not None and core.last_heartbeat.policy_version == 3
    assert core.connections == 1


def test_msgpack_stream_decodes_to_the_same_group() -> None:
    core = _core()
    stream = core._stream(None, None)
    _opened(stream, MSGPACK_MEDIA_TYPE)
    group = Group.model_validate(_group("A"))
    # The envelope as the service frames it: the stored bytes of the group (number lists
    # as raw arrays) spliced in unchanged.
    message = wire.map_header(2) + wire.pack("type") + wire.pack("group") + wire.pack("group")
    (arrival,) = stream.received(message + wire.pack_group(group))
    assert arrival.group == group.model_copy(update={"delivery_id": None})


def test_duplicates_are_dropped_held_ones_keep_their_newest_delivery_acked_ones_are_acked() -> None:
    core = _core()
    stream = core._stream(None, None)
    _opened(stream)
    (fresh,) = stream.received(_line({"type": "group", "group": _group("A", "a-1")}))
    assert fresh.group is not None and fresh.ack_now is None
    (again,) = stream.received(_line({"type": "group", "group": _group("A", "a-2")}))
    assert again.group is None and again.ack_now is None  # held, not acked: dropped
    assert core.dedupe.resolve([fresh.group]) == ["a-2"]  # the ack names the newest delivery
    (after_ack,) = stream.received(_line({"type": "group", "group": _group("A", "a-3")}))
    assert after_ack.group is None and after_ack.ack_now == "a-3"
    assert core.duplicates_dropped == 2


def test_engine_failure_raises_only_when_nothing_more_can_come() -> None:
    core = _core()
    stream = core._stream(None, None)
    _opened(stream)
    assert stream.received(_line(_heartbeat(engine_error="dead", ready=1))) == []
    assert stream.received(_line(_heartbeat(engine_error="dead", active_prompts=2))) == []
    with pytest.raises(EngineFailed, match="dead"):
        stream.received(_line(_heartbeat(engine_error="dead")))


def test_transient_refusals_are_retried_others_raised() -> None:
    stream = _core()._stream(None, None)
    stream.refused(_refusal(503, "not_ready"))
    assert stream.error is not None
    with pytest.raises(AuthError):
        stream.refused(_refusal(401, "unauthorized"))
    with pytest.raises(NotFound):
        stream.refused(_refusal(404))
    with pytest.raises(ServerError):
        stream.refused(_refusal(500))


def test_consumer_busy_is_retried_for_two_heartbeats_and_five_seconds() -> None:
    stream = _core(heartbeat_s=1.0)._stream(None, None)
    stream.refused(_refusal(409, "consumer_busy"))  # first seen: retried
    first_seen = stream.busy_since
    stream.refused(_refusal(409, "consumer_busy"))  # still within the grace
    assert stream.busy_since == first_seen
    stream.busy_since = time.monotonic() - (2 * 1.0 + 5.0)
    with pytest.raises(ConflictError):
        stream.refused(_refusal(409, "consumer_busy"))
    stream.refused(_refusal(503))  # another refusal ends the run of consumer_busy
    assert stream.busy_since is None
    with pytest.raises(ConflictError):  # a 409 of another kind is never retried
        stream.refused(_refusal(409, "stale_version"))


def test_watchdog_spends_the_silence_not_the_callers_time() -> None:
    stream = _core(watchdog_s=10.0)._stream(None, None)
    assert 9.0 < stream.connecting() <= 10.0 and stream.attempts == 1
    stream.failed(httpx.ReadError("reset"))  # retried, whatever the time
    stream.failed(httpx.ReadTimeout("early"))  # a read that timed out early reconnects
    assert stream.retry_delay() <= 0.05
    stream.last_seen = time.monotonic() - 20.0
    stream.resumed()  # the caller just came back: silence starts again
    assert stream.connecting() > 9.0
    stream.last_seen = time.monotonic() - 10.0
    assert stream.retry_delay() == 0.0  # never sleeps past the watchdog
    with pytest.raises(SamplerUnavailable) as timed_out:
        stream.failed(httpx.ReadTimeout("silent"))
    assert timed_out.value.attempts == 2 and "heartbeat or group" in str(timed_out.value)
    with pytest.raises(SamplerUnavailable) as spent:
        stream.connecting()
    assert spent.value.url == URL and spent.value.waited_s >= 10.0


def test_a_chunk_resets_the_backoff() -> None:
    stream = _core(backoff_s=(0.2, 5.0))._stream(None, None)
    _opened(stream)
    for _ in range(6):
        stream.retry_delay()
    assert stream.backoff.attempt == 6
    stream.received(_line(_heartbeat()))
    assert stream.backoff.attempt == 0


def _answer(status: int) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"code": "x", "message": "m"}}, request=httpx.Request("GET", URL)
    )


def test_request_retries_transient_statuses_and_lost_connections_within_the_watchdog() -> None:
    attempts = RequestAttempts(_core(), "GET", "/v1/stats", retry=True)
    assert attempts.answered(_answer(503)) is not None
    assert attempts.failed(httpx.ConnectError("refused")) is not None
    assert attempts.answered(_answer(200)) is None
    assert attempts.count == 3
    with pytest.raises(NotFound) as refused:
        attempts.answered(_answer(404))
    assert refused.value.attempts == 4
    with pytest.raises(SamplerUnavailable, match="reply to GET /v1/stats"):
        attempts.failed(httpx.ReadTimeout("slow"))  # a timeout spent the watchdog already
    attempts.started = time.monotonic() - 10.0
    with pytest.raises(SamplerUnavailable):
        attempts.answered(_answer(503))


def test_a_request_that_must_not_repeat_is_not_retried() -> None:
    once = RequestAttempts(_core(), "PUT", "/v1/weights", retry=False)
    with pytest.raises(ServerError):
        once.answered(_answer(503))
    with pytest.raises(SamplerUnavailable):
        once.failed(httpx.WriteError("broken pipe"))


def test_ready_wait_polls_until_ready_or_the_limit() -> None:
    waiting = ReadyWait(_core(), limit_s=5.0)
    delay = waiting.answered(False)
    assert delay is not None and delay <= 1.0
    assert waiting.answered(True) is None
    waiting.started = time.monotonic() - 6.0
    with pytest.raises(SamplerUnavailable, match="200 from /ready") as err:
        waiting.answered(False)
    assert err.value.attempts == 3
