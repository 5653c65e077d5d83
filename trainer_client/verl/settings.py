"""What the verl integration needs to know about the sampler, and what it must refuse.

`SamplerSettings` is read from the verl config section ``trainer.v1.adaptive_rollout``
(Hydra: ``+trainer.v1.adaptive_rollout.url=http://sampler:8000``; the V0 trainer reads the
same section), with the URL and API key falling back to the environment variables
``ADAPTIVE_ROLLOUT_URL`` / ``ADAPTIVE_ROLLOUT_API_KEY``.

`check_sampler_config` compares the sampler's live config (GET /v1/config) with what verl
assumes about a GRPO group:

- every group has exactly ``actor_rollout_ref.rollout.n`` samples: verl lays a batch out as
  ``train_batch_size x n`` rows and sizes its mini-batches as ``ppo_mini_batch_size x n``.
  So ``group_size`` must equal ``n``, and nothing may leave a group smaller: no
  ``maxvar``/``gfpo`` (they keep a subset of a group) and no ``topk`` (it drops samples out
  of a frame); the stopping rule must generate at least ``group_size`` answers for every
  prompt (``est`` budgets and small adaptive waves may stop earlier);
- the sampler's temperature is the one verl recomputes log-probs at;
- policies that drop whole groups (``nonzero_std``, ``difffilter``) are fine.

Pure Python: importable without verl.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strategies.allocation import ALLOCATIONS
from strategies.estimator import EstimatorParams
from strategies.stopping import StoppingParams
from trainer_client.contract.dtypes import ServingDType
from trainer_client.contract.features import LOSS_MASK, REPLAYED, VERSION_SPANS

#: The name our trainer mode and checkpoint engine are registered under in verl.
MODE = "adaptive_rollout"

#: Group-scope policies that keep a subset of a group's samples (verl needs all n).
SUBSET_GROUP_POLICIES = frozenset({"maxvar", "gfpo"})
#: Batch-scope policies that drop samples from a frame.
SAMPLE_DROPPING_BATCH_POLICIES = frozenset({"topk"})
#: Keys verl itself puts in our section (its checkpoint-engine plumbing), not ours to read.
_VERL_OWNED_KEYS = frozenset({"parameter_sync_step"})


class IncompatibleSamplerConfig(ValueError):
    """The sampler's config breaks an assumption verl makes about groups; `problems` lists each."""

    def __init__(self, problems: list[str], url: str = "") -> None:
        self.problems = problems
        where = f" at {url}" if url else ""
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"the sampler{where} is configured in a way verl cannot train on:\n{lines}\n"
            "Fix it with PATCH /v1/config (e.g. `curl -X PATCH $URL/v1/config -d "
            "'{\"group_size\": N}'`) or in the verl config, then restart the trainer."
        )


