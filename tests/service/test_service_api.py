"""The sampler service end to end over loopback HTTP with the toy model.

Tests that only read from a sampler share one per module (`shared`, whose engine the
last test kills; `guarded` for the API key and the misbehaving verifiers); a test that
restarts a sampler or needs start-up flags of its own starts its own.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import (
    Server,
    collect,
    drain,
    lease,
    perturbed_file,
    rows_with,
    stream_groups,
    unanswerable,
    write_jsonl,
)

from sampler_service.verifiers import exact
from trainer_client.contract import wire
from trainer_client.contract.protocol import MSGPACK_MEDIA_TYPE, Group, LeaseResponse

# Each test may start and restart a sampler: on a loaded 2-core machine a start alone can
# take minutes.
pytestmark = pytest.mark.timeout(900)

BALANCED = {"rule": "balanced", "k_pos": 2, "k_neg": 2, "n_max": 16, "wave_size": 4}
#: The toy tokenizer's vocabulary in id order (one token per character).
TOY_VOCAB = ["<pad>", "<eos>", "<unk>", *"0123456789", "+", "-", "*", "=", " "]
#: A chat template that joins the messages' contents: "8+" and "9=" render as "8+9=".
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _chat_model(toy, where: Path) -> Path:
    """The toy model with a chat template in its tokenizer config."""
    model = where / "chat_model"
    shutil.copytree(toy.model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": CHAT_TEMPLATE})
    )
    return model


def _chat_parquet(toy, where: Path) -> Path:
    """add1's prompts as two chat messages each, in a Parquet file (domain `chat`)."""
    rows = []
    for row in rows_with(toy.data_files[0], domain="chat"):
        text = row["prompt"]
        cut = text.index("+") + 1
        messages = [
            {"role": "user", "content": text[:cut]},
            {"role": "user", "content": text[cut:]},
        ]
        rows.append({**row, "id": f"chat-{row['id']}", "prompt": messages})
    path = where / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def shared(make_module_server, toy, tmp_path_factory) -> Server:
    """One balanced sampler over the toy domains, a domain no answer can be right for
    (so both stop reasons always occur), and a chat-message domain read from Parquet;
    its engine runs in its own process, as it does by default (until the last test kills it)."""
    where = tmp_path_factory.mktemp("shared_data")
    data = [*toy.data_files, unanswerable(toy, where), _chat_parquet(toy, where)]
    return make_module_server(BALANCED, data=data, model=_chat_model(toy, where), engine="process")


def test_balanced_groups_obey_rule_and_stats(shared) -> None:
    with shared.client() as c:
        groups = collect(c, 24)
        reasons = {g["stop_reason"] for g in groups}
        # Both branches below run: "never" prompts always reach n_max, and the toy
        # model's easy domains satisfy 2 right and 2 wrong within 16 answers.
        assert reasons == {"rule", "n_max"}, reasons
        for g in groups:
            st = g["stats"]
            assert st["n_generated"] <= 16
            assert st["n_pos"] + st["n_neg"] == st["n_generated"]
            if g["stop_reason"] == "rule":
                assert st["n_pos"] >= 2 and st["n_neg"] >= 2
            else:
                assert st["n_generated"] == 16 and (st["n_pos"] < 2 or st["n_neg"] < 2)
            if g["domain"] == "never":
                assert g["stop_reason"] == "n_max" and st["n_pos"] == 0
            # Balanced down-sampling to 4: min(2, n_pos) positives, then negatives.
            rewards = [s["reward"] for s in g["samples"]]
            assert len(rewards) == 4
            assert sum(r > 0.5 for r in rewards) == min(2, st["n_pos"]) + max(0, 2 - st["n_neg"])
            for s in g["samples"]:
                assert len(s["logprobs"]) == len(s["response_token_ids"])
                assert all(lp <= 0 for lp in s["logprobs"])
        stats = c.get("/v1/stats").json()
        assert set(stats["domains"]) == {"add1", "add2", "mul", "never", "chat"}
        assert stats["domains"]["never"]["pass_rate"] == 0
        assert stats["groups_emitted"] >= 24
        assert sum(stats["samples_per_group"].values()) >= 24
        metrics = c.get("/metrics").text
        for name in ("samples_generated_total", "groups_emitted_total", "queue_depth"):
            assert f"adaptive_rollout_{name}" in metrics


