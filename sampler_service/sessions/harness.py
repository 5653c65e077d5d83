"""Harnesses the sampler starts, one per session, from a start-up spec.

- ``python:module:function``: the function is called with a :class:`HarnessSession`
  (sync functions on a thread of their own, async ones on the episode's loop);
- anything else is a command line, run without a shell, with the session in its
  environment: ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (what the ``openai`` package
  reads, so an unchanged harness talks to its session), ``ADAPTIVE_ROLLOUT_SESSION_URL``
  (``POST .../end`` ends it) and ``ADAPTIVE_ROLLOUT_ROW`` (the row, JSON).

A spec runs code, so it is a start-up setting only, never part of the live config. A
harness that stops before it ended its session, or raises, is reported to the session
(`Session.harness_exited`): the episode fails as an environment error, not a negative.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shlex
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from sampler_service.sessions.hub import Session, SessionURLs
from sampler_service.verifiers import python

#: Seconds a harness may take to exit by itself after its episode ended.
EXIT_GRACE_S = 2.0
#: The tail of a failed command's standard error kept for the episode's error.
STDERR_TAIL = 600


@dataclass(frozen=True)
class HarnessSession:
    """What a ``python:`` harness is called with."""

    session_id: str
    #: For an OpenAI client: ``openai.OpenAI(base_url=..., api_key=...)``.
    base_url: str
    #: ``POST {session_url}/end`` with ``{"reward": r}`` (or null) ends the session.
    session_url: str
    api_key: str
    #: The dataset row: id, prompt, answer, domain, metadata.
    row: dict[str, Any]


class RunningHarness(Protocol):
    async def stop(self, *, ended: bool) -> None:
        """Stop the harness; `ended`: its session ended well, so it may exit by itself."""
        ...


class Launcher(Protocol):
    async def start(self, session: Session, urls: SessionURLs, api_key: str) -> RunningHarness:
        """Start a harness on `session` (on the episode's loop)."""
        ...


class CommandLauncher:
    """A command line per session (see the module's docstring)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    async def start(self, session: Session, urls: SessionURLs, api_key: str) -> RunningHarness:
        env = {
            **os.environ,
            "OPENAI_BASE_URL": urls.base_url,
            "OPENAI_API_KEY": api_key,
            "ADAPTIVE_ROLLOUT_SESSION_URL": urls.session_url,
            "ADAPTIVE_ROLLOUT_ROW": json.dumps(session.row),
        }
        process = await asyncio.create_subprocess_exec(
            *self.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        return _RunningProcess(process, session)


class _RunningProcess:
    def __init__(self, process: asyncio.subprocess.Process, session: Session) -> None:
        self._process = process
        self._watch = asyncio.ensure_future(self._watched(session))

    async def _watched(self, session: Session) -> None:
        _, stderr = await self._process.communicate()
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:].strip()
        session.harness_exited(
            f"the harness exited with code {self._process.returncode}"
            + (f"; its stderr ends: {tail}" if tail else "")
        )

    async def stop(self, *, ended: bool) -> None:
        if ended:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._watch), EXIT_GRACE_S)
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
        await asyncio.gather(self._watch, return_exceptions=True)


class FunctionLauncher:
    """A Python function per session (see the module's docstring)."""

    def __init__(self, function: Callable[[HarnessSession], Any]) -> None:
        self.function = function

    async def start(self, session: Session, urls: SessionURLs, api_key: str) -> RunningHarness:
        given = HarnessSession(session.id, urls.base_url, urls.session_url, api_key, session.row)
        if inspect.iscoroutinefunction(self.function):
            task = asyncio.ensure_future(_reported(self.function(given), session))
            return _RunningTask(task)
        thread = threading.Thread(
            target=_run_reported,
            args=(self.function, given, session),
            name=f"harness-{session.id}",
            daemon=True,
        )
        thread.start()
        return _RunningThread()


def _exit_reason(exc: BaseException | None) -> str:
    if exc is None:
        return "the harness returned"
    return f"the harness raised {exc!r}"


async def _reported(work: Any, session: Session) -> None:
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: any failure is the harness's
        session.harness_exited(_exit_reason(exc))
    else:
        session.harness_exited(_exit_reason(None))


def _run_reported(
    function: Callable[[HarnessSession], Any], given: HarnessSession, session: Session
) -> None:
    try:
        function(given)
    except Exception as exc:  # noqa: BLE001 - user code: any failure is the harness's
        session.harness_exited(_exit_reason(exc))
    else:
        session.harness_exited(_exit_reason(None))


class _RunningTask:
    def __init__(self, task: asyncio.Future[None]) -> None:
        self._task = task

    async def stop(self, *, ended: bool) -> None:
        if ended:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), EXIT_GRACE_S)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class _RunningThread:
    """A sync harness cannot be stopped from outside: once its session is over, its next
    call is refused (409), which ends a harness written the usual way."""

    async def stop(self, *, ended: bool) -> None:
        return None


def load_launcher(spec: str) -> Launcher:
    """The launcher of a harness spec; ValueError naming the spec if it cannot run."""
    kind, sep, target = spec.partition(":")
    if kind == "python" and sep:
        try:
            return FunctionLauncher(cast(Callable[[HarnessSession], Any], python.load(target)))
        except (ImportError, ValueError) as exc:
            raise ValueError(f"harness {spec!r} cannot be loaded: {exc}") from exc
    try:
        argv = shlex.split(spec)
    except ValueError as exc:
        raise ValueError(f"harness {spec!r} is not a command line: {exc}") from exc
    if not argv:
        raise ValueError("harness: an empty command")
    if shutil.which(argv[0]) is None:
        raise ValueError(f"harness {spec!r}: {argv[0]!r} is not an executable on PATH")
    return CommandLauncher(argv)
