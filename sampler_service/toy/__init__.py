"""The toy arithmetic task and tiny model: the embedded default for tests and the demo.

``build_toy(out_dir)`` writes a ready-to-serve model directory and per-domain JSONL
datasets; ``measure_pass_rates`` and ``greedy_accuracy`` report how well a model does on
them. See :mod:`sampler_service.toy.task` for the domains and
:mod:`sampler_service.toy.model` for the model and its warm-start.
"""

from sampler_service.toy.build import ToyPaths, build_toy
from sampler_service.toy.task import DOMAIN_NAMES, eval_rows, read_jsonl, train_rows
from trainer_client.evaluate import greedy_accuracy, measure_pass_rates

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
