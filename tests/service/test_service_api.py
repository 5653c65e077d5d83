"""The sampler service end to end over loopback HTTP with the toy model."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from trainer_client import wire
from trainer_client.protocol import MSGPACK_MEDIA_TYPE, NDJSON_MEDIA_TYPE, Group, LeaseResponse

pytestmark = pytest.mark.timeout(300)


def lease(client: httpx.Client, n: int, wait_s: float = 30.0, consumer: str = "t") -> list[dict]:
    r = client.post(
        "/v1/groups/lease", json={"max_groups": n, "wait_s": wait_s, "consumer": consumer}
    )
    assert r.status_code == 200, r.text
    return r.json()["groups"]


def collect(client: httpx.Client, n: int, ack: bool = True, **kw) -> list[dict]:
    groups: list[dict] = []
    while len(groups) < n:
        got = lease(client, n - len(groups), **kw)
        if ack and got:
            client.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]})
        groups.extend(got)
    return groups


def _msgpack_messages(response: httpx.Response) -> Iterator[dict]:
    decoder = wire.stream_decoder()
    for chunk in response.iter_bytes():
        decoder.feed(chunk)
        yield from decoder


def stream_groups(
    client: httpx.Client, n: int, consumer: str, max_unacked: int = 8, accept: str | None = None
) -> list[dict]:
    """Read n groups from the stream without acking, then drop the connection."""
    out: list[dict] = []
    params = {"consumer": consumer, "max_unacked": max_unacked}
    headers = {"Accept": accept} if accept else {}
    with client.stream("GET", "/v1/groups/stream", params=params, headers=headers) as r:
        assert r.status_code == 200
        if accept == MSGPACK_MEDIA_TYPE:
            assert r.headers["content-type"] == MSGPACK_MEDIA_TYPE
            messages = _msgpack_messages(r)
        else:
            assert r.headers["content-type"].startswith(NDJSON_MEDIA_TYPE)
            messages = (orjson.loads(line) for line in r.iter_lines())
        for msg in messages:
            if msg["type"] == "group":
                out.append(msg["group"])
                if len(out) >= n:
                    break
    return out


def test_balanced_groups_obey_rule_and_stats(make_server) -> None:
    server = make_server({"rule": "balanced", "k_pos": 2, "k_neg": 2, "n_max": 16, "wave_size": 4})
    with server.client() as c:
        groups = collect(c, 12)
        for g in groups:
            st = g["stats"]
            assert st["n_generated"] <= 16
            assert st["n_pos"] + st["n_neg"] == st["n_generated"]
            if g["stop_reason"] == "rule":
                assert st["n_pos"] >= 2 and st["n_neg"] >= 2
            else:
                assert g["stop_reason"] == "n_max" and st["n_generated"] == 16
            assert 2 <= len(g["samples"]) <= 4
            for s in g["samples"]:
                assert len(s["logprobs"]) == len(s["response_token_ids"])
                assert all(lp <= 0 for lp in s["logprobs"])
        stats = c.get("/v1/stats").json()
        assert set(stats["domains"]) == {g["domain"] for g in groups} | set(stats["domains"])
        assert stats["groups_emitted"] >= 12
        assert sum(stats["samples_per_group"].values()) >= 12
        metrics = c.get("/metrics").text
        for name in ("samples_generated_total", "groups_emitted_total", "queue_depth"):
            assert f"adaptive_rollout_{name}" in metrics


def test_patch_config_applies_validates_and_persists(make_server) -> None:
    server = make_server({"rule": "balanced", "n_max": 16})
    with server.client() as c:
        before = c.get("/v1/config").json()
        r = c.patch(
            "/v1/config", json={"rule": "fixed", "group_size": 3, "n_max": 8, "wave_size": 8}
        )
        assert r.status_code == 200, r.text
        version = r.json()["config_version"]
        assert version == before["config_version"] + 1
        newer = [g for g in collect(c, 40) if g["config_version"] == version][:5]
        assert newer, "no group admitted under the new config"
        for g in newer:
            assert g["stop_reason"] == "fixed" and g["stats"]["n_generated"] == 3
        for patch, fields in (
            ({"rule": "balanced", "k_pos": 5, "k_neg": 5, "n_max": 8}, ("k_pos", "k_neg")),
            ({"group_size": 9}, ("group_size",)),
            ({"no_such_knob": 1}, ("no_such_knob",)),
            ({"temperature": "hot"}, ("temperature",)),
            (
                {"group_policies": [{"name": "maxvar", "params": {"keep_fracton": 0.5}}]},
                ("keep_fracton",),
            ),
            ({"mixing": {"name": "reward_gap", "params": {"floor": 0.5}}}, ("floor",)),
        ):
            r = c.patch("/v1/config", json=patch)
            assert r.status_code == 422, (patch, r.text)
            assert any(f in r.json()["error"]["field"] for f in fields), (patch, r.json())
        assert c.patch("/v1/config", content=b"{not json").status_code == 400
    server.kill()
    server.start()
    with server.client() as c:
        cfg = c.get("/v1/config").json()
        assert (
            cfg["config_version"] == version and cfg["rule"] == "fixed" and cfg["group_size"] == 3
        )


def test_redelivery_after_disconnect_and_kill9(make_server) -> None:
    server = make_server({"rule": "fixed", "group_size": 2, "n_max": 4, "wave_size": 2})
    with server.client() as c:
        first = stream_groups(c, 3, consumer="a", max_unacked=3)
        again = stream_groups(c, 3, consumer="b", max_unacked=3)
        assert [g["group_id"] for g in again] == [g["group_id"] for g in first]
        assert {g["delivery_id"] for g in again}.isdisjoint({g["delivery_id"] for g in first})
        r = c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in again]})
        assert r.json() == {"acked": 3, "unknown": 0}
        # Idempotent: acking again changes nothing.
        assert (
            c.post("/v1/groups/ack", json={"delivery_ids": [again[0]["delivery_id"]]}).json()[
                "acked"
            ]
            == 0
        )
        acked = {g["group_id"] for g in again}
        unacked = stream_groups(c, 4, consumer="c", max_unacked=4)
        assert acked.isdisjoint(g["group_id"] for g in unacked)
    server.kill()  # SIGKILL: no clean shutdown
    server.start()
    with server.client() as c:
        redelivered = stream_groups(c, 4, consumer="d", max_unacked=4)
        assert [g["group_id"] for g in redelivered] == [g["group_id"] for g in unacked]
        assert acked.isdisjoint(g["group_id"] for g in redelivered)


def test_msgpack_and_json_deliver_the_same_groups(make_server) -> None:
    """Stream and lease in both encodings: the same values, only the delivery ids differ."""
    server = make_server(
        {"rule": "fixed", "group_size": 3, "n_max": 3, "wave_size": 3, "max_tokens": 16}
    )
    with server.client() as c:
        packed = stream_groups(c, 4, consumer="m", max_unacked=4, accept=MSGPACK_MEDIA_TYPE)
        as_json = stream_groups(c, 4, consumer="j", max_unacked=4)  # the same frames, redelivered
        assert [g["group_id"] for g in as_json] == [g["group_id"] for g in packed]
        for a, b in zip(packed, as_json, strict=True):
            assert a["delivery_id"] != b["delivery_id"]
            assert {**a, "delivery_id": None} == {**b, "delivery_id": None}
            assert all(
                s["logprobs"] and all(math.isfinite(x) for x in s["logprobs"]) for s in a["samples"]
            )
            Group.model_validate(a)
        r = c.post(
            "/v1/groups/lease",
            json={"max_groups": 4, "consumer": "l"},
            headers={"Accept": MSGPACK_MEDIA_TYPE},
        )
        assert r.status_code == 200 and r.headers["content-type"] == MSGPACK_MEDIA_TYPE
        leased = LeaseResponse.model_validate(wire.unpack(r.content))
        assert [g.group_id for g in leased.groups] == [g["group_id"] for g in packed]
        assert leased.groups[0].samples[0].logprobs == packed[0]["samples"][0]["logprobs"]


def _perturbed_state(model_dir, scale: float) -> bytes:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    state = {
        k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
    }
    return save({k: v.contiguous() for k, v in state.items()})


def test_weight_upload_versions_and_garbage(make_server, toy) -> None:
    server = make_server({"rule": "fixed", "group_size": 2, "n_max": 4, "wave_size": 2})
    with server.client() as c:
        assert c.get("/health").json()["policy_version"] == 0
        r = c.put(
            "/v1/weights", params={"version": 1}, content=_perturbed_state(toy.model_dir, 0.05)
        )
        assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 1
        assert c.get("/health").json()["policy_version"] == 1
        # Up to max_buffered_groups + max_active_prompts (64 + 16) groups may predate the upload.
        later = [g for g in collect(c, 100) if g["policy_version_min"] >= 1]
        assert later, "no samples from the new weights"
        assert c.put("/v1/weights", params={"version": 1}, content=b"x").status_code == 409
        r = c.put("/v1/weights", params={"version": 2}, content=b"garbage bytes, not safetensors")
        assert 400 <= r.status_code < 500, r.text
        assert c.get("/health").json()["policy_version"] == 1
        assert collect(c, 2)
        r = c.post("/v1/weights/load", json={"path": "/nonexistent/weights", "version": 3})
        assert 400 <= r.status_code < 500 and "error" in r.json()
    server.kill()
    server.start()
    with server.client() as c:
        assert c.get("/health").json()["policy_version"] == 1


def test_auth_and_bad_requests(make_server) -> None:
    server = make_server(
        {"rule": "fixed", "group_size": 2, "n_max": 4, "wave_size": 2},
        extra=["--api-key", "s3cret"],
    )
    with server.client() as c:
        assert c.get("/health").status_code == 200
        for path in ("/v1/config", "/v1/stats"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert c.get("/v1/config", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with server.client(headers={"Authorization": "Bearer s3cret"}) as c:
        assert c.get("/v1/config").status_code == 200
        assert c.post("/v1/groups/ack", json={"delivery_ids": "nope"}).status_code == 422
        assert c.post("/v1/groups/lease", json={"max_groups": -1}).status_code == 422
        assert c.get("/v1/groups/stream", params={"max_unacked": 0}).status_code == 422
        assert c.patch("/v1/config", content=b"x" * (2 << 20)).status_code == 413
        assert c.put("/v1/weights", content=b"abc").status_code == 422  # no version
        assert c.get("/v1/nope").status_code == 404


@pytest.mark.parametrize("verifier", ["raises", "hangs"])
def test_misbehaving_verifier_does_not_stop_the_stream(
    make_server, toy, tmp_path, verifier
) -> None:
    # Rows without a verifier of their own get the server's default (--verifier).
    data = tmp_path / "add1.jsonl"
    rows = [orjson.loads(line) for line in toy.data_files[0].read_text().splitlines()]
    data.write_bytes(
        b"\n".join(orjson.dumps({k: v for k, v in r.items() if k != "verifier"}) for r in rows)
    )
    server = make_server(
        {"rule": "fixed", "group_size": 2, "n_max": 4, "wave_size": 2},
        extra=["--verifier", f"python:flaky_verifiers:{verifier}", "--verifier-timeout-s", "1"],
        data=[data],
    )
    with server.client() as c:
        groups = collect(c, 6)
        errors = [s["verifier_error"] for g in groups for s in g["samples"] if s["verifier_error"]]
        assert errors, (
            "the toy model answers some prompts correctly, which should trip the verifier"
        )
        assert all(s["reward"] == 0.0 for g in groups for s in g["samples"])
        # Its label sets exist from the start, at zero: the count must have moved.
        counted = sum(
            sample.value
            for family in text_string_to_metric_families(c.get("/metrics").text)
            for sample in family.samples
            if sample.name == "adaptive_rollout_verifier_errors_total"
        )
        assert counted >= len(errors)


def test_reward_gap_mixing_favours_hardest_domain(make_server) -> None:
    server = make_server(
        {
            "rule": "fixed",
            "group_size": 4,
            "n_max": 4,
            "wave_size": 4,
            "mixing": {"name": "reward_gap", "params": {"warmup": 24, "update_every": 4}},
            "max_buffered_groups": 400,
        }
    )
    with server.client() as c:
        collect(c, 120)
        stats = c.get("/v1/stats").json()
    domains = stats["domains"]
    hardest = min(domains, key=lambda d: domains[d]["pass_rate"])
    easiest = max(domains, key=lambda d: domains[d]["pass_rate"])
    assert max(domains, key=lambda d: domains[d]["target_share"]) == hardest
    assert domains[hardest]["target_share"] > domains[easiest]["target_share"]
    for d in domains.values():
        assert math.isclose(d["admitted_share"], d["target_share"], abs_tol=0.15)


def test_a_dead_engine_is_reported_not_a_silent_hang(make_server) -> None:
    """SIGKILL the engine process: health and readiness say so, admission stops, and the
    client raises EngineFailed once the groups already finished are delivered."""
    import os
    import signal

    from trainer_client.client import EngineFailed, SamplerClient
    from trainer_client.verl.settings import SamplerSettings
    from trainer_client.verl.source import GroupSource

    server = make_server({"rule": "fixed", "group_size": 2, "n_max": 2, "wave_size": 2})
    with server.client() as c:
        collect(c, 4)
        pid = c.get("/v1/stats").json()["engine"]["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while c.get("/health").json()["status"] != "engine_failed":
            assert time.monotonic() < deadline, "health never reported the dead engine"
            time.sleep(0.2)
        health = c.get("/health").json()
        assert "exit code -9" in health["engine_error"]
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        # ... and the event log records it, once.
        while not [e for e in c.get("/v1/events").json()["events"] if e["kind"] == "engine_failed"]:
            assert time.monotonic() < deadline + 30, "the event log never recorded the failure"
            time.sleep(0.2)
        failures = [e for e in c.get("/v1/events").json()["events"] if e["kind"] == "engine_failed"]
        assert len(failures) == 1 and "exit code -9" in failures[0]["data"]["error"]
        admitted = sum(d["admitted"] for d in c.get("/v1/stats").json()["domains"].values())
        time.sleep(2.0)  # no prompts burned on an engine that cannot run them
        assert sum(d["admitted"] for d in c.get("/v1/stats").json()["domains"].values()) == admitted
    with SamplerClient(server.url, consumer="after", watchdog_s=60, heartbeat_s=0.5) as client:
        delivered = 0
        with pytest.raises(EngineFailed, match="exit code -9"):
            for group in client.groups():
                delivered += 1
                client.ack([group])
    # Everything that finished before the engine died was delivered first.
    assert delivered > 0 and client.last_heartbeat.ready == 0
    # The leasing source of the verl integration stops too, instead of waiting out its timeout.
    source = GroupSource(SamplerSettings(url=server.url, lease_wait_s=0.5, group_timeout_s=600))
    with pytest.raises(EngineFailed, match="exit code -9"):
        source.take(4)
    source.close()