class SamplerSettings(BaseModel):
    """The ``trainer.v1.adaptive_rollout`` section of a verl config: strict (unknown keys
    and wrong types are refused with the key's name) so a typo cannot silently fall back
    to a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    url: str = ""
    api_key: str | None = None
    consumer: str = Field("verl", min_length=1)
    #: How weights reach the sampler at the end of each step: ``upload`` (PUT /v1/weights,
    #: any set-up), ``path`` (write a safetensors file under `weights_dir`, a directory the
    #: sampler can read too, then POST /v1/weights/load) or ``none``.
    weight_sync: Literal["upload", "path", "none"] = "upload"
    weights_dir: str | None = None
    #: The dtype floating weights travel in: ``auto`` is the one the sampler serves in
    #: (so an fp32 trainer sends bf16 to a bf16 sampler: half the bytes, within its
    #: upload limit); the cast happens on the trainer's GPU before the host copy.
    dtype: Literal["auto"] | ServingDType = "auto"
    #: Keep only the newest file in `weights_dir` (path mode writes one per step).
    keep_weight_files: int = Field(1, ge=1)
    #: ``sampler``: train on the service's advantages (e.g. Reinforce-Ada's global
    #: baseline); ``verl``: let verl's estimator compute them from the rewards; ``auto``:
    #: the service's unless its estimator is ``grpo`` (then both are the same numbers).
    advantages: Literal["auto", "sampler", "verl"] = "auto"
    #: Multiply the service's sample/token weights into verl's ``rollout_is_weights``.
    use_sample_weights: bool = True
    #: Answers the sampler replayed into all-wrong groups (its ``replay`` config), which
    #: an older policy sampled: ``drop`` leaves them out of the loss (their reward still
    #: counts in the group's); ``keep`` trains on them with their own rollout log-probs,
    #: for verl's rollout correction (algorithm.rollout_correction) to weight.
    replayed: Literal["drop", "keep"] = "drop"
    #: Refuse to start when the sampler's config is incompatible (see the module docstring).
    check_config: bool = True
    #: PATCH the sampler's batch_groups to the trainer's train_batch_size at start-up.
    configure_sampler: bool = True
    #: Seconds one lease call waits for groups; the manager keeps asking until it has enough.
    lease_wait_s: float = Field(10.0, gt=0.0)
    #: Give up (with a message saying what the sampler reported) when no group arrived
    #: for this long. 0 waits forever.
    group_timeout_s: float = Field(1800.0, ge=0.0)
    #: The client's watchdog: a sampler that stops answering raises after this long.
    watchdog_s: float = Field(120.0, gt=0.0)
    #: Push the trainer's weights once before the first step (``auto``: only when verl
    #: resumed from a checkpoint, since a fresh run starts from the sampler's own model).
    push_initial_weights: Literal["auto", "always", "never"] = "auto"
    extra: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> SamplerSettings:
        """From the config section; the URL and key fall back to the environment."""
        data = {k: v for k, v in dict(section or {}).items() if k not in _VERL_OWNED_KEYS}
        try:
            settings = cls(**data)
        except ValidationError as exc:
            problems = "; ".join(
                f"trainer.v1.{MODE}.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                for e in exc.errors()
            )
            raise ValueError(f"{problems} (known keys: {', '.join(cls.model_fields)})") from None
        settings.url = (settings.url or os.environ.get("ADAPTIVE_ROLLOUT_URL", "")).rstrip("/")
        settings.api_key = settings.api_key or os.environ.get("ADAPTIVE_ROLLOUT_API_KEY") or None
        if not settings.url:
            raise ValueError(
                f"no sampler URL: set +trainer.v1.{MODE}.url=http://HOST:PORT in the verl config "
                "or the ADAPTIVE_ROLLOUT_URL environment variable"
            )
        if settings.weight_sync == "path" and not settings.weights_dir:
            raise ValueError(
                f"trainer.v1.{MODE}.weight_sync=path needs weights_dir (shared storage)"
            )
        return settings

    @classmethod
    def from_verl_config(cls, config: Any) -> SamplerSettings:
        """From a verl (OmegaConf) config: the ``trainer.v1.adaptive_rollout`` section."""
        section = _select(config, f"trainer.v1.{MODE}")
        if section is not None and not isinstance(section, Mapping):
            from omegaconf import OmegaConf  # verl's configs are OmegaConf objects

            section = OmegaConf.to_container(section, resolve=True)
        return cls.from_mapping(section)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def client_kwargs(self) -> dict[str, Any]:
        return {
            "api_key": self.api_key,
            "consumer": self.consumer,
            "watchdog_s": self.watchdog_s,
            # The conversion trains on Sample.loss_mask == 1 tokens only and handles
            # replayed answers (`replayed`), so episodes and replay may be served to it;
            # answers of several versions carry each token's own logprob, which verl's
            # token-level rollout correction (required then) weighs.
            "features": [LOSS_MASK, REPLAYED, VERSION_SPANS],
        }

    def sampler_advantages(self, sampler_config: Mapping[str, Any]) -> bool:
        """Whether verl should train on the service's advantages (see `advantages`)."""
        if self.advantages == "auto":
            # GET /v1/config always names the estimator; only GRPO's equals verl's own.
            return sampler_config.get("advantage") != "grpo"
        return self.advantages == "sampler"


def _knob(params: type[BaseModel], sampler: Mapping[str, Any], name: str) -> Any:
    """`name` from the sampler's config (GET /v1/config), else the default the sampler's
    own policy model gives it: the defaults live once, in strategies."""
    if name in sampler:
        return sampler[name]
    return params.model_fields[name].get_default(call_default_factory=True)


