"""The weights package without an engine: the NCCL rank layout of a pool, an NCCL
update's vetting, and the front's header-only and streaming vetting of weight files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sampler_service.backends.base import TensorSpec, WeightsRejected
from sampler_service.weights import nccl
from sampler_service.weights.nccl import NCCLUpdateInfo, vet_update_info
from sampler_service.weights.vetting import vet_weight_files_streaming, vet_weight_headers

SPECS = {"a.weight": TensorSpec((4, 2), "F32"), "b.weight": TensorSpec((3,), "BF16")}


def test_replica_ranks_follow_the_trainer_in_replica_order() -> None:
    assert nccl.nccl_rank_offsets([1, 1]) == [1, 2]
    assert nccl.nccl_rank_offsets([2, 4, 1]) == [1, 3, 7]  # TP 2, TP 4, TP 1
    with pytest.raises(ValueError):
        nccl.nccl_rank_offsets([2, 0])


def test_each_replica_gets_its_offset_and_the_whole_world() -> None:
    # What vLLM's trainer engine sends for one engine: rank_offset 1, world = 1 + ranks.
    sent = {"master_address": "10.0.0.5", "master_port": 29600, "rank_offset": 1}
    infos = nccl.nccl_replica_init_infos({**sent, "world_size": 7}, [2, 4])
    assert [i["rank_offset"] for i in infos] == [1, 3]
    assert all(i["world_size"] == 7 and i["master_port"] == 29600 for i in infos)
    # Every rank 1..6 is held by exactly one replica worker.
    ranks = [i["rank_offset"] + w for i, n in zip(infos, [2, 4], strict=True) for w in range(n)]
    assert sorted(ranks) == list(range(1, 7))
    with pytest.raises(ValueError, match="world_size 3 does not match"):
        nccl.nccl_replica_init_infos({**sent, "world_size": 3}, [2, 4])
    with pytest.raises(ValueError, match="rank_offset must be 1"):
        nccl.nccl_replica_init_infos({**sent, "world_size": 7, "rank_offset": 2}, [2, 4])


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
