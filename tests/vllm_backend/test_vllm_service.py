"""`adaptive-rollout serve --backend vllm` end to end over loopback HTTP (one engine start)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save
from support import collect
from vllm_suite import CONFIG, REPORT, ServeProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(toy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    pytest.importorskip("vllm.v1.engine.async_llm")
    root = tmp_path_factory.mktemp("vllm-serve")
    proc = ServeProcess(toy, root / "state", CONFIG, extra=[])
    proc.start()
    REPORT["service start to /ready, --backend vllm (s)"] = round(proc.ready_s, 1)
    yield proc
    proc.stop()


def test_groups_obey_the_stopping_rule(server: ServeProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        health = c.get("/health").json()
        assert health["backend"] == "vllm" and health["policy_version"] == 0
        started = time.monotonic()
        groups = collect(c, 12, timeout_s=240, wait_s=20)
        REPORT["12 balanced groups via vLLM (s)"] = round(time.monotonic() - started, 1)
    stop_reasons = set()
    for g in groups:
        st = g["stats"]
        assert st["n_generated"] <= CONFIG["n_max"]
        assert st["n_pos"] + st["n_neg"] == st["n_generated"]
        stop_reasons.add(g["stop_reason"])
        if g["stop_reason"] == "rule":
            assert st["n_pos"] >= 2 and st["n_neg"] >= 2
        else:
            assert g["stop_reason"] == "n_max" and st["n_generated"] == CONFIG["n_max"]
        assert 2 <= len(g["samples"]) <= CONFIG["group_size"]
        assert g["policy_version_min"] == g["policy_version_max"] == 0
        for s in g["samples"]:
            assert len(s["logprobs"]) == len(s["response_token_ids"]) <= CONFIG["max_tokens"]
            assert all(lp <= 0 for lp in s["logprobs"])
            assert s["finish_reason"] in ("stop", "length")
    assert "rule" in stop_reasons  # the toy model solves some prompts and fails others


def _perturbed_upload(model_dir: Path, scale: float) -> bytes:
    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    return save(
        {
            k: (v + scale * torch.randn(v.shape, generator=gen)).contiguous()
            for k, v in state.items()
        }
    )


def test_weight_upload_raises_version_and_bad_uploads_change_nothing(
    server: ServeProcess, toy
) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.put(
            "/v1/weights", params={"version": 1}, content=_perturbed_upload(toy.model_dir, 0.02)
        )
        assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 1
        assert c.get("/health").json()["policy_version"] == 1
        # groups finished before the upload drain first (at most the buffer + in-flight)
        for _ in range(40):
            if any(g["policy_version_min"] >= 1 for g in collect(c, 4, timeout_s=240, wait_s=20)):
                break
        else:
            raise AssertionError("no groups from the uploaded weights after 160 groups")

        bad_shape = save({"model.norm.weight": torch.zeros(5)})
        for body in (b"garbage, not safetensors", bad_shape):
            r = c.put("/v1/weights", params={"version": 2}, content=body)
            assert 400 <= r.status_code < 500, r.text
            assert "error" in r.json()
        assert c.put("/v1/weights", params={"version": 1}, content=bad_shape).status_code == 409
        assert c.get("/health").json()["policy_version"] == 1
        assert c.get("/ready").status_code == 200
        assert all(
            g["policy_version_max"] <= 1 for g in collect(c, 2, timeout_s=240, wait_s=20)
        )  # still serving


def test_weight_update_in_abort_mode(server: ServeProcess, toy) -> None:
    """`weight_update_mode: abort` aborts in-flight vLLM requests, which are re-issued."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.patch("/v1/config", json={"weight_update_mode": "abort"})
        assert r.status_code == 200, r.text
        version = c.get("/health").json()["policy_version"] + 1
        collect(c, 2, timeout_s=240, wait_s=20)  # sampling is busy when the update lands
        r = c.put(
            "/v1/weights",
            params={"version": version},
            content=_perturbed_upload(toy.model_dir, 0.01),
        )
        assert r.status_code == 200, r.text
        assert c.get("/health").json()["policy_version"] == version
        for _ in range(40):
            got = collect(c, 4, timeout_s=240, wait_s=20)
            for g in got:  # aborted requests are re-issued, never delivered as samples
                for s in g["samples"]:
                    assert s["finish_reason"] in ("stop", "length")
                    assert len(s["logprobs"]) == len(s["response_token_ids"])
            if any(g["policy_version_min"] == version for g in got):
                break
        else:
            raise AssertionError("no groups from the weights loaded in abort mode")
