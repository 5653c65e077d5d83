"""Observation rendering and the start-up prefix check, with a tokenizer and templates built here."""

from __future__ import annotations

import pytest
from chat_tokenizers import CHATML, STRIPPING, char_tokenizer, encode

from sampler_service.environments.render import (
    NotPrefixPreserving,
    ObservationRenderer,
    check_prefix_preserving,
)


def test_text_and_token_observations_and_truncation() -> None:
    tok = char_tokenizer(None)
    renderer = ObservationRenderer(tok)
    assert tok.decode(renderer.render("148;")) == "148;"
    assert renderer.render("148;") == encode(tok, "148;")
    assert renderer.render([5, 6, 7]) == [5, 6, 7]
    assert renderer.render("abcdef", max_tokens=2) == encode(tok, "ab")
    with pytest.raises(ValueError, match="chat template"):
        renderer.render([{"role": "tool", "content": "5"}])


def test_chat_delta_reproduces_the_template_after_eos_and_after_a_stop_string() -> None:
    tok = char_tokenizer(CHATML)
    renderer = ObservationRenderer(tok)
    user = [{"role": "user", "content": "add 2 and 3"}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    result = [{"role": "tool", "name": "add", "content": "5"}]
    prompt = encode(tok, tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False))
    expected = encode(
        tok,
        tok.apply_chat_template(
            [*user, {"role": "assistant", "content": call}, *result],
            add_generation_prompt=True,
            tokenize=False,
        ),
    )
    stopped = encode(tok, call)  # the turn ended at the stop string: no end-of-turn yet
    with_eos = [*stopped, tok.eos_token_id]  # the model closed its turn itself
    for turn in (stopped, with_eos):
        delta = renderer.chat_delta(result, turn=turn)
        assert prompt + turn + delta == expected
    assert tok.decode(renderer.chat_delta(result, turn=stopped)) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert renderer.render(result, turn=with_eos) == renderer.chat_delta(result, turn=with_eos)


def test_prefix_check_accepts_chatml_and_a_tokenizer_without_template() -> None:
    check_prefix_preserving(char_tokenizer(CHATML), "chatml-test")
    check_prefix_preserving(char_tokenizer(None), "plain-test")


def test_prefix_check_refuses_a_template_that_strips_earlier_reasoning() -> None:
    with pytest.raises(NotPrefixPreserving) as info:
        check_prefix_preserving(char_tokenizer(STRIPPING), "org/stripping-model")
    message = str(info.value)
    assert "'org/stripping-model'" in message
    assert "not prefix-preserving" in message
    assert "message 4 (tool)" in message and "use the" in message  # what changed
