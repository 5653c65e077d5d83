"""What the suites share: the real sampler as a subprocess, lease loops, weight files.

Imported by test modules (`from support import ...`; pytest puts `tests/` on the path
because `tests/conftest.py` sits in a directory without `__init__.py`) and used by the
fixtures in `tests/conftest.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson

from trainer_client.contract import wire
from trainer_client.contract.protocol import MSGPACK_MEDIA_TYPE, NDJSON_MEDIA_TYPE
from trainer_client.launch import SamplerProcess

HERE = Path(__file__).parent
#: Small answers and a small buffer: groups come fast and backpressure is reachable.
BASE_CONFIG: dict[str, Any] = {
    "max_tokens": 8,
    "max_active_prompts": 16,
    "max_buffered_groups": 64,
    # Tests take groups without training on them (nor pushing weights): nothing to bound.
    "max_staleness": None,
}


class Server(SamplerProcess):
    """`adaptive-rollout serve` on a loopback port, with an HTTP client factory."""

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 60.0, **kw})


def start_server(
    toy: Any,
    where: Path,
    config: dict[str, Any] | None = None,
    *,
    name: str = "state",
    extra: list[str] | None = None,
    data: list[Path] | None = None,
    model: Path | None = None,
    base: dict[str, Any] | None = None,
    engine: Literal["process", "thread"] = "thread",
) -> Server:
    """Start a sampler on the toy model with `config` over `base` (BASE_CONFIG).

    `engine` is the server's `--hf-engine`. Tests run the engine on a thread of the
    server unless the engine process is what they check (killing it, the shared
    servers that stand for the default set-up): spawning it imports torch and loads the
    model a second time, which more than doubles a cold start (measured 11 s vs 26-44 s
    on the loaded 2-core box). The engine process itself is tested in
    tests/service/test_engine_process.py and by the end-to-end training test.
    """
    # The misbehaving verifiers of tests/service/flaky_verifiers.py are imported by the server.
    env = {"PYTHONPATH": os.pathsep.join([str(HERE / "service"), os.environ.get("PYTHONPATH", "")])}
    server = Server(
        model or toy.model_dir,
        data or toy.data_files,
        where / name,
        {**(BASE_CONFIG if base is None else base), **(config or {})},
        where / f"{name}.log",
        heartbeat_s=0.5,
        extra=["--hf-engine", engine, *(extra or [])],
        env=env,
    )
    server.start()
    return server


def ops_cli(url: str, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    """`adaptive-rollout ARGS` (the ops commands) as a subprocess against the sampler at
    `url`, with only the URL and `key` from the ADAPTIVE_ROLLOUT_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_ROLLOUT_")}
    env["ADAPTIVE_ROLLOUT_URL"] = url
    if key is not None:
        env["ADAPTIVE_ROLLOUT_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "sampler_service", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def sample(
    tokens: list[int], logprobs: list[float] | None = None, reward: float = 1.0, **kw: Any
) -> dict[str, Any]:
    """An answer as it travels on the wire (a dict), `kw` adding or replacing fields."""
    return {
        "sample_id": uuid.uuid4().hex,
        "response_token_ids": tokens,
        "response_text": "".join(map(str, tokens)),
        "logprobs": logprobs if logprobs is not None else [-0.5] * len(tokens),
        "reward": reward,
        "finish_reason": "stop",
        "policy_version": kw.pop("policy_version", 0),
        **kw,
    }


def group(
    gid: str,
    samples: list[dict[str, Any]] | None = None,
    *,
    batch_id: str = "b0",
    batch_index: int = 0,
    batch_size: int = 1,
    prompt: list[int] | None = None,
    domain: str = "d",
    delivery_id: str | None = None,
    config_version: int = 0,
    **fields: Any,
) -> dict[str, Any]:
    """A group as it travels on the wire (a dict), answers right and wrong, with `fields`
    replacing any top-level value."""
    samples = (
        samples if samples is not None else [sample([5, 6], reward=1.0), sample([7], reward=0.0)]
    )
    rewards = [s["reward"] for s in samples]
    return {
        "group_id": gid,
        "prompt_id": f"p-{gid}",
        "domain": domain,
        "prompt_token_ids": prompt if prompt is not None else [1, 2, 3],
        "prompt_text": "1+2=",
        "config_version": config_version,
        "policy_version_min": 0,
        "policy_version_max": 0,
        "stop_reason": "rule",
        "stats": {
            "n_generated": len(samples) * 2,
            "n_pos": sum(r > 0.5 for r in rewards),
            "n_neg": sum(r <= 0.5 for r in rewards) + len(samples),
            "reward_mean": sum(rewards) / (2 * len(samples)),
            "reward_std": 0.5,
        },
        "samples": samples,
        "batch_id": batch_id,
        "batch_index": batch_index,
        "batch_size": batch_size,
        "delivery_id": delivery_id or uuid.uuid4().hex,
        **fields,
    }


