"""The toy calculator task: its tokenizer, its model directory and rows, its shipped weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer, Qwen2ForCausalLM

from trainer_client.toy import ToyPaths, build_toy, read_jsonl
from trainer_client.toy.calculator import build_calculator_tokenizer, run_episodes, summarize
from trainer_client.toy.model import build_tokenizer
from trainer_client.toy.task import eval_rows


@pytest.fixture(scope="module")
def calculator_toy(tmp_path_factory: pytest.TempPathFactory) -> ToyPaths:
    return build_toy(tmp_path_factory.mktemp("calc"), n_train=16, n_eval=16, toy_task="calculator")


def test_tokenizer_extends_the_toy_vocabulary_and_round_trips() -> None:
    tok = build_calculator_tokenizer()
    toy = build_tokenizer()
    assert len(tok) == len(toy) + 3 == 21
    assert {t: i for t, i in tok.get_vocab().items() if t not in "[];"} == toy.get_vocab()
    text = "37*4=[37*4]148;148"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_build_writes_the_calculator_model_and_rows_naming_the_env(
    calculator_toy: ToyPaths,
) -> None:
    tok = AutoTokenizer.from_pretrained(calculator_toy.model_dir)
    assert len(tok) == 21 and tok.convert_tokens_to_ids("]") == 19
    for path in [*calculator_toy.data_files, *calculator_toy.eval_files]:
        rows = read_jsonl(path)
        assert rows and all(r["env"] == "calculator" and r["verifier"] == "exact" for r in rows)


def test_the_arithmetic_build_is_unchanged(tmp_path: Path) -> None:
    paths = build_toy(tmp_path, n_train=4, n_eval=4)
    assert all("env" not in r for r in read_jsonl(paths.data_files[0]))
    assert len(AutoTokenizer.from_pretrained(paths.model_dir)) == 18


def test_shipped_weights_call_the_tool_sometimes_and_copy_the_result(
    calculator_toy: ToyPaths,
) -> None:
    tok = AutoTokenizer.from_pretrained(calculator_toy.model_dir)
    model = Qwen2ForCausalLM.from_pretrained(calculator_toy.model_dir).eval()
    results = run_episodes(model, tok, eval_rows("mul", 32), 4, seed=0)
    stats = summarize(results)
    assert 0.0 < stats["call_rate"] < 1.0, stats
    assert stats["success_with_call"] > stats["success_direct"], stats
    called = next(r for r in results if r.called and r.correct)
    expression, rest = called.text.split("]", 1)
    value, answer = rest.split(";", 1)
    assert expression.startswith("[") and answer.removesuffix("<eos>") == value


def test_the_toy_syntax_is_the_calculator_environments() -> None:
    import asyncio

    from sampler_service.environments.calculator import CalculatorEnvironment
    from trainer_client.toy import calculator as toy

    # a call written in the toy's characters is answered by the sampler's environment
    step = asyncio.run(CalculatorEnvironment().step(toy.OPEN + "37*4" + toy.CLOSE))
    assert (step.observation, step.done) == ("148" + toy.END, False)
    assert toy.CLOSE in asyncio.run(CalculatorEnvironment().reset({}, seed=None)).stop
