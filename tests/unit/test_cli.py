"""The command lines generated from the settings models: flags, defaults, validation and
the initial config's precedence."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from sampler_service.cli import add_serve_arguments, initial_config, main
from sampler_service.config import (
    ReplicaSettings,
    SamplerConfig,
    ServeSettings,
    overridden_by_saved,
)
from sampler_service.config.settings import HttpServers, InProcess, RayReplicas
from trainer_client.contract.flags import command_line, model_from_args, parse_key_values
from trainer_client.train_config import TrainConfig


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    return parser


def test_sync_every_zero_is_a_usage_error_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--url", "http://x", "--model", "m", "--sync-every", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--sync-every: Input should be greater than or equal to 1" in err


def test_the_demo_bounds_the_knobs_it_passes_to_the_trainer_as_the_trainer_does(capsys) -> None:
    from trainer_client.demo import DemoSettings

    shared = sorted(set(DemoSettings.model_fields) & set(TrainConfig.model_fields))
    assert {"steps", "batch_groups", "lr", "sync_every", "time_limit_s"} <= set(shared)
    for name in shared:
        demo, train = DemoSettings.model_fields[name], TrainConfig.model_fields[name]
        assert (demo.annotation, demo.metadata) == (train.annotation, train.metadata), name
    # Through the generated command line: the same bound, the same message, naming the flag.
    with pytest.raises(SystemExit):
        main(["demo", "--sync-every", "0"])
    assert "--sync-every: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_serve_has_one_flag_per_setting_and_shows_defaults() -> None:
    help_text = " ".join(_serve_parser().format_help().split())
    fields = [("", name, info) for name, info in ServeSettings.model_fields.items()]
    fields += [("replica-", n, i) for n, i in ReplicaSettings.model_fields.items()]
    for prefix, name, info in fields:
        if name == "replica":  # nested: a flag per field of its own, below
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        flag = "--" + str(extra.get("cli_flag") or prefix + name.replace("_", "-"))
        assert f"{flag} " in help_text, flag
    assert "--port PORT port to listen on (0 picks a free one) (default: 8000)" in help_text
    assert "--state-dir STATE_DIR" in help_text and "(default: sampler_state)" in help_text


def test_serve_flags_build_the_settings(tmp_path: Path) -> None:
    parser = _serve_parser()
    args = parser.parse_args(
        ["--model", "m", "--data", "a.jsonl", "--data", "b.jsonl", "--port", "0"]
        + ["--vllm-arg", "tensor_parallel_size=2", "--vllm-arg", "enforce_eager=true"]
        + ["--hf-engine", "thread"]
    )
    from trainer_client.contract.flags import model_from_args

    settings = model_from_args(parser, ServeSettings, args)
    assert settings.data == [Path("a.jsonl"), Path("b.jsonl")]
    assert settings.port == 0 and settings.hf_engine == "thread"
    assert settings.vllm == {"tensor_parallel_size": 2, "enforce_eager": True}
    # Flags not given keep the model's defaults.
    assert settings.heartbeat_s == ServeSettings.model_fields["heartbeat_s"].default == 5.0


def test_replica_flags_nest_with_their_prefix_and_name_their_flag_in_errors(capsys) -> None:
    parser = _serve_parser()
    base = ["--model", "m", "--data", "d.jsonl"]
    flags = ["--replicas", "3", "--replica-probe-s", "2", "--route", "least-loaded"]
    settings = model_from_args(parser, ServeSettings, parser.parse_args([*base, *flags]))
    assert settings.replica == ReplicaSettings(count=3, probe_s=2.0, route="least-loaded")
    assert settings.transport.kind == "ray"
    # The inverse gives the same flags back, under the same names.
    assert command_line(settings.replica, prefix="replica-") == [
        "--replicas",
        "3",
        "--route",
        "least-loaded",
        "--replica-probe-s",
        "2.0",
    ]
    assert model_from_args(parser, ServeSettings, parser.parse_args(base)).replica == (
        ReplicaSettings()
    )
    with pytest.raises(SystemExit):
        model_from_args(parser, ServeSettings, parser.parse_args([*base, "--replica-wait-s", "0"]))
    assert "--replica-wait-s: Input should be greater than 0" in capsys.readouterr().err


def test_set_wins_over_config_file_and_is_validated(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"rule": "positive", "k_pos": 3, "est": {"n_min": 3}}))
    parser = _serve_parser()
    args = parser.parse_args(
        ["--model", "m", "--data", "d", "--config", str(config)]
        + ["--set", "k_pos=4", "--set", "est.mean_budget=6", "--set", "mixing.name=reward_gap"]
    )
    cfg, given = initial_config(parser, args)
    assert (cfg.rule, cfg.k_pos) == ("positive", 4)
    assert (cfg.est.n_min, cfg.est.mean_budget) == (3, 6.0)  # nested keys merge
    assert cfg.mixing.name == "reward_gap"
    assert set(given) == {"rule", "k_pos", "est", "mixing"}
    bad = parser.parse_args(["--model", "m", "--data", "d", "--set", "n_max=0"])
    with pytest.raises(SystemExit):
        initial_config(parser, bad)


def test_saved_config_overrides_are_named() -> None:
    initial = SamplerConfig(rule="positive", k_pos=4, n_max=16)
    saved = SamplerConfig(rule="positive", k_pos=2, n_max=16)
    assert overridden_by_saved({"rule": 0, "k_pos": 0, "n_max": 0}, initial, saved) == [
        "k_pos=4 (saved: 2)"
    ]


def test_key_values_parse_json_else_strings_and_nest() -> None:
    assert parse_key_values(["a=1", "b=x y", "c.d=[1, 2]", "c.e=null"], "--set") == {
        "a": 1,
        "b": "x y",
        "c": {"d": [1, 2], "e": None},
    }
    with pytest.raises(argparse.ArgumentTypeError):
        parse_key_values(["novalue"], "--set")


def test_train_config_refuses_what_would_crash_later() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        TrainConfig(url="u", model=Path("m"), sync_every=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(url="u", model=Path("m"), lr=float("inf"))
    with pytest.raises(ValueError, match="not_a_knob"):
        TrainConfig(url="u", model=Path("m"), not_a_knob=1)


def test_the_dispatcher_imports_only_the_chosen_subcommand() -> None:
    """Parsing one subcommand imports its module alone: in a fresh interpreter, `events`,
    then `serve`, then `train`, each adding only its own modules."""
    code = (
        "import sys\n"
        "from sampler_service.cli import build_parser\n"
        "for argv in (['events'], ['serve', '--model', 'm', '--data', 'd'],"
        " ['train', '--url', 'http://x', '--model', 'm']):\n"
        "    before = set(sys.modules)\n"
        "    build_parser().parse_args(argv)\n"
        "    print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    events, serve, train = (set(line.split()) for line in done.stdout.splitlines())
    assert "trainer_client.ops_cli" in events
    assert not {"trainer_client.cli", "sampler_service.config"} & events
    assert "sampler_service.config" in serve and "trainer_client.cli" not in serve
    assert "trainer_client.train_config" in train and "sampler_service.service" not in train
    loaded = {m.split(".")[0] for m in events | serve | train}
    assert not loaded & {"fastapi", "uvicorn", "torch", "transformers", "httpx"}, loaded


def test_every_subcommand_has_a_parser_that_runs_it() -> None:
    from sampler_service.cli import COMMANDS, command_parser

    minimal = {"serve": ["--model", "m", "--data", "d"], "train": ["--url", "u", "--model", "m"]}
    minimal["config"] = ["get"]
    for name in COMMANDS:
        parser = command_parser(name)
        assert parser.prog == f"adaptive-rollout {name}"
        assert callable(parser.parse_args(minimal.get(name, [])).func), name


def test_a_usage_error_is_one_line_naming_the_command(capsys) -> None:
    for argv in (["serve", "--model", "m"], ["train", "--model"], ["stats", "--count", "x"], []):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "usage:" not in err, (argv, err)
        assert err.startswith("adaptive-rollout") and "--help lists the flags" in err, err


def test_help_shows_each_default_once() -> None:
    from sampler_service.cli import COMMANDS, command_parser

    def parsers() -> list[argparse.ArgumentParser]:
        found = []
        for name in COMMANDS:
            parser = command_parser(name)
            found.append(parser)
            for action in parser._actions:  # config's get, set and schedule
                if isinstance(action, argparse._SubParsersAction):
                    found += action.choices.values()
        return found

    for parser in parsers():
        for action in parser._actions:
            if not action.option_strings or action.help in (None, argparse.SUPPRESS):
                continue
            flag, shown = action.option_strings[-1], action.help.count("(default:")
            assert shown <= 1, (parser.prog, flag, action.help)
            unset = action.default in (None, [], argparse.SUPPRESS) or action.nargs == 0
            if not unset and not action.required:
                assert shown == 1, f"{parser.prog} {flag} does not show its default"


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback(tmp_path: Path) -> None:
    """`adaptive-rollout ... | head`: the command's output goes nowhere, quietly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sampler_service", "toy", "--out", str(tmp_path / "toy")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head -c 0`: nobody reads what it prints
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "Broken" not in err, err