def test_chat_prompts_from_parquet_go_through_the_chat_template(shared) -> None:
    with shared.client() as c:
        drain(c)
        chat = []
        while len(chat) < 2:
            chat += [g for g in collect(c, 10) if g["domain"] == "chat"]
    for g in chat:
        # The row "8+9=" was stored as the messages "8+" and "9="; the template joins them.
        assert g["prompt_id"].startswith("chat-add1-")
        expected = g["prompt_id"].removeprefix("chat-add1-") + "="
        assert g["prompt_text"] == expected
        assert g["prompt_token_ids"] == [TOY_VOCAB.index(ch) for ch in expected]


def test_an_expired_lease_is_offered_again(shared) -> None:
    with shared.client() as c:
        assert c.patch("/v1/config", json={"lease_ttl_s": 1.0}).status_code == 200
        try:
            drain(c)
            held = lease(c, 2, consumer="crashed")
            assert held
            held_ids = [g["group_id"] for g in held]
            # Never acked: once the lease expires the same groups are offered again, ahead
            # of anything newer. Groups finished meanwhile may be leased first; ack those.
            deadline = time.monotonic() + 3 * 1.0 + 30
            while True:
                assert time.monotonic() < deadline, "the expired lease never came back"
                got = lease(c, 8, wait_s=1.0, consumer="healthy")
                ids = [g["group_id"] for g in got]
                r = c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]})
                assert r.status_code == 200
                if set(held_ids) & set(ids):
                    break
            assert ids[: len(held_ids)] == held_ids
            again = got[: len(held_ids)]
            assert {g["delivery_id"] for g in again}.isdisjoint(g["delivery_id"] for g in held)
        finally:
            assert c.patch("/v1/config", json={"lease_ttl_s": 300.0}).status_code == 200


def test_an_oversized_weight_upload_is_refused_with_413(shared, toy) -> None:
    limit = 2 * (toy.model_dir / "model.safetensors").stat().st_size
    with shared.client() as c:
        r = c.put("/v1/weights", params={"version": 5}, content=b"\0" * (limit + (1 << 20)))
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        assert c.get("/health").json()["policy_version"] == 0


def test_a_refused_weight_file_is_named_as_the_user_knows_it(shared, tmp_path) -> None:
    """Not by the server's spool path: the user sent bytes, or named a path."""
    bad = tmp_path / "my_weights.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with shared.client() as c:
        r = c.put("/v1/weights", params={"version": 5}, content=bad.read_bytes())
        message = r.json()["error"]["message"]
        assert r.status_code == 422 and message.startswith("the uploaded file: "), message
        assert ".part" not in message and "incoming-" not in message
        r = c.post("/v1/weights/load", json={"path": str(bad), "version": 5})
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(f"{bad}: ")
        assert c.get("/health").json()["policy_version"] == 0


def test_the_api_reference_needs_no_network(shared) -> None:
    """/docs and everything it loads come from the sampler (the browser suite renders it)."""
    with shared.client() as c:
        page = c.get("/docs")
        assert (
            page.status_code == 200
            and "default-src 'self'" in page.headers["content-security-policy"]
        )
        sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sources and all(u.startswith(("/docs/", "data:")) for u in sources), sources
        for url in sources:
            if url.startswith("/docs/"):
                assert c.get(url).status_code == 200, url
        assert "Apache License" in c.get("/docs/swagger-ui.LICENSE").text  # it travels


