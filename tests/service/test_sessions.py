"""Agent harnesses drive episodes through the session proxy, against the real server.

- An unchanged OpenAI-client harness (`examples.calculator_harness`, a `python:` spec)
  drives the toy calculator task: its tool calls come back as `tool_calls`, its results
  are appended token-in/token-out, the groups obey the rule counted in sessions, the
  engine's scores reproduce the sampled logprobs, and finished groups survive kill -9.
- A command harness that crashes, quits or goes silent is an environment error, never a
  negative, and the sampler goes on.
- A harness elsewhere claims sessions over HTTP: n = 2, stream, a changed history, a call
  after the end, a cancelled or unknown session and a missing key get their answers.
"""

from __future__ import annotations

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import episode_envs
import httpx
import openai
import pytest
import torch
from chat_tokenizers import CHATML, char_tokenizer, encode, rendered
from support import Server, write_jsonl
from test_episode_runner import CALL, ScriptedChat, chat_row
from transformers import AutoTokenizer

from examples.calculator_harness import CALCULATOR_TOOL, tool_result
from sampler_service.backends.base import SamplingParams
from sampler_service.backends.hf import HFBackend
from sampler_service.config import EpisodeKnobs
from sampler_service.environments.tools import tool_schema
from sampler_service.episodes import EpisodeRenderer, EpisodeRunner, EpisodeWave
from sampler_service.sessions import build_sessions, session_factory
from sampler_service.sessions.chat import ChatRequest
from sampler_service.sessions.harness import FunctionLauncher, HarnessSession
from sampler_service.sessions.hub import End, Exited, Session, SessionHub
from trainer_client.contract.calculator import evaluate
from trainer_client.toy import ToyPaths, build_toy, read_jsonl

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).parent
#: Balanced 1/1 counted in index order, waves of 4, up to 8 sessions, every session kept.
EXACT_BALANCED: dict[str, Any] = {
    "rule": "balanced",
    "k_pos": 1,
    "k_neg": 1,
    "n_max": 8,
    "wave_size": 4,
    "group_size": 0,
    "min_answers": 1,
    "downsample": "none",
    "stopping": "exact",
    "max_active_prompts": 2,
    "episode": {"max_tokens_per_turn": 16},
}


@pytest.fixture(scope="module")
def calculator(tmp_path_factory: pytest.TempPathFactory) -> ToyPaths:
    """The toy calculator model and its rows (the mul domain calls the tool most)."""
    return build_toy(tmp_path_factory.mktemp("calc"), n_train=16, n_eval=4, toy_task="calculator")


def _session_rows(
    calculator: ToyPaths, where: Path, modes: dict[int, str] | None = None, keep: int = 0
) -> Path:
    """The calculator rows answered by sessions (the first `keep`, if given), the rows
    at `modes`' indices asking the harness to misbehave."""
    rows = [r for path in calculator.data_files for r in read_jsonl(path)]
    rows = rows[:keep] if keep else rows
    for i, row in enumerate(rows):
        row["env"] = "session"
        if modes and i in modes:
            row["metadata"] = {**(row.get("metadata") or {}), "harness": modes[i]}
    return write_jsonl(where / "sessions.jsonl", rows)


def _start(make: Any, calculator: ToyPaths, data: Path, cfg: dict, *extra: str) -> Server:
    return make(cfg, data=[data], model=calculator.model_dir, extra=list(extra))


def _lease_masked(server: Server, n: int) -> list[dict]:
    groups: list[dict] = []
    with server.client() as c:
        for _ in range(30):
            groups += _take(c, n - len(groups), 20.0)
            if len(groups) >= n:
                return groups
    raise AssertionError(f"{len(groups)} of {n} groups in time")


def _take(c: httpx.Client, n: int, wait_s: float) -> list[dict]:
    r = c.post(
        "/v1/groups/lease",
        params={"features": "loss_mask"},
        json={"max_groups": n, "wait_s": wait_s, "consumer": "t"},
    )
    assert r.status_code == 200, r.text
    return r.json()["groups"]


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


