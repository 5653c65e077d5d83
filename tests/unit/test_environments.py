"""The environment protocol's parts: the spec loader, the Hermes tool helper, the calculator."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sampler_service.environments import EnvironmentFailure, load_environment_factory
from sampler_service.environments.calculator import CalculatorEnvironment
from sampler_service.environments.tools import (
    STOP,
    MalformedCall,
    ToolCall,
    ToolEnvironment,
    parse_tool_calls,
    tool_environment,
)
from trainer_client.contract.calculator import call_of, evaluate


def call(name: str, **arguments: object) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_parser_reads_one_call() -> None:
    assert parse_tool_calls("let me add " + call("add", a=1, b=2)) == [
        ToolCall("add", {"a": 1, "b": 2})
    ]


def test_parser_reads_several_calls_and_an_unclosed_last_one() -> None:
    action = call("add", a=1, b=2) + "\n" + '<tool_call>{"name": "neg", "arguments": {"x": 3}}'
    assert parse_tool_calls(action) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("neg", {"x": 3}),
    ]


def test_parser_reports_malformed_json_instead_of_raising() -> None:
    (bad,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>')
    assert isinstance(bad, MalformedCall) and "invalid JSON" in bad.error
    (shape,) = parse_tool_calls('<tool_call>["add"]</tool_call>')
    assert isinstance(shape, MalformedCall)


def test_parser_finds_no_call_in_a_plain_answer() -> None:
    assert parse_tool_calls("The answer is 42.") == []


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def neg(x: int) -> dict[str, int]:
    """Negate an integer."""
    await asyncio.sleep(0)
    return {"value": -x}


def broken() -> str:
    raise RuntimeError("disk on fire")


async def run_episode(env: ToolEnvironment, actions: list[str]) -> list:
    await env.reset({"prompt": "q"}, seed=0)
    steps = [await env.step(a) for a in actions]
    await env.close()
    return steps


async def test_tool_env_runs_sync_and_async_functions_then_ends_on_a_plain_answer() -> None:
    env = ToolEnvironment([add, neg])
    reset = await env.reset({"prompt": "q"}, seed=0)
    assert reset.stop == STOP == ("</tool_call>",)
    schemas = {s["function"]["name"]: s["function"] for s in reset.info["tools"]}
    assert schemas["add"]["parameters"]["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": "integer"},
    }
    assert schemas["add"]["description"] == "Add two integers."
    first = await env.step(call("add", a=2, b=3) + call("neg", x=4))
    assert not first.done and first.stop == STOP
    assert first.observation == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "neg", "content": '{"value": -4}'},
    ]
    last = await env.step("It is 5.")
    assert last.done and last.observation is None and last.reward is None


async def test_the_models_mistakes_come_back_as_error_results() -> None:
    env = ToolEnvironment([add, broken])
    (step,) = await run_episode(
        env,
        [
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
            + call("mul", a=1)
            + call("add", a=1)
            + call("broken")
        ],
    )
    contents = [m["content"] for m in step.observation]
    assert "malformed tool call" in contents[0]
    assert "unknown tool 'mul'" in contents[1]
    assert "bad arguments" in contents[2]
    assert "RuntimeError: disk on fire" in contents[3]
    assert not step.done


async def test_an_environment_failure_raised_by_a_tool_fails_the_episode() -> None:
    def flaky() -> str:
        raise EnvironmentFailure("sandbox gone")

    with pytest.raises(EnvironmentFailure, match="sandbox gone"):
        await run_episode(ToolEnvironment([flaky]), [call("flaky")])


async def test_a_blocking_sync_tool_does_not_stall_the_event_loop() -> None:
    ticked = threading.Event()

    def wait_for_loop() -> bool:
        """Blocks until a coroutine on the event loop has run (or 5 s pass)."""
        return ticked.wait(timeout=5)

    async def tick() -> None:
        await asyncio.sleep(0.01)
        ticked.set()

    env = tool_environment(wait_for_loop)()
    ticker = asyncio.create_task(tick())
    (step,) = await run_episode(env, [call("wait_for_loop")])
    await ticker
    assert step.observation[0]["content"] == "true"


def test_spec_loader_resolves_builtins_and_python_specs() -> None:
    assert load_environment_factory("calculator") is CalculatorEnvironment
    spec = "python:sampler_service.environments.calculator:CalculatorEnvironment"
    assert load_environment_factory(spec) is CalculatorEnvironment
    factory = load_environment_factory("calculator")
    assert factory() is not factory()  # a fresh instance per episode


@pytest.mark.parametrize(
    "spec",
    [
        "calculatr",
        "python:",
        "python:no_such_module_here:make",
        "python:sampler_service.environments.calculator:missing",
        "python:sampler_service.environments.calculator",
    ],
)
def test_spec_loader_names_a_bad_spec(spec: str) -> None:
    with pytest.raises(ValueError, match="environment") as info:
        load_environment_factory(spec)
    assert repr(spec) in str(info.value)


def test_calculator_evaluates_with_precedence_and_rejects_non_expressions() -> None:
    assert evaluate("37*4") == 148
    assert evaluate("2+3*4-5") == 9
    assert evaluate("3-10") == -7
    for bad in ["", "37*", "*4", "4**2", "1/2", "__import__('os')", "1234567890*2"]:
        assert evaluate(bad) is None, bad
    assert call_of("[37*4]") == call_of("[37*4") == "37*4"
    assert call_of("148") is None


async def test_calculator_episode() -> None:
    env = CalculatorEnvironment()
    reset = await env.reset({"prompt": "37*4=", "answer": "148"}, seed=0)
    assert reset.stop == ("]",)
    called = await env.step("[37*4]")
    assert (called.observation, called.done, called.stop) == ("148;", False, ("]",))
    malformed = await env.step("[37*]")
    assert (malformed.observation, malformed.done) == (";", False)
    final = await env.step("148")
    assert final.done and final.observation is None and final.reward is None
    await env.close()
