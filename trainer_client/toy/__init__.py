"""The toy arithmetic task and tiny model: the embedded default for tests and the demo.

``build_toy(out_dir)`` writes a ready-to-serve model directory and per-domain JSONL
datasets; ``measure_pass_rates`` and ``greedy_accuracy`` report how well a model does on
them. See :mod:`trainer_client.toy.task` for the domains and
:mod:`trainer_client.toy.model` for the model and its warm-start.
"""

from trainer_client.evaluate import greedy_accuracy, measure_pass_rates
from trainer_client.toy.build import ToyPaths, build_toy
from trainer_client.toy.task import DOMAIN_NAMES, eval_rows, read_jsonl, train_rows

__all__ = [
    "DOMAIN_NAMES",
    "ToyPaths",
    "build_toy",
    "eval_rows",
    "greedy_accuracy",
    "measure_pass_rates",
    "read_jsonl",
    "train_rows",
]