@pytest.fixture(scope="module")
def harnessed(make_module_server, calculator, tmp_path_factory) -> Server:
    data = _session_rows(calculator, tmp_path_factory.mktemp("rows"))
    return _start(
        make_module_server,
        calculator,
        data,
        EXACT_BALANCED,
        "--harness",
        "python:examples.calculator_harness:harness",
    )


@pytest.fixture(scope="module")
def harnessed_groups(harnessed: Server) -> list[dict]:
    return _lease_masked(harnessed, 8)


def test_an_openai_harness_drives_the_calculator_task_token_in_token_out(
    harnessed: Server, harnessed_groups: list[dict], calculator: ToyPaths
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(calculator.model_dir)
    observed = 0
    for group in harnessed_groups:
        for sample in group["samples"]:
            ids, mask = sample["response_token_ids"], sample["loss_mask"]
            assert len(mask) == len(ids) == len(sample["logprobs"])
            runs = _runs(mask)
            assert sample["num_turns"] == sum(value == 1 for value, _, _ in runs)
            for k, (value, start, end) in enumerate(runs):
                if value == 0:
                    # what the harness's tool answered to the call the turn before made
                    turn = ids[runs[k - 1][1] : runs[k - 1][2]]
                    call = tokenizer.decode(turn, skip_special_tokens=True)
                    expression = call.rsplit("[", 1)[1].rstrip("]")
                    answer = evaluate(expression)
                    expected = ";" if answer is None else f"{answer};"
                    assert tokenizer.decode(ids[start:end]) == expected
                    assert all(lp == 0.0 for lp in sample["logprobs"][start:end])
                    observed += 1
    assert observed > 0, "no session called the tool"
    with harnessed.client() as c:
        sessions = c.get("/v1/stats").json()["sessions"]
    assert sessions["calls"] >= sum(len(g["samples"]) for g in harnessed_groups)
    # the harness's temperature was counted and ignored
    assert sessions["ignored"]["temperature"] == sessions["calls"]
    assert sessions["ended_by_harness"] > 0


def test_groups_obey_the_rule_counted_in_sessions(harnessed_groups: list[dict]) -> None:
    """Balanced 1/1 in index order: a group is sessions 1..j for the first j holding a
    right and a wrong one (or all 8)."""
    for group in harnessed_groups:
        samples = group["samples"]
        assert [s["index"] for s in samples] == list(range(len(samples)))
        right = [s["reward"] > 0.5 for s in samples]
        assert group["stats"]["outcomes"] == [s["reward"] for s in samples]
        if group["stop_reason"] == "rule":
            assert len(set(right)) == 2 and len(set(right[:-1])) == 1
        else:
            assert group["stop_reason"] == "n_max" and len(samples) == 8


def test_the_engine_scores_reproduce_the_sampled_logprobs(
    harnessed_groups: list[dict], calculator: ToyPaths
) -> None:
    async def scores() -> int:
        engine = HFBackend(
            calculator.model_dir, tokenizer=AutoTokenizer.from_pretrained(calculator.model_dir)
        )
        await engine.start()
        checked = 0
        try:
            for group in harnessed_groups:
                for sample in group["samples"]:
                    got = await engine.score(
                        group["prompt_token_ids"], sample["response_token_ids"]
                    )
                    kept = [i for i, m in enumerate(sample["loss_mask"]) if m]
                    torch.testing.assert_close(
                        torch.tensor([got[i] for i in kept]),
                        torch.tensor([sample["logprobs"][i] for i in kept]),
                        atol=1e-4,
                        rtol=0,
                    )
                    checked += len(kept)
        finally:
            await engine.close()
        return checked

    assert asyncio.run(scores()) > 0


def test_surplus_sessions_are_cancelled_and_finished_groups_survive_a_kill(
    harnessed: Server, harnessed_groups: list[dict]
) -> None:
    with harnessed.client() as c:
        for _ in range(60):
            stats = c.get("/v1/stats").json()
            if stats["sessions"]["cancelled"] > 0:
                break
            _take(c, 4, 5.0)  # keep the sampler going
        assert stats["sessions"]["cancelled"] > 0
    unacked = {g["group_id"] for g in harnessed_groups}
    harnessed.kill()  # SIGKILL: finished session groups are in the store
    harnessed.start()
    with harnessed.client() as c:
        seen: set[str] = set()
        for _ in range(20):
            seen |= {g["group_id"] for g in _take(c, 64, 5.0)}
            if unacked <= seen:
                break
        assert unacked <= seen


def test_failing_command_harnesses_are_environment_errors_not_negatives(
    make_server, calculator, tmp_path
) -> None:
    """A command harness that crashes, quits without ending, or goes silent past
    env_timeout_s fails its episode (re-run while the prompt's error budget lasts, then
    the prompt is dropped as env_error); the
    sampler goes on with the other prompts, and no failure is ever a negative."""
    modes = {0: "crash", 1: "quit", 2: "silent"}
    data = _session_rows(calculator, tmp_path, modes, keep=6)
    failing = {r["id"] for i, r in enumerate(read_jsonl(data)) if i in modes}
    cfg = {
        **EXACT_BALANCED,
        "max_active_prompts": 3,
        # a process per session: ~1.2 s of CPU to start one, on a loaded 2-core box
        "episode": {"max_tokens_per_turn": 16, "env_timeout_s": 20.0, "max_env_errors": 1},
    }
    harness = f"{sys.executable} -m session_harnesses"  # tests/service is on PYTHONPATH
    server = _start(make_server, calculator, data, cfg, "--harness", harness)
    groups = _lease_masked(server, 4)
    assert not {g["prompt_id"] for g in groups} & failing
    with server.client() as c:
        reasons = (
            "exited with code 1",  # crash, its stderr quoted
            "the harness crashed",
            "exited with code 0 without ending its session",  # quit
            "took longer than env_timeout_s",  # silent
        )
        for _ in range(120):
            stats = c.get("/v1/stats").json()
            dropped = stats["dropped"].get("env_error", 0)
            log = server.log_path.read_text()
            if dropped >= len(modes) and all(reason in log for reason in reasons):
                break
            _take(c, 8, 2.0)
        assert dropped >= len(modes), stats["episodes"]
        assert stats["episodes"]["env_errors"] >= len(modes)
        assert [reason for reason in reasons if reason not in log] == []
        assert c.get("/ready").status_code == 200


KEY = "session-key"


@pytest.fixture(scope="module")
def claimable(make_module_server, calculator, tmp_path_factory) -> Server:
    """Sessions for harnesses elsewhere (no --harness), behind an API key; a session not
    called within 20 s fails (and its prompt is re-run)."""
    data = _session_rows(calculator, tmp_path_factory.mktemp("claim"))
    cfg = {
        **EXACT_BALANCED,
        "max_active_prompts": 1,
        "episode": {"env_timeout_s": 20.0, "max_tokens_per_turn": 8},
    }
    return make_module_server(
        cfg, data=[data], model=calculator.model_dir, extra=["--api-key", KEY], name="claim"
    )


def _claim(server: Server) -> dict[str, Any]:
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        r = c.post("/v1/sessions/claim", json={"wait_s": 30.0})
    assert r.status_code == 200, r.text
    session = r.json()["session"]
    assert session is not None
    return session


def test_a_claimed_session_answers_every_misuse_with_its_code(claimable: Server) -> None:
    session = _claim(claimable)
    url = session["base_url"] + "/chat/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    first = [{"role": "user", "content": session["row"]["prompt"]}]
    body = {"model": "toy", "messages": first, "tools": [CALCULATOR_TOOL]}
    with httpx.Client(timeout=60, headers=auth) as c:
        assert httpx.post(url, json=body, timeout=30).status_code == 401  # no key
        n2 = c.post(url, json={**body, "n": 2})
        assert n2.status_code == 400 and n2.json()["error"]["code"] == "n_unsupported"
        streamed = c.post(url, json={**body, "stream": True})
        assert streamed.status_code == 400
        assert streamed.json()["error"]["code"] == "stream_unsupported"
        assert c.post(url, json={"messages": []}).status_code == 422
        # a real turn, with logprobs for each sampled token
        r = c.post(url, json={**body, "logprobs": True, "seed": 3})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["logprobs"]["content"]) == r.json()["usage"]["completion_tokens"]
        transcript = [*first, choice["message"]]
        # a changed prefix is refused, and the session goes on
        changed = [{"role": "user", "content": "1+1="}, choice["message"]]
        refused = c.post(
            url, json={**body, "messages": [*changed, {"role": "user", "content": "x"}]}
        )
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "history_changed"
        # another assistant turn of the harness's own is refused too
        forged = [*transcript, {"role": "assistant", "content": "7"}]
        assert c.post(url, json={**body, "messages": forged}).status_code == 409
        # the transcript plus new messages continues it
        follow = [*transcript, {"role": "user", "content": ""}]
        if choice["message"].get("tool_calls"):
            call = choice["message"]["tool_calls"][0]
            follow = [
                *transcript,
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": tool_result(call["function"]["arguments"]),
                },
            ]
        # two copies of the next call at once: one is served, the other refused (in
        # flight, or no longer the transcript once the first was answered)
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda _: c.post(url, json={**body, "messages": follow}), [0, 1]))
        assert sorted(r.status_code for r in both) == [200, 409]
        (loser,) = [r for r in both if r.status_code == 409]
        assert loser.json()["error"]["code"] == "history_changed"
        (served,) = [r for r in both if r.status_code == 200]
        follow = [*follow, served.json()["choices"][0]["message"], {"role": "user", "content": ""}]
        assert c.post(url, json={**body, "messages": follow}).status_code == 200
        # the harness is a start-up setting: never part of the live config
        patched = c.patch(f"{claimable.url}/v1/config", json={"harness": "python:os:system"})
        assert patched.status_code == 422 and "harness" in patched.text
        end = c.post(f"{session['session_url']}/end", json={"reward": 1.0})
        assert end.status_code == 200 and end.json()["ended"] is True
        after = c.post(url, json={**body, "messages": follow})
        assert after.status_code == 409 and after.json()["error"]["code"] == "session_ended"
        unknown = c.post(url.replace(session["session_id"], "nope"), json=body)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "unknown_session"
    assert httpx.get(f"{claimable.url}/ready", timeout=30).status_code == 200


