"""The tiny toy model: a character-level tokenizer, a small Qwen2 and its warm-start.

The service's embedded default and its tests need a real Hugging Face causal LM that
loads offline in both transformers and vLLM, generates thousands of answers per second on
two CPU cores, and is neither hopeless nor perfect on the toy task (an adaptive sampler
has nothing to do when every answer is right or every answer is wrong). So:

- the tokenizer is character level (one id per character, eos and pad, no BOS), built
  with the ``tokenizers`` library and saved as ``tokenizer.json``;
- the model is a Qwen2 (the architecture vLLM's CPU build serves) with head_dim 64,
  because vLLM's CPU attention rejects head_dim 16; 0.65 M float32 parameters (2.6 MB);
- a short supervised warm-start teaches it the task format and part of the arithmetic,
  and stops at the first check where the domains' pass rates at temperature 1 are spread
  (see :data:`STOP`), leaving headroom for RL to show an improvement.

The warm-started weights are shipped in ``trainer_client/toy/weights/`` so that nothing
trains at run time. Regenerate them with::

    python -m trainer_client.toy.model --train

which trains on one thread (seed 0 stops after 1000 steps: 4-6 minutes measured on a
busy 2-core CPU), writes the weights directory and prints held-out pass rates. The same
torch build and CPU give the same weights bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from trainer_client.evaluate import greedy_accuracy_of, pass_rates_of
from trainer_client.toy import task
from trainer_client.toy.shipped import WEIGHTS_DIR

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
#: Every character a toy prompt or answer can contain, plus a few harmless extras.
CHARS = "0123456789+-*= "
MAX_LEN = 64


def build_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: each character of ``chars`` is one token.

    Splitting every character into its own pre-token and mapping it with a word-level
    vocabulary gives exactly one id per character; the ``Fuse`` decoder joins tokens
    back without the spaces a word-level decoder would insert. No post-processor, so
    prompts get no BOS and no EOS: the model sees exactly the prompt's characters.
    """
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_LEN,
        padding_side="left",
    )


def build_config(vocab_size: int, *, pad_id: int, eos_id: int) -> Qwen2Config:
    """The tiny Qwen2: 3 layers, hidden 128, 2 heads of 64, untied float32 head."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        bos_token_id=None,
        eos_token_id=eos_id,
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )


def neutral_generation_config(pad_id: int, eos_id: int) -> GenerationConfig:
    """Generation defaults that leave the model's distribution untouched.

    Engines that read ``generation_config.json`` (transformers, vLLM) would otherwise
    apply their own defaults, e.g. transformers' top_k 50; the sampler's logprobs must be
    those of plain temperature sampling. ``do_sample`` is set because transformers
    refuses to save sampling knobs without it, and sampling is what this model is for.
    """
    return GenerationConfig(
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )


@dataclass(frozen=True)
class StopCriterion:
    """When the warm-start stops: the first check where all bounds hold.

    Measured on probe prompts from the train split at temperature 1 (``easy_min``,
    ``hard_max``) and greedily (``medium_greedy_min``). The bounds are stricter than the
    task's promise (one domain above 0.6, one below 0.3) so that the promise survives
    sampling noise and other seeds' prompt draws.
    """

    easy_min: float = 0.75
    hard_max: float = 0.2
    medium_greedy_min: float = 0.4


STOP = StopCriterion()


@dataclass(frozen=True)
class TrainSettings:
    """Warm-start hyperparameters (the defaults produce the shipped weights)."""

    seed: int = 0
    batch_size: int = 96
    lr: float = 2e-3
    max_steps: int = 6000
    check_every: int = 100
    probe_prompts: int = 64
    probe_samples: int = 16


def _encode_example(
    tokenizer: PreTrainedTokenizerFast, row: dict[str, str]
) -> tuple[list[int], int]:
    """Token ids of prompt + answer + eos, and the prompt's length (loss starts there)."""
    prompt_ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
    answer_ids = tokenizer.encode(row["answer"], add_special_tokens=False)
    return prompt_ids + answer_ids + [tokenizer.eos_token_id], len(prompt_ids)


