"""Greedy exact-match accuracy of a causal LM on prompt rows, per domain.

The trainer's held-out check (and the demo's before/after table): rows are the prompt
rows of the prompt files (`prompt`, `answer`, `domain`). An answer is right when its
decoded text, stripped, equals the row's answer. Prompts of equal token length are
generated together, so no padding (and no padding-dependent numerics) is involved; the
model's generation_config is overridden (plain greedy decoding).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: Most sequences per `generate` call.
MAX_BATCH = 4096


def read_rows(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Prompt rows from JSONL files; a row without `domain` gets its file's stem."""
    rows = []
    for path in paths:
        with Path(path).open(encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    row = json.loads(line)
                    row.setdefault("domain", Path(path).stem)
                    rows.append(row)
    return rows


def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _correct_by_domain(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    samples_per_prompt: int,
    sampling: dict[str, Any],
    max_new_tokens: int | None,
) -> dict[str, float]:
    """Fraction of right completions per domain, domains in first-seen order.

    `max_new_tokens` defaults to the longest answer plus two (room for eos and a space).
    """
    by_length: dict[int, list[tuple[list[int], dict[str, Any]]]] = defaultdict(list)
    for row in rows:
        ids = _prompt_ids(tokenizer, row["prompt"])
        by_length[len(ids)].extend([(ids, row)] * samples_per_prompt)
    if max_new_tokens is None:
        max_new_tokens = (
            max(len(tokenizer.encode(str(r["answer"]), add_special_tokens=False)) for r in rows) + 2
        )
    hits: dict[str, list[int]] = {r["domain"]: [0, 0] for r in rows}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        for items in by_length.values():
            for start in range(0, len(items), MAX_BATCH):
                chunk = items[start : start + MAX_BATCH]
                input_ids = torch.tensor([ids for ids, _ in chunk], dtype=torch.long, device=device)
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                texts = tokenizer.batch_decode(
                    out[:, input_ids.shape[1] :], skip_special_tokens=True
                )
                for (_, row), text in zip(chunk, texts, strict=True):
                    counts = hits[row["domain"]]
                    counts[0] += text.strip() == str(row["answer"]).strip()
                    counts[1] += 1
    model.train(was_training)
    return {domain: ok / n for domain, (ok, n) in hits.items()}


def greedy_accuracy_of(
    model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], max_new_tokens: int | None = None
) -> dict[str, float]:
    """Per-domain fraction of rows whose greedy answer is right."""
    return _correct_by_domain(model, tokenizer, rows, 1, {"do_sample": False}, max_new_tokens)


def pass_rates_of(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    samples_per_prompt: int,
    temperature: float,
    *,
    seed: int = 0,
) -> dict[str, float]:
    """Per-domain mean reward of `samples_per_prompt` sampled answers per row.

    Pure temperature sampling (top_p 1, no top_k), whatever the model's generation
    config says; seeded on a forked RNG, so the numbers repeat and the caller's RNG is
    untouched.
    """
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _correct_by_domain(model, tokenizer, rows, samples_per_prompt, sampling, None)


def greedy_accuracy(model_dir: Path | str, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per-domain greedy accuracy of the model saved in `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_accuracy_of(model, tokenizer, rows)


def measure_pass_rates(
    model_dir: Path | str,
    rows: Sequence[dict[str, Any]],
    samples_per_prompt: int,
    temperature: float,
    *,
    seed: int = 0,
) -> dict[str, float]:
    """Per-domain pass rates of the model saved in `model_dir` (see `pass_rates_of`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return pass_rates_of(model, tokenizer, rows, samples_per_prompt, temperature, seed=seed)