def _select(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return node


def _differs(sampler: Mapping[str, Any], key: str, value: float | None) -> bool:
    """Both sides set `key` and the sampler's value is not verl's (floats, so within 1e-9)."""
    return value is not None and key in sampler and abs(float(sampler[key]) - float(value)) > 1e-9


def _policy_names(sampler: Mapping[str, Any], key: str) -> list[Any]:
    """The names of the policies the config lists under `key`, each a spec or a bare name."""
    return [s.get("name") if isinstance(s, Mapping) else str(s) for s in sampler.get(key) or []]


def check_sampler_config(
    sampler: Mapping[str, Any],
    *,
    rollout_n: int,
    temperature: float | None = None,
    top_p: float | None = None,
    max_response_length: int | None = None,
    rollout_is: str | None = None,
) -> tuple[list[str], list[str]]:
    """(problems, warnings) of training verl with rollout.n = `rollout_n` on this sampler
    config; `rollout_is` is verl's ``algorithm.rollout_correction.rollout_is``."""
    problems: list[str] = []
    warnings: list[str] = []
    if sampler.get("weight_update_mode") == "continue" and rollout_is != "token":
        problems.append(
            "the sampler's weight updates continue running answers (weight_update_mode "
            "continue), so one answer's tokens may come from several policy versions, each "
            "with its own logprob: set algorithm.rollout_correction.rollout_is=token so verl "
            f"weighs every token by its own truncated ratio (it is {rollout_is!r})"
        )
    group_size = _knob(StoppingParams, sampler, "group_size")
    if group_size != rollout_n:
        what = (
            "keeps every sample (group_size 0, variable group sizes)"
            if group_size == 0
            else f"has group_size {group_size}"
        )
        fix = f"set the sampler's group_size to {rollout_n}" + (
            f" (or rollout.n to {group_size})" if group_size else ""
        )
        problems.append(
            f"verl needs every group to have exactly actor_rollout_ref.rollout.n = {rollout_n} samples, "
            f"but the sampler {what}: {fix}"
        )
    for name in _policy_names(sampler, "group_policies"):
        if name in SUBSET_GROUP_POLICIES:
            problems.append(
                f"group policy {name!r} keeps a subset of each group's samples; verl needs all "
                f"{rollout_n} (policies that drop whole groups, like nonzero_std and difffilter, are fine)"
            )
    for name in _policy_names(sampler, "batch_policies"):
        if name in SAMPLE_DROPPING_BATCH_POLICIES:
            problems.append(
                f"batch policy {name!r} drops samples out of groups; verl needs all {rollout_n} "
                "(reweighting policies per/softmax/diffband/ar are fine: they become rollout_is_weights)"
            )
    rule = sampler.get("rule")
    if group_size > 0 and rule not in (None, "fixed"):
        if rule == "est":
            n_min = _knob(EstimatorParams, sampler.get("est") or {}, "n_min")
            if n_min < group_size:
                problems.append(
                    f"rule 'est' may stop a prompt after est.n_min = {n_min} < group_size = {group_size} "
                    f"answers; set est.n_min >= {group_size} or use another rule"
                )
        else:
            first_wave = _knob(StoppingParams, sampler, "wave_size")
            if (
                _knob(StoppingParams, sampler, "wave") == "adaptive"
                and sampler.get("mode") != "rounds"
            ):
                first_wave = 1  # an adaptive wave can be a single answer
            k_pos = _knob(StoppingParams, sampler, "k_pos")
            k_neg = _knob(StoppingParams, sampler, "k_neg")
            least = k_pos if rule == "positive" else k_pos + k_neg
            if max(first_wave, least) < group_size:
                problems.append(
                    f"rule {rule!r} can stop a prompt with fewer than group_size = {group_size} answers "
                    f"(first wave {first_wave}, rule satisfied after {least}); use wave 'fixed' with "
                    f"wave_size >= {group_size}, or rule 'fixed'"
                )
    allocation = sampler.get("allocation")
    if group_size > 0 and isinstance(allocation, Mapping):
        name = allocation.get("name")
        if name in ALLOCATIONS.names():
            # The fewest answers the policy can give a prompt: knapsack's n_min, else the pilot.
            model = ALLOCATIONS.entry(name).params
            knob = "n_min" if "n_min" in model.model_fields else "pilot"
            least = _knob(model, allocation.get("params") or {}, knob)
            if least < group_size:
                problems.append(
                    f"allocation {name!r} may stop a prompt after its {knob} = {least} < "
                    f"group_size = {group_size} answers; set allocation.params.{knob} >= "
                    f"{group_size} or no allocation"
                )
    if _differs(sampler, "temperature", temperature):
        problems.append(
            f"the sampler generates at temperature {sampler.get('temperature')} but verl computes "
            f"log-probs at actor_rollout_ref.rollout.temperature = {temperature}; they must be equal"
        )
    if _differs(sampler, "top_p", top_p):
        warnings.append(
            f"sampler top_p {sampler.get('top_p')} differs from rollout.top_p {top_p} "
            "(verl does not use top_p in the loss; the logprobs come from the sampler)"
        )
    if (
        max_response_length is not None
        and "max_tokens" in sampler
        and int(sampler["max_tokens"]) > int(max_response_length)
    ):
        warnings.append(
            f"sampler max_tokens {sampler.get('max_tokens')} > data.max_response_length "
            f"{max_response_length}: size verl's token budgets (ppo_max_token_len_per_gpu) for the longer answers"
        )
    return problems, warnings


def require_compatible(sampler: Mapping[str, Any], *, url: str = "", **kw: Any) -> list[str]:
    """Raise `IncompatibleSamplerConfig` listing every problem; return the warnings."""
    problems, warnings = check_sampler_config(sampler, **kw)
    if problems:
        raise IncompatibleSamplerConfig(problems, url)
    return warnings


#: What verl's model config uses when ``override_config.attn_implementation`` is unset.
VERL_DEFAULT_ATTENTION = "flash_attention_2"
_FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")


def flash_attn_installed() -> bool:
    """Whether the flash-attn package (which ``verl[verl-core]`` does not install) is importable."""
    return importlib.util.find_spec("flash_attn") is not None


def attention_of(config: Any) -> str:
    """The attention implementation verl's FSDP actor will ask transformers for."""
    override = _select(config, "actor_rollout_ref.model.override_config")
    chosen = override.get("attn_implementation") if override is not None else None
    return str(chosen or VERL_DEFAULT_ATTENTION)


def check_attention(config: Any, *, flash_attn: bool) -> list[str]:
    """Problems with the actor's attention: flash attention without flash-attn installed
    (transformers raises ImportError when the actor loads the model), and verl's padding
    removal without flash attention (it packs a micro-batch into one sequence and relies on
    flash attention's variable-length kernels to keep the sequences apart)."""
    problems = []
    attention = attention_of(config)
    where = "actor_rollout_ref.model.override_config.attn_implementation"
    if attention in _FLASH_ATTENTION and not flash_attn:
        problems.append(
            f"{where} is {attention} (verl's default when unset) but flash-attn is not installed: "
            f"set {where}=sdpa and actor_rollout_ref.model.use_remove_padding=false, or install flash-attn"
        )
    model = _select(config, "actor_rollout_ref.model")
    if (
        attention not in _FLASH_ATTENTION
        and model is not None
        and model.get("use_remove_padding", False)
    ):
        problems.append(
            f"actor_rollout_ref.model.use_remove_padding=true needs flash attention, but {where} is "
            f"{attention}: set actor_rollout_ref.model.use_remove_padding=false"
        )
    return problems


def check_verl_config(config: Any, *, flash_attn: bool | None = None) -> list[str]:
    """Problems in the verl config itself when the sampler does the rollout.

    `flash_attn`: whether flash-attn is installed where the actor runs (default: here).
    """
    problems = check_attention(
        config, flash_attn=flash_attn_installed() if flash_attn is None else flash_attn
    )
    filter_groups = _select(config, "algorithm.filter_groups")
    if filter_groups is not None and filter_groups.get("enable", False):
        problems.append(
            "algorithm.filter_groups (DAPO) would evict groups the sampler already selected; "
            "use the sampler's nonzero_std group policy instead and set algorithm.filter_groups.enable=False"
        )
    reward_model = _select(config, "reward.reward_model")
    if reward_model is not None and reward_model.get("enable", False):
        problems.append(
            "reward.reward_model.enable=True: rewards come from the sampler's verifiers; disable verl's reward model"
        )
    return problems


def sampler_metrics(stats: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """GET /v1/stats flattened into numeric metrics for verl's logger (``adaptive_rollout/...``)."""
    head = f"{prefix}/{MODE}" if prefix else MODE
    out: dict[str, float] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, int | float):
            out[f"{head}/{key}"] = float(value)

    for key in (
        "policy_version",
        "config_version",
        "samples_per_s",
        "tokens_per_s",
        "groups_per_s",
        "groups_emitted",
    ):
        put(key, stats.get(key))
    for key, value in (stats.get("queue") or {}).items():
        put(f"queue/{key}", value)
    for domain, d in (stats.get("domains") or {}).items():
        for key in ("pass_rate", "target_share", "admitted_share", "emitted_share"):
            put(f"{domain}/{key}", (d or {}).get(key))
    for reason, count in (stats.get("dropped") or {}).items():
        put(f"dropped/{reason}", count)
    return out