def test_serve_help_groups_its_flags_by_section_and_every_section_names_real_fields() -> None:
    paths = {
        f"replica.{sub}" if name == "replica" else name
        for name in ServeSettings.model_fields
        for sub in (ReplicaSettings.model_fields if name == "replica" else [""])
    }
    named = [p for fields in ServeSettings.CLI_SECTIONS.values() for p in fields]
    assert set(named) <= paths and len(named) == len(set(named)), set(named) - paths
    sections = {
        group.title: {a.option_strings[0] for a in group._group_actions}
        for group in _serve_parser()._action_groups
    }
    assert {"--model", "--port", "--config", "--set"} <= sections["core"]
    assert {"--backend", "--vllm-arg", "--weights-dir"} <= sections["engine"]
    assert sections["episodes"] == {"--env", "--harness", "--session-tools"}
    assert {"--replicas", "--ray-address"} <= sections["Ray replicas"]
    assert {"--engine-url", "--engine-compare-checksums"} <= sections["HTTP fleet (--backend http)"]


def test_the_transport_is_one_choice_the_flags_name_and_a_flag_of_another_is_refused(
    tmp_path: Path,
) -> None:
    base: dict[str, Any] = {"model": tmp_path, "data": [tmp_path / "d.jsonl"]}
    assert ServeSettings(**base).transport == InProcess(engine="hf")
    ray = ServeSettings(**base, backend="vllm", replica={"count": 2}, weights_dir=tmp_path)
    assert ray.transport == RayReplicas(
        engine="vllm", replica=ReplicaSettings(count=2), weights_dir=tmp_path
    )
    http = ServeSettings(
        **base, backend="http", engine_url=["http://10.0.0.1:8000"], weights_dir=tmp_path
    )
    assert isinstance(http.transport, HttpServers)
    assert http.transport.urls == ("http://10.0.0.1:8000",) and http.transport.kind == "http"
    refused = {
        "engine_url: for --backend http only": {"engine_url": ["http://10.0.0.1:8000"]},
        "weights_dir is for engine replicas": {"weights_dir": tmp_path},
        "no --replicas or --ray-address": {
            "backend": "http",
            "engine_url": ["http://10.0.0.1:8000"],
            "weights_dir": tmp_path,
            "replica": {"ray_address": "auto"},
        },
        "needs --weights-dir": {"backend": "http", "engine_url": ["http://10.0.0.1:8000"]},
    }
    for message, flags in refused.items():
        with pytest.raises(ValidationError, match=message):
            ServeSettings(**base, **flags)
