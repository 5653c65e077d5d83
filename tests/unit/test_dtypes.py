"""The one dtype table both sides read agrees with torch and with safetensors' own files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from trainer_client.contract import dtypes


@pytest.mark.parametrize("entry", dtypes.DTYPES, ids=lambda d: d.name)
def test_each_dtype_is_torchs_and_safetensors_own(entry: dtypes.DType) -> None:
    dtype = dtypes.torch_dtype(entry.name)
    tensor = torch.zeros(3, dtype=dtype)
    assert tensor.element_size() == entry.itemsize
    assert tensor.is_floating_point() == entry.floating
    data = save({"t": tensor})
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    assert header["t"]["dtype"] == entry.safetensors == dtypes.safetensors_code(dtype)
    assert dtypes.BY_SAFETENSORS[entry.safetensors] is entry


def test_serving_dtypes_are_floating_and_unknown_names_are_refused() -> None:
    assert set(dtypes.SERVING_DTYPES) <= dtypes.FLOAT_NAMES
    with pytest.raises(ValueError, match="no safetensors name"):
        dtypes.safetensors_code(torch.complex64)
    with pytest.raises(ValueError, match="unknown dtype"):
        dtypes.torch_dtype("float128")
