"""What an HTTP engine's answers cost the front to parse: vLLM 0.32's responses at 4 x 700 tokens.

`bench/fixtures/vllm-0.32.0-*.json` are response bodies recorded from a CPU `vllm serve`
of the toy model (4 answers of 40 tokens, the sampled token's logprob), one per request
of `REQUESTS`:

- `generate-tokens`: `POST /inference/v1/generate` (`output_mode` "tokens": token ids,
  one logprob entry per token with the sampled token as its one `top_logprobs` entry, the
  `weight_versions` spans; no text, which the front would then detokenize itself);
- `generate-text`: the same with `output_mode` "text" (the text, and token strings with
  their bytes in every logprob entry);
- `completions`: `POST /v1/completions` with a token-id prompt,
  `return_tokens_as_token_ids` and `return_token_ids`.

`expand` rebuilds a recorded response around answers of any length, keeping every field,
its key order and vLLM's serialization (`json.dumps`, compact separators, as FastAPI's
`JSONResponse` writes it): expanding a recording with its own answers gives back its
bytes exactly, which `tests/bench/test_engine_responses.py` checks. The 700-token answers
get random token ids below 151k, float32 logprobs (as engines produce them) and token
strings of ~4 characters cut from a reasoning text.

Parsing is what an HTTP backend must do with a body to have each answer's token ids,
logprobs, text and finish reason (`PARSERS`): for the two endpoints `--backend http`
reads, its own dialect parsers after `orjson.loads` (as the backend runs them); for the
text mode, `orjson.loads` and one pass. `json.loads` (what `httpx.Response.json()` uses)
is measured beside it.

Recording needs the vLLM environment (`make venv-vllm`) and a server started as

    VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \\
        --model TOY/model --host 127.0.0.1 --port 8011 --max-model-len 64 --enforce-eager \\
        --dtype float32 --kv-cache-memory-bytes 268435456 --enable-scale-out
    .venv/bin/python -m bench.engine_responses --record http://127.0.0.1:8011 --model TOY/model
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VLLM_VERSION = "0.32.0"
#: The toy prompt "12+34=" as the toy tokenizer encodes it.
PROMPT_TOKEN_IDS = [4, 5, 13, 6, 7, 16]
_SAMPLING = {"n": 4, "max_tokens": 40, "temperature": 1.0, "logprobs": 0, "ignore_eos": True}
#: endpoint name -> (path, request body; "MODEL" is replaced by the served model's name).
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "generate-tokens": (
        "/inference/v1/generate",
        {"token_ids": PROMPT_TOKEN_IDS, "sampling_params": _SAMPLING},
    ),
    "generate-text": (
        "/inference/v1/generate",
        {"token_ids": PROMPT_TOKEN_IDS, "output_mode": "text", "sampling_params": _SAMPLING},
    ),
    "completions": (
        "/v1/completions",
        {
            "model": "MODEL",
            "prompt": PROMPT_TOKEN_IDS,
            **{k: v for k, v in _SAMPLING.items()},
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    ),
}


def fixture(name: str) -> Path:
    return FIXTURES / f"vllm-{VLLM_VERSION}-{name}.json"


@dataclass
class Answer:
    """One answer as the engine reports it; `pieces` are the token strings (text mode)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int | None]
    pieces: list[str]
    text: str
    finish_reason: str


def recorded_answers(name: str, doc: dict[str, Any]) -> list[Answer]:
    """The answers of a recorded response (the inverse of `expand`)."""
    out = []
    for choice in doc["choices"]:
        if name == "completions":
            lp = choice["logprobs"]
            ranks: list[int | None] = [None] * len(lp["tokens"])
            out.append(
                Answer(
                    choice["token_ids"],
                    lp["token_logprobs"],
                    ranks,
                    lp["tokens"],
                    choice["text"],
                    choice["finish_reason"],
                )
            )
            continue
        content = choice["logprobs"]["content"]
        out.append(
            Answer(
                choice["token_ids"],
                [e["logprob"] for e in content],
                [e.get("rank") for e in content],
                [e["token"] for e in content] if name == "generate-text" else [],
                choice.get("text", ""),
                choice["finish_reason"],
            )
        )
    return out


