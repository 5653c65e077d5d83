"""The judge client against real HTTP servers on loopback: the scripted judge of
`sampler_service.verifiers.testing_judge` (right, broken, slow, garbage or flaky on
purpose) on a thread of the test process, and a port nobody listens on.

Verdicts in every API and form, the batching of a wave's answers, the time-out, the
concurrency bound, the retries, and the rule the sampler lives by: a judgement that
failed is a failed verdict, never a reward.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import collect, lease, rows_with, write_jsonl

from sampler_service.config import JudgeKnobs, SamplerConfig
from sampler_service.dataset import PromptRow
from sampler_service.tally import Tally
from sampler_service.verifiers import exact, testing_judge
from sampler_service.verifiers.judge import Judges
from sampler_service.verifiers.retry import verify_with_retries

pytestmark = pytest.mark.timeout(300)

#: What the scripted judge reads: the response and the reference, one per line.
TEMPLATE = "question: {prompt}\nresponse: {response}\nanswer: {answer}"
ROW = PromptRow(id="p1", prompt="3+4=", answer="7", domain="add1")
#: Right, wrong, right (as `exact` reads it), wrong.
RESPONSES = ["7", "8", " 7.0", "seven"]
RIGHT = [True, False, True, False]


def _judge_server(**kw: Any) -> Iterator[str]:
    state = testing_judge.State(
        kw.get("mode", "grade"),
        kw.get("text", "label"),
        kw.get("delay", 5.0),
        kw.get("fail_first", 0),
        0.0,
    )
    server = testing_judge.serve("127.0.0.1", 0, state)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def judge_server() -> Iterator[Callable[..., str]]:
    """Start scripted judges (keyword arguments: `State`'s), each shut down after the test."""
    started: list[Iterator[str]] = []

    def start(**kw: Any) -> str:
        server = _judge_server(**kw)
        started.append(server)
        return next(server)

    yield start
    for server in started:
        next(server, None)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def judges() -> AsyncIterator[Callable[..., tuple[Judges, Tally]]]:
    """Judges over one named `g`: `make(url, **knobs)`; every client closed after."""
    made: list[Judges] = []

    def make(url: str, **knobs: Any) -> tuple[Judges, Tally]:
        config = SamplerConfig(judges={"g": JudgeKnobs(template=TEMPLATE, **knobs)})
        tally = Tally(["add1"], time.monotonic, judges=["g"])
        judge = Judges({"g": url}, "k3y", lambda: config.judges, tally)
        made.append(judge)
        return judge, tally

    yield make
    for judge in made:
        await judge.close()


def _served(url: str) -> dict[str, int]:
    return httpx.get(url + "/stats").json()


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({"api": "chat"}, [1.0, 0.0, 1.0, 0.0]),
        ({"api": "chat", "verdict": {"form": "yes_prob"}}, [0.9, 0.1, 0.9, 0.1]),
        ({"api": "completions", "verdict": {"form": "yes_prob", "no": None}}, [0.9, 0.1, 0.9, 0.1]),
        ({"api": "completions", "verdict": {"form": "label", "labels": {"yes": 0.8, "no": 0.2}}},
         [0.8, 0.2, 0.8, 0.2]),
        ({"api": "classify", "verdict": {"form": "score", "index": 1}}, [0.9, 0.1, 0.9, 0.1]),
        ({"api": "classify", "verdict": {"form": "label", "labels": {"right": 1, "wrong": 0}}},
         [1.0, 0.0, 1.0, 0.0]),
    ],
)  # fmt: skip
async def test_verdicts_in_every_api_and_form(judge_server, judges, knobs, expected) -> None:
    url = judge_server()
    judge, tally = judges(url, **knobs)
    verdicts = await judge.verify_wave("g", ROW, RESPONSES)
    assert [v.kind for v in verdicts] == ["ok"] * 4
    assert [v.reward for v in verdicts] == pytest.approx(expected)
    stats = tally.judges["g"].to_dict()
    assert (stats["answers"], stats["verdicts"]) == (4, 4)
    assert sum(stats["failures"].values()) == 0


async def test_a_score_out_of_ten_from_the_judges_text(judge_server, judges) -> None:
    judge, _ = judges(judge_server(text="score"), verdict={"form": "score", "high": 10})
    verdicts = await judge.verify_wave("g", ROW, RESPONSES)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0, 0.0]


async def test_a_wave_is_batched_into_prompt_lists_or_concurrent_chat_calls(
    judge_server, judges
) -> None:
    url = judge_server()
    batched, tally = judges(url, api="completions", batch=3)
    wave = RESPONSES * 2
    assert [v.reward for v in await batched.verify_wave("g", ROW, wave)] == [1, 0, 1, 0] * 2
    assert _served(url) == {"requests": 3, "prompts": 8}  # 3 + 3 + 2
    assert tally.judges["g"].requests == 3
    one_each, _ = judges(url, api="completions", batch=1)
    await one_each.verify_wave("g", ROW, wave)
    chat, _ = judges(url, api="chat", batch=8)  # chat: a request per answer, whatever batch
    await chat.verify_wave("g", ROW, wave)
    assert _served(url) == {"requests": 3 + 8 + 8, "prompts": 24}


