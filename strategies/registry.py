"""Name -> policy registries with validated parameters.

Every policy the service can be configured with is looked up by name and built from a
pydantic parameter model that forbids unknown keys and checks types strictly. DataFlex-RL
silently ignored misspelled parameters; here they raise :class:`PolicyError`, whose
``field`` names the offending parameter so the HTTP layer can answer 422 with it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, ValidationError

Scope = Literal["prompt", "group", "batch", "token", "domain"]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
P = TypeVar("P", bound="type[Policy]")


class PolicyError(ValueError):
    """A policy name or parameter is invalid; ``field`` names the parameter at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Params(BaseModel):
    """Base of every parameter model: unknown keys, ill-typed values and non-finite floats
    are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class NoParams(Params):
    """Parameter model of a policy that takes no parameters."""


class Policy:
    """Base of policy classes: a class declares its scope and the type of its parameters;
    its registry decorator gives it its name and the model that validates them."""

    name: ClassVar[str]
    scope: ClassVar[Scope]

    def __init__(self, params: BaseModel) -> None:
        self.params = params

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered policy: how to validate its parameters and how to build it."""

    params: type[BaseModel]
    factory: Callable[[Any], T]
    scope: Scope


class Registry(Generic[T]):
    """Policies of one family (``kind``), e.g. all stopping rules or all selections.

    ``kind`` doubles as the ``field`` of the error raised for an unknown policy name, so
    it should be the config key that holds the name (``rule``, ``downsample``, ...).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def add(
        self, name: str, params: type[BaseModel], factory: Callable[[Any], T], scope: Scope
    ) -> None:
        """Register ``factory(validated_params)`` under ``name``."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = Entry(params=params, factory=factory, scope=scope)

    def policy(self, name: str, params: type[BaseModel] = NoParams) -> Callable[[P], P]:
        """Class decorator: register a :class:`Policy` subclass as ``name``, built from
        parameters validated by ``params``; the class's ``name`` is set to it."""

        def register(cls: P) -> P:
            cls.name = name
            # A policy class is its own factory: calling it with the validated params builds it.
            self.add(name, params, cast(Callable[[Any], T], cls), cls.scope)
            return cls

        return register

    def names(self, scope: Scope | None = None) -> list[str]:
        """Registered names (of one scope if given), in registration order."""
        return [n for n, e in self._entries.items() if scope is None or e.scope == scope]

    def entry(self, name: str) -> Entry[T]:
        """The entry for ``name``; an unknown name is a :class:`PolicyError` on ``kind``."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = ", ".join(self._entries)
            raise PolicyError(
                f"unknown {self.kind} {name!r}{_suggest(name, self._entries)}; known: {known}",
                field=self.kind,
            ) from None

    def parse(self, name: str, **params: Any) -> BaseModel:
        """Validate ``params`` against the parameter model of ``name``."""
        return parse_params(self.entry(name).params, params, kind=self.kind, name=name)

    def build(self, name: str, **params: Any) -> T:
        """Validate ``params`` and build the policy ``name``."""
        return self.entry(name).factory(self.parse(name, **params))


def _suggest(word: object, choices: Any) -> str:
    """A ' (did you mean ...?)' hint for a misspelled name, or ''."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_params(model: type[M], params: dict[str, Any], *, kind: str, name: str) -> M:
    """Validate ``params`` with ``model``; pydantic's first complaint becomes a PolicyError
    whose message says which policy (``kind`` ``name``) and parameter it is about."""
    try:
        return model(**params)
    except ValidationError as exc:
        err = exc.errors()[0]
    field = ".".join(str(part) for part in err["loc"]) or None
    allowed = [f.alias or n for n, f in model.model_fields.items()]
    if err["type"] == "extra_forbidden":
        message = (
            f"{kind} {name!r}: unknown parameter {field!r}{_suggest(field, allowed)}; "
            f"allowed: {', '.join(allowed) or 'none'}"
        )
    else:
        message = f"{kind} {name!r}: parameter {field!r}: {err['msg']} (got {err.get('input')!r})"
    raise PolicyError(message, field=field) from None