def _generate_choice(template: dict[str, Any], index: int, a: Answer, text: bool) -> dict:
    if text:
        content = [
            {
                "token": piece,
                "logprob": lp,
                "bytes": list(piece.encode()),
                "top_logprobs": [{"token": piece, "logprob": lp, "bytes": list(piece.encode())}],
            }
            for piece, lp in zip(a.pieces, a.logprobs, strict=True)
        ]
    else:
        content = [
            {
                "token_id": t,
                "logprob": lp,
                "rank": r,
                "top_logprobs": [{"token_id": t, "logprob": lp, "rank": r}],
            }
            for t, lp, r in zip(a.token_ids, a.logprobs, a.ranks, strict=True)
        ]
    choice = {**template, "index": index, "finish_reason": a.finish_reason}
    choice["token_ids"] = a.token_ids
    choice["weight_versions"] = [
        {**template["weight_versions"][0], "start": 0, "end": len(a.token_ids)}
    ]
    if text:
        choice["text"] = a.text
    choice["logprobs"] = {**template["logprobs"], "content": content}
    return choice


def _completions_choice(template: dict[str, Any], index: int, a: Answer) -> dict:
    offsets, at = [], 0
    for piece in a.pieces:
        offsets.append(at)
        at += len(piece)
    logprobs = {
        "text_offset": offsets,
        "token_logprobs": a.logprobs,
        "tokens": a.pieces,
        "top_logprobs": [{piece: lp} for piece, lp in zip(a.pieces, a.logprobs, strict=True)],
    }
    return {
        **template,
        "index": index,
        "text": a.text,
        "logprobs": logprobs,
        "finish_reason": a.finish_reason,
        "token_ids": a.token_ids,
    }


def expand(name: str, recorded: dict[str, Any], answers: list[Answer]) -> bytes:
    """The recorded response `recorded` of endpoint `name`, with `answers` as its choices."""
    template = recorded["choices"][0]
    if name == "completions":
        choices = [_completions_choice(template, i, a) for i, a in enumerate(answers)]
    else:
        text = name == "generate-text"
        choices = [_generate_choice(template, i, a, text) for i, a in enumerate(answers)]
    completion = sum(len(a.token_ids) for a in answers)
    usage = recorded["usage"]
    doc = {
        **recorded,
        "choices": choices,
        "usage": {
            **usage,
            "completion_tokens": completion,
            "total_tokens": usage["prompt_tokens"] + completion,
        },
    }
    # Key order as recorded: `usage` keeps its place in the top-level object.
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def synthetic_answers(name: str, count: int, tokens: int, seed: int = 0) -> list[Answer]:
    """`count` answers of `tokens` tokens: ids below 151k, float32 logprobs, ~4-char pieces."""
    from bench.front_service import CHARS_PER_TOKEN, _reasoning_text

    rng = np.random.default_rng(seed)
    text = _reasoning_text(rng, count * tokens * CHARS_PER_TOKEN + 1)
    out = []
    for i in range(count):
        ids = rng.integers(0, 151_000, tokens).tolist()
        lps = (-rng.exponential(0.7, tokens)).astype(np.float32).tolist()
        ranks: list[int | None] = rng.choice([1, 1, 1, 2, 3], tokens).tolist()
        start = i * tokens * CHARS_PER_TOKEN
        words = [
            text[start + k * CHARS_PER_TOKEN : start + (k + 1) * CHARS_PER_TOKEN]
            for k in range(tokens)
        ]
        pieces = [f"token_id:{t}" for t in ids] if name == "completions" else words
        out.append(Answer(ids, lps, ranks, pieces, "".join(words), "stop"))
    return out


