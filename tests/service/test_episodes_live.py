"""Multi-turn episodes through the real server: the features handshake (lease, stream,
clients), stats and metrics (and the `stats` command), the live episode knobs, and
finished episode groups surviving a kill -9."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from support import Server, ops_cli, rows_with, write_jsonl

from trainer_client.client import SamplerClient
from trainer_client.contract.features import LOSS_MASK
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


def _episode_data(toy, where: Path) -> Path:
    """The toy's add2 prompts, each answered by two-turn episodes."""
    return write_jsonl(where / "episodes.jsonl", rows_with(toy.data_files[1], env=RETELL))


#: Turns of at most 8 tokens: every episode has room for both turns in the toy's context
#: (a turn that never sampled EOS could otherwise take the whole context).
SHORT_TURNS = {**FIXED4, "episode": {"max_tokens_per_turn": 8}}


@pytest.fixture(scope="module")
def episodes(make_module_server, toy, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """A sampler answering by episodes, shared by the tests that do not stop it."""
    return make_module_server(
        SHORT_TURNS,
        data=[_episode_data(toy, tmp_path_factory.mktemp("data"))],
    )


class CountingTransport(httpx.HTTPTransport):
    """The real HTTP transport, keeping the path of every request it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return super().handle_request(request)


def test_episodes_need_the_loss_mask_feature_and_survive_a_kill(make_server, toy, tmp_path) -> None:
    server = make_server(SHORT_TURNS, data=[_episode_data(toy, tmp_path)])
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


def test_the_stream_refuses_a_consumer_without_the_mask_at_once(episodes: Server) -> None:
    """The sync stream raises the 409 naming the feature on its first answer: a refusal
    the consumer must fix is not retried until the watchdog gives up."""
    transport = CountingTransport()
    with (
        SamplerClient(
            episodes.url, transport=transport, consumer="plain-stream", watchdog_s=30
        ) as client,
        pytest.raises(ConflictError, match=LOSS_MASK) as refused,
    ):
        next(client.groups())
    assert refused.value.code == "feature_required"
    assert transport.paths == ["/v1/groups/stream"]
    # The same stream with the feature declared gets the episodes.
    with SamplerClient(episodes.url, consumer="mask-stream", features=[LOSS_MASK]) as client:
        group = next(client.groups(max_unacked=1))
        client.ack([group])
    assert all(s.loss_mask and 0 in s.loss_mask for s in group.samples)


def _row(text: str, label: str) -> str:
    """The value of one labelled row of the `stats` output."""
    match = re.search(rf"^ *{re.escape(label)} +(\S.*?) *$", text, re.MULTILINE)
    assert match, (label, text)
    return match[1]


def test_the_stats_command_shows_the_episodes(episodes: Server) -> None:
    """`adaptive-rollout stats` shows what `/v1/stats` has under `episodes`: the figures
    it printed lie between those read just before and just after it."""
    with episodes.client() as c:
        assert _lease(c, LOSS_MASK, n=1).json()["groups"]  # episodes have run
        before = c.get("/v1/stats").json()["episodes"]
        shown = ops_cli(episodes.url, "stats")
        after = c.get("/v1/stats").json()["episodes"]
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert before["episodes"] <= int(_row(text, "episodes")) <= after["episodes"]
    assert _row(text, "turns per episode") == "2.00"  # every Retell episode has two turns
    assert _row(text, "environment errors") == "0"
    assert float(_row(text, "environment seconds")) >= 0.0
    tokens = re.fullmatch(
        r"(\d+) / (\d+) \((\d+)% observation\)", _row(text, "model / observation tokens")
    )
    assert tokens, text
    model, observation, share = map(int, tokens.groups())
    assert before["model_tokens"] <= model <= after["model_tokens"]
    assert before["observation_tokens"] <= observation <= after["observation_tokens"]
    assert observation > 0 and abs(share - 100 * observation / (model + observation)) <= 0.5
