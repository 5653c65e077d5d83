"""The toy calculator task: the toy model, taught to call a calculator tool.

An episode task small enough for CPU tests: after ``37*4=`` the model either answers
directly (``148``) or calls the tool, ``[37*4]``, reads the answer ``148;`` (observation
tokens, never trained on) and copies it (``148``). The tokenizer is the toy's with three
characters more (``[`` ``]`` ``;``, ids 18-20, so the toy's ids keep their meaning), and
the warm-start continues from the toy's shipped weights: it keeps the toy's arithmetic
and teaches the call format on part of its examples, so the model calls the tool on
some answers and not on others. RL on episodes
then has something to raise: calls are almost always right, direct products mostly not.

The weights ship in ``trainer_client/toy/calculator_weights/``. Regenerate them with::

    python -m trainer_client.toy.calculator --train

which trains on one thread, stops at the first check where :data:`STOP` holds, writes
the weights directory and prints the held-out tool-call rate and episode success,
measured by running episodes with the service's calculator environment and
``generate``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2ForCausalLM

from trainer_client.contract.calculator import CLOSE, END, OPEN, reply
from trainer_client.toy import task
from trainer_client.toy.model import (
    CHARS,
    MAX_LEN,
    Batch,
    _batch,
    _fmt,
    build_tokenizer,
    repeatable,
    save_warm_start,
    train_until,
    warm_start_args,
)
from trainer_client.toy.model import TrainSettings as ToySettings
from trainer_client.toy.shipped import CALCULATOR_WEIGHTS_DIR, WEIGHTS_DIR

#: The toy's characters and the tool syntax's (the contract's, which the sampler's
#: built-in `calculator` environment answers), appended so the toy's ids are unchanged.
CALCULATOR_CHARS = CHARS + OPEN + CLOSE + END
#: Turns an episode may take (a call, then the answer, with one spare).
MAX_TURNS = 3


def build_calculator_tokenizer() -> PreTrainedTokenizerFast:
    """The toy tokenizer over :data:`CALCULATOR_CHARS` (21 tokens)."""
    return build_tokenizer(CALCULATOR_CHARS)


@dataclass(frozen=True)
class StopCriterion:
    """When the warm-start stops: the first check (after ``min_steps``) where all hold.

    Measured on ``mul`` probe prompts from the train split at temperature 1: the share of
    episodes that call the tool lies in [``call_min``, ``call_max``] (RL can move it both
    ways) and an episode that called is right at least ``copy_min`` of the time.
    """

    min_steps: int = 250
    call_min: float = 0.1
    call_max: float = 0.5
    copy_min: float = 0.6


STOP = StopCriterion()


@dataclass(frozen=True)
class TrainSettings(ToySettings):
    """Warm-start hyperparameters (the defaults produce the shipped calculator weights)."""

    lr: float = 1e-3
    max_steps: int = 1500
    check_every: int = 50
    probe_samples: int = 8
    copy_steps: int = 150
    call_fraction: float = 0.6
    decide_fraction: float = 0.3


def _encode(
    tokenizer: PreTrainedTokenizerFast, row: dict[str, str], *, call: bool, decide: bool = True
) -> tuple[list[int], list[int]]:
    """Token ids of one episode and its labels (-100 on the prompt and the observation).

    ``decide=False`` leaves the call's first token (the choice to call) out of the loss:
    the call and the copy are learned from every calling example, the choice only from
    some (see :class:`TrainSettings`).
    """

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt, answer = enc(row["prompt"]), enc(row["answer"]) + [tokenizer.eos_token_id]
    ids, labels = list(prompt), [-100] * len(prompt)
    if call:
        action = enc(OPEN + row["prompt"].rstrip("=") + CLOSE)
        observation = enc(row["answer"] + END)
        ids += action + observation
        labels += ([] if decide else [-100]) + action[0 if decide else 1 :]
        labels += [-100] * len(observation)
    return ids + answer, labels + answer


def _collate(
    examples: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The toy's right-padded batch, with the episode's own labels."""
    input_ids, mask, _ = _batch([(ids, 0) for ids, _ in examples], pad_id)
    labels = torch.full_like(input_ids, -100)
    for i, (_, lab) in enumerate(examples):
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, mask, labels


