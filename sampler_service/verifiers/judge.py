"""Judges: answers graded by a model over HTTP, an LLM judge or a reward model.

A row whose verifier is `judge:NAME` is graded by the judge NAME: the server given at
start-up by `--judge-url NAME=URL` (`vllm serve`, or any OpenAI-compatible server), asked
as the live config's `judges.NAME` says (`config.JudgeKnobs`: the API, the prompt
template, how the verdict is read, batching, time-out, retries, concurrency). The knobs
are read at each request, so a PATCH applies to the next request.

The requests go out from the service's event loop through one `httpx.AsyncClient` per
judge: a request waiting on a judge costs the loop nothing, unlike a verifier worker
process blocked on a socket. A wave's answers are asked together: `completions` and
`classify` send up to `batch` answers in one request (a prompt list), `chat` sends one
request per answer, all at once; at most `concurrency` requests are in flight per judge.

A request that fails (the server cannot be reached, answers an error status, runs past
`timeout_s`) or whose reply holds no verdict yields failed verdicts (kind `timeout` or
`error`), never a reward: `retry.verify_with_retries` asks them again, then the prompt is
dropped. Every request is one `tally.JudgeCall` record, which /v1/stats and /metrics read.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from sampler_service.config import JudgeKnobs, LabelVerdict, ScoreVerdict, YesProbVerdict
from sampler_service.dataset import PromptRow
from sampler_service.tally import JudgeCall, Tally
from sampler_service.verifiers import verdicts
from sampler_service.verifiers.base import Verdict, VerdictKind
from sampler_service.verifiers.retry import RetryPolicy

log = logging.getLogger(__name__)

#: Each API's path, under the judge's URL.
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "classify": "/classify"}
#: How much of a failed request's reply an error message quotes.
_QUOTED = 200
#: A judge whose recent requests failed this often is named in /health's warnings.
_RECENT, _WARN_SHARE, _WARN_MIN = 50, 0.5, 10
#: Requests take turns over this many connection pools. A request holds its connection
#: until the judge answers, and httpx's pool scans every connection it holds whenever a
#: request starts or ends: one pool of 64 judge requests in flight cost the loop ~10 ms per
#: request (`bench/judge.py`), 8 pools of 8 a tenth of it (the HTTP engines' remedy too).
_POOLS = 8
#: What a reply that cannot be read at all raises, beside `verdicts.Unreadable`.
_SHAPE_ERRORS = (verdicts.Unreadable, KeyError, IndexError, TypeError, ValueError)


def prompt_text(row: PromptRow) -> str:
    """What `{prompt}` shows the judge: the row's prompt, or a chat row's last user turn
    (its text parts), which is the question the answer answers."""
    if isinstance(row.prompt, str):
        return row.prompt
    for message in reversed(row.prompt):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    return row.text


class _Failed(Exception):
    """A request that produced no reply to read: its cause and message."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class _Judge:
    """One judge's HTTP clients, its concurrency bound and its recent outcomes."""

    def __init__(self, name: str, url: str, api_key: str | None, tls: ssl.SSLContext) -> None:
        self.name, self.url = name, url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No httpx time-outs (its read time-out is per chunk): `timeout_s` bounds the
        # whole request. No pool limit: the bound below is the live one.
        self.clients = [
            httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=httpx.Timeout(None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                verify=tls,
            )
            for _ in range(_POOLS)
        ]
        self._turn = itertools.cycle(self.clients)
        self._bound: asyncio.Semaphore | None = None
        self._limit = 0
        #: Whether each recent request got every verdict it asked for (for warnings).
        self.recent: collections.deque[bool] = collections.deque(maxlen=_RECENT)

    def slots(self, limit: int) -> asyncio.Semaphore:
        """The concurrency bound: a changed limit applies to requests started after it."""
        if self._bound is None or limit != self._limit:
            self._bound, self._limit = asyncio.Semaphore(limit), limit
        return self._bound

    async def post(self, knobs: JudgeKnobs, body: dict[str, Any]) -> Any:
        """The reply's JSON, or `_Failed`."""
        try:
            async with asyncio.timeout(knobs.timeout_s):
                response = await next(self._turn).post(PATHS[knobs.api], json=body)
        except TimeoutError:
            raise _Failed("timeout", f"no reply within {knobs.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise _Failed("transport", f"{type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            text = response.text[:_QUOTED]
            raise _Failed("status", f"HTTP {response.status_code}: {text}")
        try:
            return response.json()
        except ValueError:
            raise _Failed("unreadable", f"not JSON: {response.text[:_QUOTED]!r}") from None


def _body(knobs: JudgeKnobs, prompts: list[str]) -> dict[str, Any]:
    """The request for `prompts` (one, for chat) in the API the knobs name."""
    body: dict[str, Any] = {} if knobs.model is None else {"model": knobs.model}
    if knobs.api == "classify":
        return {**body, "input": prompts}
    verdict = knobs.verdict
    yes_prob = isinstance(verdict, YesProbVerdict)
    body.update(max_tokens=1 if yes_prob else knobs.max_tokens, temperature=knobs.temperature)
    if knobs.api == "chat":
        [prompt] = prompts
        system = [] if knobs.system is None else [{"role": "system", "content": knobs.system}]
        body["messages"] = [*system, {"role": "user", "content": prompt}]
        if isinstance(verdict, YesProbVerdict):
            body.update(logprobs=True, top_logprobs=verdict.top_logprobs)
        return body
    body["prompt"] = prompts
    if isinstance(verdict, YesProbVerdict):
        body["logprobs"] = verdict.top_logprobs
    return body


def _in_order(items: Any, count: int) -> list[Any]:
    """A reply's per-prompt items (`choices`, `data`) in prompt order, one per prompt."""
    if not isinstance(items, list) or len(items) != count:
        got = len(items) if isinstance(items, list) else type(items).__name__
        raise verdicts.Unreadable(f"{count} results expected, got {got}")
    ordered = sorted(items, key=lambda item: int(item["index"]))
    if [int(item["index"]) for item in ordered] != list(range(count)):
        raise verdicts.Unreadable("the results' indices are not those of the prompts")
    return ordered


def _reward(knobs: JudgeKnobs, item: Any) -> float:
    """The reward in one result of a reply (a choice, or a classification)."""
    verdict = knobs.verdict
    if knobs.api == "classify":
        if isinstance(verdict, ScoreVerdict):
            return verdicts.scaled(verdict, float(item["probs"][verdict.index]))
        assert isinstance(verdict, LabelVerdict)
        return verdicts.read_label(verdict, str(item["label"]))
    if isinstance(verdict, YesProbVerdict):
        logprobs = item["logprobs"]
        if logprobs is None:
            raise verdicts.Unreadable("the judge's answer carries no logprobs")
        first = (
            logprobs["content"][0]["top_logprobs"]
            if knobs.api == "chat"
            else (logprobs["top_logprobs"][0])
        )
        return verdicts.yes_probability(verdict, verdicts.as_pairs(first))
    text = item["message"]["content"] if knobs.api == "chat" else item["text"]
    if not isinstance(text, str):
        raise verdicts.Unreadable(f"the judge's answer has no text ({text!r})")
    if isinstance(verdict, ScoreVerdict):
        return verdicts.read_score(verdict, text)
    return verdicts.read_label(verdict, text)


def _read(knobs: JudgeKnobs, reply: Any, count: int) -> list[float | str]:
    """Each prompt's reward, or why its result holds no verdict."""
    try:
        items = _in_order(reply["data" if knobs.api == "classify" else "choices"], count)
    except _SHAPE_ERRORS as exc:
        return [f"{type(exc).__name__}: {exc}"[:_QUOTED]] * count
    out: list[float | str] = []
    for item in items:
        try:
            out.append(_reward(knobs, item))
        except _SHAPE_ERRORS as exc:
            out.append(f"no verdict: {exc}"[: _QUOTED * 2])
    return out


class Judges:
    """The judges the sampler was started with (see the module docstring)."""

    def __init__(
        self,
        urls: Mapping[str, str],
        api_key: str | None,
        knobs: Callable[[], Mapping[str, JudgeKnobs]],
        tally: Tally,
    ) -> None:
        """`urls`: name -> the server's base URL; `knobs`: the live config's judges."""
        tls = httpx.create_ssl_context()  # one for every client: each costs ~20 ms to make
        self._judges = {name: _Judge(name, url, api_key, tls) for name, url in urls.items()}
        self._knobs = knobs
        self._tally = tally

    def knobs(self, name: str) -> JudgeKnobs:
        """The judge's live knobs (the config always holds every judge a row names)."""
        return self._knobs()[name]

    def retry_policy(self, name: str) -> RetryPolicy:
        """How the judge's failed judgements are asked again, from its live knobs."""
        knobs = self.knobs(name)
        return RetryPolicy(knobs.retries, knobs.backoff_s)

    async def verify_wave(
        self, name: str, row: PromptRow, responses: Sequence[str]
    ) -> list[Verdict]:
        """One try at a verdict for each response, in order; failures are verdicts of
        kind `timeout` or `error`, never rewards."""
        judge, knobs = self._judges[name], self.knobs(name)
        question = prompt_text(row)
        prompts = [
            verdicts.render(knobs.template, prompt=question, response=r, answer=row.answer)
            for r in responses
        ]
        size = 1 if knobs.api == "chat" else knobs.batch
        chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        results = await asyncio.gather(*(self._ask(judge, knobs, chunk) for chunk in chunks))
        return [verdict for chunk in results for verdict in chunk]

    async def _ask(self, judge: _Judge, knobs: JudgeKnobs, prompts: list[str]) -> list[Verdict]:
        """One request for `prompts`: a verdict each, and the request's record."""
        async with judge.slots(knobs.concurrency):
            started = time.perf_counter()
            try:
                read = _read(knobs, await judge.post(knobs, _body(knobs, prompts)), len(prompts))
                failure = None
            except _Failed as exc:
                read, failure = [str(exc)] * len(prompts), exc
            seconds = time.perf_counter() - started
        failed = [r for r in read if isinstance(r, str)]
        cause = failure.cause if failure is not None else "unreadable" if failed else None
        error = f"{cause}: {failed[-1]}" if failed else None
        self._tally.judged(JudgeCall(judge.name, len(prompts), seconds, cause, len(failed), error))
        counts = (len(failed), len(prompts))
        if failed and (not judge.recent or judge.recent[-1]):  # once per run of failures
            log.warning(
                "judge %s: no verdict for %d of %d answers (%s)", judge.name, *counts, error
            )
        judge.recent.append(not failed)
        kind: VerdictKind = "timeout" if cause == "timeout" else "error"
        return [
            Verdict(0.0, f"judge {judge.name}: {r}", seconds, kind)
            if isinstance(r, str)
            else Verdict(r, None, seconds)
            for r in read
        ]

    def warnings(self) -> list[str]:
        """One line per judge whose recent requests mostly failed."""
        out = []
        for judge in self._judges.values():
            recent = judge.recent
            failed = sum(not ok for ok in recent)
            if len(recent) >= _WARN_MIN and failed >= _WARN_SHARE * len(recent):
                last = self._tally.judges[judge.name].last_error
                out.append(
                    f"judge {judge.name}: {failed} of its last {len(recent)} requests failed "
                    f"(last: {last}); its prompts are dropped as verifier_error"
                )
        return out

    async def close(self) -> None:
        for judge in self._judges.values():
            for client in judge.clients:
                await client.aclose()
