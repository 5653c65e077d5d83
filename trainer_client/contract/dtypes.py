"""The tensor dtypes weights travel in: one table for the trainer and the sampler.

A dtype has three spellings on the way from a trainer's tensor to a served weight: torch's
name (`bfloat16`, also what vLLM's NCCL update names), the safetensors header's code
(`BF16`) and the byte size a shape implies. Both sides read them here, so an upload a
trainer writes and the vetting the sampler does cannot disagree about a dtype.

Floating dtypes stand in for one another (an engine casts a float upload to its own
dtype); other dtypes must match exactly. The serving dtypes are the ones an engine may
run in and a trainer may cast its upload to.

Names only: no torch here (a trainer node's core install has none); `torch_dtype` imports
it when asked.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One dtype's spellings: torch's name, the safetensors code and its size in bytes."""

    name: str
    safetensors: str
    itemsize: int
    floating: bool


DTYPES: tuple[DType, ...] = (
    DType("float64", "F64", 8, True),
    DType("float32", "F32", 4, True),
    DType("float16", "F16", 2, True),
    DType("bfloat16", "BF16", 2, True),
    DType("float8_e4m3fn", "F8_E4M3", 1, True),
    DType("float8_e5m2", "F8_E5M2", 1, True),
    DType("int64", "I64", 8, False),
    DType("int32", "I32", 4, False),
    DType("int16", "I16", 2, False),
    DType("int8", "I8", 1, False),
    DType("uint64", "U64", 8, False),
    DType("uint32", "U32", 4, False),
    DType("uint16", "U16", 2, False),
    DType("uint8", "U8", 1, False),
    DType("bool", "BOOL", 1, False),
)
BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in DTYPES}
#: torch names of the floating dtypes (an NCCL update may send only these).
FLOAT_NAMES: frozenset[str] = frozenset(d.name for d in DTYPES if d.floating)
#: safetensors codes of the floating dtypes (any may be loaded into any other).
FLOAT_CODES: frozenset[str] = frozenset(d.safetensors for d in DTYPES if d.floating)

#: The dtypes an engine serves in and a trainer casts its uploads to.
ServingDType = Literal["float32", "bfloat16", "float16"]
SERVING_DTYPES: tuple[ServingDType, ...] = typing.get_args(ServingDType)


def safetensors_code(dtype: object) -> str:
    """The safetensors code ("F32", "BF16", ...) of a torch dtype or a torch dtype name."""
    entry = BY_NAME.get(str(dtype).removeprefix("torch."))
    if entry is None:
        raise ValueError(f"no safetensors name for dtype {dtype}")
    return entry.safetensors


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in the table, e.g. a serving dtype (imports torch)."""
    import torch

    if name not in BY_NAME:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(BY_NAME)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype
