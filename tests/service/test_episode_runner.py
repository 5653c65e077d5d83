"""Multi-turn episodes in-process: the scheduler, the episode runner, the real transformers
backend on the toy model, and the environments of `episode_envs.py`.

The networked side (409 `feature_required`, stats, a kill -9) is in
tests/service/test_episodes_live.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import episode_envs
import pytest
import pytest_asyncio
import torch
from chat_tokenizers import CHATML, char_tokenizer, encode, rendered
from support import rows_with, write_jsonl
from test_scheduler import make_scheduler, run_until
from transformers import AutoTokenizer

from sampler_service.backends.base import Completion, SamplingParams, StreamedWave, WaveRequest
from sampler_service.backends.hf import HFBackend
from sampler_service.config import EpisodeKnobs
from sampler_service.dataset import PromptRow
from sampler_service.environments.base import Reset, Step
from sampler_service.environments.tools import tool_schema
from sampler_service.episodes import EpisodeRenderer, EpisodeRunner, EpisodeWave, load_factories
from sampler_service.finalize import MemorySink
from sampler_service.grouping import on_one_prompt
from sampler_service.scheduler import Scheduler
from sampler_service.startup import PromptTokenizer
from sampler_service.verifiers import exact

pytestmark = pytest.mark.timeout(600)


class RecordingHF(HFBackend):
    """The real hf engine, remembering the ids of every request it was sent."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.requests: list[tuple[list[int], SamplingParams, str | None]] = []

    def issue(self, request: WaveRequest) -> StreamedWave:
        self.requests.append((request.prompt_token_ids, request.sampling, request.affinity_key))
        return super().issue(request)


@pytest_asyncio.fixture
async def engine(toy) -> Any:
    backend = RecordingHF(toy.model_dir, tokenizer=AutoTokenizer.from_pretrained(toy.model_dir))
    await backend.start()
    yield backend
    await backend.close()


def episode_data(toy, where: Path, env: str, domain: int = 1) -> list[Path]:
    """The toy's add2 prompts, each answered by episodes against `env`."""
    path = where / f"{env.rsplit(':', 1)[-1]}.jsonl"
    return [write_jsonl(path, rows_with(toy.data_files[domain], env=env))]


def with_episodes(
    toy, engine: HFBackend, data: list[Path], **cfg: Any
) -> tuple[Scheduler, MemorySink]:
    scheduler, sink = make_scheduler(toy, engine, data, **cfg)
    tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)
    scheduler.episodes = EpisodeRunner(
        tokenizer,
        EpisodeRenderer(tokenizer),
        load_factories(scheduler.dataset.env_specs()),
        max_context=64,
    )
    return scheduler, sink


FIXED4 = {"rule": "fixed", "n_max": 4, "wave_size": 4, "group_size": 4}


async def test_episode_tokens_masks_and_the_ids_of_every_turn(toy, engine, tmp_path) -> None:
    """The mask is 1 exactly on sampled tokens, logprobs are 0.0 elsewhere, and every
    request was the prompt plus everything the episode held before it (a property over
    every turn of every episode, with observations of random length and content)."""
    tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)
    data = episode_data(toy, tmp_path, "python:episode_envs:retell_three")
    scheduler, sink = with_episodes(toy, engine, data, **FIXED4)
    groups = await run_until(scheduler, sink, 6)
    prompts = {g.prompt_id: g.prompt_token_ids for g in groups}
    turns_seen = set()
    for group in groups:
        assert group.stats.n_generated == len(group.samples) == 4
        for sample in group.samples:
            mask, ids = sample.loss_mask, sample.response_token_ids
            assert mask is not None and len(mask) == len(ids) == len(sample.logprobs)
            assert set(mask) <= {0, 1} and 1 in mask
            assert all(lp == 0.0 for lp, m in zip(sample.logprobs, mask, strict=True) if not m)
            assert all(lp <= 0.0 for lp in sample.logprobs)
            # the turns are the runs of mask 1; each ends at eos or the turn's budget,
            # and each observation (a run of 0s) is what the environment said, encoded once
            runs = _runs(mask)
            turns = [r for r in runs if r[0] == 1]
            turns_seen.add(len(turns))
            assert sample.num_turns == len(turns)
            for value, start, end in runs:
                if value == 0:
                    text = tokenizer.decode(ids[start:end])
                    assert text.endswith("=") and ids[start:end] == tokenizer.encode(
                        text, add_special_tokens=False
                    )
            # each turn was requested with the prompt plus the episode before it
            for _, start, _ in turns:
                sent = prompts[group.prompt_id] + ids[:start]
                assert any(req == sent for req, _, _ in engine.requests), "turn ids not sent"
    assert turns_seen == {3}  # three model turns, two observations between them
    # every request was the prompt plus a prefix of a finished or unfinished episode, and
    # carried the prompt's id as its affinity key
    by_key = {g.prompt_id: g.prompt_token_ids for g in groups}
    for ids, sampling, key in engine.requests:
        assert key is not None
        if key in by_key:
            assert ids[: len(by_key[key])] == by_key[key]
        assert len(ids) + sampling.max_tokens <= 63  # the toy's context, one token spare


