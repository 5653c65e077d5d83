"""The session proxy's OpenAI wire: tool-call parsers, the history's canonical form,
what a request may ask, and the response body."""

from __future__ import annotations

import json

import pytest

from sampler_service.errors import ServiceError
from sampler_service.sessions.chat import (
    TOOL_PARSERS,
    ChatRequest,
    assistant_turn,
    canonical,
    completion_body,
    parser_for,
)


def test_hermes_calls_become_openai_tool_calls_and_a_malformed_one_stays_text() -> None:
    hermes = TOOL_PARSERS["hermes"]
    text = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    turn = assistant_turn(hermes, text, "stop", "call_s_1")
    assert turn.finish_reason == "tool_calls"
    assert turn.message == {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [
            {
                "id": "call_s_1_0",
                "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
            }
        ],
    }
    broken = "<tool_call>{not json</tool_call>"
    assert assistant_turn(hermes, broken, "stop", "c").message == {
        "role": "assistant",
        "content": broken,
    }
    assert assistant_turn(hermes, "5", "length", "c").finish_reason == "length"


def test_the_calculator_call_is_one_tool_call_and_text_without_one_is_the_answer() -> None:
    calc = TOOL_PARSERS["calculator"]
    content, calls = calc.parse("ok[37*4")  # the stop string may be cut off
    assert (content, calls) == ("ok", [{"name": "calculator", "arguments": {"expression": "37*4"}}])
    assert calc.parse("148") == ("148", [])
    assert calc.stop == ("]",)


def test_auto_reads_the_parser_from_the_chat_template() -> None:
    assert parser_for("auto", None) is TOOL_PARSERS["calculator"]
    assert parser_for("auto", "{{ '<tool_call>' }}") is TOOL_PARSERS["hermes"]
    assert parser_for("auto", "{{ messages }}") is TOOL_PARSERS["none"]
    assert parser_for("none", None) is TOOL_PARSERS["none"]


def test_the_same_turn_sent_back_by_an_sdk_is_the_same_turn() -> None:
    ours = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "f", "arguments": '{"a":1,"b":2}'},
            }
        ],
    }
    sdk = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "f", "arguments": '{"b": 2, "a": 1}'},
            }
        ],
    }
    assert canonical(ours) == canonical(sdk)
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3"}],
    }
    assert canonical(parts) == canonical({"role": "user", "content": "2+3", "name": "me"})
    assert canonical({"role": "user", "content": "2+3"}) != canonical(
        {"role": "user", "content": "2+4"}
    )
    changed_call = {**sdk, "tool_calls": [{**sdk["tool_calls"][0], "id": "c1"}]}
    assert canonical(changed_call) != canonical(ours)


def test_a_request_names_what_it_cannot_have_and_what_is_ignored() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 0.1, "seed": 3}
    request = ChatRequest.model_validate(body)
    request.check()
    assert request.ignored() == ["seed", "temperature"]
    for field, value, code in (("n", 2, "n_unsupported"), ("stream", True, "stream_unsupported")):
        with pytest.raises(ServiceError) as refused:
            ChatRequest.model_validate({**body, field: value}).check()
        assert (refused.value.status, refused.value.code, refused.value.field) == (400, code, field)
    with pytest.raises(ValueError, match="messages"):
        ChatRequest.model_validate({"messages": []})
    with pytest.raises(ValueError, match="role"):
        ChatRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})


def test_the_response_is_an_openai_chat_completion_with_the_sampled_logprobs() -> None:
    turn = assistant_turn(TOOL_PARSERS["none"], "42", "stop", "c")
    body = completion_body(
        completion_id="chatcmpl-1",
        model="toy",
        turn=turn,
        prompt_tokens=5,
        tokens=["4", "2"],
        logprobs=[-0.5, -0.25],
    )
    assert body["object"] == "chat.completion"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "42"}
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.5, -0.25]
    assert [c["token"] for c in choice["logprobs"]["content"]] == ["4", "2"]
    without = completion_body(
        completion_id="x",
        model="toy",
        turn=turn,
        prompt_tokens=5,
        tokens=None,
        logprobs=[-0.5, -0.25],
    )
    assert without["choices"][0]["logprobs"] is None