def _batch(
    examples: Sequence[tuple[list[int], int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 outside the answer)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def _stop_reached(pass_rates: dict[str, float], greedy: dict[str, float]) -> bool:
    """Whether the probe metrics satisfy :data:`STOP` (domains are ordered easy to hard)."""
    easy, medium, hard = task.DOMAIN_NAMES
    return (
        pass_rates[easy] >= STOP.easy_min
        and pass_rates[hard] <= STOP.hard_max
        and greedy[medium] >= STOP.medium_greedy_min
    )


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@contextlib.contextmanager
def repeatable(seed: int) -> Iterator[random.Random]:
    """Seeded torch and a seeded `random.Random`, on one thread: repeatable bits on a given
    CPU and torch build (the shipped weights are made so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        yield random.Random(seed)
    finally:
        torch.set_num_threads(threads)


def train_until(
    model: Qwen2ForCausalLM,
    settings: TrainSettings,
    stop: object,
    next_batch: Callable[[int], Batch],
    check: Callable[[int, float], tuple[dict[str, object], bool]],
) -> tuple[int, list[dict[str, object]]]:
    """AdamW steps on `next_batch(step)` until a check (every `check_every` steps, given the
    step and the loss) says the warm-start is done: (steps, every check's record). Past
    `max_steps` a RuntimeError names `stop`, the criterion never met."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    history: list[dict[str, object]] = []
    step = 0
    while step < settings.max_steps:
        model.train()
        input_ids, mask, labels = next_batch(step)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % settings.check_every:
            continue
        model.eval()
        record, done = check(step, loss.item())
        history.append({"step": step, "loss": round(loss.item(), 4), **record})
        if done:
            return step, history
    raise RuntimeError(
        f"warm-start did not reach {stop} within {settings.max_steps} steps; see the printed checks"
    )


def save_warm_start(
    out_dir: Path,
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    settings: TrainSettings,
    stop: object,
    started: float,
    checks: tuple[int, list[dict[str, object]]],
) -> dict[str, object]:
    """Save the model and, beside it, a summary of how it was made: the settings, the stop
    criterion, the wall time since `started` (perf_counter) and what `train_until`
    returned."""
    steps, history = checks
    summary: dict[str, object] = {
        "settings": settings.__dict__,
        "stop": stop.__dict__,
        "steps": steps,
        "wall_s": round(time.perf_counter() - started, 1),
        "checks": history,
    }
    save(out_dir, model, tokenizer)
    (out_dir / "warm_start.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def warm_start(out_dir: Path, settings: TrainSettings = TrainSettings()) -> dict[str, object]:
    """Train the tiny model from scratch on the train split and save it to ``out_dir``.

    Teacher forcing on prompt + answer + eos with the loss on answer and eos tokens only
    (the prompt is given at sampling time). Each batch draws the same number of rows
    from every domain. Returns a summary (steps, wall time, probe metrics), also written
    to ``out_dir/warm_start.json`` so the shipped weights say how they were made.
    """
    started = time.perf_counter()
    with repeatable(settings.seed) as rng:
        tokenizer = build_tokenizer()
        config = build_config(
            len(tokenizer), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id
        )
        model = Qwen2ForCausalLM(config)
        train = {d: task.train_rows(d, None, seed=settings.seed) for d in task.DOMAIN_NAMES}
        encoded = {d: [_encode_example(tokenizer, r) for r in rs] for d, rs in train.items()}
        probe = [r for rs in train.values() for r in rs[: settings.probe_prompts]]
        per_domain = settings.batch_size // len(encoded)

        def next_batch(step: int) -> Batch:
            examples = [ex for exs in encoded.values() for ex in rng.choices(exs, k=per_domain)]
            return _batch(examples, tokenizer.pad_token_id)

        def check(step: int, loss: float) -> tuple[dict[str, object], bool]:
            rates = pass_rates_of(
                model, tokenizer, probe, settings.probe_samples, 1.0, seed=settings.seed
            )
            greedy = greedy_accuracy_of(model, tokenizer, probe)
            print(
                f"step {step:5d} loss {loss:.3f} T=1 {_fmt(rates)} greedy {_fmt(greedy)}",
                flush=True,
            )
            return {"pass_rate_t1": rates, "greedy": greedy}, _stop_reached(rates, greedy)

        checks = train_until(model, settings, STOP, next_batch, check)
    return save_warm_start(out_dir, model, tokenizer, settings, STOP, started, checks)


def save(out_dir: Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Write a complete offline-loadable model directory (weights, config, tokenizer).

    The tokenizer class is recorded under its transformers 4.x name, which transformers
    5 still resolves, so engines pinned to either major version (vLLM builds, verl) load it.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    neutral_generation_config(tokenizer.pad_token_id, tokenizer.eos_token_id).save_pretrained(
        out_dir
    )


def _fmt(values: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.2f}" for k, v in values.items())


def warm_start_args(
    argv: Sequence[str] | None, doc: str | None, out: Path, out_name: str
) -> argparse.Namespace:
    """A warm-start command's arguments: ``--train [--out DIR] [--seed N]``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--train", action="store_true", help="run the warm-start and save the weights"
    )
    parser.add_argument("--out", type=Path, default=out, help=f"output directory [{out_name}]")
    parser.add_argument("--seed", type=int, default=0, help="training seed [0]")
    args = parser.parse_args(argv)
    if not args.train:
        parser.error("nothing to do: pass --train")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trainer_client.toy.model --train [--out DIR] [--seed N]``."""
    args = warm_start_args(argv, __doc__, WEIGHTS_DIR, "the shipped weights dir")
    summary = warm_start(args.out, TrainSettings(seed=args.seed))
    eval_rows = [r for d in task.DOMAIN_NAMES for r in task.eval_rows(d, 256)]
    tok = AutoTokenizer.from_pretrained(args.out)
    model = Qwen2ForCausalLM.from_pretrained(args.out)
    print(f"saved {args.out} after {summary['steps']} steps in {summary['wall_s']} s")
    print(f"held-out T=1 pass rates: {_fmt(pass_rates_of(model, tok, eval_rows, 16, 1.0))}")
    print(f"held-out greedy accuracy: {_fmt(greedy_accuracy_of(model, tok, eval_rows))}")


if __name__ == "__main__":
    main()
