"""Materialize the toy setup on disk: model directory plus per-domain prompt files.

The service, its tests and the demo all start from a directory, as a user would with a
real model and dataset, so the toy goes through the same loading paths (AutoTokenizer,
AutoModelForCausalLM, vLLM, JSONL datasets with a domain per file) as the real thing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainer_client.toy import task
from trainer_client.toy.shipped import CALCULATOR_WEIGHTS_DIR, WEIGHTS_DIR

#: ``arithmetic``: single answers; ``calculator``: episodes with the calculator tool.
ToyTask = Literal["arithmetic", "calculator"]
TOY_TASKS: tuple[ToyTask, ...] = ("arithmetic", "calculator")

DEFAULT_N_TRAIN = 512
DEFAULT_N_EVAL = 64


@dataclass(frozen=True)
class ToyPaths:
    """What :func:`build_toy` wrote: a model directory and one JSONL file per domain."""

    model_dir: Path
    data_files: list[Path] = field(default_factory=list)
    eval_files: list[Path] = field(default_factory=list)


def _install_model(model_dir: Path, toy_task: ToyTask) -> None:
    """Copy the shipped weights into ``model_dir``, training them if they are missing.

    Training is the fallback for a checkout without the weight files; it takes minutes
    on two cores, is skipped when ``model_dir`` already holds a trained model, and is
    imported only then: importing the training module here would make
    ``python -m trainer_client.toy.model`` import itself twice.
    """
    weights = CALCULATOR_WEIGHTS_DIR if toy_task == "calculator" else WEIGHTS_DIR
    if (weights / "model.safetensors").is_file():
        model_dir.mkdir(parents=True, exist_ok=True)
        for src in sorted(weights.iterdir()):
            if src.is_file():
                shutil.copy2(src, model_dir / src.name)
    elif not (model_dir / "model.safetensors").is_file():
        if toy_task == "calculator":
            from trainer_client.toy.calculator import warm_start as calculator_warm_start

            calculator_warm_start(model_dir)
        else:
            from trainer_client.toy.model import warm_start

            warm_start(model_dir)


def build_toy(
    out_dir: Path,
    *,
    seed: int = 0,
    n_train: int = DEFAULT_N_TRAIN,
    n_eval: int = DEFAULT_N_EVAL,
    toy_task: ToyTask = "arithmetic",
) -> ToyPaths:
    """Write ``out_dir/model/``, ``out_dir/data/<domain>.jsonl`` and ``out_dir/eval/<domain>.jsonl``.

    ``n_train`` and ``n_eval`` are per domain and capped by the domain's split (``add1``
    has only 100 problems: about 80 train and 20 held out). The same arguments always
    write the same bytes, so calling it again is harmless and takes a second or two.
    ``toy_task="calculator"`` writes the calculator model and rows that name the
    ``calculator`` environment (the same prompts, episodes instead of single answers).
    """
    out_dir = Path(out_dir)
    model_dir = out_dir / "model"
    _install_model(model_dir, toy_task)

    def rows(found: list[dict[str, str]]) -> list[dict[str, str]]:
        return (
            [{**row, "env": "calculator"} for row in found] if toy_task == "calculator" else found
        )

    data_files = [
        task.write_jsonl(
            out_dir / "data" / f"{d}.jsonl", rows(task.train_rows(d, n_train, seed=seed))
        )
        for d in task.DOMAIN_NAMES
    ]
    eval_files = [
        task.write_jsonl(
            out_dir / "eval" / f"{d}.jsonl", rows(task.eval_rows(d, n_eval, seed=seed))
        )
        for d in task.DOMAIN_NAMES
    ]
    return ToyPaths(model_dir=model_dir, data_files=data_files, eval_files=eval_files)