def test_a_surplus_session_is_cancelled_and_its_openai_client_told_so(
    claimable: Server,
) -> None:
    """Claim a wave's sessions and end them in order, right then wrong: under exact
    balanced 1/1 the rule then holds, the sessions above are cancelled, and their next
    call gets 409 session_cancelled (a ConflictError in the openai package)."""
    codes: list[str] = []
    for _ in range(5):
        held = []
        for _ in range(4):
            with claimable.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
                claimed = c.post("/v1/sessions/claim", json={"wait_s": 10.0}).json()["session"]
            if claimed is None:
                break
            held.append(claimed)
        rewards = iter([1.0, 0.0] * 4)
        for session in held:
            client = openai.OpenAI(base_url=session["base_url"], api_key=KEY, max_retries=0)
            try:
                client.chat.completions.create(
                    model="toy", messages=[{"role": "user", "content": session["row"]["prompt"]}]
                )
            except openai.ConflictError as exc:
                codes.append(json.loads(exc.response.text)["error"]["code"])
                continue
            httpx.post(
                f"{session['session_url']}/end",
                json={"reward": next(rewards)},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=30,
            ).raise_for_status()
        if "session_cancelled" in codes:
            break
    assert "session_cancelled" in codes, codes
    with claimable.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        sessions = c.get("/v1/stats").json()["sessions"]
    assert sessions["cancelled"] >= 1 and sessions["refused"]["session_cancelled"] >= 1


