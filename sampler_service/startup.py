"""What a start checks before anything loads, and what it claims.

`prepare` reads the data, checks the config against it and the model, and claims the
state dir with its store, so that a mistake is one message on the command line before
an engine or tokenizer loads. `SamplerService.build` takes what it returns.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from sampler_service import episodes
from sampler_service.config import (
    JUDGE_PREFIX,
    ConfigError,
    SamplerConfig,
    ServeSettings,
    check_consistency,
    check_context,
    check_judges,
    overridden_by_saved,
    validate_config,
)
from sampler_service.dataset import Dataset, DatasetError, OverlongPrompt, PromptRow
from sampler_service.environments.render import check_prefix_preserving
from sampler_service.sessions import SESSION_ENV, SessionSetup, build_sessions, session_factory
from sampler_service.state_dir import StateDir, StateDirError, fingerprint, open_state_dir
from sampler_service.store import AsyncStore, Store
from sampler_service.verifiers.pool import VerifierPool, resolve_error

log = logging.getLogger(__name__)

#: The store's file in the state dir.
STORE_FILE = "sampler.sqlite"


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
        # verbose=False: a prompt past the model's length is the start-up check's to report,
        # in one line naming it, not the tokenizer's warning.
        tokenizer = self.tokenizer
        if isinstance(row.prompt, str):
            row.text = row.prompt
            row.token_ids = list(tokenizer(row.prompt, verbose=False)["input_ids"])
        else:
            row.text = tokenizer.apply_chat_template(
                row.prompt, add_generation_prompt=True, tokenize=False
            )
            row.token_ids = list(
                tokenizer(row.text, add_special_tokens=False, verbose=False)["input_ids"]
            )


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
    """What `prepare` checked and claimed: the data (tokenized, over-long prompts dropped
    where asked), the environments its rows name, the state dir with its store, and the
    config to start from (the saved one, when the state dir has one, with how far its
    schedule got; else the given one, max_tokens fitted to the context)."""

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
    #: Prompts dropped for having no room for an answer (`--filter-overlong-prompts`).
    filtered_overlong: int = 0
    #: Each judge a row or --verifier names, with who names it first (`check_judges`).
    judges_used: dict[str, str] = field(default_factory=dict)
    #: Harness sessions, when a row or --env names the environment `session`.
    sessions: SessionSetup | None = None

    def check_judges(self, cfg: SamplerConfig) -> None:
        """A config's judges against the servers given and the judges the data uses."""
        check_judges(cfg, self.settings.judge_url, self.judges_used)


def prepare(
    settings: ServeSettings,
    initial_config: SamplerConfig | None = None,
    given: frozenset[str] = frozenset(),
) -> Prepared:
    """Check what the sampler was given and claim its state dir, before any engine loads:
    a bad data file or prompt, a model whose tokenizer cannot load, a config the model
    cannot serve, a verifier or environment that cannot be imported, a state dir held by
    another sampler or made for another run is a `StartupError` (one message, for the
    command line). Every check that does not need the state dir runs before it exists, so
    a refused start leaves nothing behind that would refuse the corrected one.

    `given`: the top-level config keys the command line set (--config, --set), named in
    a warning when the config saved by an earlier run overrides them.
    """
    started_at, s = time.time(), settings
    initial = initial_config or SamplerConfig()
    tokenize = PromptTokenizer(s.model)
    context_length = _context_length(s.model)
    try:
        dataset = Dataset(s.data, tokenize, seed=s.seed)
        _load_tokenizer(tokenize, s.model)
        dropped = dataset.fit_context(context_length, drop_overlong=s.filter_overlong_prompts)
    except OverlongPrompt as exc:
        raise StartupError(f"{exc}; --filter-overlong-prompts drops such prompts") from exc
    except DatasetError as exc:
        raise StartupError(str(exc)) from exc
    specs = dataset.env_specs() | ({s.env} if s.env else set())
    sessions = None
    try:
        env_factories = episodes.load_factories(specs - {SESSION_ENV})
        if SESSION_ENV in specs:
            sessions = build_sessions(
                model=s.model.name,
                api_key=s.api_key,
                harness=s.harness,
                tools=s.session_tools,
                tokenizer=tokenize.tokenizer,
            )
            env_factories[SESSION_ENV] = session_factory(sessions)
        elif s.harness is not None:
            raise ValueError(
                "--harness drives sessions, but no row names the environment 'session' "
                '(rows with "env": "session", or --env session for the rows that name no '
                "environment)"
            )
        if env_factories:  # chat observations need a prefix-preserving template
            check_prefix_preserving(tokenize.tokenizer, str(s.model))
        check_verifier_imports(dataset, s.verifier)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    used = judges_used(dataset, s.verifier)
    # A run the state dir holds serves its saved config, whose judges are checked below.
    resumes = not s.fresh and (s.state_dir / STORE_FILE).exists()
    try:
        if "max_tokens" in given:
            check_context(initial, context_length)
        check_consistency(initial, dataset.domains)
        check_judges(initial, s.judge_url, {} if resumes else used)
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
    # Claimed: what follows is said once the start cannot be refused for its inputs.
    if dropped:
        log.warning(
            "--filter-overlong-prompts: dropped %d over-long prompt%s (no room for an answer "
            "in the model's context of %s tokens), e.g. %s",
            len(dropped),
            "" if len(dropped) == 1 else "s",
            context_length,
            ", ".join(f"{row.id!r} ({row.where})" for row in dropped[:3]),
        )
    store = Store(s.state_dir / STORE_FILE, s.store_checkpoint_s or None)
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
        len(dropped),
        used,
        sessions,
    )
    if (saved := store.get("config")) is None:
        if "max_tokens" not in given:
            prepared.config = _fitted(initial, dataset, context_length)
        try:
            prepared.check_judges(initial)
        except ConfigError as exc:
            state_dir.release()
            store.close()
            raise StartupError(f"--config/--set: {exc}") from exc
    else:
        try:
            cfg = validate_config(saved["config"])
            check_consistency(cfg, dataset.domains)
            check_context(cfg, context_length)
            prepared.check_judges(cfg)
        except ConfigError as exc:
            state_dir.release()
            store.close()
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


