"""What differs between inference servers driven over HTTP (`--backend http`): paths and
field names, one small table per server kind.

Everything else (routing, labels, the weight barrier, probes, re-issue) is the same for
every kind, so a kind is only this: where to ask, how to spell a wave, how to read an
answer back as token ids and logprobs, and how to reload weights from a path.

- `vllm`: `vllm serve` with `VLLM_SERVER_DEV_MODE=1` (its RL endpoints). Waves are
  `/v1/completions` with token-id prompts; weights reload through `/collective_rpc`
  `reload_weights`; labels through `/weight_info` and `/update_weight_version`.
- `vllm-generate`: the same servers started with `--enable-scale-out` too. Waves are
  `/inference/v1/generate` (token ids in, token ids and logprobs out), whose answers
  carry `weight_versions`: the label under which each run of tokens was sampled. The
  backend checks every span against the label the wave was sent under, so an answer a
  foreign reload touched is never kept. The spans also make `continue` weight updates
  possible (`/pause?mode=keep`, the only dialect that reports them): an answer an update
  ran across reads its later labels as its `version_spans`, and each request is
  cache-salted with its label. Everything else is `vllm`'s.
- `sglang`: SGLang's native API. Waves are `/generate` with `input_ids` and
  `sampling_params` (`n` answers, `sampling_seed`), `return_logprob` giving
  `meta_info.output_token_logprobs` as `[logprob, token_id, text]` triples; weights reload
  through `/update_weights_from_disk` (`model_path`), which flushes the radix cache
  itself; `/pause_generation` and `/continue_generation` hold the scheduler around it;
  labels through `/get_weight_version` and `/update_weight_version`.

NCCL weight transfer (`NCCLPaths`) is vLLM's RL endpoints (both vLLM dialects): servers
started with `--weight-transfer-config '{"backend":"nccl"}'` join the trainer's group
(`/init_weight_transfer_engine`) and receive its broadcasts (`/start_weight_update`,
`/update_weights`, `/finish_weight_update`). SGLang's distributed update
(`/init_weights_update_group`, `/update_weights_from_distributed`) is not driven.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from sampler_service.backends.base import ContinueKV, PauseMode, SamplingParams

DialectName = Literal["vllm", "vllm-generate", "sglang"]

#: token ids, their logprobs, finish reason ("stop", "length", "abort" or the server's
#: word), and (weight label, first token) of each run of its tokens sampled under one
#: label (None: not reported)
Answer = tuple[list[int], list[float], str | None, tuple[tuple[str, int], ...] | None]


@dataclass(frozen=True)
class NCCLPaths:
    """vLLM's weight-transfer endpoints (vllm/entrypoints/rl/online/api_router.py)."""

    #: GET -> `{"world_size": N}`: the server's ranks in the group (TP x PP x DP).
    world_size: str = "/get_world_size"
    #: `{"init_info": {...}}`; returns once the trainer's rank joined too.
    init: str = "/init_weight_transfer_engine"
    start: str = "/start_weight_update"
    #: `{"update_info": {...}}`; returns once the server received the broadcast.
    update: str = "/update_weights"
    #: `{"weight_version": label}`: ends the session and sets the server's label.
    finish: str = "/finish_weight_update"
    shutdown: str = "/shutdown_weight_transfer_engine"


@dataclass(frozen=True)
class Dialect:
    """One server kind's API: see the module docstring."""

    name: DialectName
    generate: str
    weight_label: str
    set_label: str
    #: The pause, `{mode}` standing for the mode where the path names it.
    pause: str
    #: The modes a pause takes (a mode another server kind has raises NotSupported).
    pause_modes: tuple[PauseMode, ...]
    resume: str
    reload: str
    abort: str
    #: None: the server has no pause query; a pause is known only from our own calls.
    is_paused: str | None
    #: None: the reload itself drops the prefix cache.
    reset_cache: str | None
    #: None: the server reports no logprob semantics to check at start-up.
    server_info: str | None
    #: None: the server computes no checksums of the weights it serves.
    weight_checker: str | None
    #: None: weights cannot come over NCCL through this server kind's API.
    nccl: NCCLPaths | None
    #: Start-up hint when an endpoint answers 403/404.
    hint: str
    #: (model, prompt, n, sampling, request_id) -> the generate body; the sampling's
    #: stop_token_ids hold the model's end-of-sequence ids too.
    request: Callable[[str, list[int], int, SamplingParams, str], dict[str, Any]]
    answers: Callable[[Any], list[Answer]]
    reload_body: Callable[[str], dict[str, Any]]
    #: Our request ids -> the abort calls' bodies, under the ids the server gave them.
    abort_bodies: Callable[[Sequence[str]], list[dict[str, Any]]]
    #: What running answers can go on under across a weight load: the servers report
    #: each answer's label spans (`Backend.continues`).
    continues: frozenset[ContinueKV] = frozenset()
    #: The request field that salts its prefix cache (None: not salted).
    cache_salt: str | None = None


def _knobs(sampling: SamplingParams, no_top_k: int) -> dict[str, Any]:
    """Every distribution knob explicit, so a server's generation_config changes nothing;
    `no_top_k` is the server's word for "no top-k"."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k and sampling.top_k > 0 else no_top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": list(sampling.stop_token_ids),
        "stop": list(sampling.stop),
    }


def _vllm_sampling(n: int, sampling: SamplingParams) -> dict[str, Any]:
    """vLLM's SamplingParams fields, as both of its generate endpoints read them."""
    return {
        "n": n,
        "max_tokens": sampling.max_tokens,
        **_knobs(sampling, 0),
        "seed": sampling.seed,
        "logprobs": 0,
        "include_stop_str_in_output": True,
    }