async def test_the_engine_scores_reproduce_the_sampled_logprobs(toy, engine, tmp_path) -> None:
    """At every mask-1 position the engine's own score of the whole episode is the
    logprob the sampler recorded (observation tokens in between are context)."""
    data = episode_data(toy, tmp_path, "python:episode_envs:retell")
    scheduler, sink = with_episodes(toy, engine, data, **FIXED4)
    groups = await run_until(scheduler, sink, 2)
    checked = 0
    for group in groups:
        for sample in group.samples:
            scores = await engine.score(group.prompt_token_ids, sample.response_token_ids)
            assert sample.loss_mask is not None
            kept = [i for i, m in enumerate(sample.loss_mask) if m]
            torch.testing.assert_close(
                torch.tensor([scores[i] for i in kept]),
                torch.tensor([sample.logprobs[i] for i in kept]),
                atol=1e-4,
                rtol=0,
            )
            checked += len(kept)
    assert checked > 0


#: Balanced 1/1, n_max 8, waves of 2, every answer kept in its group (no down-sampling),
#: so a group's samples are exactly the answers its rule counted.
BALANCED_WHOLE_GROUPS: dict[str, Any] = {
    "rule": "balanced",
    "k_pos": 1,
    "k_neg": 1,
    "n_max": 8,
    "wave_size": 2,
    "group_size": 0,
    "downsample": "none",
}


async def test_groups_obey_the_rule_counted_in_episodes(toy, engine, tmp_path) -> None:
    """Balanced 1/1 with n_max 8, waves of 2: a group stops at its first wave holding a
    right and a wrong episode, or at n_max; every episode generated is in its group."""
    data = episode_data(toy, tmp_path, "python:episode_envs:retell")
    scheduler, sink = with_episodes(toy, engine, data, **BALANCED_WHOLE_GROUPS)
    groups = await run_until(scheduler, sink, 8, reasons=frozenset({"rule"}))
    assert any(g.stop_reason == "rule" for g in groups)
    for group in groups:
        right = [s.reward > 0.5 for s in group.samples]
        assert group.stats.n_generated == len(group.samples)
        assert group.stats.n_pos == sum(right)
        assert all(s.num_turns == 2 for s in group.samples)
        if group.stop_reason == "rule":
            assert group.stats.n_pos >= 1 and group.stats.n_neg >= 1
            # it stopped at the first wave that met the rule
            earlier = right[:-2]
            assert not (any(earlier) and not all(earlier))
        else:
            assert group.stop_reason == "n_max" and group.stats.n_generated == 8
    assert scheduler.tally.episodes.episodes >= sum(len(g.samples) for g in groups)


async def test_exact_stopping_counts_episodes_in_index_order_and_cancels_the_surplus(
    toy, engine, tmp_path
) -> None:
    """Balanced 1/1 in waves of 4: a group is episodes 1..j for the first j holding a right
    and a wrong one, whatever order they finished in; the wave's episodes above j are
    cancelled (or discarded if done) and counted as surplus, never as answers."""
    data = episode_data(toy, tmp_path, "python:episode_envs:retell")
    cfg = {**BALANCED_WHOLE_GROUPS, "wave_size": 4, "stopping": "exact"}
    scheduler, sink = with_episodes(toy, engine, data, **cfg)
    groups = await run_until(scheduler, sink, 8, reasons=frozenset({"rule"}))
    for group in groups:
        assert [s.index for s in group.samples] == list(range(group.stats.n_generated))
        right = [s.reward > 0.5 for s in group.samples]
        assert group.stats.outcomes == [s.reward for s in group.samples]
        if group.stop_reason == "rule":
            assert len(set(right)) == 2 and len(set(right[:-1])) == 1  # first j where it holds
    # Each rule-stopped group left the rest of its last wave of 4 as surplus (which
    # groups have any is the toy's draw); other prompts may have added more.
    surplus = sum(-g.stats.n_generated % 4 for g in groups if g.stop_reason == "rule")
    tally = scheduler.tally
    assert tally.surplus_answers >= surplus
    assert not tally.redrawn and tally.episodes.episodes >= sum(len(g.samples) for g in groups)


