"""The verl trainer's ``trainer.v1.adaptive_rollout`` section is validated strictly: a
typo or a wrong type names its key instead of silently keeping a default."""

from __future__ import annotations

import pytest

from trainer_client.verl.settings import MODE, SamplerSettings


def test_unknown_key_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=rf"trainer\.v1\.{MODE}\.lease_wait:"):
        SamplerSettings.from_mapping({"url": "http://s:1", "lease_wait": 3})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lease_wait_s", "soon"),
        ("lease_wait_s", 0),
        ("watchdog_s", float("inf")),
        ("keep_weight_files", 0),
        ("weight_sync", "rsync"),
        ("advantages", "mine"),
        ("group_timeout_s", -1),
    ],
)
def test_bad_values_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"trainer\.v1\.{MODE}\.{key}:"):
        SamplerSettings.from_mapping({"url": "http://s:1", key: value})


def test_verls_own_key_and_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTIVE_ROLLOUT_URL", "http://sampler:8000/")
    monkeypatch.setenv("ADAPTIVE_ROLLOUT_API_KEY", "k")
    settings = SamplerSettings.from_mapping({"parameter_sync_step": 1, "lease_wait_s": 2})
    assert (settings.url, settings.api_key, settings.lease_wait_s) == (
        "http://sampler:8000",
        "k",
        2,
    )
    assert "parameter_sync_step" not in settings.to_dict()


def test_missing_url_and_path_mode_without_a_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADAPTIVE_ROLLOUT_URL", raising=False)
    with pytest.raises(ValueError, match="no sampler URL"):
        SamplerSettings.from_mapping({})
    with pytest.raises(ValueError, match="weight_sync=path needs weights_dir"):
        SamplerSettings.from_mapping({"url": "http://s:1", "weight_sync": "path"})


@pytest.mark.parametrize(
    ("choice", "estimator", "expected"),
    [
        ("auto", "grpo", False),
        ("auto", "global", True),
        ("auto", "est", True),
        ("verl", "global", False),
        ("sampler", "grpo", True),
    ],
)
def test_whose_advantages_verl_trains_on(choice: str, estimator: str, expected: bool) -> None:
    settings = SamplerSettings(url="http://s:1", advantages=choice)
    assert settings.sampler_advantages({"advantage": estimator}) is expected