def _vllm_request(
    model: str, prompt: list[int], n: int, sampling: SamplingParams, request_id: str
) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        **_vllm_sampling(n, sampling),
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "request_id": request_id,
    }


def _vllm_answers(body: Any) -> list[Answer]:
    """The lists as the JSON parser built them (no per-token work: at ~700 tokens an
    answer, converting each token again cost more than parsing it); the logprob entries
    must cover the answer and end on its last token (`token_id:N`, with
    `return_tokens_as_token_ids`)."""
    out: list[Answer] = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        ids = choice.get("token_ids")
        if ids is None:
            ids = [int(t.removeprefix("token_id:")) for t in tokens]
        if tokens and (len(tokens) != len(ids) or tokens[-1] != f"token_id:{ids[-1]}"):
            raise RuntimeError("the server's token ids and logprob tokens differ")
        values = logprobs.get("token_logprobs") or []
        out.append((ids, values, choice.get("finish_reason"), None))
    return out


def _vllm_generate_request(
    model: str, prompt: list[int], n: int, sampling: SamplingParams, request_id: str
) -> dict[str, Any]:
    return {
        "model": model,
        "request_id": request_id,
        "token_ids": prompt,
        "sampling_params": _vllm_sampling(n, sampling),
        "output_mode": "tokens",
        "stream": False,
    }


def _vllm_generate_answers(body: Any) -> list[Answer]:
    """`logprobs.content` holds the sampled token first; `weight_versions` spans cover
    the answer's tokens (each `[start, end)` under one label)."""
    out: list[Answer] = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        if content and [int(c["token_id"]) for c in content] != ids:
            raise RuntimeError("the server's token ids and logprob tokens differ")
        spans = choice.get("weight_versions")
        labels = (
            None
            if spans is None
            else tuple((str(span["version"]), int(span["start"])) for span in spans)
        )
        if spans and sum(int(span["end"]) - int(span["start"]) for span in spans) != len(ids):
            raise RuntimeError("the server's weight_versions spans do not cover the answer")
        values = [float(c["logprob"]) for c in content]
        out.append((ids, values, choice.get("finish_reason"), labels))
    return out


def _sglang_request(
    model: str, prompt: list[int], n: int, sampling: SamplingParams, request_id: str
) -> dict[str, Any]:
    """SGLang reads no model name; top_k -1 is its "no top-k"."""
    del model
    params: dict[str, Any] = {
        "n": n,
        "max_new_tokens": sampling.max_tokens,
        **_knobs(sampling, -1),
        "no_stop_trim": True,  # the stop string stays in the answer, as vLLM's does
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return {
        "input_ids": prompt,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
        "rid": request_id,
    }


def _sglang_answers(body: Any) -> list[Answer]:
    """One answer is an object, `n` answers a list of them, in sample order."""
    out: list[Answer] = []
    for item in body if isinstance(body, list) else [body]:
        meta = item.get("meta_info") or {}
        triples = meta.get("output_token_logprobs") or []
        ids = [int(t[1]) for t in triples] or [int(t) for t in item.get("output_ids") or []]
        if item.get("output_ids") is not None and triples and ids != list(item["output_ids"]):
            raise RuntimeError("the server's output_ids and logprob tokens differ")
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        out.append((ids, [float(t[0]) for t in triples], kind, None))
    return out


VLLM = Dialect(
    name="vllm",
    generate="/v1/completions",
    weight_label="/weight_info",
    set_label="/update_weight_version",
    pause="/pause?mode={mode}",
    pause_modes=("wait", "abort", "keep"),
    resume="/resume",
    reload="/collective_rpc",
    abort="/abort_requests",
    is_paused="/is_paused",
    reset_cache="/reset_prefix_cache?reset_running_requests=true",
    server_info="/server_info?config_format=json",
    weight_checker="/weight_checker",
    nccl=NCCLPaths(),
    hint="start the server with VLLM_SERVER_DEV_MODE=1 (vLLM's RL endpoints)",
    request=_vllm_request,
    answers=_vllm_answers,
    reload_body=lambda path: {"method": "reload_weights", "kwargs": {"weights_path": path}},
    # vLLM's completions server runs our request "X" as "cmpl-X-0" (one prompt per
    # request) and /abort_requests looks ids up as the server named them: "X" aborts
    # nothing.
    abort_bodies=lambda ids: [{"request_ids": [f"cmpl-{rid}-0" for rid in sorted(ids)]}],
)

SGLANG = Dialect(
    name="sglang",
    generate="/generate",
    weight_label="/get_weight_version",
    set_label="/update_weight_version",
    pause="/pause_generation",
    pause_modes=("wait",),
    resume="/continue_generation",
    reload="/update_weights_from_disk",
    abort="/abort_request",
    is_paused=None,
    reset_cache=None,
    server_info=None,
    weight_checker=None,
    nccl=None,
    hint="is this an SGLang server recent enough for /get_weight_version?",
    request=_sglang_request,
    answers=_sglang_answers,
    reload_body=lambda path: {"model_path": path},
    abort_bodies=lambda ids: [{"rid": rid} for rid in sorted(ids)],
)

VLLM_GENERATE = replace(
    VLLM,
    name="vllm-generate",
    generate="/inference/v1/generate",
    hint="start the server with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out",
    request=_vllm_generate_request,
    answers=_vllm_generate_answers,
    abort_bodies=lambda ids: [{"request_ids": [f"generate-tokens-{rid}" for rid in sorted(ids)]}],
    continues=frozenset({"keep", "recompute"}),
    cache_salt="cache_salt",
)

DIALECTS: dict[DialectName, Dialect] = {
    "vllm": VLLM,
    "vllm-generate": VLLM_GENERATE,
    "sglang": SGLANG,
}
