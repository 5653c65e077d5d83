"""The toy task and tiny model: offline loading, character tokens, spread pass rates, splits.

Every service test and the demo run on this model, and adaptive sampling only does
something when domains differ in difficulty, so these are the properties they rely on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer_client.toy import (
    DOMAIN_NAMES,
    ToyPaths,
    build_toy,
    eval_rows,
    greedy_accuracy,
    measure_pass_rates,
    read_jsonl,
    train_rows,
)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> ToyPaths:
    return build_toy(tmp_path_factory.mktemp("toy"), n_train=128, n_eval=32)


def test_layout(toy: ToyPaths) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (toy.model_dir / name).is_file(), name
    assert [p.stem for p in toy.data_files] == list(DOMAIN_NAMES)
    assert [p.stem for p in toy.eval_files] == list(DOMAIN_NAMES)
    assert len(DOMAIN_NAMES) >= 3
    for path in toy.data_files:
        for row in read_jsonl(path):
            assert set(row) == {"id", "prompt", "answer", "domain", "verifier"}
            assert row["domain"] == path.stem and row["verifier"] == "exact"
            a, op, b = re.fullmatch(r"(\d+)([+*])(\d+)=", row["prompt"]).groups()
            assert row["answer"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))


def test_loads_offline_with_char_tokenizer(toy: ToyPaths) -> None:
    tok = AutoTokenizer.from_pretrained(toy.model_dir)
    model = AutoModelForCausalLM.from_pretrained(toy.model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size // model.config.num_attention_heads >= 32  # vLLM CPU
    assert not model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    ids = tok("37+45=").input_ids
    assert len(ids) == len("37+45=") and tok.unk_token_id not in ids  # no BOS, one per char
    assert [tok.convert_ids_to_tokens(i) for i in ids] == list("37+45=")
    assert tok.decode(tok.encode("148") + [tok.eos_token_id], skip_special_tokens=True) == "148"
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id != tok.pad_token_id


def test_pass_rates_spread_over_domains(toy: ToyPaths) -> None:
    rows = [r for path in toy.data_files for r in read_jsonl(path)[:64]]
    rates = measure_pass_rates(toy.model_dir, rows, samples_per_prompt=16, temperature=1.0)
    assert list(rates) == list(DOMAIN_NAMES)
    assert min(rates.values()) < 0.3 < 0.6 < max(rates.values()), rates
    assert all(0.0 < r < 1.0 for r in rates.values()), rates
    # Ordered by design difficulty: easiest first.
    assert rates[DOMAIN_NAMES[0]] > rates[DOMAIN_NAMES[1]] > rates[DOMAIN_NAMES[-1]], rates


def test_greedy_heldout_leaves_headroom(toy: ToyPaths) -> None:
    rows = [r for path in toy.eval_files for r in read_jsonl(path)]
    acc = greedy_accuracy(toy.model_dir, rows)
    assert 0.2 <= acc[DOMAIN_NAMES[1]] <= 0.8, acc  # medium: learnable, not learned
    assert acc[DOMAIN_NAMES[-1]] < 0.5, acc


def test_measurements_repeat(toy: ToyPaths) -> None:
    rows = [r for path in toy.data_files for r in read_jsonl(path)[:8]]
    runs = [measure_pass_rates(toy.model_dir, rows, 4, 1.0, seed=3) for _ in range(2)]
    assert runs[0] == runs[1]


def test_data_deterministic_from_seed(toy: ToyPaths, tmp_path: Path) -> None:
    again = build_toy(tmp_path / "again", n_train=128, n_eval=32)
    for ours, theirs in [(toy.data_files, again.data_files), (toy.eval_files, again.eval_files)]:
        for a, b in zip(ours, theirs, strict=True):
            assert a.read_bytes() == b.read_bytes()
    weights = "model.safetensors"
    assert (toy.model_dir / weights).read_bytes() == (again.model_dir / weights).read_bytes()
    other = build_toy(tmp_path / "other", seed=1, n_train=128, n_eval=32)
    assert read_jsonl(other.data_files[1]) != read_jsonl(toy.data_files[1])
    # Idempotent: building into the same directory again writes the same bytes.
    before = {p: p.read_bytes() for p in again.data_files}
    build_toy(tmp_path / "again", n_train=128, n_eval=32)
    assert {p: p.read_bytes() for p in again.data_files} == before


@pytest.mark.parametrize("domain", DOMAIN_NAMES)
def test_heldout_disjoint_from_train(domain: str) -> None:
    held_out = {r["prompt"] for r in eval_rows(domain, None)}
    assert held_out
    for seed in range(3):
        train = {r["prompt"] for r in train_rows(domain, None, seed=seed)}
        assert train and not train & held_out
        drawn = train_rows(domain, 50, seed=seed)
        assert len(drawn) == len({r["id"] for r in drawn})  # distinct prompts, distinct ids