def test_config_weights_and_unacked_groups_survive_one_kill9(make_server, toy) -> None:
    """PATCH /v1/config (applied, validated), weight uploads (versions, garbage) and
    stream redelivery after a disconnect, then one SIGKILL and restart (no clean
    shutdown) that finds all three as they were: the saved config, the policy version,
    and the unacked groups offered again ahead of anything else."""
    server = make_server({"rule": "balanced", "n_max": 16})
    with server.client() as c:
        # The config: applied to groups admitted after it, refused with the field named.
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

        # The weights: versions rise, a repeated version is a conflict, garbage is refused.
        assert c.get("/health").json()["policy_version"] == 0
        r = c.put("/v1/weights", params={"version": 1}, content=perturbed_file(toy.model_dir, 0.05))
        assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 1
        assert c.get("/health").json()["policy_version"] == 1
        # Up to max_buffered_groups + max_active_prompts (64 + 16) groups may predate the upload.
        later = [g for g in collect(c, 100) if g["policy_version_min"] >= 1]
        assert later, "no samples from the new weights"
        assert c.put("/v1/weights", params={"version": 1}, content=b"x").status_code == 409
        r = c.put("/v1/weights", params={"version": 2}, content=b"garbage bytes, not safetensors")
        assert r.status_code == 422 and r.json()["error"]["code"] == "weights_rejected", r.text
        assert c.get("/health").json()["policy_version"] == 1
        assert collect(c, 2)
        r = c.post("/v1/weights/load", json={"path": "/nonexistent/weights", "version": 3})
        assert r.status_code == 422 and r.json()["error"]["code"] == "weights_rejected", r.text
        assert r.json()["error"]["field"] == "path"

        # The stream: a dropped connection's groups go to the next consumer, acks are idempotent.
        first = stream_groups(c, 3, consumer="a", max_unacked=3)
        again = stream_groups(c, 3, consumer="b", max_unacked=3)
        assert [g["group_id"] for g in again] == [g["group_id"] for g in first]
        assert {g["delivery_id"] for g in again}.isdisjoint({g["delivery_id"] for g in first})
        r = c.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in again]})
        assert r.json() == {"acked": 3, "unknown": 0, "hint": None}
        # Idempotent: acking again changes nothing.
        r = c.post("/v1/groups/ack", json={"delivery_ids": [again[0]["delivery_id"]]})
        assert r.json()["acked"] == 0 and "already acked" in r.json()["hint"]
        acked = {g["group_id"] for g in again}
        unacked = stream_groups(c, 4, consumer="c", max_unacked=4)
        assert acked.isdisjoint(g["group_id"] for g in unacked)
        # Acking by group_id acks nothing, and the answer says which id was meant.
        r = c.post("/v1/groups/ack", json={"delivery_ids": [unacked[0]["group_id"]]})
        assert r.json()["acked"] == 0 and r.json()["unknown"] == 1
        assert "1 of the ids are group_id values" in r.json()["hint"], r.json()
        assert "delivery_id" in r.json()["hint"]
    server.kill()  # SIGKILL: no clean shutdown
    server.start()
    with server.client() as c:
        cfg = c.get("/v1/config").json()
        assert (
            cfg["config_version"] == version and cfg["rule"] == "fixed" and cfg["group_size"] == 3
        )
        assert c.get("/health").json()["policy_version"] == 1
        redelivered = stream_groups(c, 4, consumer="d", max_unacked=4)
        assert [g["group_id"] for g in redelivered] == [g["group_id"] for g in unacked]
        assert acked.isdisjoint(g["group_id"] for g in redelivered)
    # The saved config won over the command line's --config, and the log says which knobs.
    log = server.log_path.read_text()
    assert "overrides the command line's rule='balanced' (saved: 'fixed')" in log
    assert "overrides the command line's n_max=16 (saved: 8)" in log


def test_msgpack_and_json_deliver_the_same_groups(shared) -> None:
    """Stream and lease in both encodings: the same values, only the delivery ids differ."""
    with shared.client() as c:
        drain(c)
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
        c.post("/v1/groups/ack", json={"delivery_ids": [g.delivery_id for g in leased.groups]})


#: The key of the `guarded` sampler.
API_KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def guarded(make_module_server, toy, tmp_path_factory) -> Server:
    """A sampler behind an API key whose verifiers misbehave. Rows without a verifier of
    their own get the server's default (--verifier), which raises on a right answer; the
    `hang` domain names a verifier that hangs on one. The prompts are add2's, which the
    toy answers right about 40% of the time: some prompts meet a failing verifier, some
    get only wrong answers (which both verifiers score)."""
    where = tmp_path_factory.mktemp("guarded_data")
    raises = write_jsonl(where / "add2.jsonl", rows_with(toy.data_files[1], verifier=None))
    hangs = write_jsonl(
        where / "hang.jsonl",
        rows_with(toy.data_files[1], domain="hang", verifier="python:flaky_verifiers:hangs"),
    )
    return make_module_server(
        {"rule": "fixed", "group_size": 2, "n_max": 2, "wave_size": 2},
        extra=[
            *("--api-key", API_KEY),
            *("--verifier", "python:flaky_verifiers:raises", "--verifier-timeout-s", "1"),
        ],
        data=[raises, hangs],
        name="guarded",  # a state directory of its own, apart from `shared`'s
    )


