"""A scripted judge server, for tests, benchmarks and checking a deployment's fault paths.

    python -m sampler_service.verifiers.testing_judge --port 0 [--mode MODE] [--delay S]

It speaks the three APIs a judge may use (`/v1/chat/completions`, `/v1/completions`,
`/classify`) with the standard library only, and prints `listening on http://HOST:PORT`
once it serves. As a judge (`--mode grade`) it is always right: the judge's prompt must
hold a line `response: ...` and a line `answer: ...` (a template such as
"response: {response}\\nanswer: {answer}"), and the response is right when the two match
as `exact` matches them. It answers in whatever form the request asks: a `yes`/`no`
label (or with `--text score` a score out of 10, `Score: 10`), first-token logprobs (`yes` at 0.9 when right,
0.1 when wrong, with `no` the rest), or for `/classify` class probabilities
(`[wrong, right]`) and a label (`right` or `wrong`).

Its other modes misbehave on purpose: `garbage` answers 200 with text that holds no
verdict and no logprobs; `status` answers 500; `notjson` answers 200 with a body that is
not JSON; `slow` waits `--delay` seconds before grading (a judge past its time-out);
`--fail-first K` answers the first K requests with 503, then grades. `GET /stats` says
how many requests and prompts it served, so a test can tell batched requests apart, and
`GET /last` shows the last request (path, Authorization header, body).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sampler_service.verifiers import exact

MODES = ("grade", "garbage", "status", "notjson", "slow")
#: P(yes) the judge gives a right answer (a wrong one gets 1 minus it).
CONFIDENCE = 0.9
_FIELD = re.compile(r"^(response|answer):[ \t]?(.*)$", re.M)


def right(prompt: str) -> bool:
    """Whether the judge's prompt shows a right response (its last `response:` line
    matches its last `answer:` line)."""
    fields = dict(_FIELD.findall(prompt))
    if "response" not in fields or "answer" not in fields:
        return False
    return exact.verify(fields["response"], fields["answer"]) == 1.0


def _logprobs(ok: bool, chat: bool) -> dict[str, Any]:
    yes = CONFIDENCE if ok else 1.0 - CONFIDENCE
    top = [("yes", math.log(yes)), ("no", math.log(1.0 - yes)), ("maybe", math.log(1e-4))]
    if chat:
        candidates = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
        return {"content": [{"token": "yes" if ok else "no", "top_logprobs": candidates}]}
    return {"tokens": ["yes" if ok else "no"], "top_logprobs": [dict(top)]}


class State:
    """What the server does, and what it served."""

    def __init__(
        self, mode: str, text: str, delay_s: float, fail_first: int, item_delay_s: float
    ) -> None:
        self.mode, self.text = mode, text
        self.delay_s, self.item_delay_s = delay_s, item_delay_s
        self.fail_first = fail_first
        self.requests = self.prompts = 0
        #: The last request: its path, Authorization header and body.
        self.last: dict[str, Any] = {}
        self.lock = threading.Lock()


def _reply(state: State, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """(status, body) for a request to `path`."""
    with state.lock:
        state.requests += 1
        failing = state.requests <= state.fail_first
    if failing:
        return 503, b'{"error": "not yet"}'
    mode = state.mode
    if mode == "status":
        return 500, b'{"error": "the judge failed on purpose"}'
    if mode == "notjson":
        return 200, b"<html>this is not JSON</html>"
    if path == "/classify":
        prompts = body["input"]
    elif path == "/v1/chat/completions":
        prompts = [body["messages"][-1]["content"]]
    else:
        prompts = body["prompt"]
    with state.lock:
        state.prompts += len(prompts)
    if mode == "slow":
        time.sleep(state.delay_s)
    if state.item_delay_s:
        time.sleep(state.item_delay_s * len(prompts))
    if mode == "garbage":
        said = "I cannot decide."
        chat_reply = {"message": {"content": said}} if path == "/v1/chat/completions" else {}
        nonsense = [
            {"index": i, "text": said, "logprobs": None, **chat_reply} for i in range(len(prompts))
        ]
        return 200, json.dumps({"choices": nonsense}).encode()
    verdicts = [right(p) for p in prompts]
    if path == "/classify":
        data = [
            {
                "index": i,
                "label": "right" if ok else "wrong",
                "probs": [0.1, 0.9][:: 1 if ok else -1],
            }
            for i, ok in enumerate(verdicts)
        ]
        return 200, json.dumps({"data": data}).encode()
    chat = path == "/v1/chat/completions"
    choices = []
    for i, ok in enumerate(verdicts):
        choice: dict[str, Any] = {"index": i, "finish_reason": "stop"}
        text = ("yes" if ok else "no") if state.text == "label" else f"Score: {10 if ok else 0}"
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        asked = body.get("top_logprobs") if chat else body.get("logprobs")
        choice["logprobs"] = _logprobs(ok, chat) if asked else None
        choices.append(choice)
    return 200, json.dumps({"choices": choices}).encode()


def serve(host: str, port: int, state: State) -> ThreadingHTTPServer:
    """A started server on a thread of its own (`shutdown()` ends it)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            if self.path in ("/stats", "/last"):
                with state.lock:
                    counts = {"requests": state.requests, "prompts": state.prompts}
                    shown = counts if self.path == "/stats" else state.last
                self._send(200, json.dumps(shown).encode())
            else:
                self._send(200 if self.path == "/health" else 404, b"{}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length))
                with state.lock:
                    key = self.headers.get("Authorization")
                    state.last = {"path": self.path, "authorization": key, "body": body}
                status, payload = _reply(state, self.path, body)
            except (ValueError, KeyError, TypeError) as exc:
                status, payload = 400, json.dumps({"error": repr(exc)}).encode()
            self._send(status, payload)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # a client opening many connections at once

        def handle_error(self, request: Any, client_address: Any) -> None:
            # A client that gave up (its time-out) resets the connection: not news.
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="testing-judge", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sampler_service.verifiers.testing_judge")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--mode", choices=MODES, default="grade")
    parser.add_argument(
        "--text", choices=("label", "score"), default="label", help="what a text reply says"
    )
    parser.add_argument("--delay", type=float, default=5.0, help="seconds `slow` waits")
    parser.add_argument(
        "--item-delay", type=float, default=0.0, help="seconds each prompt of a request costs"
    )
    parser.add_argument("--fail-first", type=int, default=0, help="requests answered 503 first")
    args = parser.parse_args(argv)
    state = State(args.mode, args.text, args.delay, args.fail_first, args.item_delay)
    server = serve(args.host, args.port, state)
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