def _load_tokenizer(tokenize: PromptTokenizer, model: Path) -> None:
    """Load the model's tokenizer now: a model directory without a usable one is a
    start-up error naming it, not a failure once the engine is loading."""
    try:
        tokenize.tokenizer  # noqa: B018 - a cached property: this loads it
    except (OSError, ValueError, TypeError) as exc:
        raise DatasetError(f"--model {model}: its tokenizer cannot be loaded ({exc})") from exc


def _fitted(cfg: SamplerConfig, dataset: Dataset, context_length: int | None) -> SamplerConfig:
    """`cfg` with max_tokens cut to what the context leaves after the longest prompt (the
    prompts are tokenized and each leaves room for an answer by now: this cannot fail)."""
    if context_length is None:
        return cfg
    longest, _ = dataset.longest_prompt()
    room = context_length - longest
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


def check_verifier_imports(dataset: Dataset, default: str) -> None:
    """Import the `python:` verifiers the flags and the data name, in this process (whose
    `sys.path` the verifier workers get): a typo is refused before the state dir exists.
    `check_verifiers` then resolves every spec in a worker, as verify does."""
    for spec, user in _verifier_users(dataset, default).items():
        if spec.startswith("python:") and (error := resolve_error(spec)[1]):
            raise ValueError(f"verifier {spec!r}, used by {user}, cannot be loaded: {error}")


def _verifier_users(dataset: Dataset, default: str) -> dict[str, str]:
    """Each verifier spec in use, with who uses it first (for the messages)."""
    # The default is checked even when every row names its own: it is what a row added
    # later, or a mistyped flag, would silently fall back to.
    users = {default: "--verifier (the default for rows naming none)"}
    for rows in dataset.rows.values():
        for row in rows:
            if row.verifier is not None:
                users.setdefault(str(row.verifier), f"prompt {row.id!r} (domain {row.domain!r})")
    return users


def judges_used(dataset: Dataset, default: str) -> dict[str, str]:
    """Each judge (`judge:NAME`) the flags and the data name, with who names it first."""
    return {
        spec.removeprefix(JUDGE_PREFIX): user
        for spec, user in _verifier_users(dataset, default).items()
        if spec.startswith(JUDGE_PREFIX)
    }


async def check_verifiers(verifiers: VerifierPool, dataset: Dataset, default: str) -> None:
    """Resolve the default verifier and every program verifier the data names in a
    verifier worker, or refuse to start. A spec that cannot be imported would otherwise
    fail every verification in silence. Judges were checked against the config."""
    for spec, user in _verifier_users(dataset, default).items():
        if spec.startswith(JUDGE_PREFIX):
            continue
        if error := await verifiers.check(spec):
            raise VerifierSpecError(f"verifier {spec!r}, used by {user}, cannot be loaded: {error}")
