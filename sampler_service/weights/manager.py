"""Every way new weights reach the engine, behind one component the service calls.

An upload (`PUT /v1/weights`), a path (`POST /v1/weights/load`) and an NCCL round
(`/v1/weights/nccl/*`) take the same steps: vet before anything is loaded (a refusal is a
4xx while the old weights keep serving), check that the version is above the served one,
pause new requests, install, count it, and tell the service (which logs the event and
applies what depends on the version). File weights are persisted as the restart weights
(the `weights` item of the store; an upload kept under the state dir, or in the shared
`--weights-dir`) and restored before /ready. NCCL weights exist only in the engine.

The manager knows its engine (as `WeightTarget`, the part of an engine it drives), the
store, the metrics and three callables the service hands it (the pause, the engine's
failure, what follows an install): it knows nothing of the service or of the engines'
package, so it can be built and tested alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, TypeVar

from sampler_service.errors import NotSupported, ServiceError
from sampler_service.metrics import Metrics
from sampler_service.store import AsyncStore
from sampler_service.weights.nccl import NCCLUpdateRequest, vet_update_info
from sampler_service.weights.types import (
    NCCLDescription,
    NCCLGroupStale,
    NCCLUnavailable,
    WeightsNotServed,
    WeightsRejected,
    WeightTarget,
)
from trainer_client.contract.protocol import WeightsResponse

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How a refusal names an uploaded weight file (the server's spool path means nothing to
#: the user, who sent the bytes).
UPLOAD_NAME = "the uploaded file"
#: The store item naming the weights to serve again after a restart.
STORE_KEY = "weights"


@dataclass(frozen=True)
class WeightPlaces:
    """Where weight files live: the state dir (uploads kept for a restart) and the shared
    directory every engine replica reads (`--weights-dir`), if there is one."""

    state_dir: Path
    weights_dir: Path | None = None


#: What the service does once new weights serve: (version, transport, seconds since the
#: request arrived, seconds new requests were paused).
Installed = Callable[[int, str, float, float], Awaitable[None]]


@dataclass(eq=False)
class WeightsManager:
    """Vetting, the pause, the version check, install, persist and restore (see above).

    `pause` stops new requests for the length of its block, `engine_error` says why the
    engine cannot take weights (None: it can), `installed` is what follows an install."""

    backend: WeightTarget
    places: WeightPlaces
    store: AsyncStore
    metrics: Metrics
    _: KW_ONLY
    pause: Callable[[], AbstractAsyncContextManager[None]]
    engine_error: Callable[[], str | None]
    installed: Installed

    # -- checks -----------------------------------------------------------------------
    def size_limit(self) -> int:
        """Twice the model's weight bytes: room for a full checkpoint in a wider dtype, which
        is cast down, while an upload many times the model's size is refused unread."""
        from sampler_service.weights.vetting import spec_bytes

        return 2 * spec_bytes(self.backend.weight_specs())

    def check_engine(self) -> None:
        """503 for weight calls while the engine is dead: there is nothing to load into."""
        if error := self.engine_error():
            raise ServiceError(
                503, "engine_failed", f"the engine failed and cannot take weights: {error}"
            )

    def check_version(self, version: int) -> None:
        self.check_engine()
        current = self.backend.policy_version
        if version <= current:
            self.metrics.weight_update_failures.labels("stale_version").inc()
            raise ServiceError(
                409,
                "stale_version",
                f"version {version} must be greater than the served {current}",
                "version",
            )

    @property
    def shared(self) -> bool:
        """Engine replicas read weight files themselves from a shared path (`--weights-dir`)."""
        return self.places.weights_dir is not None and self.backend.reads_weight_files

    def upload_dir(self) -> Path:
        """Where an upload is spooled: the shared weights dir, or the state dir."""
        if self.places.weights_dir is not None:
            return self.places.weights_dir
        return self.places.state_dir / "weights"

    # -- files ------------------------------------------------------------------------
    async def _install(
        self,
        files: list[Path],
        version: int,
        transport: str,
        *,
        vetted: bool = False,
        shown_as: str | None = None,
    ) -> WeightsResponse:
        """Vet weight files and have the engine serve them as `version`.

        In the shared mode (`--weights-dir`) the replicas read the files themselves: the
        front checks the headers (and, for an upload it wrote, every tensor's values:
        `vetted`) and sends only the paths; each replica vets the tensors again. A refusal
        names the files as `shown_as` when they are ours (an upload spooled to disk), not
        the user's.
        """

        def refused(exc: WeightsRejected) -> ServiceError:
            self.metrics.weight_update_failures.labels("rejected").inc()
            message = str(exc)
            for file in files if shown_as else ():
                message = message.replace(str(file), str(shown_as))
            return ServiceError(422, "weights_rejected", message)

        from sampler_service.weights.vetting import (
            vet_weight_files,
            vet_weight_files_streaming,
            vet_weight_headers,
        )

        specs = self.backend.weight_specs()
        loop = asyncio.get_running_loop()
        received = time.monotonic()
        shared = self.shared
        try:
            if shared:
                vet = vet_weight_files_streaming if vetted else vet_weight_headers
                names = await loop.run_in_executor(None, vet, files, specs)
            else:
                tensors = await loop.run_in_executor(None, vet_weight_files, files, specs)
                names = list(tensors)
        except WeightsRejected as exc:
            raise refused(exc) from exc
        started = time.monotonic()
        async with self.pause():
            self.check_version(version)
            try:
                if shared:
                    await self.backend.load_weight_files([str(f) for f in files], version, names)
                else:
                    await self.backend.load_weights(tensors, version)
            except WeightsRejected as exc:
                raise refused(exc) from exc
            except WeightsNotServed as exc:
                self.metrics.weight_update_failures.labels("error").inc()
                raise ServiceError(503, "weights_not_served", str(exc)) from exc
            except Exception as exc:
                self.metrics.weight_update_failures.labels("error").inc()
                if self.engine_error() is None:
                    raise
                raise ServiceError(
                    503, "engine_failed", f"the engine failed while loading weights: {exc}"
                ) from exc
        elapsed = time.monotonic() - started
        log.info("serving weights v%d (%d tensors, %.3fs paused)", version, len(names), elapsed)
        await self._served(version, transport, time.monotonic() - received, elapsed)
        return WeightsResponse(policy_version=version, tensors=len(names), load_s=elapsed)

    async def _served(self, version: int, transport: str, seconds: float, paused_s: float) -> None:
        self.metrics.weight_updates.inc()
        self.metrics.weight_update_seconds.observe(paused_s)
        await self.installed(version, transport, seconds, paused_s)

    async def put(self, upload: Path, version: int) -> WeightsResponse:
        """Install an uploaded safetensors file, then keep it as the restart weights."""
        if self.shared:
            return await self._put_shared(upload, version)
        result = await self._install([upload], version, "upload", shown_as=UPLOAD_NAME)
        keep = self.places.state_dir / "weights" / "current.safetensors"
        keep.parent.mkdir(parents=True, exist_ok=True)
        os.replace(upload, keep)
        await self._persist({"files": [str(keep)], "version": version})
        return result

    async def _put_shared(self, upload: Path, version: int) -> WeightsResponse:
        """`--weights-dir`: the upload (spooled in the dir) is vetted, renamed into place
        atomically, and read by every replica from there; it stays as the committed
        weights (restarted replicas load it) until a newer upload replaces it."""
        assert self.places.weights_dir is not None
        with upload.open("rb") as fh:  # on shared storage: durable before any replica reads
            os.fsync(fh.fileno())
        name = f"weights-v{version}-{uuid.uuid4().hex[:8]}.safetensors"
        final = self.places.weights_dir / name
        os.replace(upload, final)
        try:
            result = await self._install(
                [final], version, "upload", vetted=True, shown_as=UPLOAD_NAME
            )
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        saved = await self._saved()
        await self._persist({"files": [str(final)], "version": version, "uploaded": True})
        self._drop_replaced_upload(saved, [final])
        return result

    async def load(self, path: str, version: int) -> WeightsResponse:
        """Install the weights at a path the server reads (a file or a checkpoint dir)."""
        from sampler_service.weights.vetting import weight_files

        self.check_version(version)
        try:
            files = weight_files(Path(path))
        except WeightsRejected as exc:
            self.metrics.weight_update_failures.labels("rejected").inc()
            raise ServiceError(422, "weights_rejected", str(exc), "path") from exc
        saved = await self._saved()
        result = await self._install(files, version, "path")
        await self._persist({"files": [str(f) for f in files], "version": version})
        self._drop_replaced_upload(saved, files)
        return result

    async def _saved(self) -> dict[str, Any] | None:
        saved: dict[str, Any] | None = await self.store.call(self.store.sync.get, STORE_KEY)
        return saved

    async def _persist(self, record: dict[str, Any]) -> None:
        await self.store.call(self.store.sync.put, {STORE_KEY: record})

    @staticmethod
    def _drop_replaced_upload(saved: dict[str, Any] | None, kept: list[Path]) -> None:
        """Delete the shared-dir upload (`--weights-dir`) newer weights replaced."""
        if saved and saved.get("uploaded"):
            for old in saved["files"]:
                if Path(old) not in kept:
                    Path(old).unlink(missing_ok=True)

    async def restore(self) -> None:
        """Serve the last accepted weights again after a restart, before /ready."""
        from sampler_service.weights.vetting import vet_weight_files, vet_weight_headers

        saved = await self._saved()
        if not saved:
            return
        files = [Path(f) for f in saved["files"]]
        if not all(f.exists() for f in files):
            log.error(
                "weights v%s to restore are gone (%s); serving the base model",
                saved["version"],
                files,
            )
            return
        loop = asyncio.get_running_loop()
        specs = self.backend.weight_specs()
        if self.shared:  # each replica reads them from the shared path again
            names = await loop.run_in_executor(None, vet_weight_headers, files, specs)
            await self.backend.load_weight_files(
                [str(f) for f in files], int(saved["version"]), names
            )
            log.info("restored weights v%s (replicas read %s)", saved["version"], files)
            return
        tensors = await loop.run_in_executor(None, vet_weight_files, files, specs)
        await self.backend.load_weights(tensors, int(saved["version"]))
        log.info("restored weights v%s", saved["version"])

    # -- NCCL -------------------------------------------------------------------------
    async def _engine_call(self, call: Coroutine[Any, Any, _T]) -> _T:
        """An engine's weight call, its typed refusals as the 409s the trainer reads."""
        try:
            return await call
        except NCCLUnavailable as exc:
            raise ServiceError(409, "nccl_unavailable", str(exc)) from exc
        except NCCLGroupStale as exc:
            raise ServiceError(409, "nccl_group_stale", str(exc)) from exc
        except NotSupported as exc:
            raise ServiceError(409, "not_supported", str(exc)) from exc

    async def nccl_describe(self) -> NCCLDescription:
        return await self._engine_call(self.backend.nccl_describe())

    async def nccl_init(self, init_info: dict[str, Any]) -> int:
        """Form the trainer's group; returns the inference ranks in it."""
        try:
            await self._engine_call(self.backend.nccl_init(init_info))
            return (await self.nccl_describe()).inference_ranks
        except (ValueError, TypeError) as exc:
            raise ServiceError(422, "invalid_init_info", _cause(exc), "init_info") from exc
        except RuntimeError as exc:
            raise ServiceError(409, "nccl_unavailable", _cause(exc)) from exc

    async def nccl_update(self, req: NCCLUpdateRequest) -> WeightsResponse:
        """Vet a round's metadata (a refusal once the trainer broadcasts would block it in
        NCCL), pause, receive it, serve it as `req.version`."""
        described = await self.nccl_describe()
        if described.stale is not None:
            # a stale group is refused before the pause and any transfer (and checked
            # again, under the pool's weights lock, before the replicas receive)
            raise ServiceError(409, "nccl_group_stale", described.stale)
        problem = vet_update_info(req.update_info, described.specs, described.required)
        if problem is not None:
            raise ServiceError(422, "weights_rejected", problem, "update_info")
        self.check_version(req.version)
        started = time.monotonic()
        async with self.pause():
            self.check_version(req.version)
            try:
                await self._engine_call(
                    self.backend.nccl_update(req.update_info.model_dump(), req.version)
                )
            except RuntimeError as exc:
                # the engine reloaded whole weights; the message says which version it serves
                raise ServiceError(409, "nccl_update_failed", _cause(exc), "update_info") from exc
        elapsed = time.monotonic() - started
        await self._served(req.version, "nccl", elapsed, elapsed)
        return WeightsResponse(
            policy_version=req.version, tensors=len(req.update_info.names), load_s=elapsed
        )

    async def nccl_shutdown(self) -> None:
        await self._engine_call(self.backend.nccl_shutdown())


def _cause(exc: BaseException) -> str:
    """The message of an error raised in a replica actor, without Ray's traceback."""
    return str(getattr(exc, "cause", None) or exc)