def _sample_turn(
    model: Any,
    seqs: Sequence[list[int]],
    stop_ids: list[int],
    pad_id: int,
    temperature: float | None,
) -> list[list[int]]:
    """One turn per sequence: sampled ids up to and including a stop id (or the context's end).

    Sequences of equal length are generated together, so no padding enters the model;
    `temperature` None decodes greedily.
    """
    sampling: dict[str, Any] = (
        {"do_sample": False}
        if temperature is None
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    out: list[list[int]] = [[] for _ in seqs]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(seqs):
        by_length[len(ids)].append(i)
    for length, idxs in by_length.items():
        if length >= MAX_LEN:
            continue
        input_ids = torch.tensor([seqs[i] for i in idxs])
        gen = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_LEN - length,
            **sampling,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
        )
        for row, i in enumerate(idxs):
            new = gen[row, length:].tolist()
            cut = next((j + 1 for j, t in enumerate(new) if t in stop_ids), len(new))
            out[i] = new[:cut]
    return out


@dataclass(frozen=True)
class EpisodeResult:
    """What one simulated episode did: whether it called the tool, whether it was right, and
    its decoded ids after the prompt."""

    called: bool
    correct: bool
    text: str


def run_episodes(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, str]],
    samples: int,
    *,
    temperature: float | None = 1.0,
    seed: int = 0,
) -> list[EpisodeResult]:
    """``samples`` episodes per row with the calculator tool, scored by exact match.

    Each turn is sampled (greedy where ``temperature`` is None) until ``]`` or eos; the
    tool's answer (`trainer_client.contract.calculator.reply`, the one the sampler's
    environment gives) is appended as tokens (never re-encoding what was sampled); the
    final answer is the text of the last turn, the one after the last observation.
    """
    torch.manual_seed(seed)
    eos, close = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CLOSE)
    episodes = [row for row in rows for _ in range(samples)]
    seqs = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in episodes]
    called = [False] * len(episodes)
    final: list[str | None] = [None] * len(episodes)
    active = list(range(len(episodes)))
    with torch.no_grad():
        for _ in range(MAX_TURNS):
            if not active:
                break
            turns = _sample_turn(model, [seqs[i] for i in active], [eos, close], eos, temperature)
            texts = [tokenizer.decode([t for t in ids if t != eos]) for ids in turns]
            still = []
            for i, ids, text in zip(active, turns, texts, strict=True):
                seqs[i] = seqs[i] + ids
                observation = reply(text)
                if observation is None:
                    final[i] = text
                    continue
                called[i] = True
                seqs[i] += tokenizer.encode(observation, add_special_tokens=False)
                still.append(i)
            active = still
    return [
        EpisodeResult(
            called=c,
            correct=f is not None and f.strip() == r["answer"],
            text=tokenizer.decode(ids[len(tokenizer.encode(r["prompt"])) :]),
        )
        for c, f, r, ids in zip(called, final, episodes, seqs, strict=True)
    ]


def greedy_episode_success_of(
    model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """Per-domain share of rows whose greedy episode (the tool called or not) ends right:
    the calculator task's held-out score, as greedy accuracy is the arithmetic task's."""
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):  # run_episodes seeds; the caller's RNG stays
            results = run_episodes(model, tokenizer, rows, 1, temperature=None)
    finally:
        model.train(was_training)
    hits: dict[str, list[int]] = {row["domain"]: [0, 0] for row in rows}
    for row, result in zip(rows, results, strict=True):
        hits[row["domain"]][0] += result.correct
        hits[row["domain"]][1] += 1
    return {domain: ok / n for domain, (ok, n) in hits.items()}


