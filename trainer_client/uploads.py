"""Weights as the body of `PUT /v1/weights`: what `push_weights` of either client sends.

A body is bytes in memory (a model's `state_dict()` encoded here, or safetensors bytes)
or a stream of chunks that is never built whole in memory (a `.safetensors` file read
from disk, or a `WeightStream` such as the verl integration's). Bytes can be sent again
after a lost reply; a stream cannot, so the clients do not retry one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Tensors that share storage (tied embeddings) once, under their first name: the
    sampler takes a subset of tensors as a partial update."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = []
    for name, t in named:
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out


def encode_weights(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """A safetensors file of a model's `state_dict()` (tensor names as the model has them),
    each tensor once (`unique_tensors`)."""
    from safetensors.torch import save

    unique = unique_tensors(state_dict.items())
    return save({name: t.detach().to("cpu").contiguous() for name, t in unique})


@dataclass(frozen=True)
class WeightStream:
    """A weights body made piece by piece (`length` bytes from `chunks()`): uploaded as it
    is produced, never built whole in memory."""

    length: int
    chunks: Callable[[], Iterator[bytes]]


#: The weights `push_weights` takes.
Weights = Mapping[str, Any] | str | Path | bytes | WeightStream


@dataclass(frozen=True)
class Upload:
    """One `PUT /v1/weights` body: `stream`'s chunks, or `data` in memory."""

    data: bytes = b""
    stream: WeightStream | None = None

    @property
    def repeatable(self) -> bool:
        """Whether the body can be sent again (a retry after a lost reply)."""
        return self.stream is None

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/octet-stream"}
        if self.stream is not None:
            headers["Content-Length"] = str(self.stream.length)
        return headers

    def content(self) -> bytes | Iterator[bytes]:
        """The body for a blocking client."""
        return self.data if self.stream is None else self.stream.chunks()

    def acontent(self) -> bytes | AsyncIterator[bytes]:
        """The body for an asyncio client: chunks are produced on a worker thread, so
        reading a file or casting tensors never blocks the event loop."""
        return self.data if self.stream is None else _in_thread(self.stream.chunks())


def upload(weights: Weights) -> Upload:
    """The body for `weights`: a state_dict (encoded here), safetensors bytes, a
    `.safetensors` file (or a directory holding exactly one), or a `WeightStream`."""
    if isinstance(weights, WeightStream):
        return Upload(stream=weights)
    if isinstance(weights, bytes | bytearray):
        return Upload(data=bytes(weights))
    if isinstance(weights, str | Path):
        path = Path(weights)
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if len(files) != 1:
                raise ValueError(
                    f"{path} holds {len(files)} .safetensors files; push one file, or use "
                    "load_weights() to load a sharded checkpoint from shared storage"
                )
            path = files[0]
        return Upload(stream=WeightStream(path.stat().st_size, partial(_file_chunks, path)))
    return Upload(data=encode_weights(weights))


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            yield chunk


async def _in_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    while (chunk := await loop.run_in_executor(None, next, chunks, None)) is not None:
        yield chunk