def test_calls_in_one_session_are_sequential_and_the_end_waits_for_its_answer() -> None:
    """The session's own bookkeeping: a second call while one is in flight, or an end
    during a call, is refused with 409; events come out in order."""

    async def run() -> None:
        session = Session("s", {"prompt": "1+1="}, asyncio.get_running_loop())
        request = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
        call = session.begin_call(request)
        with pytest.raises(Exception, match="sequential") as second:
            session.begin_call(request)
        assert second.value.code == "history_changed"  # type: ignore[attr-defined]
        with pytest.raises(Exception, match="in flight"):
            session.end(1.0)
        assert await session.next_event() is call
        session.end_call()
        session.end(0.5)
        assert await session.next_event() == End(0.5)
        with pytest.raises(Exception, match="ended"):
            session.begin_call(request)

    asyncio.run(run())


def test_a_python_harness_that_raises_or_returns_is_reported_to_its_session() -> None:
    async def run(function: Any) -> Exited:
        hub = SessionHub(model="toy", api_key=None)
        session = hub.open({"prompt": "x"}, asyncio.get_running_loop())
        running = await FunctionLauncher(function).start(
            session, hub.urls(session, "http://127.0.0.1:1"), "k"
        )
        event = await asyncio.wait_for(session.next_event(), 30)
        await running.stop(ended=False)
        assert isinstance(event, Exited)
        return event

    def crash(session: HarnessSession) -> None:
        raise ValueError("boom")

    async def quits(session: HarnessSession) -> None:
        return None

    assert "raised ValueError('boom')" in asyncio.run(run(crash)).reason
    assert asyncio.run(run(quits)).reason == "the harness returned"


