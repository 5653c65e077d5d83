"""The weights package without an engine: an NCCL update's vetting, and the front's
header-only and streaming vetting of weight files. (The NCCL group's rank layout over a
fleet is the fleet suite's, test_fleet.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sampler_service.weights.nccl import NCCLUpdateInfo, vet_update_info
from sampler_service.weights.types import TensorSpec, WeightsRejected
from sampler_service.weights.vetting import vet_weight_files_streaming, vet_weight_headers

SPECS = {"a.weight": TensorSpec((4, 2), "F32"), "b.weight": TensorSpec((3,), "BF16")}


def test_vet_update_info() -> None:
    ok = NCCLUpdateInfo(
        names=["a.weight", "b.weight"], dtype_names=["float32", "bfloat16"], shapes=[[4, 2], [3]]
    )
    assert vet_update_info(ok, SPECS, set(SPECS)) is None
    cases = {
        "missing": NCCLUpdateInfo(names=["a.weight"], dtype_names=["float32"], shapes=[[4, 2]]),
        "no tensor": NCCLUpdateInfo(
            names=["a.weight", "b.weight", "c"],
            dtype_names=["float32"] * 3,
            shapes=[[4, 2], [3], [1]],
        ),
        "shape": NCCLUpdateInfo(
            names=["a.weight", "b.weight"], dtype_names=["float32"] * 2, shapes=[[2, 4], [3]]
        ),
        "floating": NCCLUpdateInfo(
            names=["a.weight", "b.weight"], dtype_names=["int32", "float32"], shapes=[[4, 2], [3]]
        ),
        "same length": NCCLUpdateInfo(
            names=["a.weight", "b.weight"], dtype_names=["float32"], shapes=[[4, 2], [3]]
        ),
        "twice": NCCLUpdateInfo(
            names=["a.weight", "a.weight"], dtype_names=["float32"] * 2, shapes=[[4, 2]] * 2
        ),
    }
    for word, info in cases.items():
        problem = vet_update_info(info, SPECS, set(SPECS))
        assert problem and word in problem, (word, problem)


def _specs() -> dict[str, TensorSpec]:
    return {"a": TensorSpec((2, 3), "F32"), "b": TensorSpec((4,), "F32")}


def test_front_vets_headers_without_data_and_values_one_tensor_at_a_time(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4)}, str(good))
    assert sorted(vet_weight_headers([good], _specs())) == ["a", "b"]
    assert sorted(vet_weight_files_streaming([good], _specs())) == ["a", "b"]

    nan = tmp_path / "nan.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, str(nan))
    assert sorted(vet_weight_headers([nan], _specs())) == ["a", "b"]  # headers are fine
    with pytest.raises(WeightsRejected, match="'b': holds NaN"):
        vet_weight_files_streaming([nan], _specs())

    shape = tmp_path / "shape.safetensors"
    save_file({"a": torch.zeros(3, 2)}, str(shape))
    with pytest.raises(WeightsRejected, match="shape"):
        vet_weight_headers([shape], _specs())
    with pytest.raises(WeightsRejected, match="present in both"):
        vet_weight_headers([good, good], _specs())
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-8])
    with pytest.raises(WeightsRejected, match="truncated"):
        vet_weight_headers([cut], _specs())