class OneTurn:
    """An episode of one model turn."""

    async def reset(self, row: Any, *, seed: int | None) -> Reset:
        return Reset()

    async def step(self, action: str) -> Step:
        return Step(observation=None, done=True)

    async def close(self) -> None:
        return None


async def test_a_cancelled_episode_stops_and_comes_back_with_what_it_sampled(
    tmp_path: Path,
) -> None:
    """The first two turns answer at once; the other two episodes are still in their
    turn when the reader cancels them: their engine calls are cancelled, and they come
    back as aborted with the tokens they had (none: their one turn never returned), by
    their own index (which episodes reach the engine first is the threads' race)."""
    tokenizer = char_tokenizer(CHATML)
    text = "What is 2+3?"
    row = PromptRow(id="text", prompt=text, answer="5", domain="add")
    row.text, row.token_ids = text, encode(tokenizer, text)
    started: list[int] = []
    cancelled: list[int] = []

    async def turn(ids: list[int], sampling: SamplingParams) -> Completion:
        started.append(len(started))
        if len(started) > 2:
            try:
                await asyncio.Event().wait()  # a turn that would never end
            except asyncio.CancelledError:
                cancelled.append(len(started))
                raise
        tokens = encode(tokenizer, "5")
        return Completion(tokens, [-1.0] * len(tokens), "5", "stop")

    runner = EpisodeRunner(tokenizer, EpisodeRenderer(tokenizer), {})
    wave = EpisodeWave(runner, row, OneTurn, 4, SamplingParams(), EpisodeKnobs(), turn, 1)
    got: dict[int, Completion] = {}
    running: list[int] = []
    async for index, completion in wave:
        got[index] = completion
        if len(got) == 2:
            async with asyncio.timeout(30):  # the other two are in their turn
                while len(started) < 4:
                    await asyncio.sleep(0.01)
            running = [i for i in range(4) if i not in got]
            await wave.cancel(running)
    assert sorted(got) == [0, 1, 2, 3] and len(cancelled) == 2 and len(running) == 2
    finished = [i for i in range(4) if i not in running]
    assert [got[i].finish_reason for i in finished] == ["stop", "stop"]
    assert [got[i].finish_reason for i in running] == ["abort", "abort"]
    assert all(not got[i].token_ids for i in running)
    assert all(len(got[i].token_ids) > 0 for i in finished)


async def test_the_environments_terminal_reward_is_what_the_rule_counts(
    toy, engine, tmp_path
) -> None:
    """`contrary` rewards each episode 1.0 exactly where the row's verifier would score
    it 0: every reward, n_pos and the rule's stop follow the environment's reward. Every
    answer stays in its group (no down-sampling), so n_pos counts the group's samples: a
    prompt that took three waves would otherwise keep 4 of its 6 answers."""
    data = episode_data(toy, tmp_path, "python:episode_envs:contrary")
    scheduler, sink = with_episodes(toy, engine, data, **BALANCED_WHOLE_GROUPS)
    groups = await run_until(scheduler, sink, 6, reasons=frozenset({"rule"}))
    answers = {row.id: row.answer for rows in scheduler.dataset.rows.values() for row in rows}
    for group in groups:
        for sample in group.samples:
            assert sample.response_text is not None
            verdict = exact.verify(sample.response_text, answers[group.prompt_id])
            assert sample.reward == 1.0 - verdict
        assert group.stats.n_pos == sum(s.reward > 0.5 for s in group.samples)
        if group.stop_reason == "rule":
            assert group.stats.n_pos >= 1 and group.stats.n_neg >= 1


async def test_an_episode_cut_at_max_turns_scores_zero(toy, engine, tmp_path) -> None:
    """An environment that never says done: every episode ends after `max_turns` model
    turns with finish reason `turns`, on the model's last turn (no observation after it:
    no turn would read it), and scores 0 unverified (its final answer was never given),
    so its group has no right answer."""
    data = episode_data(toy, tmp_path, "python:episode_envs:endless")
    scheduler, sink = with_episodes(toy, engine, data, **FIXED4, episode={"max_turns": 3})
    groups = await run_until(scheduler, sink, 2)
    for group in groups:
        assert group.stats.n_pos == 0
        for sample in group.samples:
            assert sample.num_turns == 3 and sample.finish_reason == "turns"
            assert sample.reward == 0.0
            assert sample.loss_mask is not None and sample.loss_mask[-1] == 1