def summarize(results: Sequence[EpisodeResult]) -> dict[str, float]:
    """Tool-call rate, episode success, and success with and without a call."""
    calls = [r for r in results if r.called]
    direct = [r for r in results if not r.called]

    def rate(rs: Sequence[EpisodeResult]) -> float:
        return round(sum(r.correct for r in rs) / len(rs), 4) if rs else 0.0

    return {
        "call_rate": round(len(calls) / len(results), 4),
        "success": rate(results),
        "success_with_call": rate(calls),
        "success_direct": rate(direct),
    }


def _stop_reached(step: int, probe: dict[str, float]) -> bool:
    return (
        step >= STOP.min_steps
        and STOP.call_min <= probe["call_rate"] <= STOP.call_max
        and probe["success_with_call"] >= STOP.copy_min
    )


def warm_start(out_dir: Path, settings: TrainSettings = TrainSettings()) -> dict[str, object]:
    """Continue the toy's shipped weights on episodes of every domain; save to ``out_dir``.

    The first ``copy_steps`` steps only call (copying a result is not learned while most
    examples answer directly); then a fraction ``call_fraction`` of the examples call the
    tool, the rest answer directly;
    the loss covers the model's own tokens only (the observation is given at run time), and
    the choice to call only on ``decide_fraction`` of the calls: copying a result needs
    many calling examples, a call rate well below one needs few choices to call (about
    0.6 * 0.3 / (0.6 * 0.3 + 0.4) = 0.31 of the answers).
    Returns a summary, also written to ``out_dir/warm_start.json``.
    """
    started = time.perf_counter()
    with repeatable(settings.seed) as rng:
        tokenizer = build_calculator_tokenizer()
        model = Qwen2ForCausalLM.from_pretrained(WEIGHTS_DIR)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        train = {d: task.train_rows(d, None, seed=settings.seed) for d in task.DOMAIN_NAMES}
        probe = train["mul"][: settings.probe_prompts]
        per_domain = settings.batch_size // len(train)

        def next_batch(step: int) -> Batch:
            examples = [
                _encode(
                    tokenizer,
                    row,
                    call=rng.random() < settings.call_fraction or step < settings.copy_steps,
                    decide=rng.random() < settings.decide_fraction,
                )
                for rows in train.values()
                for row in rng.choices(rows, k=per_domain)
            ]
            return _collate(examples, tokenizer.pad_token_id)

        def check(step: int, loss: float) -> tuple[dict[str, object], bool]:
            probe_stats = summarize(
                run_episodes(model, tokenizer, probe, settings.probe_samples, seed=settings.seed)
            )
            print(f"step {step:5d} loss {loss:.3f} mul T=1 {_fmt(probe_stats)}", flush=True)
            return {"mul_t1": probe_stats}, _stop_reached(step, probe_stats)

        checks = train_until(model, settings, STOP, next_batch, check)
    model.config.vocab_size = len(tokenizer)
    return save_warm_start(out_dir, model, tokenizer, settings, STOP, started, checks)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trainer_client.toy.calculator --train [--out DIR] [--seed N]``."""
    args = warm_start_args(
        argv, __doc__, CALCULATOR_WEIGHTS_DIR, "the shipped calculator weights dir"
    )
    summary = warm_start(args.out, TrainSettings(seed=args.seed))
    tok = AutoTokenizer.from_pretrained(args.out)
    model = Qwen2ForCausalLM.from_pretrained(args.out).eval()
    print(f"saved {args.out} after {summary['steps']} steps in {summary['wall_s']} s")
    for domain in task.DOMAIN_NAMES:
        held_out = task.eval_rows(domain, 256)
        stats = summarize(run_episodes(model, tok, held_out, 8, seed=args.seed))
        print(f"held-out {domain} T=1 episodes: {_fmt(stats)}")


if __name__ == "__main__":
    main()