async def test_at_most_concurrency_requests_are_in_flight(judge_server, judges) -> None:
    url = judge_server(mode="slow", delay=0.3)
    judge, tally = judges(url, api="chat", concurrency=2)
    started = time.monotonic()
    verdicts = await judge.verify_wave("g", ROW, RESPONSES * 2)
    elapsed = time.monotonic() - started
    assert all(v.kind == "ok" for v in verdicts)
    # 8 requests of 0.3 s, 2 at a time: 4 rounds; all at once would take one.
    assert elapsed >= 4 * 0.3 - 0.05, elapsed
    assert tally.judges["g"].requests == 8


@pytest.mark.parametrize(
    ("server", "knobs", "cause", "kind"),
    [
        ({"mode": "status"}, {}, "status", "error"),
        ({"mode": "notjson"}, {}, "unreadable", "error"),
        ({"mode": "garbage"}, {}, "unreadable", "error"),  # text with no label in it
        ({"mode": "garbage"}, {"verdict": {"form": "yes_prob"}}, "unreadable", "error"),
        ({"mode": "slow", "delay": 2.0}, {"timeout_s": 0.2}, "timeout", "timeout"),
        (None, {}, "transport", "error"),  # nobody listens
    ],
)
async def test_a_failed_judgement_is_a_failed_verdict_never_a_reward(
    judge_server, judges, server, knobs, cause, kind
) -> None:
    url = judge_server(**server) if server is not None else f"http://127.0.0.1:{_closed_port()}"
    judge, tally = judges(url, api="completions", batch=2, **knobs)
    started = time.monotonic()
    verdicts = await judge.verify_wave("g", ROW, RESPONSES)
    assert [v.kind for v in verdicts] == [kind] * 4
    assert all(v.error is not None and v.error.startswith("judge g: ") for v in verdicts)
    stats = tally.judges["g"].to_dict()
    assert stats["failures"][cause] == 4 and stats["verdicts"] == 0 and stats["requests"] == 2
    assert stats["last_error"] is not None and stats["last_error"].startswith(cause)
    if cause == "timeout":
        assert time.monotonic() - started < 1.5  # both requests cut at 0.2 s, together
    # Enough failed requests in a row and /health names the judge.
    for _ in range(5):
        await judge.verify_wave("g", ROW, RESPONSES)
    assert any(w.startswith("judge g: ") for w in judge.warnings())


async def test_failures_are_asked_again_with_backoff_until_the_judge_answers(
    judge_server, judges
) -> None:
    """A judge that answers 503 to its first 3 requests: with 2 retries of a batch of 4
    the third try still fails (the prompt would be dropped); with 3 the fourth answers."""
    for retries, kinds in ((2, ["error"] * 4), (3, ["ok"] * 4)):
        url = judge_server(fail_first=3)
        judge, tally = judges(url, api="completions", retries=retries, backoff_s=0.05)
        policy = judge.retry_policy("g")
        retried: list[int] = []

        async def once(indices: Any, judge: Judges = judge) -> list:
            return await judge.verify_wave("g", ROW, [RESPONSES[i] for i in indices])

        started = time.monotonic()
        verdicts = await verify_with_retries(once, 4, lambda policy=policy: policy, retried.append)
        assert [v.kind for v in verdicts] == kinds
        assert retried == [4] * retries
        # Waits of at least half of 0.05, 0.1 (and 0.2) s.
        assert time.monotonic() - started >= 0.5 * sum(0.05 * 2**k for k in range(retries))
        assert tally.judges["g"].failures["status"] == 4 * 3
        if kinds[0] == "ok":
            assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0, 0.0]


async def test_the_api_key_the_model_and_the_prompt_go_to_the_judge(judge_server, judges) -> None:
    url = judge_server()
    judge, _ = judges(url, model="judge-model", system="Be strict.", temperature=0.5)
    [verdict] = await judge.verify_wave("g", ROW, ["7"])
    assert verdict.reward == 1.0
    last = httpx.get(url + "/last").json()
    assert last["path"] == "/v1/chat/completions"
    assert last["authorization"] == "Bearer k3y"
    body = last["body"]
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("judge-model", 0.5, 16)
    assert body["messages"] == [
        {"role": "system", "content": "Be strict."},
        {"role": "user", "content": "question: 3+4=\nresponse: 7\nanswer: 7"},
    ]
    chat_row = PromptRow(
        id="p2",
        prompt=[{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}],
        answer="7",
        domain="add1",
    )
    await judge.verify_wave("g", chat_row, ["7"])
    body = httpx.get(url + "/last").json()["body"]
    assert body["messages"][-1]["content"].startswith("question: 3+4=\n")