async def test_a_spent_token_budget_ends_the_episode_as_length(toy, engine, tmp_path) -> None:
    """`max_total_tokens` 3 cannot hold retell_three's three turns and two observations:
    every episode stops at the budget with finish reason `length`, scored 0 unverified,
    holding no more than the budget."""
    data = episode_data(toy, tmp_path, "python:episode_envs:retell_three")
    scheduler, sink = with_episodes(toy, engine, data, **FIXED4, episode={"max_total_tokens": 3})
    groups = await run_until(scheduler, sink, 2)
    for group in groups:
        for sample in group.samples:
            assert sample.finish_reason == "length" and sample.reward == 0.0
            assert 1 <= len(sample.response_token_ids) <= 3


async def test_observations_are_cut_to_obs_max_tokens(toy, engine, tmp_path) -> None:
    """With `obs_max_tokens` 1 every observation (a run of mask 0) holds one token, where
    retell's are 2 to 6."""
    data = episode_data(toy, tmp_path, "python:episode_envs:retell_three")
    scheduler, sink = with_episodes(toy, engine, data, **FIXED4, episode={"obs_max_tokens": 1})
    groups = await run_until(scheduler, sink, 2)
    observations = 0
    for group in groups:
        for sample in group.samples:
            assert sample.loss_mask is not None
            cut = [end - start for value, start, end in _runs(sample.loss_mask) if value == 0]
            assert all(n == 1 for n in cut), cut
            observations += len(cut)
    assert observations > 0


