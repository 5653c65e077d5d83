"""Allocation policies through the running service: a prompt never solved costs a pilot
under `posterior` instead of n_max, the policy is PATCHed live, validated (422 naming the
field), counted in /v1/stats and persisted with the config."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import collect, unanswerable

pytestmark = pytest.mark.timeout(300)

CONFIG = {"rule": "balanced", "n_max": 8, "wave_size": 8}
POSTERIOR = {"name": "posterior", "params": {"pilot": 4}}


def test_posterior_pilots_unsolved_prompts_is_live_validated_and_persisted(
    make_server, toy, tmp_path: Path
) -> None:
    never = unanswerable(toy, tmp_path)  # no answer is ever right: no success history
    server = make_server(CONFIG, data=[never])
    with server.client() as c:
        for g in collect(c, 4):
            assert (g["stats"]["n_generated"], g["stop_reason"]) == (8, "n_max")
        assert c.get("/v1/stats").json()["allocation"]["policy"] is None

        r = c.patch("/v1/config", json={"allocation": POSTERIOR})
        assert r.status_code == 200, r.text
        assert r.json()["allocation"] == POSTERIOR
        version = r.json()["config_version"]
        # Prompts admitted before the PATCH finish under the old config; those after it
        # stop at the pilot, cut by the budget before balanced's rule or n_max.
        after: list[dict] = []
        while len(after) < 6:
            after += [g for g in collect(c, 4) if g["config_version"] >= version]
        for g in after:
            assert (g["stats"]["n_generated"], g["stop_reason"]) == (4, "budget")
        stats = c.get("/v1/stats").json()
        assert stats["allocation"]["policy"] == POSTERIOR
        assert stats["allocation"]["cut"] >= len(after)
        assert stats["allocation"]["mean_budget"] == 4.0
        assert stats["stop_reasons"]["budget"] >= len(after)

        for allocation, field in (
            ({"name": "posterior", "params": {"pilot": 0}}, "allocation.params.pilot"),
            ({"name": "posterior", "params": {"pilot": 9}}, "allocation.params.pilot"),
            ({"params": {"confidence": 1.5}}, "allocation.params.confidence"),
            ({"name": "knapsack", "params": {"mean_budget": 9.0}}, "allocation.params.mean_budget"),
            ({"name": "greedy"}, "allocation.name"),
        ):
            r = c.patch("/v1/config", json={"allocation": allocation})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["field"] == field
        assert c.get("/v1/config").json()["config_version"] == version
        r = c.patch("/v1/config", json={"allocation": None})
        assert r.status_code == 200 and r.json()["allocation"] is None
        assert c.get("/v1/stats").json()["allocation"]["policy"] is None
        r = c.patch("/v1/config", json={"allocation": POSTERIOR})
        assert r.status_code == 200 and r.json()["config_version"] == version + 2

    server.stop()
    server = make_server(CONFIG, data=[never])
    with server.client() as c:
        assert c.get("/v1/config").json()["allocation"] == POSTERIOR
