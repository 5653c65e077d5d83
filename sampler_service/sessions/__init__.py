"""Sessions: agent harnesses drive episodes through an OpenAI-compatible proxy.

A row whose environment is ``session`` is answered by episodes that a harness drives:
the sampler gives each episode a session URL, the harness calls
``{session_url}/v1/chat/completions`` as it would call any OpenAI server, the sampler's
engine answers every call token-in/token-out, and the harness ends the session with its
reward. The stopping rule counts sessions as it counts episodes, and cancels surplus
ones (their next call gets 409 ``session_cancelled``).

- `chat`: the OpenAI wire, the history's canonical form, the tool-call parsers;
- `hub`: the live sessions, where HTTP calls meet episodes;
- `environment`: a session as an episode's environment;
- `harness`: the harnesses the sampler starts from a start-up spec;
- `routes`: the HTTP routes.
"""

from __future__ import annotations

from typing import Any

from sampler_service.environments.base import EnvironmentFactory
from sampler_service.sessions.chat import parser_for
from sampler_service.sessions.environment import SessionEnvironment, SessionSetup
from sampler_service.sessions.harness import HarnessSession, load_launcher
from sampler_service.sessions.hub import SessionHub

#: The environment name of rows answered by sessions.
SESSION_ENV = "session"

__all__ = ["SESSION_ENV", "HarnessSession", "SessionHub", "SessionSetup", "build_sessions"]


def build_sessions(
    *, model: str, api_key: str | None, harness: str | None, tools: str, tokenizer: Any
) -> SessionSetup:
    """Everything sessions share, from the start-up settings; ValueError naming a harness
    spec that cannot run."""
    template = getattr(tokenizer, "chat_template", None) or None
    return SessionSetup(
        hub=SessionHub(model=model, api_key=api_key),
        parser=parser_for(tools, template),
        launcher=load_launcher(harness) if harness else None,
        token_text=lambda token_id: tokenizer.decode([token_id]),
        templated=template is not None,
    )


def session_factory(setup: SessionSetup) -> EnvironmentFactory:
    """The episode runner's factory: a fresh environment per session."""
    return lambda: SessionEnvironment(setup)