#: The scripted model's tool call; it answers with the sum once it has the result.
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class ScriptedChat:
    """A chat model's turns on `char_tokenizer`: the call, then the sum and end of turn.

    The toy model's vocabulary cannot hold a chat template, so no real engine on this
    machine speaks one; the runner only needs a turn function, which this is.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sent: list[list[int]] = []

    async def turn(self, ids: list[int], sampling: SamplingParams) -> Completion:
        self.sent.append(list(ids))
        if "<tool_response>" in self.tokenizer.decode(ids):
            text, tokens = "5", [*encode(self.tokenizer, "5"), self.tokenizer.eos_token_id]
        else:
            text, tokens = CALL, encode(self.tokenizer, CALL)
        return Completion(tokens, [-1.0] * len(tokens), text, "stop")


def chat_row(tmp_path: Path, tokenizer: Any) -> PromptRow:
    """A chat row with a system prompt, rendered as `serve` renders rows."""
    model = tmp_path / "chat-model"
    tokenizer.save_pretrained(model)
    row = PromptRow(
        id="chat",
        prompt=[
            {"role": "system", "content": "You add."},
            {"role": "user", "content": "What is 2+3?"},
        ],
        answer="5",
        domain="add",
    )
    PromptTokenizer(model)(row)
    return row


@pytest.mark.parametrize(
    ("factory", "messages"),
    [(episode_envs.add_tool, []), (episode_envs.BriefedTools, [episode_envs.BriefedTools.BRIEF])],
    ids=["tools", "tools-and-reset-messages"],
)
async def test_a_tool_episode_on_a_chat_row_starts_from_the_whole_conversation(
    tmp_path: Path, factory: Any, messages: list[dict[str, Any]]
) -> None:
    """The first turn is sent the template's rendering of the row's messages, the reset's
    messages and the tools' schemas, in one piece (no empty assistant turn before the
    reset's messages); the second the same conversation grown by the call and its result;
    and the group's prompt plus each response is token for token what was sent."""
    tokenizer = char_tokenizer(CHATML)
    row = chat_row(tmp_path, tokenizer)
    model = ScriptedChat(tokenizer)
    runner = EpisodeRunner(tokenizer, EpisodeRenderer(tokenizer), {})
    wave = await EpisodeWave(
        runner, row, factory, 2, SamplingParams(), EpisodeKnobs(), model.turn, 1
    ).run()

    tools = [tool_schema(episode_envs.add)]
    opening = [*row.prompt, *messages]
    after_call = [
        *opening,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    first, second = (rendered(tokenizer, m, tools) for m in (opening, after_call))
    assert "# Tools" in tokenizer.decode(first) and first != row.token_ids
    assert sorted(model.sent) == [first, first, second, second]
    assert not any("assistant\n<|im_end|>" in tokenizer.decode(ids) for ids in model.sent)
    assert not wave.env_errors and len(wave.completions) == 2
    prompt, _, answers = on_one_prompt(row, wave.completions)
    assert prompt == first
    for answer in answers:
        assert answer.num_turns == 2 and answer.finish_reason == "stop"
        assert prompt + answer.token_ids == [
            *second,
            *encode(tokenizer, "5"),
            tokenizer.eos_token_id,
        ]


@pytest.mark.parametrize("env", ["raises", "hangs"])
async def test_a_failing_environment_never_stalls_nor_counts_as_wrong(
    toy, engine, tmp_path, env
) -> None:
    """Every third environment step raises or blocks its thread (past the 0.5 s
    time-out): the failed episodes are run again, never scored, and the event loop runs
    while a blocked call waits: each blocked step is released by the loop itself, after
    the time-out, which a loop frozen by the blocking call could not do."""
    data = episode_data(toy, tmp_path, f"python:episode_envs:{env}")
    scheduler, sink = with_episodes(
        toy,
        engine,
        data,
        **FIXED4,
        episode={"env_timeout_s": 0.5, "max_env_errors": 1000},
    )
    unreleased_before = next(episode_envs.UNRELEASED)
    held: list[Any] = []

    async def release() -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not episode_envs.HELD.empty():
                gate = episode_envs.HELD.get_nowait()
                held.append(gate)
                loop.call_later(0.6, gate.set)  # once the runner has given up on it
            await asyncio.sleep(0.01)

    releaser = asyncio.create_task(release())
    try:
        groups = await run_until(scheduler, sink, 4)
    finally:
        releaser.cancel()
        while not episode_envs.HELD.empty():
            held.append(episode_envs.HELD.get_nowait())
        for gate in held:
            gate.set()
    stats = scheduler.tally.episodes
    assert stats.env_errors > 0
    expected = "raised RuntimeError" if env == "raises" else "took longer than env_timeout_s"
    assert stats.last_env_error is not None and expected in stats.last_env_error
    assert sum(g.stats.n_env_errors for g in groups) > 0
    for group in groups:  # only finished episodes are in a group, all of them scored
        assert group.stats.n_generated == len(group.samples) == 4
        assert group.stats.n_pos + group.stats.n_neg == 4
    if env == "hangs":
        assert held, "no step blocked"
        # every blocked step was let go by the loop, none ran out its own 3 s wait
        assert next(episode_envs.UNRELEASED) == unreleased_before + 1


async def test_an_environment_that_always_fails_drops_its_prompts(toy, engine, tmp_path) -> None:
    data = episode_data(toy, tmp_path, "python:episode_envs:broken")
    scheduler, sink = with_episodes(toy, engine, data, **FIXED4, episode={"max_env_errors": 2})
    scheduler.start()
    try:
        async with asyncio.timeout(120):
            while scheduler.tally.dropped["env_error"] < 3:
                await asyncio.sleep(0.05)
    finally:
        await scheduler.stop()
    assert not sink.groups()
    assert scheduler.tally.samples == 0  # no failed episode was counted as an answer
    assert scheduler.tally.episodes.env_errors >= 6


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], i + 1)
        else:
            runs.append((m, i, i + 1))
    return runs


@pytest.mark.parametrize(
    ("factory", "why"),
    [
        # a text prompt has no chat turns to add messages to (the error says what to use)
        (episode_envs.BriefedTools, "Reset.messages need a chat prompt"),
        # a plain mistake in a user's environment: something else returned from reset
        (episode_envs.NoReset, "reset returned dict, not a Reset"),
    ],
)
async def test_a_reset_the_episode_cannot_start_from_fails_the_environment(
    factory: Any, why: str
) -> None:
    """The episode fails as the environment's fault (re-run, never scored, no turn
    generated), saying why."""
    tokenizer = char_tokenizer(CHATML)
    text = "What is 2+3?"
    row = PromptRow(id="text", prompt=text, answer="5", domain="add")
    row.text, row.token_ids = text, encode(tokenizer, text)
    model = ScriptedChat(tokenizer)
    runner = EpisodeRunner(tokenizer, EpisodeRenderer(tokenizer), {})
    # An error budget of 3: each failure re-runs its episode until the third ends the wave
    # (the other episode may fail at the same time: it is counted too).
    wave = await EpisodeWave(
        runner, row, factory, 2, SamplingParams(), EpisodeKnobs(), model.turn, 3
    ).run()
    assert not wave.completions and not model.sent
    assert 3 <= len(wave.env_errors) <= 4 and all(why in error for error in wave.env_errors)
