"""The OpenAPI document says what the server does: the bounds it advertises are the ones it
enforces, and it asks for a key only when the sampler has one. Built from the app alone
(the document needs no engine)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from sampler_service.app import create_app
from sampler_service.config import ServeSettings
from sampler_service.service import SamplerService
from strategies import stopping
from strategies.stopping import StoppingParams


def _document(api_key: str | None = None) -> dict[str, Any]:
    settings = ServeSettings(model=Path("model"), data=[Path("data.jsonl")], api_key=api_key)
    return create_app(settings, functools.partial(SamplerService.build, settings)).openapi()


def _rule_bounds(knob: str) -> tuple[Any, Any]:
    """The (ge, le) bounds of a stopping rule's parameter, as the rule validates it."""
    metadata = StoppingParams.model_fields[knob].metadata
    low = next(m.ge for m in metadata if hasattr(m, "ge"))
    high = next(m.le for m in metadata if hasattr(m, "le"))
    return low, high


def _bounds(schema: dict[str, Any]) -> tuple[Any, Any]:
    # An optional knob of the patch body is anyOf [the knob, null].
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "integer":
            return option.get("minimum"), option.get("maximum")
    return schema.get("minimum"), schema.get("maximum")


@pytest.mark.parametrize("knob", ["k_pos", "k_neg", "n_max", "wave_size", "group_size"])
def test_the_document_advertises_the_bounds_the_stopping_rule_enforces(knob: str) -> None:
    rule = _rule_bounds(knob)
    schemas = _document()["components"]["schemas"]
    assert _bounds(schemas["ConfigView"]["properties"][knob]) == rule
    assert _bounds(schemas["ConfigPatch"]["properties"][knob]) == rule
    low, high = rule
    # What the document allows, the rule accepts; one past either end, the rule refuses.
    for value, ok in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
        params = {"k_pos": 1, "k_neg": 1, "n_max": stopping.MAX_ANSWERS, "group_size": 0}
        params[knob] = value
        if ok:
            StoppingParams(**params)
        else:
            with pytest.raises(ValueError):
                StoppingParams(**params)


def _operations(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [op for item in document["paths"].values() for op in item.values()]


def test_without_a_key_no_operation_declares_security() -> None:
    document = _document()
    assert not [op["operationId"] for op in _operations(document) if op.get("security")]
    assert "securitySchemes" not in document.get("components", {})


def test_with_a_key_every_v1_and_session_operation_declares_the_bearer_scheme() -> None:
    document = _document(api_key="secret")
    schemes = document["components"]["securitySchemes"]
    assert [s["scheme"] for s in schemes.values()] == ["bearer"]
    for path, item in document["paths"].items():
        guarded = path.startswith(("/v1/", "/sessions/"))
        for op in item.values():
            assert bool(op.get("security")) == guarded, (path, op.get("security"))
