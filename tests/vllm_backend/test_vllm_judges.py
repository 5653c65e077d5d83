"""Judges over HTTP with a real `vllm serve` of the toy model on loopback.

The toy is a judge through the probability of a "yes" token: the judge's prompt is
"{response}*1=" and its "yes" is the token "1", so each answer's reward is the toy's
probability of writing 1 next, a number the test recomputes by asking the server itself.
Beside it, one sampler has three judges that misbehave, each a real process on loopback:
one nobody listens for (down), one slower than its time-out, one that answers text with
no verdict in it. Their prompts are asked again, then dropped as verifier_error; none
becomes a negative, and the toy's groups keep coming meanwhile.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from support import Server, collect, rows_with, start_server, write_jsonl
from vllm_suite import REPORT

from trainer_client.launch import EngineServer, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: The toy as a judge: P("1" | "<response>*1=") from its first-token logprobs. The toy's
#: vocabulary has 18 tokens: vLLM's engine dies when asked for more top logprobs than that.
TOY_JUDGE = {
    "api": "completions",
    "template": "{response}*1=",
    "verdict": {"form": "yes_prob", "yes": "1", "no": None, "top_logprobs": 5},
    "batch": 8,
    "retries": 1,
    "backoff_s": 0.05,
}
#: What the scripted judges read (`sampler_service.verifiers.testing_judge`).
SCRIPTED = {
    "api": "completions",
    "template": "response: {response}\nanswer: {answer}",
    "retries": 1,
    "backoff_s": 0.05,
    "timeout_s": 0.5,
}
CONFIG = {
    "rule": "balanced",
    "k_pos": 1,
    "k_neg": 1,
    "n_max": 8,
    "wave_size": 4,
    "group_size": 2,
    "max_tokens": 4,
    "judges": {
        "toy": TOY_JUDGE,
        "down": SCRIPTED,
        "slow": SCRIPTED,
        "garbage": {**SCRIPTED, "api": "chat"},
    },
}


class ScriptedJudge:
    """`python -m sampler_service.verifiers.testing_judge` in a process of its own."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sampler_service.verifiers.testing_judge", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip().removeprefix("listening on ")
        assert self.url.startswith("http://"), self.url

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Judged:
    def __init__(self, judge: EngineServer, sampler: Server) -> None:
        self.judge, self.sampler = judge, sampler
        self.model = httpx.get(judge.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def judged(toy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Judged]:
    pytest.importorskip("vllm.entrypoints.openai.api_server")
    root = tmp_path_factory.mktemp("judges")
    judge = EngineServer(toy.model_dir, root / "vllm-judge.log").start()
    scripted = [ScriptedJudge("--mode", "slow", "--delay", "5"), ScriptedJudge("--mode", "garbage")]
    try:
        started = time.monotonic()
        judge.wait_ready()
        REPORT["vllm serve (the judge) to /health (s)"] = round(time.monotonic() - started, 1)
        data = [
            write_jsonl(root / f"{name}.jsonl", rows_with(toy.data_files[0], domain=name,
                                                          verifier=f"judge:{name}"))
            for name in ("toy", "down", "slow", "garbage")
        ]  # fmt: skip
        urls = {
            "toy": judge.url,
            "down": f"http://127.0.0.1:{free_port()}",  # nobody listens there
            "slow": scripted[0].url,
            "garbage": scripted[1].url,
        }
        sampler = start_server(
            toy,
            root,
            CONFIG,
            data=data,
            extra=[a for name, url in urls.items() for a in ("--judge-url", f"{name}={url}")],
        )
        try:
            yield Judged(judge, sampler)
        finally:
            sampler.stop()
    finally:
        judge.stop()
        for server in scripted:
            server.stop()


def _p_one(judged: Judged, responses: list[str]) -> list[float]:
    """What the judge server says, asked directly: P("1") after "<response>*1=" each."""
    r = httpx.post(
        judged.judge.url + "/v1/completions",
        json={
            "model": judged.model,
            "prompt": [f"{text}*1=" for text in responses],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 5,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    out = []
    for choice in sorted(r.json()["choices"], key=lambda c: c["index"]):
        top = choice["logprobs"]["top_logprobs"][0]
        out.append(sum(math.exp(lp) for token, lp in top.items() if token.strip() == "1"))
    return out


def test_verdicts_reach_the_groups_and_the_rule_counts_them(judged: Judged) -> None:
    with judged.sampler.client() as c:
        started = time.monotonic()
        groups = collect(c, 12, timeout_s=300, wait_s=10)
        REPORT["12 groups judged by vllm serve (s)"] = round(time.monotonic() - started, 1)
        stats = c.get("/v1/stats").json()
    assert {g["domain"] for g in groups} == {"toy"}  # the other judges never judge
    rewards = [s["reward"] for g in groups for s in g["samples"]]
    expected = _p_one(judged, [s["response_text"] for g in groups for s in g["samples"]])
    assert rewards == pytest.approx(expected, abs=1e-4)
    assert min(rewards) < 0.5 < max(rewards)  # both sides of the threshold
    for g in groups:
        st = g["stats"]
        assert st["n_pos"] + st["n_neg"] == st["n_generated"] <= CONFIG["n_max"]
        if g["stop_reason"] == "rule":
            assert st["n_pos"] >= 1 and st["n_neg"] >= 1
        else:
            assert g["stop_reason"] == "n_max"
    toy = stats["judges"]["toy"]
    assert toy["verdicts"] > 0 and toy["requests"] < toy["answers"]  # waves batched
    assert toy["failures"] == {"timeout": 0, "transport": 0, "status": 0, "unreadable": 0}


def test_judges_down_slow_or_garbage_never_yield_a_negative(judged: Judged) -> None:
    with judged.sampler.client() as c:
        deadline = time.monotonic() + 240
        while True:
            stats = c.get("/v1/stats").json()
            failures = {
                name: stats["judges"][name]["failures"] for name in ("down", "slow", "garbage")
            }
            if (failures["down"]["transport"] and failures["slow"]["timeout"]
                    and failures["garbage"]["unreadable"]):  # fmt: skip
                break
            assert time.monotonic() < deadline, failures
            time.sleep(1)
        for name in ("down", "slow", "garbage"):
            judge = stats["judges"][name]
            assert judge["verdicts"] == 0 and judge["retries"] > 0, (name, judge)
        assert stats["dropped"]["verifier_error"] > 0
        # No answer a failing judge was asked about was counted, right or wrong.
        assert set(stats["domains"]) == {"toy", "down", "slow", "garbage"}
        for name in ("down", "slow", "garbage"):
            assert stats["domains"][name]["samples"] == 0, stats["domains"][name]
            assert stats["domains"][name]["emitted"] == 0
        # Live meanwhile: the toy judge's groups keep coming, /health answers at once.
        before = stats["groups_emitted"]
        started = time.monotonic()
        assert c.get("/health", timeout=5).json()["status"] == "ok"
        assert time.monotonic() - started < 2
        groups = collect(c, 4, timeout_s=120, wait_s=10)
        assert {g["domain"] for g in groups} == {"toy"}
        deadline = time.monotonic() + 120
        while c.get("/v1/stats").json()["groups_emitted"] <= before:  # new ones, not buffered
            assert time.monotonic() < deadline, "no group emitted while judges fail"
            time.sleep(0.5)
        warnings = c.get("/health").json()["warnings"]
        assert any(w.startswith("judge down") for w in warnings), warnings


def test_the_judges_knobs_are_live_and_refused_with_their_field(judged: Judged) -> None:
    with judged.sampler.client() as c:
        for body, field in (
            ({"judges": {"toy": {"timeout_s": 0}}}, "judges.toy.timeout_s"),
            ({"judges": {"toy": {"retries": -1}}}, "judges.toy.retries"),
            ({"judges": {"toy": {"template": "{answer}*1="}}}, "judges.toy.template"),
            ({"judges": {"toy": {"template": "{response.real}"}}}, "judges.toy.template"),
            ({"judges": {"toy": {"verdict": {"form": "yes_prob", "top_logprobs": 0}}}},
             "judges.toy.verdict.yes_prob.top_logprobs"),
            ({"judges": {"toy": {"verdict": {"form": "score", "pattern": "("}}}},
             "judges.toy.verdict.score.pattern"),
            ({"judges": {"new": {}}}, "judges.new"),
        ):  # fmt: skip
            r = c.patch("/v1/config", json=body)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["field"] == field, (body, r.json())
        r = c.patch("/v1/config", json={"judges": {"toy": {"batch": 2}}})
        assert r.status_code == 200, r.text
        judge = r.json()["judges"]["toy"]
        assert judge["batch"] == 2 and judge["template"] == TOY_JUDGE["template"]
