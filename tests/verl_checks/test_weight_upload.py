"""Weights from a float32 trainer to a sampler serving bfloat16 (core suite, no verl).

The pusher casts floating tensors to the sampler's serving dtype before the host copy
and streams the safetensors body from those copies: the upload is half the float32
size, so the sampler's upload limit (2x its own weight bytes) admits it, and the body is
a valid safetensors file of exactly the cast tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load
from support import start_server

from trainer_client.client import SamplerClient
from trainer_client.uploads import unique_tensors
from trainer_client.verl.settings import MODE, SamplerSettings
from trainer_client.verl.upload import WeightPusher, safetensors_stream, to_host

CONFIG = {
    "rule": "fixed",
    "group_size": 2,
    "wave_size": 2,
    "n_max": 4,
    "max_tokens": 4,
    "max_staleness": None,  # groups are leased without training on them
}


@pytest.fixture(scope="module")
def bf16_sampler(toy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The engine on a server thread (start_server's default): the cast and the upload
    # limit are the subject, not the engine process.
    server = start_server(
        toy, tmp_path_factory.mktemp("bf16"), CONFIG, base={}, extra=["--dtype", "bfloat16"]
    )
    yield server.url
    server.stop()


def _model(toy: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model


def test_stream_is_the_cast_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g),
        "steps": torch.arange(4),
        "empty": torch.zeros(0, 3),
    }
    host = [(n, to_host(t, torch.bfloat16)) for n, t in state.items()]
    stream = safetensors_stream(host)
    body = b"".join(stream.chunks())
    assert len(body) == stream.length
    back = load(body)
    assert back["a"].dtype == torch.bfloat16 and torch.equal(back["a"], state["a"].bfloat16())
    assert torch.equal(back["steps"], state["steps"])  # integers keep their dtype
    assert back["empty"].shape == (0, 3)


def test_tied_tensors_travel_once() -> None:
    shared = torch.ones(4, 2)
    assert [n for n, _ in unique_tensors([("x", shared), ("y", shared), ("z", shared[1:])])] == [
        "x",
        "z",
    ]


def test_float32_trainer_to_bfloat16_sampler(bf16_sampler: str, toy: Any) -> None:
    # One client for the checks and the pusher, closed with the test.
    with SamplerClient(bf16_sampler) as client:
        assert client.stats()["engine"]["dtype"] == "bfloat16"
        model = _model(toy)
        state = model.state_dict()
        pusher = WeightPusher(SamplerSettings.from_mapping({"url": bf16_sampler}), client=client)
        assert pusher.wire_dtype() == torch.bfloat16
        version = client.health().policy_version + 1
        metrics = pusher.push(state, version)
        assert client.health().policy_version == version == metrics[f"{MODE}/policy_version"]
        unique = unique_tensors(state.items())
        bf16_bytes = sum(t.numel() * 2 for _, t in unique)
        # the body is the bf16 tensors plus a header, half of what float32 would be
        assert bf16_bytes < metrics[f"{MODE}/weight_bytes"] < bf16_bytes + 64 * 1024
        # the trainer's own tensors are untouched by the cast
        assert all(t.dtype == torch.float32 for t in model.state_dict().values())