def rows_with(path: Path, **changes: Any) -> list[dict[str, Any]]:
    """The rows of a JSONL prompt file with some keys replaced (None removes a key)."""
    rows = [orjson.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for row in rows:
        row = {**row, **changes}
        out.append({k: v for k, v in row.items() if v is not None})
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def unanswerable(toy: Any, where: Path) -> Path:
    """A domain no answer can be right for (the expected answer is not a number), so
    every prompt of it runs to n_max: the `n_max` branches of a test always run."""
    return write_jsonl(
        where / "never.jsonl", rows_with(toy.data_files[0], answer="never", domain="never")
    )


def lease(client: httpx.Client, n: int, wait_s: float = 30.0, consumer: str = "t") -> list[dict]:
    r = client.post(
        "/v1/groups/lease", json={"max_groups": n, "wait_s": wait_s, "consumer": consumer}
    )
    assert r.status_code == 200, r.text
    return r.json()["groups"]


def collect(
    client: httpx.Client, n: int, ack: bool = True, timeout_s: float = 300.0, **kw: Any
) -> list[dict]:
    """Lease (and ack) until n groups came back, failing after `timeout_s` seconds."""
    groups: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(groups) < n:
        assert time.monotonic() < deadline, f"only {len(groups)} of {n} groups in {timeout_s}s"
        got = lease(client, n - len(groups), **kw)
        if ack and got:
            r = client.post(
                "/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]}
            )
            assert r.status_code == 200, r.text
        groups.extend(got)
    return groups


def drain(client: httpx.Client, consumer: str = "t") -> int:
    """Ack everything READY now, so a shared server's next test starts from new groups."""
    n = 0
    while got := lease(client, 256, wait_s=0.0, consumer=consumer):
        client.post("/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in got]})
        n += len(got)
    return n


def _msgpack_messages(response: httpx.Response) -> Iterator[dict]:
    decoder = wire.stream_decoder()
    for chunk in response.iter_bytes():
        decoder.feed(chunk)
        yield from decoder


def stream_groups(
    client: httpx.Client, n: int, consumer: str, max_unacked: int = 8, accept: str | None = None
) -> list[dict]:
    """Read n groups from the stream without acking, then drop the connection."""
    out: list[dict] = []
    params = {"consumer": consumer, "max_unacked": max_unacked}
    headers = {"Accept": accept} if accept else {}
    with client.stream("GET", "/v1/groups/stream", params=params, headers=headers) as r:
        assert r.status_code == 200
        if accept == MSGPACK_MEDIA_TYPE:
            assert r.headers["content-type"] == MSGPACK_MEDIA_TYPE
            messages = _msgpack_messages(r)
        else:
            assert r.headers["content-type"].startswith(NDJSON_MEDIA_TYPE)
            messages = (orjson.loads(line) for line in r.iter_lines())
        for msg in messages:
            if msg["type"] == "group":
                out.append(msg["group"])
                if len(out) >= n:
                    break
    return out


def perturbed_state(
    model: Path | Any, scale: float, seed: int = 0, names: list[str] | None = None
) -> dict[str, Any]:
    """A model's weights (a model directory or a loaded model) plus seeded Gaussian noise:
    a new policy to push. `names` limits it to some tensors (a partial update)."""
    import torch

    if isinstance(model, Path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model)
    state = model.state_dict()
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (state[n] + scale * torch.randn(state[n].shape, generator=gen)).contiguous()
        for n in (names or list(state))
    }


def endless(model_dir: Path, out: Path) -> Path:
    """A copy of a model whose EOS id is outside the vocabulary: every hf answer runs to
    max_tokens (a greedy one the same each time), so one stopped early shows."""
    shutil.copytree(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": 1_000_000}))
    return out


async def cancelled_twin(backend: Any, prompt: list[int], longest: int) -> tuple[Any, Any]:
    """Greedy twins of one wave of `backend` on a prompt whose answers run to `longest`
    tokens: the second is cancelled once a 4-token answer sent after them is back (so
    both have decoded tokens by then). The cut one must come back aborted with a prefix
    of its uncancelled twin's tokens; returns (cut, twin)."""
    from sampler_service.backends.base import SamplingParams

    wave = backend.wave(prompt, 2, SamplingParams(temperature=0.0, max_tokens=longest))
    assert wave.cancels_answers
    await backend.generate(prompt, 1, SamplingParams(temperature=0.0, max_tokens=4))
    await wave.cancel([1])
    answers = dict([pair async for pair in wave])
    cut, twin = answers[1], answers[0]
    assert cut.finish_reason == "abort" and twin.finish_reason == "length"
    assert 0 < len(cut.token_ids) < len(twin.token_ids) == longest
    assert cut.token_ids == twin.token_ids[: len(cut.token_ids)]
    return cut, twin


def perturbed_file(model_dir: Path, scale: float, seed: int = 0) -> bytes:
    """`perturbed_state` as safetensors bytes, the body of PUT /v1/weights."""
    from safetensors.torch import save

    return save(perturbed_state(model_dir, scale, seed))


def train_command(url: str, model: Path, out: Path, steps: int, *flags: str) -> list[str]:
    """`adaptive-rollout train` as its own process against the sampler at `url`, with
    4-group batches, a push every step and a 60 s watchdog; `flags` add to or follow them."""
    return [
        sys.executable, "-m", "sampler_service", "train",
        "--url", url, "--model", str(model), "--out", str(out), "--steps", str(steps),
        "--batch-groups", "4", "--sync-every", "1", "--watchdog-s", "60", *flags,
    ]  # fmt: skip


def report_measurements(
    terminalreporter: Any, title: str, values: dict[str, Any], started: float, spec: str = ""
) -> None:
    """A suite's measurements (each formatted with `spec`) and its wall time since
    `started` (monotonic), as a section of pytest's terminal summary; nothing if none."""
    if not values:
        return
    terminalreporter.section(title)
    for key, value in values.items():
        terminalreporter.write_line(f"{key}: {value:{spec}}")
    terminalreporter.write_line(f"suite wall time (s): {time.monotonic() - started:.0f}")
