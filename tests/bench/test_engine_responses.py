"""vLLM-shaped engine responses (bench/engine_responses.py): the expansion of a recorded
response keeps vLLM's bytes, and the parsers give back the answers a response holds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import engine_responses as er


@pytest.mark.parametrize("name", list(er.REQUESTS))
def test_expanding_a_recording_with_its_own_answers_gives_back_its_bytes(name: str) -> None:
    raw = er.fixture(name).read_bytes()
    doc = json.loads(raw)
    answers = er.recorded_answers(name, doc)
    assert len(answers) == 4 and all(len(a.token_ids) == 40 for a in answers)
    assert er.expand(name, doc, answers) == raw


@pytest.mark.parametrize("name", list(er.REQUESTS))
def test_parsing_a_long_response_gives_back_its_answers(name: str) -> None:
    answers = er.synthetic_answers(name, 4, 700, seed=3)
    body = er.expand(name, json.loads(er.fixture(name).read_bytes()), answers)
    parsed = er.PARSERS[name](body)
    assert [p[0] for p in parsed] == [a.token_ids for a in answers]
    assert [p[1] for p in parsed] == [a.logprobs for a in answers]
    # float32 logprobs, as an engine reports them, survive the JSON round trip exactly
    assert all(np.array_equal(np.float32(p[1]), p[1]) for p in parsed)
    if name != "generate-tokens":  # the tokens mode carries no text
        assert [p[2] for p in parsed] == [a.text for a in answers]
    assert {p[3] for p in parsed} == {"stop"}
    assert len(body) > 4 * 700 * 20  # at least a token id and a logprob per token, as text


def test_parse_costs_are_reported_per_answer_for_every_endpoint() -> None:
    result = er.measure_parsing({"parse_seconds": 0.05, "parse_tokens": 50})
    assert set(result["endpoints"]) == set(er.REQUESTS)
    for endpoint in result["endpoints"].values():
        assert endpoint["answers"] == 4 and endpoint["tokens_per_answer"] == 50
        assert endpoint["ms_per_answer"] > 0 and endpoint["ms_per_answer_json"] > 0
