"""Start-up settings of `adaptive-rollout serve` (CLI flags; fixed for the run)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from sampler_service.backends.http.discovery import ServiceName
from sampler_service.config.base import StrictModel
from sampler_service.config.knobs import JudgeName
from trainer_client.contract.dtypes import ServingDType


class ReplicaSettings(StrictModel):
    """Engine replicas (Ray actors) or engine servers (`--backend http`): how many, where,
    and how the pool routes waves to them and watches them. The pools take it as it is;
    nested in `ServeSettings` as `replica`, its flags are `--replica-<field>` but for
    the few named otherwise (`--replicas`, `--ray-address`, `--route`,
    `--replicas-on-exit`)."""

    count: int = Field(
        1,
        ge=1,
        description="engine replicas, each a Ray actor (a local Ray unless --ray-address); 1 "
        "keeps the engine beside the server and never imports Ray",
        json_schema_extra={"cli_flag": "replicas"},
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to run the replicas on (auto, or host:port); replicas outlive "
        "the sampler there, so a restarted sampler re-attaches to them",
        json_schema_extra={"cli_flag": "ray-address"},
    )
    gpus: float = Field(0.0, ge=0.0, description="GPUs per replica")
    cpus: float = Field(1.0, ge=0.0, description="CPUs per replica")
    max_restarts: int = Field(
        3, ge=0, description="restarts of a failed replica before it is given up"
    )
    max_inflight: int | None = Field(
        None,
        ge=1,
        description="samples in flight per replica or engine server (none: 384, 1.5 x vLLM's "
        "256 sequences)",
    )
    route: Literal["sticky", "least-loaded"] = Field(
        "sticky",
        description="sticky: a prompt's next wave goes to its last replica (prefix cached) "
        "unless that one is overloaded; least-loaded: always the replica with the fewest samples",
        json_schema_extra={"cli_flag": "route"},
    )
    probe_s: float = Field(
        5.0, gt=0.0, description="seconds between replica (or engine server) health probes"
    )
    probe_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="a replica that does not answer a probe this long is killed and restarted",
    )
    wait_s: float = Field(
        300.0,
        gt=0.0,
        description="how long a wave waits for a routable replica before it counts as failed",
    )
    compare_checksums: bool = Field(
        False,
        description="with --backend http: after every weight load, compare the servers' "
        "/weight_checker checksums with each other (vLLM checksums its fused runtime tensors, "
        "so servers are compared with each other, not with the trainer's tensors); a server "
        "outside the majority is taken out of routing and reloaded",
        json_schema_extra={"cli_flag": "engine-compare-checksums"},
    )
    on_exit: Literal["keep", "kill"] = Field(
        "kill",
        description="on a clean exit, kill the replicas or keep them warm for the next sampler",
        json_schema_extra={"cli_flag": "replicas-on-exit"},
    )
    orphan_s: float = Field(
        600.0,
        gt=0.0,
        description="a replica that hears from no sampler (no call, no probe) this long exits "
        "for good, freeing its GPUs; probes keep it alive, so a restarted sampler must "
        "re-attach within this window (at least 2 x --replica-probe-s)",
    )

    @model_validator(mode="after")
    def _orphan_window_spans_probes(self) -> ReplicaSettings:
        if self.orphan_s < 2 * self.probe_s:
            raise ValueError(
                f"replica_orphan_s ({self.orphan_s:g}) must be at least twice "
                f"replica_probe_s ({self.probe_s:g}): probes keep replicas alive"
            )
        return self


class InProcess(StrictModel):
    """One engine in this process or a child of it (a fleet of one)."""

    kind: Literal["in_process"] = "in_process"
    engine: Literal["hf", "vllm"]


class RayReplicas(StrictModel):
    """Engine replicas as Ray actors; `weights_dir` (shared storage) lets each read weight
    files itself instead of receiving tensors through Ray's object store."""

    kind: Literal["ray"] = "ray"
    engine: Literal["hf", "vllm"]
    replica: ReplicaSettings
    weights_dir: Path | None = None


class HttpServers(StrictModel):
    """`vllm serve` (or SGLang) servers the user runs, each driven over its own HTTP API,
    reloading weights from `weights_dir`, a directory every server can read."""

    kind: Literal["http"] = "http"
    urls: tuple[str, ...] = ()
    services: tuple[str, ...] = ()
    resolve_s: float
    dialect: Literal["vllm", "vllm-generate", "sglang"]
    replica: ReplicaSettings
    weights_dir: Path


