"""The config page's table is rendered from the live config model and the registries."""

from __future__ import annotations

from sampler_service.config import SamplerConfig
from sampler_service.config_table import PAGE, page_block, render
from strategies.reweighting import REWEIGHTINGS


def test_the_config_page_table_is_the_models() -> None:
    assert page_block(PAGE.read_text()) == render(), (
        "docs/config.md's config table differs from SamplerConfig: "
        "run `python -m sampler_service.config_table --write`"
    )


def test_every_knob_has_a_row_that_says_what_it_does() -> None:
    rows = {line.split(" | ")[0].strip("| `"): line for line in render().splitlines()[3:-1]}
    for name, field in SamplerConfig.model_fields.items():
        if name in ("est", "episode"):  # nested knobs: one row each
            nested = type(getattr(SamplerConfig(), name)).model_fields
            assert {f"{name}.{n}" for n in nested} <= set(rows)
            continue
        assert name in rows, name
        assert field.description, f"{name} has no description"
    # Defaults and bounds come from the model; policies and their parameters from the registry.
    assert rows["k_pos"].startswith("| `k_pos` | 2 [1, 4096] |")
    assert all(f"`{name}`" in rows["batch_policies"] for name in REWEIGHTINGS.names())
    assert "`domains`" not in rows["mixing"]  # filled in by the sampler, not the user