def test_auth_and_bad_requests(guarded) -> None:
    server = guarded
    with server.client() as c:
        assert c.get("/health").status_code == 200
        for path in ("/v1/config", "/v1/stats"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert c.get("/v1/config", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with server.client(headers=AUTH) as c:
        assert c.get("/v1/config").status_code == 200
        assert c.post("/v1/groups/ack", json={"delivery_ids": "nope"}).status_code == 422
        assert c.post("/v1/groups/lease", json={"max_groups": -1}).status_code == 422
        assert c.get("/v1/groups/stream", params={"max_unacked": 0}).status_code == 422
        assert c.patch("/v1/config", content=b"x" * (2 << 20)).status_code == 413
        assert c.put("/v1/weights", content=b"abc").status_code == 422  # no version
        assert c.get("/v1/nope").status_code == 404


def _verifier_errors(c: httpx.Client) -> dict[str, float]:
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(c.get("/metrics").text)
        for sample in family.samples
        if sample.name == "adaptive_rollout_verifier_errors_total"
    }


def test_misbehaving_verifiers_do_not_stop_the_stream(guarded) -> None:
    """Both verifiers fail on every right answer (one raises, one hangs past its time
    limit). A failure is never a negative: each is asked again, then its prompt is dropped
    (verifier_error, or verifier_unavailable once the hanging one's breaker opens). The
    stream goes on with the groups whose answers were all scored, none of which holds a
    right answer scored 0."""
    with guarded.client(headers=AUTH) as c:
        for g in collect(c, 8):
            for s in g["samples"]:
                assert s["verifier_error"] is None
                assert exact.verify(s["response_text"], g["answer"]) == 0.0, g
            assert g["stats"]["n_neg"] == g["stats"]["n_generated"] == 2
        # Failures come at their own pace (a retry waits, a time-out takes a second): the
        # counts must move, in /v1/stats and in /metrics' series (there from the start).
        deadline = time.monotonic() + 120
        while True:
            stats, errors = c.get("/v1/stats").json(), _verifier_errors(c)
            if stats["dropped"].get("verifier_error") and errors["timeout"]:
                break
            assert time.monotonic() < deadline, (stats["dropped"], errors)
            time.sleep(0.5)
        assert stats["verifier_retries"] > 0 and errors["error"] > 0


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
    # The mixer's state survives a restart: the new process starts from the learned
    # targets, not from the uniform shares of a fresh mixer in warm-up. A buffer of 1
    # stops admission (groups are READY), so the targets stop moving before the
    # snapshot, and the restarted process admits nothing that could move them.
    with server.client() as c:
        assert c.patch("/v1/config", json={"max_buffered_groups": 1}).status_code == 200
        deadline = time.monotonic() + 120
        while (queue := c.get("/v1/stats").json()["queue"])["active_prompts"] or queue[
            "finalizing"
        ]:
            assert time.monotonic() < deadline, f"prompts still running: {queue}"
            time.sleep(0.1)
        before = c.get("/v1/stats").json()["domains"]
    server.stop()
    server.start()
    with server.client() as c:
        after = c.get("/v1/stats").json()["domains"]
    assert after[hardest]["target_share"] > after[easiest]["target_share"]
    for name, d in before.items():
        assert after[name]["target_share"] == pytest.approx(d["target_share"], abs=1e-9)


def test_a_dead_engine_is_reported_not_a_silent_hang(shared) -> None:
    """SIGKILL the engine process: health and readiness say so, admission stops, and the
    client raises EngineFailed once the groups already finished are delivered.

    It kills the engine of the module's `shared` sampler, so it is the module's last test."""
    import os
    import signal

    from trainer_client.client import SamplerClient
    from trainer_client.exceptions import EngineFailed
    from trainer_client.verl.settings import SamplerSettings
    from trainer_client.verl.source import GroupSource

    server = shared
    with server.client() as c:
        collect(c, 4)
        # Finished groups wait in the buffer when the engine dies (run alone, the sampler
        # is new): the client must get them before it hears of the failure.
        deadline = time.monotonic() + 120
        while not c.get("/v1/stats").json()["queue"]["ready"]:
            assert time.monotonic() < deadline, "the sampler finished no group to deliver"
            time.sleep(0.2)
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
