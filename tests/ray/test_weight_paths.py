"""Weights through a shared directory (`serve --weights-dir`) and replica-side rejection.

Two hf replicas on a Ray head whose replica 1 refuses weights v1 and v3 (the fault
hook `ADAPTIVE_ROLLOUT_FAULT_REJECT_WEIGHTS`, read in the replica actor). Every refusal
answers 422 and changes nothing: both replicas serve the version before it, with the same
greedy answers and logprobs, whether the replica that had installed the weights is
restarted (the committed weights are the base model) or reloads the committed file in
place. A killed replica comes back at the committed weights, read from the shared path.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from ray_helpers import Consumer, wait_for
from safetensors.torch import load, save
from support import perturbed_file
from test_cluster import _agreed, _args, _at_version, _greedy

from sampler_service.backends.ray.replica import FAULT_REJECT_WEIGHTS_ENV

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1500)]


#: The replicas of this module's Ray head run with the reject hook (see conftest).
RAY_HEAD_ENV = {FAULT_REJECT_WEIGHTS_ENV: "1:1,1:3"}


def _close(a: list[float], b: list[float]) -> bool:
    return a == pytest.approx(b, abs=1e-5)


def test_shared_dir_weights_and_rollback_of_a_rejected_update(
    ray_cluster, make_sampler, toy, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    sampler = make_sampler(_args(ray_cluster) + ["--weights-dir", str(shared)])
    with sampler.client() as client:
        consumer = Consumer(client)
        consumer.take(2)
        prompt = next(iter(consumer.groups.values()))["prompt_token_ids"]
        base = _agreed(sampler, prompt)
        pids = [r["pid"] for r in sampler.replicas()]

        # v1: replica 1 refuses; replica 0 installed it and the committed weights are the
        # base model, so replica 0 is restarted.
        r = client.put(
            "/v1/weights", params={"version": 1}, content=perturbed_file(toy.model_dir, 0.05, 0)
        )
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "weights_rejected"
        assert "replica 1: fault hook" in r.json()["error"]["message"]
        reps = _at_version(sampler, 0)
        assert reps[1]["pid"] == pids[1] and reps[0]["restarts"] == 1
        after = _agreed(sampler, prompt)
        assert _close(after[0][1], base[0][1]) and after[0][0] == base[0][0]
        assert not list(shared.glob("*.safetensors*"))  # the refused upload is gone

        # v2 is accepted: written into the shared dir, read there by both replicas.
        r = client.put(
            "/v1/weights", params={"version": 2}, content=perturbed_file(toy.model_dir, 0.05, 1)
        )
        assert r.status_code == 200, r.text
        (v2_file,) = shared.glob("*.safetensors*")
        assert v2_file.name.startswith("weights-v2-")
        reps = _at_version(sampler, 2)
        pids = [r["pid"] for r in reps]
        v2 = _agreed(sampler, prompt)
        assert not _close(v2[0][1], base[0][1])

        # v3: refused again; now replica 0 reloads the committed v2 file in place.
        r = client.put(
            "/v1/weights", params={"version": 3}, content=perturbed_file(toy.model_dir, 0.05, 2)
        )
        assert r.status_code == 422, r.text
        reps = _at_version(sampler, 2)
        assert [r["pid"] for r in reps] == pids  # no restart
        again = _agreed(sampler, prompt)
        assert _close(again[0][1], v2[0][1])
        assert list(shared.glob("*.safetensors*")) == [v2_file]

        # A path load: the front checks headers only; a NaN is caught by the replicas
        # (both vet the tensors themselves), so the front never read the tensors.
        state = load(v2_file.read_bytes())
        name = next(iter(state))
        state[name] = state[name].clone()
        state[name].view(-1)[0] = float("nan")
        nan_file = shared / "nan.safetensors"
        nan_file.write_bytes(save(state))
        r = client.post("/v1/weights/load", json={"path": str(nan_file), "version": 5})
        assert r.status_code == 422, r.text
        assert "holds NaN" in r.json()["error"]["message"]
        assert [r["pid"] for r in _at_version(sampler, 2)] == pids
        assert _close(_greedy(sampler, prompt)[0][1], v2[0][1])

        # A good path: every replica reads it from there.
        good = shared / "step6.safetensors"
        good.write_bytes(perturbed_file(toy.model_dir, 0.05, 3))
        r = client.post("/v1/weights/load", json={"path": str(good), "version": 6})
        assert r.status_code == 200, r.text
        _at_version(sampler, 6)
        v6 = _agreed(sampler, prompt)
        assert not _close(v6[0][1], v2[0][1])

        # A killed replica comes back with the committed weights, read from the path.
        os.kill(pids[1], signal.SIGKILL)

        def back() -> bool:
            rep = sampler.replicas()[1]
            return rep["state"] == "ok" and rep["pid"] != pids[1] and rep["policy_version"] == 6

        wait_for("replica 1 back at v6", back, 600)
        _agreed(sampler, prompt)
        assert _close(_greedy(sampler, prompt)[1][1], v6[0][1])

        # NCCL needs vLLM engines: hf replicas say so, as a single hf engine does.
        for method, path, body in (
            ("GET", "/v1/weights/nccl", None),
            ("POST", "/v1/weights/nccl/init", {"init_info": {"world_size": 3}}),
        ):
            r = client.request(method, path, json=body)
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "nccl_unavailable", r.text
        consumer.take(2)  # still sampling


def test_object_store_weights_roll_back_in_place(ray_cluster, make_sampler, toy) -> None:
    """Without --weights-dir the tensors travel once through Ray's object store; a refused
    update is rolled back by reloading the committed tensors from there."""
    sampler = make_sampler(_args(ray_cluster), name="objects")
    with sampler.client() as client:
        Consumer(client).take(1)
        prompt = [1, 2, 3, 4]
        r = client.put(
            "/v1/weights", params={"version": 2}, content=perturbed_file(toy.model_dir, 0.05, 4)
        )
        assert r.status_code == 200, r.text
        pids = [r["pid"] for r in _at_version(sampler, 2)]
        v2 = _agreed(sampler, prompt)
        r = client.put(
            "/v1/weights", params={"version": 3}, content=perturbed_file(toy.model_dir, 0.05, 5)
        )
        assert r.status_code == 422, r.text
        assert [r["pid"] for r in _at_version(sampler, 2)] == pids
        after = _agreed(sampler, prompt)
        assert _close(after[0][1], v2[0][1]) and after[0][0] == v2[0][0]
