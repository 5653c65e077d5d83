"""What every config model shares: strictness, bounds, and the error that names a knob."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
)


class ConfigError(ValueError):
    """A configuration that cannot be served; `field` names the knob at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class LiveModel(BaseModel):
    """A live config model: what a client sends is taken literally, never coerced.

    Strict types reject `"3"` for an int, `true` for a count and `"nan"` for a float, and
    no float may be NaN or infinite: a lax parse once turned `"nan"` into a threshold that
    made every answer negative, and `"inf"` into leases that never expire.
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=False, strict=True, allow_inf_nan=False
    )


#: Upper bounds that the machine can honour: each knob scales memory or work, and an
#: unbounded one let a single PATCH spawn a billion prompt tasks.
MAX_PROMPTS = 65_536
MAX_LIST_ITEMS = 100_000
