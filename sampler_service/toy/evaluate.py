"""Per-domain pass rates and greedy accuracy of a model on toy prompt rows.

Tests check that the toy model's domains differ in difficulty, the warm-start decides
when to stop from these numbers, and the demo prints them before and after RL. They use
plain transformers ``generate``, independent of the service's backends, so they measure
the model and not the code under test.

Sampling is pure temperature sampling (top_p 1, no top_k), overriding whatever a model's
``generation_config.json`` says. Prompts of equal token length are generated together,
so no padding (and no padding-dependent numerics) is involved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

#: Most sequences per ``generate`` call: large enough to amortize its overhead on CPU,
#: small enough to bound memory with a tiny model.
MAX_BATCH = 4096


def _correct_by_domain(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    samples_per_prompt: int,
    sampling: dict[str, Any],
) -> dict[str, float]:
    """Fraction of correct completions per domain, domains in order of first appearance.

    An answer is correct when its decoded text, stripped, equals the row's answer; one
    token beyond the longest answer leaves room for eos, a second for a stray space.
    """
    by_length: dict[int, list[tuple[list[int], dict[str, Any]]]] = defaultdict(list)
    for row in rows:
        ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
        by_length[len(ids)].extend([(ids, row)] * samples_per_prompt)
    max_new = max(len(tokenizer.encode(r["answer"], add_special_tokens=False)) for r in rows) + 2

    hits: dict[str, list[int]] = {r["domain"]: [0, 0] for r in rows}
    model.eval()
    with torch.no_grad():
        for items in by_length.values():
            for start in range(0, len(items), MAX_BATCH):
                chunk = items[start : start + MAX_BATCH]
                input_ids = torch.tensor([ids for ids, _ in chunk], dtype=torch.long)
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new,
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
    return {domain: ok / n for domain, (ok, n) in hits.items()}


def pass_rates_of(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    samples_per_prompt: int,
    temperature: float,
    *,
    seed: int = 0,
) -> dict[str, float]:
    """Per-domain mean reward of ``samples_per_prompt`` sampled answers per row.

    Seeded on a forked RNG, so the numbers repeat and the caller's RNG is untouched.
    """
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _correct_by_domain(model, tokenizer, rows, samples_per_prompt, sampling)


def greedy_accuracy_of(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """Per-domain fraction of rows whose greedy answer is right."""
    return _correct_by_domain(model, tokenizer, rows, 1, {"do_sample": False})


def _load(model_dir: Path | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def measure_pass_rates(
    model_dir: Path | str,
    rows: Sequence[dict[str, Any]],
    samples_per_prompt: int,
    temperature: float,
    *,
    seed: int = 0,
) -> dict[str, float]:
    """Per-domain pass rates of the model saved in ``model_dir`` (see :func:`pass_rates_of`)."""
    model, tokenizer = _load(model_dir)
    return pass_rates_of(model, tokenizer, rows, samples_per_prompt, temperature, seed=seed)


def greedy_accuracy(model_dir: Path | str, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per-domain greedy accuracy of the model saved in ``model_dir``."""
    model, tokenizer = _load(model_dir)
    return greedy_accuracy_of(model, tokenizer, rows)
