"""Vet a weight file against an engine's tensor specs before anything is loaded.

`PUT /v1/weights` and `POST /v1/weights/load` must refuse a bad file with a 4xx while the
engine keeps serving its current weights, so every check here runs on the safetensors
header alone, before a single tensor is copied into the model. It is engine-agnostic:
the hf and vLLM backends both describe their tensors as `TensorSpec`s and reuse it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from safetensors import SafetensorError

from sampler_service.weights.types import TensorSpec, WeightsRejected
from trainer_client.contract.dtypes import BY_SAFETENSORS, FLOAT_CODES, safetensors_code

# Same bound the safetensors library applies; stops a forged length from allocating GBs.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def tensor_spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(shape=tuple(tensor.shape), dtype=safetensors_code(tensor.dtype))


def check_tensor(
    name: str, shape: tuple[int, ...], dtype: str, specs: Mapping[str, TensorSpec]
) -> None:
    """Raise WeightsRejected naming `name` unless it fits the engine's tensor of that name."""
    spec = specs.get(name)
    if spec is None:
        raise WeightsRejected(f"tensor {name!r}: the model has no tensor of this name")
    if tuple(shape) != spec.shape:
        raise WeightsRejected(
            f"tensor {name!r}: shape {list(shape)} does not match the model's {list(spec.shape)}"
        )
    # Floating tensors are cast to the engine dtype on load, so any may stand in for
    # another (a F16 or BF16 upload for a F32 CPU model is normal). Others must match.
    if dtype != spec.dtype and not (dtype in FLOAT_CODES and spec.dtype in FLOAT_CODES):
        raise WeightsRejected(f"tensor {name!r}: dtype {dtype} cannot be loaded into {spec.dtype}")


class WeightSpecs(dict[str, TensorSpec]):
    """Accepted tensor names -> spec, knowing which names only re-spell another entry.

    A backend may accept one tensor under several names (state_dict key and checkpoint
    name, or both halves of a tied embedding); `aliases` lists the extra ones so that
    `spec_bytes` counts the model's size once.
    """

    def __init__(self, specs: Mapping[str, TensorSpec], aliases: Iterable[str] = ()) -> None:
        super().__init__(specs)
        self.aliases = frozenset(aliases)


def spec_bytes(specs: Mapping[str, TensorSpec]) -> int:
    """Bytes of the model's weights as described by `specs` (the upload size limit's base)."""
    aliases: frozenset[str] = getattr(specs, "aliases", frozenset())
    sizes = {code: entry.itemsize for code, entry in BY_SAFETENSORS.items()}
    return sum(
        math.prod(spec.shape) * sizes.get(spec.dtype, 4)
        for name, spec in specs.items()
        if name not in aliases
    )