#: The engines' transport: one of the three, told apart by `kind`.
EngineTransport = Annotated[InProcess | RayReplicas | HttpServers, Field(discriminator="kind")]


class ServeSettings(StrictModel):
    """Start-up settings of `adaptive-rollout serve` (not changeable at runtime).

    The command line is generated from these fields (one flag each, this description as
    its help, the default shown), so a new start-up option is one new field here, and a
    line in `CLI_SECTIONS` unless it belongs to the core.
    """

    #: `serve --help`'s sections: each title's fields (a replica field as `replica.x`);
    #: a field no section names is in the first.
    CLI_SECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "core": (),
        "engine": (
            "backend",
            "hf_engine",
            "torch_threads",
            "device",
            "dtype",
            "vllm",
            "weights_dir",
        ),
        "episodes": ("env", "harness", "session_tools"),
        "judges": ("judge_url", "judge_api_key"),
        "replicas and servers (Ray or HTTP fleet)": (
            "replica.max_inflight",
            "replica.route",
            "replica.probe_s",
            "replica.probe_timeout_s",
            "replica.wait_s",
        ),
        "Ray replicas": (
            "replica.count",
            "replica.ray_address",
            "replica.gpus",
            "replica.cpus",
            "replica.max_restarts",
            "replica.on_exit",
            "replica.orphan_s",
        ),
        "HTTP fleet (--backend http)": (
            "engine_url",
            "engine_service",
            "engine_resolve_s",
            "engine_dialect",
            "replica.compare_checksums",
        ),
    }

    model: Path = Field(description="Hugging Face model directory (weights + tokenizer)")
    data: list[Path] = Field(
        description="prompt file (.jsonl or .parquet); repeat for several domains "
        "(domain = file stem unless a row says)"
    )
    verifier: str = Field(
        "exact",
        description="default verifier for rows without one: exact | math | "
        "python:module:function (python: specs import with the working directory on "
        "sys.path, as under python -m) | judge:NAME (a model over HTTP: --judge-url)",
    )
    judge_url: dict[JudgeName, str] = Field(
        default_factory=dict,
        description="NAME=URL: the judge NAME (a verifier judge:NAME, its knobs the live "
        "config's judges.NAME) is the server at URL, `vllm serve` or any OpenAI-compatible "
        "server, given as its base (http://host:port, no /v1); repeatable",
        json_schema_extra={"cli_flag": "judge-url"},
    )
    judge_api_key: str | None = Field(
        default_factory=lambda: os.environ.get("ADAPTIVE_ROLLOUT_JUDGE_API_KEY") or None,
        description="sent to every judge as 'Authorization: Bearer KEY' (vllm serve "
        "--api-key; default: env ADAPTIVE_ROLLOUT_JUDGE_API_KEY)",
        repr=False,
    )

    @field_validator("judge_url")
    @classmethod
    def _judge_urls(cls, urls: dict[str, str]) -> dict[str, str]:
        for name, url in urls.items():
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"judge_url {name}={url!r} must be http(s)://HOST[:PORT]")
            if parsed.query or parsed.fragment:
                raise ValueError(f"judge_url {name}={url!r} must be a base URL, no query")
        return urls

    env: str | None = Field(
        None,
        description="default environment for rows without one (their prompts are answered "
        "by multi-turn episodes): a built-in name | python:module:factory (imported from the "
        "working directory too); unset: rows without an env get single answers",
    )
    harness: str | None = Field(
        None,
        description="the agent harness the sampler starts for each session (rows whose "
        "environment is 'session'): python:module:function (called with a HarnessSession) "
        "| a command line (run without a shell; OPENAI_BASE_URL, OPENAI_API_KEY, "
        "ADAPTIVE_ROLLOUT_SESSION_URL and ADAPTIVE_ROLLOUT_ROW in its environment); unset: "
        "harnesses elsewhere claim sessions (POST /v1/sessions/claim). Start-up only: a "
        "spec runs code",
    )
    session_tools: Literal["auto", "hermes", "calculator", "none"] = Field(
        "auto",
        description="how a session's model turns are read into OpenAI tool_calls: hermes "
        "(Qwen/Hermes <tool_call> JSON), calculator (the toy's [expr]), none; auto: hermes "
        "when the chat template has <tool_call>, calculator for a model without a template, "
        "else none",
    )
    filter_overlong_prompts: bool = Field(
        False,
        description="drop prompts with no room for one answer token in the model's context "
        "(counted in the start-up log and /v1/stats `prompts`) instead of refusing to start",
    )
    backend: Literal["hf", "vllm", "http"] = Field(
        "hf",
        description="inference engine: hf, vllm (in this process), or http (vllm serve servers "
        "you run, given by --engine-url)",
    )
    engine_url: list[str] = Field(
        default_factory=list,
        description="with --backend http: base URL of one vllm serve server (its own "
        "address, not a load balancer: each is paused and reloaded by itself); repeatable",
    )
    engine_service: list[str] = Field(
        default_factory=list,
        description="with --backend http: NAME:PORT of a Kubernetes headless Service whose DNS "
        "name lists the servers (one per pod IP); re-resolved every --engine-resolve-s, new "
        "pods are synced before they are routed to; repeatable",
    )
    engine_resolve_s: float = Field(
        10.0, gt=0, description="how often --engine-service names are re-resolved (seconds)"
    )
    engine_dialect: Literal["vllm", "vllm-generate", "sglang"] = Field(
        "vllm",
        description="with --backend http: the servers' API, vllm (vllm serve, tested live), "
        "vllm-generate (vllm serve --enable-scale-out: waves through /inference/v1/generate, "
        "each answer's weight_versions spans checked against the wave's label; tested live) "
        "or sglang (SGLang's native /generate and weight endpoints, tested against its "
        "documented shapes)",
    )

    hf_engine: Literal["process", "thread"] = Field(
        "process",
        description="run the hf backend in its own process (the service's work then never "
        "waits on the engine's GIL) or on a thread of the server process",
    )
    torch_threads: int = Field(
        1,
        ge=0,
        description="CPU threads for torch in the engine (1 suits small models: more threads "
        "spin against the verifier and HTTP work on few cores; 0 leaves torch's default)",
    )
    device: str = Field("cpu", description="torch device for the hf backend")
    dtype: ServingDType = Field("float32", description="engine dtype of the hf backend")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0 picks a free one)")
    state_dir: Path = Field(
        Path("sampler_state"),
        description="directory for the SQLite store (groups, config, mixer state) and "
        "accepted weights; one sampler at a time, and it records the model, data and "
        "backend it was created for",
    )
    resume: bool = Field(
        False,
        description="continue the run stored in --state-dir as it is (its weights, groups "
        "and config) although the model, data or backend differ from those it recorded",
    )
    fresh: bool = Field(
        False,
        description="move an existing --state-dir aside (renamed to <dir>.<time>, never "
        "deleted) and start a new run in it",
    )

    @model_validator(mode="after")
    def _resume_or_fresh(self) -> ServeSettings:
        if self.resume and self.fresh:
            raise ValueError("give --resume (continue the stored run) or --fresh (a new one)")
        return self

    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("ADAPTIVE_ROLLOUT_API_KEY") or None,
        description="require 'Authorization: Bearer KEY' on /v1/* (default: env "
        "ADAPTIVE_ROLLOUT_API_KEY)",
        repr=False,
    )
    heartbeat_s: float = Field(5.0, gt=0.0, description="stream heartbeat interval")
    verifier_timeout_s: float = Field(10.0, gt=0.0, description="time limit per verification")
    verifier_retries: int = Field(
        1,
        ge=0,
        le=10,
        description="times a failed verification (an exception, a value not in [0, 1], a "
        "crash or a time-out) is asked again before its prompt is dropped as verifier_error; "
        "a failure is never a negative (judges have their own: judges.NAME.retries)",
    )
    verifier_workers: int | None = Field(
        None,
        ge=1,
        description="verifier processes (default: one per core this process may run on, "
        "less one for its event loop, at least 2)",
    )
    max_request_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="size limit of a JSON request body (acks: 8x; weight uploads: twice the "
        "model's weight bytes)",
    )
    store_checkpoint_s: float = Field(
        0.5,
        ge=0.0,
        description="seconds between SQLite WAL checkpoints, run off the write path; 0 = "
        "SQLite's default (inside commits)",
    )
    seed: int = Field(0, description="seed for data order and sampling")
    vllm: dict[str, Any] = Field(
        default_factory=dict,
        description="engine argument passed to vLLM, e.g. tensor_parallel_size=2 (value "
        "parsed as JSON if it can be); repeatable",
        json_schema_extra={"cli_flag": "vllm-arg"},
    )
    max_lease_wait_s: float = Field(
        300.0,
        gt=0.0,
        le=300.0,
        description="a lease call waits at most this long for groups, whatever its wait_s",
    )
    shutdown_timeout_s: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="on SIGTERM, streams end at once and the process exits within this bound",
    )
    # Scale-out: engine replicas as Ray actors, or engine servers over HTTP. The defaults
    # (one replica, no address) keep the engine in or beside this process and never
    # import Ray.
    replica: ReplicaSettings = Field(
        default_factory=ReplicaSettings,
        description="engine replicas and engine servers",
        json_schema_extra={"cli_prefix": "replica-"},
    )
    weights_dir: Path | None = Field(
        None,
        description="with replicas or --backend http: a directory every replica or server can "
        "read (shared storage); an "
        "uploaded weight file is written there atomically and each replica reads weight "
        "files itself (uploads and POST /v1/weights/load paths) instead of receiving the "
        "tensors through Ray's object store",
    )

    _transport: EngineTransport | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_transport(self) -> ServeSettings:
        self._transport = self._chosen_transport()
        return self

    @property
    def transport(self) -> EngineTransport:
        """The engines' transport, which three flag families imply (`--backend`, the
        replica flags, `--weights-dir`): one validated choice, so nothing downstream
        reads those flags to work it out again."""
        assert self._transport is not None  # set by validation
        return self._transport

    def _chosen_transport(self) -> EngineTransport:
        ray = self.replica.count > 1 or self.replica.ray_address is not None
        if self.backend == "http":
            self._check_servers(ray)
            assert self.weights_dir is not None  # checked above
            return HttpServers(
                urls=tuple(self.engine_url),
                services=tuple(self.engine_service),
                resolve_s=self.engine_resolve_s,
                dialect=self.engine_dialect,
                replica=self.replica,
                weights_dir=self.weights_dir,
            )
        http_only = {
            "engine_url": bool(self.engine_url or self.engine_service),
            "engine_dialect": self.engine_dialect != "vllm",
            "engine_compare_checksums": self.replica.compare_checksums,
        }
        if given := [name for name, set_ in http_only.items() if set_]:
            raise ValueError(f"{', '.join(given)}: for --backend http only")
        if ray:
            return RayReplicas(
                engine=self.backend, replica=self.replica, weights_dir=self.weights_dir
            )
        if self.weights_dir is not None:
            raise ValueError(
                "weights_dir is for engine replicas (--replicas > 1 or --ray-address) and "
                "--backend http; a single engine loads uploads from the state dir"
            )
        return InProcess(engine=self.backend)

    def _check_servers(self, ray: bool) -> None:
        if self.replica.compare_checksums and self.engine_dialect == "sglang":
            raise ValueError(
                "engine_compare_checksums needs vLLM servers (SGLang has no /weight_checker)"
            )
        if not (self.engine_url or self.engine_service):
            raise ValueError(
                "--backend http needs at least one --engine-url (one per server) or "
                "--engine-service (a headless Service)"
            )
        for name in self.engine_service:
            ServiceName.parse(name)
        seen: set[str] = set()
        for url in self.engine_url:
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
                raise ValueError(
                    f"engine_url {url!r} must be http(s)://HOST:PORT (a server's own address)"
                )
            if parsed.path not in ("", "/") or parsed.query:
                raise ValueError(f"engine_url {url!r} must be the server's base URL, no path")
            base = url.rstrip("/")
            if base in seen:
                raise ValueError(f"engine_url {url!r} is given twice")
            seen.add(base)
        if self.weights_dir is None:
            raise ValueError(
                "--backend http needs --weights-dir: a directory every server can read, where "
                "the sampler puts the weights each server reloads"
            )
        if ray:
            raise ValueError(
                "--backend http routes to its servers itself: no --replicas or --ray-address"
            )
        if self.vllm:
            raise ValueError("--vllm-arg is for --backend vllm; give engine flags to vllm serve")

    @property
    def verifier_pool_size(self) -> int:
        """`verifier_workers`, or what the cores this process may run on allow: verifying
        (math-verify, ~1 ms of CPU per answer) scales with the workers until they take
        every core the event loop does not need. At least 2, so one verifier hanging
        until its time limit never stops all verification."""
        if self.verifier_workers is not None:
            return self.verifier_workers
        return max(2, len(os.sched_getaffinity(0)) - 1)