def test_a_hermes_harness_session_on_a_chat_template_is_token_in_token_out(
    tmp_path: Path,
) -> None:
    """On a ChatML template with Hermes tool calls: the first turn is sent the template's
    rendering of the harness's messages and tools, the model's `<tool_call>` comes back
    as an OpenAI tool call, the tool message is appended as the template's delta, and
    the episode is the sampled tokens (never re-encoded) with the harness's reward."""
    tokenizer = char_tokenizer(CHATML)
    row = chat_row(tmp_path, tokenizer)
    model = ScriptedChat(tokenizer)
    setup = build_sessions(
        model="chat", api_key=None, harness=None, tools="hermes", tokenizer=tokenizer
    )
    hub = setup.hub
    hub.server_url = "http://127.0.0.1:1"  # the harness below calls the hub itself
    tools = [tool_schema(episode_envs.add)]
    replies: list[dict[str, Any]] = []

    async def harness(session: HarnessSession) -> None:
        messages: list[dict[str, Any]] = list(session.row["prompt"])
        while True:
            request = ChatRequest.model_validate({"messages": messages, "tools": tools})
            reply = await hub.chat(session.session_id, request)
            replies.append(reply)
            message = reply["choices"][0]["message"]
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                result = episode_envs.add(**json.loads(call["function"]["arguments"]))
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": str(result)}
                )
        hub.get(session.session_id).end(1.0)

    setup = replace(setup, launcher=FunctionLauncher(harness))

    async def run() -> EpisodeWave:
        runner = EpisodeRunner(tokenizer, EpisodeRenderer(tokenizer), {})
        return await EpisodeWave(
            runner, row, session_factory(setup), 1, SamplingParams(), EpisodeKnobs(), model.turn, 1
        ).run()

    wave = asyncio.run(run())
    assert not wave.env_errors, wave.env_errors
    call = replies[0]["choices"][0]
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] == ""
    assert call["message"]["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": json.dumps({"a": 2, "b": 3}),
    }
    assert replies[1]["choices"][0]["message"] == {"role": "assistant", "content": "5"}
    opening = list(row.prompt)
    after_call = [
        *opening,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    first, second = (rendered(tokenizer, m, tools) for m in (opening, after_call))
    assert model.sent == [first, second]
    (episode,) = wave.completions
    assert episode.env_reward == 1.0 and episode.num_turns == 2
    assert episode.prompt_token_ids == first
    assert first + episode.token_ids == [*second, *encode(tokenizer, "5"), tokenizer.eos_token_id]
    assert hub.stats()["ended_by_harness"] == 1
