"""The policy registry: names, scopes and errors that name the parameter."""

from __future__ import annotations

import pytest

from strategies import PolicyError, mixing, reweighting, selection, stopping
from strategies.registry import NoParams, Params, Registry


class _Knobs(Params):
    size: int = 3


def test_build_validates_and_lists_names():
    registry: Registry[int] = Registry("thing")
    registry.add("double", _Knobs, lambda p: 2 * p.size, scope="group")
    registry.add("none", NoParams, lambda p: 0, scope="batch")
    assert registry.build("double") == 6
    assert registry.build("double", size=5) == 10
    assert registry.names() == ["double", "none"]
    assert registry.names("batch") == ["none"]
    with pytest.raises(ValueError, match="already registered"):
        registry.add("none", NoParams, lambda p: 1, scope="batch")


@pytest.mark.parametrize(
    ("params", "field", "fragment"),
    [
        ({"sise": 4}, "sise", "did you mean 'size'"),
        ({"size": "4"}, "size", "valid integer"),
        ({"size": True}, "size", "valid integer"),
        ({"size": 4.5}, "size", "valid integer"),
    ],
)
def test_misspelled_and_ill_typed_parameters(params, field, fragment):
    registry: Registry[int] = Registry("thing")
    registry.add("double", _Knobs, lambda p: 2 * p.size, scope="group")
    with pytest.raises(PolicyError) as info:
        registry.build("double", **params)
    assert info.value.field == field
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_every_policy_declares_its_scope():
    assert {stopping.RULES.entry(n).scope for n in stopping.RULES.names()} == {"prompt"}
    assert selection.build("maxvar").scope == "group"
    assert selection.build("topk").scope == "batch"
    assert [reweighting.build(n).scope for n in ("per", "softmax", "diffband", "ar")] == [
        "batch",
        "batch",
        "batch",
        "token",
    ]
    assert mixing.build("tscl", domains=["a"]).scope == "domain"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_policy_parameters_are_refused(value):
    """A NaN temperature would make every softmax weight NaN; it is a 422, not a run."""
    with pytest.raises(PolicyError) as info:
        reweighting.REWEIGHTINGS.build("softmax", temperature=value)
    assert info.value.field == "temperature"
    assert "finite" in str(info.value)
