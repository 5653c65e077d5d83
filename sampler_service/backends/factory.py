"""The engine the settings ask for, built as a fleet: one engine in this process or a
child (a fleet of one), Ray replicas, or `vllm serve` servers driven over HTTP. Each kind
is imported only when chosen, so a default sampler never imports Ray or vLLM."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sampler_service.backends.base import Backend
from sampler_service.config import ServeSettings
from sampler_service.config.settings import HttpServers, InProcess, RayReplicas
from sampler_service.metrics import Metrics


def _instance_id(state_dir: Path) -> str:
    """This sampler's id, kept in its state dir: a restarted sampler finds its replicas."""
    path = state_dir / "instance_id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def _engine_factory(settings: ServeSettings, engine: str) -> Any:
    """A picklable recipe for one engine, built where it runs (a Ray actor)."""
    if engine == "vllm":
        from sampler_service.backends.vllm import VLLMBackend

        return functools.partial(VLLMBackend, settings.model, seed=settings.seed, **settings.vllm)
    from sampler_service.backends.hf import HFBackend

    return functools.partial(
        HFBackend, settings.model, device=settings.device, dtype=settings.dtype
    )


def _replica_fleet(
    settings: ServeSettings,
    transport: RayReplicas,
    metrics: Metrics,
    on_state_change: Callable[[dict[str, Any]], None] | None = None,
) -> Backend:
    """Engine replicas as Ray actors; the only place the service imports Ray."""
    # Ray's C++ core would print a stack dump on every SIGTERM ("*** SIGTERM received ...
    # PC: @ epoll_pwait"), which reads as a crash: the sampler handles SIGTERM itself, as
    # a clean shutdown. Ray reads this when it is imported (and a local Ray's processes
    # inherit it).
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        from sampler_service.backends.ray.transport import build_ray_fleet
    except ImportError as exc:
        raise RuntimeError(
            f"--replicas {transport.replica.count} / --ray-address need Ray: "
            "pip install 'adaptive-rollout[ray]'"
        ) from exc

    return build_ray_fleet(
        _engine_factory(settings, transport.engine),
        transport.replica,
        instance_id=_instance_id(settings.state_dir),
        torch_threads=settings.torch_threads,
        metrics=metrics,
        on_state_change=on_state_change,
    )


def _http_fleet(
    settings: ServeSettings,
    transport: HttpServers,
    tokenizer: Any,
    metrics: Metrics,
    on_state_change: Callable[[dict[str, Any]], None] | None = None,
) -> Backend:
    """`vllm serve` servers the user runs (`--engine-url`), driven over HTTP."""
    from sampler_service.backends.http.dialects import DIALECTS
    from sampler_service.backends.http.discovery import ServiceName
    from sampler_service.backends.http.transport import HTTPPoolSettings, build_http_fleet

    pool = HTTPPoolSettings(
        urls=transport.urls,
        instance_id=_instance_id(settings.state_dir),
        weights_dir=transport.weights_dir,
        replica=transport.replica,
        dialect=DIALECTS[transport.dialect],
        services=tuple(ServiceName.parse(name) for name in transport.services),
        resolve_s=transport.resolve_s,
    )
    return build_http_fleet(
        settings.model, pool, tokenizer=tokenizer, metrics=metrics, on_state_change=on_state_change
    )


def _engine(settings: ServeSettings, engine: str, tokenizer: Any) -> Backend:
    """The one engine of a fleet of one."""
    if engine == "vllm":
        from sampler_service.backends.vllm import VLLMBackend

        return VLLMBackend(settings.model, tokenizer=tokenizer, seed=settings.seed, **settings.vllm)
    from sampler_service.backends.hf import HFBackend

    if settings.hf_engine == "process":
        from sampler_service.backends.engine_process import EngineProcess

        # The child loads the tokenizer itself (from the model directory) for response texts.
        return EngineProcess(
            _engine_factory(settings, engine), torch_threads=settings.torch_threads
        )
    return HFBackend(
        settings.model, device=settings.device, dtype=settings.dtype, tokenizer=tokenizer
    )


def build_backend(
    settings: ServeSettings,
    tokenizer: Any,
    metrics: Metrics,
    on_member_change: Callable[[dict[str, Any]], None] | None = None,
) -> Backend:
    """The engine `settings` name; `on_member_change` hears a replica's or a server's
    state changes. One engine in the sampler's process keeps its metrics and events to
    itself: absent replica series mean one engine."""
    transport = settings.transport
    if isinstance(transport, RayReplicas):
        return _replica_fleet(settings, transport, metrics, on_member_change)
    if isinstance(transport, HttpServers):
        return _http_fleet(settings, transport, tokenizer, metrics, on_member_change)
    assert isinstance(transport, InProcess)
    from sampler_service.fleet.local import LocalFleet

    return LocalFleet(_engine(settings, transport.engine, tokenizer))