Parsed = list[tuple[list[int], list[float], str | None, str]]


def parse_generate(body: bytes, loads: Callable[[bytes], Any] = orjson.loads) -> Parsed:
    """The text mode, which no HTTP engine dialect reads: orjson and one pass."""
    doc = loads(body)
    return [
        (
            c["token_ids"],
            [e["logprob"] for e in c["logprobs"]["content"]],
            c.get("text"),
            c["finish_reason"],
        )
        for c in doc["choices"]
    ]


def backend_parser(dialect: str) -> Callable[..., Parsed]:
    """What `--backend http` runs on a body of its `dialect` (`backends/http/dialects.py`), plus each
    choice's text where the server sent one (the backend decodes its own)."""
    from sampler_service.backends.http.dialects import DIALECTS

    answers = DIALECTS[dialect].answers  # type: ignore[index]

    def parse(body: bytes, loads: Callable[[bytes], Any] = orjson.loads) -> Parsed:
        doc = loads(body)
        texts = [c.get("text") for c in sorted(doc["choices"], key=lambda c: c["index"])]
        return [
            (ids, values, text, reason)
            for (ids, values, reason, _), text in zip(answers(doc), texts, strict=True)
        ]

    return parse


PARSERS: dict[str, Callable[..., Parsed]] = {
    "generate-tokens": backend_parser("vllm-generate"),
    "generate-text": parse_generate,
    "completions": backend_parser("vllm"),
}


def cpu_per_call(fn: Callable[[], Any], seconds: float) -> float:
    """CPU seconds per call of `fn`, repeated for about `seconds` of CPU (median of 5 runs)."""
    fn()
    calls = 1
    while True:
        started = time.thread_time()
        for _ in range(calls):
            fn()
        if time.thread_time() - started > seconds / 5:
            break
        calls *= 2
    runs = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - started) / calls)
    return sorted(runs)[2]


def measure_parsing(spec: dict[str, Any]) -> dict[str, Any]:
    """Parse cost per answer of each recorded endpoint at 4 x `tokens` tokens."""
    count, tokens = int(spec.get("parse_answers", 4)), int(spec.get("parse_tokens", 700))
    seconds = float(spec.get("parse_seconds", 2.0))
    endpoints = {}
    for name, parser in PARSERS.items():
        recorded = json.loads(fixture(name).read_bytes())
        body = expand(name, recorded, synthetic_answers(name, count, tokens))
        parsed = parser(body)
        assert len(parsed) == count and all(len(p[0]) == tokens for p in parsed)
        endpoints[name] = {
            "path": REQUESTS[name][0],
            "bytes": len(body),
            "answers": count,
            "tokens_per_answer": tokens,
            "ms_per_answer": 1000 * cpu_per_call(partial(parser, body), seconds) / count,
            "ms_per_answer_json": 1000
            * cpu_per_call(partial(parser, body, json.loads), seconds)
            / count,
        }
    return {"vllm_version": VLLM_VERSION, "endpoints": endpoints}


def record(url: str, model: str) -> list[Path]:
    """Record every request of `REQUESTS` from a running vLLM server into the fixtures."""
    import httpx

    FIXTURES.mkdir(exist_ok=True)
    written = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for name, (path, body) in REQUESTS.items():
            sent = {k: (model if v == "MODEL" else v) for k, v in body.items()}
            response = http.post(path, json=sent)
            response.raise_for_status()
            fixture(name).write_bytes(response.content)
            written.append(fixture(name))
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", metavar="URL", help="record the fixtures from a vLLM server")
    p.add_argument("--model", help="the served model's name (its --model path)")
    args = p.parse_args(argv)
    if args.record:
        for path in record(args.record, args.model):
            print(f"wrote {path}")
        return
    print(json.dumps(measure_parsing({}), indent=1))


if __name__ == "__main__":
    main()