def weight_files(path: Path) -> list[Path]:
    """The safetensors files behind a path: the file itself, or a checkpoint dir's shards."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsRejected(f"{path}: directory holds no *.safetensors files")
        return files
    if not path.is_file():
        raise WeightsRejected(f"{path}: no such file or directory")
    return [path]


def vet_weight_file(
    source: bytes | str | os.PathLike[str], specs: Mapping[str, TensorSpec]
) -> dict[str, torch.Tensor]:
    """Check a safetensors upload or path against `specs`, then read its tensors (on CPU).

    `source` is the uploaded bytes, a `.safetensors` file, or a Hugging Face checkpoint
    directory (every `*.safetensors` shard in it). Raises WeightsRejected, naming the
    tensor where there is one, for: not safetensors, a truncated file, a tensor name the
    model lacks, a wrong shape, a non-floating dtype mismatch, a non-finite value, or no
    tensors at all.
    A subset of the model's tensors is accepted (a partial update). Tensors keep their
    file dtype; the backend casts floating ones to its own dtype when loading.
    """
    if not isinstance(source, bytes | bytearray | memoryview):
        return vet_weight_files(weight_files(Path(source)), specs)
    data = bytes(source)
    _check_header(_parse_header(data[:8], data, len(data), "upload"), specs)
    return _nonempty(_load(lambda: safetensors.torch.load(data), "upload"))


def vet_weight_files(
    files: Sequence[Path], specs: Mapping[str, TensorSpec]
) -> dict[str, torch.Tensor]:
    """`vet_weight_file` for the shards of one checkpoint: every header is checked (and no
    tensor may appear twice) before any tensor data is read."""
    vet_weight_headers(files, specs)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(_load(partial(safetensors.torch.load_file, file), str(file)))
    return _nonempty(tensors)


def vet_weight_headers(files: Sequence[Path], specs: Mapping[str, TensorSpec]) -> list[str]:
    """The tensor names of a checkpoint's shards, after checking every header against
    `specs` (names, shapes, dtypes, byte ranges within the file, no tensor twice, at
    least one tensor); no tensor data is read."""
    seen: dict[str, Path] = {}
    for file in files:
        for name in _check_header(_read_header(file), specs):
            if name in seen:
                raise WeightsRejected(f"tensor {name!r}: present in both {seen[name]} and {file}")
            seen[name] = file
    if not seen:
        raise WeightsRejected("the weight file holds no tensors")
    return list(seen)


def vet_weight_files_streaming(files: Sequence[Path], specs: Mapping[str, TensorSpec]) -> list[str]:
    """`vet_weight_files` without keeping the tensors: headers first, then each tensor read
    alone and checked for NaN and infinities; returns the tensor names. For a front that
    only vets a file its engines will read themselves (`serve --weights-dir`)."""
    names = vet_weight_headers(files, specs)
    for file in files:
        try:
            with safetensors.safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    _nonempty({name: handle.get_tensor(name)})
        except WeightsRejected:
            raise
        except (SafetensorError, ValueError, OSError) as exc:
            raise WeightsRejected(f"{file}: invalid safetensors data ({exc})") from exc
    return names


def _nonempty(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, refused when there are none or one holds NaN or an infinity.

    Non-finite weights would load, then make every generation fail while the old
    weights, which still work, are gone.
    """
    if not tensors:
        raise WeightsRejected("the weight file holds no tensors")
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightsRejected(f"tensor {name!r}: holds NaN or infinite values")
    return tensors


def _read_header(path: Path) -> dict[str, dict[str, Any]]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
            header = f.read(min(length, _MAX_HEADER_BYTES))
    except OSError as exc:
        raise WeightsRejected(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return _parse_header(prefix, prefix + header, size, str(path))


def _parse_header(
    prefix: bytes, head: bytes, total_size: int, label: str
) -> dict[str, dict[str, Any]]:
    """Validate the 8-byte length, the JSON header and every tensor's byte range."""
    if total_size < 8:
        raise WeightsRejected(f"{label}: not a safetensors file (shorter than 8 bytes)")
    length = struct.unpack("<Q", prefix[:8])[0]
    if length > _MAX_HEADER_BYTES or 8 + length > total_size:
        raise WeightsRejected(f"{label}: not a safetensors file, or truncated (bad header length)")
    try:
        header = json.loads(head[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsRejected(f"{label}: not a safetensors file (header is not JSON)") from exc
    if not isinstance(header, dict):
        raise WeightsRejected(f"{label}: not a safetensors file (header is not a JSON object)")
    data_size = total_size - 8 - length
    entries: dict[str, dict[str, Any]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            valid = (
                isinstance(dtype, str)
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int)
                and isinstance(end, int)
                and 0 <= begin <= end
            )
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise WeightsRejected(f"tensor {name!r}: malformed safetensors header entry")
        if end > data_size:
            raise WeightsRejected(
                f"tensor {name!r}: data runs past the end of {label} (truncated?)"
            )
        entries[name] = entry
    return entries


def _check_header(
    entries: Mapping[str, Mapping[str, Any]], specs: Mapping[str, TensorSpec]
) -> list[str]:
    for name, entry in entries.items():
        check_tensor(name, tuple(entry["shape"]), entry["dtype"], specs)
    return list(entries)


def _load(read: Callable[[], dict[str, torch.Tensor]], label: str) -> dict[str, torch.Tensor]:
    """Run a safetensors read; its own consistency errors become WeightsRejected."""
    try:
        return read()
    except (SafetensorError, ValueError, OSError) as exc:
        raise WeightsRejected(f"{label}: invalid safetensors data ({exc})") from exc
