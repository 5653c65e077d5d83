"""Multi-turn episodes through the real server: the features handshake, stats and
metrics, the live episode knobs, and finished episode groups surviving a kill -9."""

from __future__ import annotations

import httpx
import pytest
from support import rows_with, write_jsonl

from trainer_client.client import SamplerClient
from trainer_client.exceptions import ConflictError

pytestmark = pytest.mark.timeout(600)

RETELL = "python:episode_envs:retell"
FIXED4 = {"rule": "fixed", "n_max": 4, "wave_size": 4, "group_size": 4}


def _lease(
    c: httpx.Client, features: str | None, n: int = 2, wait_s: float = 60.0
) -> httpx.Response:
    params = {"features": features} if features else {}
    return c.post(
        "/v1/groups/lease",
        params=params,
        json={"max_groups": n, "wait_s": wait_s, "consumer": "t"},
    )


def test_episodes_need_the_loss_mask_feature_and_survive_a_kill(make_server, toy, tmp_path) -> None:
    data = write_jsonl(tmp_path / "episodes.jsonl", rows_with(toy.data_files[1], env=RETELL))
    server = make_server(FIXED4, data=[data])
    with server.client() as c:
        # A consumer that would train on observation tokens is refused, with the fix.
        for response in (
            _lease(c, None),
            _lease(c, "no_text"),
            c.get("/v1/groups/stream", params={"consumer": "s"}),
        ):
            assert response.status_code == 409, response.text
            error = response.json()["error"]
            assert error["code"] == "feature_required" and error["field"] == "features"
            assert "loss_mask" in error["message"]
        # The clients raise it at once (no retry), naming the feature.
        with SamplerClient(server.url, consumer="plain", watchdog_s=30) as client:
            with pytest.raises(ConflictError, match="loss_mask") as refused:
                client.lease(1, wait_s=0.0)
            assert refused.value.code == "feature_required"
        # The episode knobs are live and validated, naming the field.
        bad = c.patch("/v1/config", json={"episode": {"max_turns": 0}})
        assert bad.status_code == 422 and "episode.max_turns" in bad.text
        ok = c.patch("/v1/config", json={"episode": {"env_timeout_s": 5.0}})
        assert ok.status_code == 200, ok.text
        assert c.get("/v1/config").json()["episode"]["env_timeout_s"] == 5.0

        leased = _lease(c, "loss_mask")
        assert leased.status_code == 200, leased.text
        groups = leased.json()["groups"]
        assert groups
        for group in groups:
            for sample in group["samples"]:
                assert sample["num_turns"] == 2
                mask = sample["loss_mask"]
                assert len(mask) == len(sample["response_token_ids"]) and 0 in mask and 1 in mask
        stats = c.get("/v1/stats").json()["episodes"]
        assert stats["episodes"] >= 4 * len(groups) and stats["turns_per_episode"] == 2.0
        assert stats["observation_tokens"] > 0 and stats["model_tokens"] > 0
        metrics = c.get("/metrics").text
        assert "adaptive_rollout_episode_turns_count" in metrics
        assert 'adaptive_rollout_episode_tokens_total{kind="observation"}' in metrics
        unacked = {g["group_id"] for g in groups}
    server.kill()  # SIGKILL: finished episode groups are in the store, not in memory
    server.start()
    with server.client() as c:
        seen: set[str] = set()
        for _ in range(20):
            got = _lease(c, "loss_mask", n=64, wait_s=5.0).json()["groups"]
            seen |= {g["group_id"] for g in got}
            if unacked <= seen:
                break
        assert unacked <= seen
