"""What a start checks before anything loads, and what it claims.

`prepare` reads the data, checks the config against it and the model, and claims the
state dir with its store, so that a mistake is one message on the command line before
an engine or tokenizer loads. `SamplerService.build` takes what it returns.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from sampler_service import episodes
from sampler_service.config import (
    ConfigError,
    SamplerConfig,
    ServeSettings,
    check_consistency,
    check_context,
    overridden_by_saved,
    validate_config,
)
from sampler_service.dataset import Dataset, DatasetError, PromptRow
from sampler_service.environments.render import check_prefix_preserving
from sampler_service.state_dir import StateDir, StateDirError, fingerprint, open_state_dir
from sampler_service.store import AsyncStore, Store
from sampler_service.verifiers.pool import VerifierPool

log = logging.getLogger(__name__)


class VerifierSpecError(RuntimeError):
    """A verifier named by --verifier or by a data row cannot be loaded."""


class StartupError(RuntimeError):
    """The sampler cannot start with what it was given; the message says why, for the user."""


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class PromptTokenizer:
    """Tokenizes a prompt row on first use, with the model's tokenizer loaded once.

    The dataset is opened (and its rows checked) before the tokenizer loads; rows are
    tokenized when first served, after the start loaded it (`tokenizer`).
    """

    def __init__(self, model_dir: Path) -> None:
        self._model_dir = model_dir

    @functools.cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(self._model_dir)

    def __call__(self, row: PromptRow) -> None:
        tokenizer = self.tokenizer
        if isinstance(row.prompt, str):
            row.text = row.prompt
            row.token_ids = list(tokenizer(row.prompt)["input_ids"])
        else:
            row.text = tokenizer.apply_chat_template(
                row.prompt, add_generation_prompt=True, tokenize=False
            )
            row.token_ids = list(tokenizer(row.text, add_special_tokens=False)["input_ids"])


def _context_length(model_dir: Path) -> int | None:
    """The model's context length from its config.json, if it states one."""
    try:
        config = orjson.loads((model_dir / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else None


@dataclass
class Prepared:
    """What `prepare` checked and claimed: the data, the environments its rows name, the
    state dir with its store, and the config to start from (the saved one, when the state
    dir has one, with how far its schedule got)."""

    settings: ServeSettings
    #: When the start began (the service's uptime counts from it).
    started_at: float
    dataset: Dataset
    tokenize: PromptTokenizer
    context_length: int | None
    env_factories: dict[str, Any]
    state_dir: StateDir
    store: AsyncStore
    config: SamplerConfig
    config_version: int
    schedule_applied: int
    #: Unless someone chose max_tokens, answers get what the context leaves (`fitted`).
    fit_max_tokens: bool


def prepare(
    settings: ServeSettings,
    initial_config: SamplerConfig | None = None,
    given: frozenset[str] = frozenset(),
) -> Prepared:
    """Check what the sampler was given and claim its state dir, before any engine or
    tokenizer loads: a bad data file, a config the model cannot serve, a state dir held
    by another sampler or made for another run is a `StartupError` (one message, for the
    command line), and a data or config error leaves nothing created.

    `given`: the top-level config keys the command line set (--config, --set), named in
    a warning when the config saved by an earlier run overrides them.
    """
    started_at, s = time.time(), settings
    initial = initial_config or SamplerConfig()
    tokenize = PromptTokenizer(s.model)
    try:
        dataset = Dataset(s.data, tokenize, seed=s.seed)
    except DatasetError as exc:
        raise StartupError(str(exc)) from exc
    context_length = _context_length(s.model)
    specs = dataset.env_specs() | ({s.env} if s.env else set())
    try:
        env_factories = episodes.load_factories(specs)
        if env_factories:  # chat observations need a prefix-preserving template
            check_prefix_preserving(tokenize.tokenizer, str(s.model))
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    try:
        if "max_tokens" in given:
            check_context(initial, context_length)
        check_consistency(initial, dataset.domains)
    except ConfigError as exc:
        hint = (
            f"; start with --set max_tokens=N, N <= {context_length}"
            if exc.field == "max_tokens"
            else ""
        )
        raise StartupError(f"--config/--set: {exc}{hint}") from exc
    try:
        state_dir = open_state_dir(
            s.state_dir, fingerprint(s.model, s.data, s.backend), resume=s.resume, fresh=s.fresh
        )
    except StateDirError as exc:
        raise StartupError(str(exc)) from exc
    store = Store(s.state_dir / "sampler.sqlite", s.store_checkpoint_s or None)
    prepared = Prepared(
        s,
        started_at,
        dataset,
        tokenize,
        context_length,
        env_factories,
        state_dir,
        AsyncStore(store),
        initial,
        0,
        0,
        "max_tokens" not in given,
    )
    if (saved := store.get("config")) is not None:
        prepared.fit_max_tokens = False
        try:
            cfg = validate_config(saved["config"])
            check_consistency(cfg, dataset.domains)
            check_context(cfg, context_length)
        except ConfigError as exc:
            raise StartupError(
                f"the config saved in {s.state_dir} cannot be served: {exc}; start a new "
                "run with --fresh or another --state-dir"
            ) from exc
        prepared.config, prepared.config_version = cfg, int(saved["version"])
        prepared.schedule_applied = int(saved.get("schedule_applied", 0))
        for knob in overridden_by_saved(given, initial, cfg):
            log.warning(
                "the config saved in %s (v%d) overrides the command line's %s; "
                "PATCH /v1/config to change it",
                s.state_dir,
                prepared.config_version,
                knob,
            )
    return prepared


async def fitted(prepared: Prepared) -> SamplerConfig:
    """The config to start with: max_tokens cut to what the context leaves after the
    longest prompt, unless someone chose it."""
    cfg, context_length = prepared.config, prepared.context_length
    if not prepared.fit_max_tokens or context_length is None:
        return cfg
    longest, prompt_id = await asyncio.get_running_loop().run_in_executor(
        None, prepared.dataset.longest_prompt
    )
    room = context_length - longest
    if room < 1:
        raise ConfigError(
            f"prompt {prompt_id!r} has {longest} tokens: no room for an answer in the "
            f"model's context ({context_length} tokens)",
            "max_tokens",
        )
    if cfg.max_tokens <= room:
        return cfg
    log.info(
        "max_tokens %d: what the model's context (%d tokens) leaves after the longest "
        "prompt (%d tokens); --set max_tokens=N chooses another",
        room,
        context_length,
        longest,
    )
    return cfg.model_copy(update={"max_tokens": room})


async def check_verifiers(verifiers: VerifierPool, dataset: Dataset, default: str) -> None:
    """Resolve the default verifier and every one the data names, or refuse to start.

    A spec that cannot be imported would otherwise score every answer 0 in silence.
    """
    # The default is checked even when every row names its own: it is what a row added
    # later, or a mistyped flag, would silently fall back to.
    users = {default: "--verifier (the default for rows naming none)"}
    for rows in dataset.rows.values():
        for row in rows:
            if row.verifier is not None:
                users.setdefault(str(row.verifier), f"prompt {row.id!r} (domain {row.domain!r})")
    for spec, user in users.items():
        if error := await verifiers.check(spec):
            raise VerifierSpecError(f"verifier {spec!r}, used by {user}, cannot be loaded: {error}")
