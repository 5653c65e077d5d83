"""Pieces of the replica pool's weight paths that need no cluster: the reject fault hook's
spec and the shared weights dir's flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sampler_service.backends.ray.replica import fault_rejects
from sampler_service.cli import add_serve_arguments
from sampler_service.config import ServeSettings
from trainer_client.contract.flags import model_from_args


def test_reject_hook_names_replicas_and_versions() -> None:
    assert not fault_rejects(None, 1, 3)
    assert not fault_rejects("", 0, 1)
    assert fault_rejects("1", 1, 3) and not fault_rejects("1", 0, 3)
    assert fault_rejects("1:1, 1:3", 1, 3) and not fault_rejects("1:1,1:3", 1, 2)
    assert fault_rejects("0,1:2", 0, 9)


def test_weights_dir_flag_is_for_replicas(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    base = ["--model", "m", "--data", "d.jsonl", "--weights-dir", str(tmp_path)]
    settings = model_from_args(parser, ServeSettings, parser.parse_args([*base, "--replicas", "2"]))
    assert settings.weights_dir == tmp_path
    with pytest.raises(SystemExit):
        model_from_args(parser, ServeSettings, parser.parse_args(base))
