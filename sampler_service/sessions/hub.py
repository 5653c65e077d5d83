"""The session table: where a harness's HTTP calls meet the episode they drive.

"Session" is the product's own term (docs/architecture.md, "Sessions"): one episode that
an outside agent harness drives through a URL of its own, never a work session.

An episode runs on its environment's own thread and event loop (`episodes.EnvThread`);
the harness's calls arrive on the server's loop. A `Session` is the one place both
touch, under a lock: the server's side posts events (a call, the end) and awaits the
call's reply on a thread-safe future; the episode's side takes the events in order and
settles the replies. A session that is over refuses what comes after with the reason,
so no call waits for an answer nobody will give.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sampler_service.errors import ServiceError
from sampler_service.sessions.chat import ChatRequest

log = logging.getLogger(__name__)

#: open: calls are served; ended: the harness ended it; cancelled: surplus, or the
#: episode stopped early; closed: the episode is over (its turns or tokens spent). The
#: refusals below name the harness's session (its episode), as the OpenAI wire sees it.
State = Literal["open", "ended", "cancelled", "closed"]

_REFUSALS: dict[State, tuple[str, str]] = {
    "ended": ("session_ended", "the harness ended this session"),
    "cancelled": (
        "session_cancelled",
        "this session was cancelled: its prompt's stopping rule held without it (a surplus "
        "episode) or the sampler stopped it; end the harness",
    ),
    "closed": (
        "session_ended",
        "this session's episode is over (its turns, tokens or time-out are spent)",
    ),
}


def refusal(session_id: str, state: State) -> ServiceError:
    """The 409 a call to a session that is over gets, naming why it is over."""
    code, message = _REFUSALS[state]
    return ServiceError(409, code, f"session {session_id}: {message}")


#: Sessions that are over, remembered (newest last) so a late call learns why.
REMEMBERED_OVER = 10_000


@dataclass(frozen=True)
class SessionURLs:
    """Where a harness reaches its session: `base_url` for an OpenAI client, and the
    session's own URL (`POST {session_url}/end` ends it)."""

    session_url: str

    @property
    def base_url(self) -> str:
        return f"{self.session_url}/v1"


@dataclass
class Call:
    """One chat-completions call, waiting for its answer (a response body)."""

    request: ChatRequest
    reply: concurrent.futures.Future[dict[str, Any]] = field(
        default_factory=concurrent.futures.Future
    )

    def answer(self, body: dict[str, Any]) -> None:
        if not self.reply.done():  # the caller may have gone (a disconnect)
            self.reply.set_result(body)

    def refuse(self, error: ServiceError) -> None:
        if not self.reply.done():
            self.reply.set_exception(error)


@dataclass(frozen=True)
class End:
    """The harness ended the session; None: the row's verifier scores the last turn."""

    reward: float | None


@dataclass(frozen=True)
class Exited:
    """The harness stopped (a process that exited, a function that returned or raised)."""

    reason: str


Event = Call | End | Exited


class Session:
    """One episode's session (see the module's docstring)."""

    def __init__(self, session_id: str, row: Mapping[str, Any], loop: asyncio.AbstractEventLoop):
        self.id = session_id
        self.row = dict(row)
        self._loop = loop  # the episode's loop: events wake it
        self._lock = threading.Lock()
        self._events: collections.deque[Event] = collections.deque()
        self._wake = asyncio.Event()
        self.state: State = "open"
        self._busy = False

    def _refusal(self) -> ServiceError:
        return refusal(self.id, self.state)

    def _post(self, event: Event) -> None:
        """Queue an event (the lock held) and wake the episode."""
        self._events.append(event)
        # A closed loop means the episode is gone: close() refuses what is queued.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake.set)

    def _check_idle(self, code: str, why: str) -> None:
        """409 if the session is over, or (`code`, `why`) if a call is in flight (the
        lock held)."""
        if self.state != "open":
            raise self._refusal()
        if self._busy:
            raise ServiceError(409, code, f"session {self.id}: a call is in flight; {why}")

    def begin_call(self, request: ChatRequest) -> Call:
        """Queue a call; 409 if the session is over or a call is in flight already."""
        with self._lock:
            self._check_idle(
                "history_changed",
                "calls in one session are sequential, each continuing the transcript the "
                "last one returned",
            )
            self._busy = True
            call = Call(request)
            self._post(call)
            return call

    def end_call(self) -> None:
        with self._lock:
            self._busy = False

    def end(self, reward: float | None) -> None:
        """The harness's end of the session; 409 if it is over or a call is in flight."""
        with self._lock:
            self._check_idle("call_in_flight", "end the session after its answer")
            self.state = "ended"
            self._post(End(reward))

    def harness_exited(self, reason: str) -> None:
        with self._lock:
            self._post(Exited(reason))

    async def next_event(self) -> Event:
        """The next event, in the order posted (on the episode's loop)."""
        while True:
            with self._lock:
                if self._events:
                    return self._events.popleft()
                self._wake.clear()
            await self._wake.wait()

    def cancel(self) -> None:
        """The episode was cancelled (from any thread)."""
        with self._lock:
            if self.state == "open":
                self.state = "cancelled"

    def close(self, held: Call | None = None) -> None:
        """The episode is over: refuse the call it `held` unanswered and the queued ones,
        and every call after, with why."""
        with self._lock:
            if self.state == "open":
                self.state = "closed"
            pending = [e for e in self._events if isinstance(e, Call)]
            if held is not None:
                pending.append(held)
            self._events.clear()
            refusal = self._refusal()
        for call in pending:
            call.refuse(refusal)