# -- a sampler whose rows are graded by a judge ---------------------------------------
#: A judge config for the toy: the scripted judge reads the response and the answer.
GRADER = {"api": "completions", "template": TEMPLATE, "batch": 4, "verdict": {"form": "label"}}
JUDGED = {"rule": "balanced", "k_pos": 1, "k_neg": 1, "n_max": 8, "wave_size": 4, "group_size": 2}


def _judged_rows(toy: Any, where: Path, judge: str = "judge:grader") -> Path:
    return write_jsonl(where / "add2.jsonl", rows_with(toy.data_files[1], verifier=judge))


def test_a_sampler_grades_its_rows_with_a_judge(make_server, toy, tmp_path, judge_server) -> None:
    """Rows naming `judge:grader` are graded by the scripted judge over HTTP: rewards are
    its verdicts, the rule counts them, /v1/stats and /metrics count its requests, and its
    knobs are live, each refused with its field when it cannot be served."""
    url = judge_server()
    server = make_server(
        {**JUDGED, "judges": {"grader": GRADER}},
        data=[_judged_rows(toy, tmp_path)],
        extra=["--judge-url", f"grader={url}"],
    )
    with server.client() as c:
        groups = collect(c, 6)
        for g in groups:
            rewards = [s["reward"] for s in g["samples"]]
            expected = [exact.verify(s["response_text"], g["answer"]) for s in g["samples"]]
            assert rewards == expected, g
            st = g["stats"]
            assert st["n_pos"] + st["n_neg"] == st["n_generated"] <= 8
            if g["stop_reason"] == "rule":
                assert st["n_pos"] >= 1 and st["n_neg"] >= 1
        stats = c.get("/v1/stats").json()
        judged = stats["judges"]["grader"]
        assert judged["verdicts"] > 0 and judged["requests"] < judged["answers"]  # batched
        assert sum(judged["failures"].values()) == 0 and judged["retries"] == 0
        assert _served(url)["requests"] >= judged["requests"]
        metrics = c.get("/metrics").text
        assert re.search(r'judge_verdicts_total\{judge="grader"\} [1-9]', metrics), metrics
        assert 'judge_failures_total{cause="timeout",judge="grader"} 0.0' in metrics

        for body, field in (
            ({"judges": {"other": {}}}, "judges.other"),  # no server for it
            ({"judges": {"grader": {"template": "{answer}"}}}, "judges.grader.template"),
            ({"judges": {"grader": {"batch": 0}}}, "judges.grader.batch"),
            ({"judges": {"grader": {"timeout_s": "30"}}}, "judges.grader.timeout_s"),
            ({"judges": {"grader": {"verdict": {"form": "yes_prob"}, "api": "classify"}}},
             "judges.grader"),
        ):  # fmt: skip
            r = c.patch("/v1/config", json=body)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["field"] == field, r.json()
        r = c.patch("/v1/config", json={"judges": {"grader": {"batch": 1, "retries": 0}}})
        assert r.status_code == 200, r.text
        assert r.json()["judges"]["grader"]["batch"] == 1
        assert r.json()["judges"]["grader"]["template"] == TEMPLATE  # merged, not replaced


def test_a_judge_that_fails_drops_its_prompts_and_never_yields_a_negative(
    make_server, toy, tmp_path, judge_server
) -> None:
    """A judge that answers 500 to everything: every prompt is asked again, then dropped
    as verifier_error; no group is emitted, the sampler stays live and says why."""
    url = judge_server(mode="status")
    server = make_server(
        {**JUDGED, "judges": {"grader": {**GRADER, "retries": 1, "backoff_s": 0.01}}},
        data=[_judged_rows(toy, tmp_path)],
        extra=["--judge-url", f"grader={url}"],
    )
    with server.client() as c:
        deadline = time.monotonic() + 120
        while (stats := c.get("/v1/stats").json())["dropped"].get("verifier_error", 0) < 5:
            assert time.monotonic() < deadline, stats["dropped"]
            time.sleep(0.2)
        assert lease(c, 8, wait_s=0.0) == []
        assert stats["groups_emitted"] == 0 and stats["samples"] == 0
        judged = stats["judges"]["grader"]
        assert judged["verdicts"] == 0 and judged["failures"]["status"] > 0
        assert judged["retries"] > 0
        assert any(w.startswith("judge grader") for w in c.get("/health").json()["warnings"])


def test_a_judge_in_use_needs_a_server_and_knobs_at_start_up(make_server, toy, tmp_path) -> None:
    data = [_judged_rows(toy, tmp_path)]
    with pytest.raises(RuntimeError, match="judge 'grader'.*not configured"):
        make_server(data=data, extra=["--judge-url", "grader=http://127.0.0.1:9"], name="knobs")
    with pytest.raises(RuntimeError, match="--judge-url grader=URL"):
        make_server({"judges": {"grader": GRADER}}, data=data, name="url")