@dataclass
class SessionCounts:
    """What `/v1/stats` `sessions` reports."""

    opened: int = 0
    claimed: int = 0
    calls: int = 0
    ended_by_harness: int = 0
    cancelled: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    ignored: collections.Counter[str] = field(default_factory=collections.Counter)


class SessionHub:
    """Every live session, by id; the queue of sessions no harness has claimed yet (for
    harnesses that run elsewhere); the counts."""

    def __init__(self, *, model: str, api_key: str | None) -> None:
        self.model = model
        self.api_key = api_key
        #: http://host:port of this server, for the harnesses it starts (set at bind).
        self.server_url: str | None = None
        self._sessions: dict[str, Session] = {}
        self._over: collections.OrderedDict[str, State] = collections.OrderedDict()
        self._unclaimed: collections.deque[Session] = collections.deque()
        self._lock = threading.Lock()
        self._offered: asyncio.Event | None = None
        self._server_loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self.counts = SessionCounts()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The server's loop, where claims wait."""
        self._server_loop = loop
        self._offered = asyncio.Event()

    def urls(self, session: Session, server_url: str) -> SessionURLs:
        return SessionURLs(f"{server_url.rstrip('/')}/sessions/{session.id}")

    def open(self, row: Mapping[str, Any], loop: asyncio.AbstractEventLoop) -> Session:
        """A new session for an episode of `row`, driven from `loop`."""
        session_id = f"s{next(self._ids)}-{uuid.uuid4().hex[:12]}"
        session = Session(session_id, row, loop)
        with self._lock:
            self._sessions[session_id] = session
            self.counts.opened += 1
        return session

    def offer(self, session: Session) -> None:
        """Queue `session` for a harness that claims sessions over HTTP."""
        with self._lock:
            self._unclaimed.append(session)
        if self._server_loop is not None and self._offered is not None:
            self._server_loop.call_soon_threadsafe(self._offered.set)

    def forget(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
            self._over[session.id] = session.state
            if len(self._over) > REMEMBERED_OVER:
                self._over.popitem(last=False)
            if session in self._unclaimed:
                self._unclaimed.remove(session)
            if session.state == "cancelled":
                self.counts.cancelled += 1
            elif session.state == "ended":
                self.counts.ended_by_harness += 1

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            over = self._over.get(session_id)
        if over is not None:
            raise refusal(session_id, over)
        if session is None:
            raise ServiceError(
                404,
                "unknown_session",
                f"no session {session_id!r} (ids come from a claim or a started harness)",
            )
        return session

    async def claim(self, wait_s: float) -> Session | None:
        """The oldest unclaimed open session, waiting up to `wait_s` for one."""
        assert self._offered is not None, "attach() the server's loop first"
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                while self._unclaimed:
                    session = self._unclaimed.popleft()
                    if session.state == "open":
                        self.counts.claimed += 1
                        return session
                self._offered.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._offered.wait(), left)
            except TimeoutError:
                return None

    async def chat(self, session_id: str, request: ChatRequest) -> dict[str, Any]:
        """Serve one call: queued to its episode, answered when the model's turn is in."""
        try:
            session = self.get(session_id)
            request.check()
            call = session.begin_call(request)
        except ServiceError as exc:
            self.refused(exc.code)
            raise
        with self._lock:
            self.counts.calls += 1
            self.counts.ignored.update(request.ignored())
        try:
            return await asyncio.wrap_future(call.reply)
        except ServiceError as exc:
            self.refused(exc.code)
            raise
        finally:
            session.end_call()

    def refused(self, code: str) -> None:
        with self._lock:
            self.counts.refused[code] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self.counts
            return {
                "live": len(self._sessions),
                "unclaimed": sum(s.state == "open" for s in self._unclaimed),
                "opened": c.opened,
                "claimed": c.claimed,
                "calls": c.calls,
                "ended_by_harness": c.ended_by_harness,
                "cancelled": c.cancelled,
                "refused": dict(c.refused),
                "ignored": dict(c.ignored),
            }
