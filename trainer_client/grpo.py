"""The reference GRPO trainer: takes groups from the sampler over HTTP, pushes weights back.

The whole algorithm is `GRPOTrainer.train_step` plus the three functions above it:

- per-token logprobs of the sampled tokens under the current policy, at the sampler's
  temperature (log_softmax(logits / T), as the sampler computed its own);
- advantages from the service (`advantage="server"`, e.g. Reinforce-Ada's global
  baseline) or recomputed here per group (`"grpo"`: (r - mean) / (std + 1e-6));
- PPO-clip with asymmetric clipping (0.2 low, 0.28 high, as DAPO) against the proximal
  policy (the weights at the start of the step), token-mean over the batch's response
  tokens, each token's loss multiplied by the service's sample and token weights and,
  optionally, by a truncated importance weight min(pi_old / pi_sampler, cap) that
  corrects for the sampler running older weights;
- AdamW; every `sync_every` steps the weights go to the sampler as a new policy version.

Nothing here imports the server: a trainer node needs torch, transformers and httpx.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from trainer_client import checkpoints
from trainer_client.batch import BatchAssembler, TrainBatch
from trainer_client.client import SamplerClient
from trainer_client.contract.features import LOSS_MASK, NO_TEXT, REPLAYED, VERSION_SPANS
from trainer_client.contract.flags import command_line
from trainer_client.train_config import TrainConfig

log = logging.getLogger(__name__)

# Seconds between progress lines when stderr is not a terminal.
PIPED_PROGRESS_INTERVAL_S = 30.0
#: Scores a model on held-out prompt rows: (model, tokenizer, rows) -> score per domain.
Evaluator = Callable[[Any, Any, list[dict[str, Any]]], dict[str, float]]


class TrainingStopped(Exception):
    """Training ended early on a signal (a checkpoint was saved); `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Interrupted(BaseException):
    """Raised by the signal handler into a wait for groups (nothing to finish there)."""


class StopSignals:
    """SIGINT and SIGTERM during training: the step under way finishes, then training stops.

    A signal while waiting for groups stops at once (`interruptible`); a second signal
    while a step runs raises KeyboardInterrupt as usual. Installed only on the main thread
    (the only one Python delivers signals to).
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._waiting = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        if self._waiting:
            raise Interrupted
        tqdm.write(
            f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
            "(again to stop at once)",
            file=sys.stderr,
        )

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False


# -- the algorithm ------------------------------------------------------------------------
def token_logprobs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """[B, L]: column t holds log p(token t | tokens < t) at temperature T (0 at t = 0)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature.view(-1, 1, 1), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """(r - group mean) / (group std + eps), std with ddof 1; 0 for a singleton group."""
    n = torch.zeros(int(group_index.max()) + 1).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros_like(n).index_add_(0, group_index, rewards) / n
    dev = rewards - mean[group_index]
    var = torch.zeros_like(n).index_add_(0, group_index, dev**2) / (n - 1).clamp(min=1)
    adv = dev / (var.sqrt()[group_index] + eps)
    return torch.where(n[group_index] > 1, adv, torch.zeros_like(adv))


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO-clip: sum_t w_t max(-A r_t, -A clip(r_t, 1-lo, 1+hi)) / #tokens,
    over the tokens where `mask` is 1."""
    keep = mask > 0
    # Masked-out positions (an episode's observation tokens) get ratio 1 and weight 0
    # before any arithmetic: whatever was recorded there, even an inf, reaches neither
    # the loss nor its gradient (a product with the mask would turn inf into NaN).
    ratio = torch.exp(logprobs - torch.where(keep, old_logprobs, logprobs.detach()))
    weights = torch.where(keep, weights, 0.0)
    adv = advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped) * weights
    n_tokens = mask.sum().clamp(min=1.0)
    loss = per_token.sum() / n_tokens
    clip_frac = ((clipped > unclipped).float() * mask).sum() / n_tokens
    return loss, {"clip_frac": clip_frac.item()}


#: The truncated importance correction's cap for a batch holding an answer a `continue`
#: weight update ran across, where none is configured.
SPANNING_TIS_CAP = 2.0


def tis_cap(configured: float | None, batch: TrainBatch) -> float | None:
    """The cap of the per-token importance weight min(pi_old / pi_sampler, cap): the
    configured one, else SPANNING_TIS_CAP where the batch holds an answer decoded under
    several versions (each token's sampler logprob is its own version's, so the one
    correction covers every span), else none."""
    if configured is not None:
        return configured
    return SPANNING_TIS_CAP if bool(batch.spanning.any()) else None


def approx_kl(logprobs: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimate of KL(sampler || policy) over response tokens: E[r - 1 - log r]."""
    log_r = torch.where(mask > 0, logprobs - behaviour, 0.0)
    return ((torch.exp(log_r) - 1 - log_r) * mask).sum().item() / max(mask.sum().item(), 1.0)


class GRPOTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        client: SamplerClient | None = None,
        evaluate_rows: Evaluator | None = None,
    ) -> None:
        """`evaluate_rows` scores the model on the held-out rows of `cfg.eval_files`, per
        domain (default: greedy exact-match accuracy of single answers; an episode task
        passes its own, e.g. greedy episode success with the task's tool)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from trainer_client.evaluate import greedy_accuracy_of

        self.cfg = cfg
        if not cfg.progress:  # --no-progress: transformers' "Loading weights" bars too
            hf_logging.disable_progress_bar()
        self.evaluate_rows = evaluate_rows or greedy_accuracy_of
        torch.manual_seed(cfg.seed)
        self.client = client or SamplerClient(
            cfg.url,
            api_key=cfg.api_key,
            consumer=cfg.consumer,
            watchdog_s=cfg.watchdog_s,
            max_unacked=cfg.stream_credit,
            groups_per_step=cfg.batch_groups,
            # It trains on token ids and logprobs and never reads a text (a third fewer
            # bytes per group on the wire), on an episode's sampled tokens only, and on
            # replayed answers as off-policy ones (`cfg.replayed`), and on answers decoded
            # under several versions through the truncated importance weights (`tis_cap`).
            features=[NO_TEXT, LOSS_MASK, REPLAYED, VERSION_SPANS],
        )
        if cfg.fresh and (aside := checkpoints.move_aside(cfg.out_dir)) is not None:
            tqdm.write(f"--fresh: moved {cfg.out_dir} aside to {aside}", file=sys.stderr)
        #: The model directory training starts from: --model, or the run's newest
        #: checkpoint in --out when this is a rerun (`checkpoints.choose_start`).
        self.start = checkpoints.choose_start(
            cfg.model, cfg.out_dir, resume=cfg.resume, fresh=cfg.fresh
        )
        self.tokenizer = AutoTokenizer.from_pretrained(self.start)
        model = AutoModelForCausalLM.from_pretrained(self.start, dtype=torch.float32)
        # transformers wraps `to` with functools.wraps, whose stub asks for the model twice.
        self.model = model.to(cfg.device)  # type: ignore[arg-type]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.step, self.version = 0, 0
        if (resumed := checkpoints.read_checkpoint(self.start)) is not None:
            self.step, self.version = resumed.step, resumed.policy_version
            if (self.start / "optimizer.pt").is_file():
                self.optimizer.load_state_dict(torch.load(self.start / "optimizer.pt"))
            if self.start != cfg.model:
                tqdm.write(
                    f"resuming from {self.start} (step {self.step}, policy v{self.version}); "
                    "--fresh starts from --model instead",
                    file=sys.stderr,
                )
        if moved := checkpoints.trim_log(cfg.out_dir, self.step):
            tqdm.write(
                f"{moved} log records of steps after {self.step} moved to "
                f"{cfg.out_dir / checkpoints.ROLLED_BACK_LOG}: they are trained again",
                file=sys.stderr,
            )
        #: Weight pushes after a training step, counted for `save_every`.
        self._pushes = 0
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self._temperatures: dict[int, float] = {}
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self._lag_warned = False
        #: The sampler's max_staleness, as of the newest config read (None: unbounded).
        self._max_staleness: int | None = None
        self._held_ahead = held_pushes(cfg.stream_credit, cfg.batch_groups, cfg.sync_every)

    # -- one step: the whole algorithm ---------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        cfg, b = self.cfg, batch.to(self.cfg.device)
        temps = self._temperature_of(batch).to(cfg.device)
        mask = b.response_mask
        self.model.eval()  # no dropout: logprobs must be the policy's, as the sampler's are
        with torch.no_grad():
            old_lp = token_logprobs(self.model, b.input_ids, b.attention_mask, temps)
        adv = (
            b.advantages if cfg.advantage == "server" else grpo_advantages(b.rewards, b.group_index)
        )
        weights = b.sample_weights[:, None] * torch.where(mask > 0, b.token_weights, 0.0)
        # Importance weights pi_old / pi_sampled per token: truncated for every sample
        # (tis_cap), and for a replayed answer, sampled by an older policy, capped at
        # replay_is_cap (or zero: dropped) in place of that.
        log_r = torch.where(mask > 0, old_lp - b.behaviour_logprobs, 0.0)
        cap = tis_cap(cfg.tis_cap, b)
        is_weights = torch.exp(log_r).clamp(max=cap) if cap else None
        if b.replayed.any():
            replay_w = (
                torch.exp(log_r).clamp(max=cfg.replay_is_cap)
                if cfg.replayed == "clip"
                else torch.zeros_like(log_r)
            )
            fresh_w = is_weights if is_weights is not None else torch.ones_like(log_r)
            is_weights = torch.where(b.replayed[:, None], replay_w, fresh_w)
        if is_weights is not None:
            weights = weights * is_weights
        losses, clip_fracs, grad_norms = [], [], []
        for _ in range(cfg.ppo_epochs):
            for idx in torch.randperm(b.size).chunk(cfg.minibatches):
                lp = token_logprobs(self.model, b.input_ids[idx], b.attention_mask[idx], temps[idx])
                loss, st = ppo_clip_loss(
                    lp, old_lp[idx], adv[idx], weights[idx], mask[idx], cfg.clip_low, cfg.clip_high
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norms.append(
                    torch.nn.utils.clip_grad_norm_(
                        self.model.parameters(), cfg.max_grad_norm
                    ).item()
                )
                self.optimizer.step()
                losses.append(loss.item())
                clip_fracs.append(st["clip_frac"])
        # How far behind the sampler generates: replayed answers are old by design.
        fresh = ~b.replayed
        lag = (self.version - b.policy_versions[fresh if fresh.any() else slice(None)]).float()
        return {
            "loss": sum(losses) / len(losses),
            "clip_frac": sum(clip_fracs) / len(clip_fracs),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "approx_kl": approx_kl(old_lp, b.behaviour_logprobs, mask),
            "version_lag_mean": lag.mean().item(),
            "version_lag_max": lag.max().item(),
            "advantage_abs_mean": adv.abs().mean().item(),
            # Tokens whose importance weight the cap truncated (0 with the correction off).
            "tis_truncated_tokens": float(((torch.exp(log_r) > cap) & (mask > 0)).sum())
            if cap
            else 0.0,
        }

    def train(self) -> list[dict[str, Any]]:
        """Run `cfg.steps` steps (from where a resumed checkpoint left off); returns the log.

        Any exit it can catch leaves a checkpoint to resume from: a sampler error (it went
        away past the watchdog, someone else pushed a newer version) is raised after one
        is saved, and SIGINT or SIGTERM end the step under way, save, and raise
        `TrainingStopped`.
        """
        cfg = self.cfg
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        started = self.step
        self._prepare_sampler()
        if cfg.eval_files:
            self._log_eval("before")
        batches = self._batches()
        bar = tqdm(
            total=cfg.steps,
            initial=min(self.step, cfg.steps),
            desc="train",
            unit="step",
            disable=not cfg.progress,
            dynamic_ncols=True,
            # Piped to a file, a bar redrawn 10 times a second is tens of KB of log lines.
            mininterval=0.1 if sys.stderr.isatty() else PIPED_PROGRESS_INTERVAL_S,
        )
        signals = StopSignals()
        try:
            with signals:
                self._run_steps(batches, bar, signals)
        except BaseException:
            self._save_on_exit(started)
            raise
        finally:
            bar.close()
            batches.close()  # ends the stream: prefetched, unused groups go back to the sampler
        if signals.received is not None:
            self._save_on_exit(started)
            raise TrainingStopped(signals.received)
        if cfg.eval_files:
            self._log_eval("after")
        self.save(cfg.out_dir / "final")
        return self.history

    def _run_steps(
        self, batches: Generator[TrainBatch, None, None], bar: Any, signals: StopSignals
    ) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.time_limit_s if cfg.time_limit_s else math.inf
        with (cfg.out_dir / "train_log.jsonl").open("a") as log_file:
            while (
                self.step < cfg.steps and time.monotonic() < deadline and signals.received is None
            ):
                t0 = time.monotonic()
                try:
                    with signals.interruptible():
                        batch = next(batches)  # blocks on the sampler; raises if it died
                except Interrupted:
                    return  # stopped while waiting: no step under way
                t1 = time.monotonic()
                metrics = self.train_step(batch)
                self.step += 1
                t2 = time.monotonic()
                last = self.step == cfg.steps or time.monotonic() >= deadline
                pushed = self.step % cfg.sync_every == 0 or last or signals.received is not None
                if pushed:
                    self._push(self.version + 1)
                    self._pushes += 1
                # Ack only once the new weights are served: `max_staleness` counts unacked
                # groups, so an ack before the push would let the sampler start the next
                # batch on the weights this step just replaced (one step off-policy).
                acked = self.client.ack(batch.groups)  # used: the sampler may delete them
                record = self._record(
                    batch,
                    metrics,
                    acked.acked,
                    wait_s=t1 - t0,
                    train_s=t2 - t1,
                    sync_s=time.monotonic() - t2,
                )
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
                # After the log line: a checkpoint's step is always logged.
                if pushed and cfg.save_every and self._pushes % cfg.save_every == 0 and not last:
                    self.save(cfg.out_dir / f"checkpoint-{self.step}")
                    checkpoints.prune(cfg.out_dir, cfg.keep_checkpoints)
                self.history.append(record)
                self._check_lag(metrics)
                # The postfix rides on the bar's next timed draw: a refresh here would draw
                # every step, whatever the interval.
                bar.set_postfix(
                    refresh=False,
                    reward=f"{record['reward_mean']:.2f}",
                    pass_rate=f"{record['pass_rate']:.2f}",
                    loss=f"{record['loss']:+.3f}",
                    kl=f"{record['approx_kl']:.4f}",
                    v=self.version,
                )
                bar.update(1)

    def _save_on_exit(self, started: int) -> None:
        """Keep what was trained since `started` and say how to go on from it."""
        if self.step <= started:
            return  # nothing trained since the start (or the checkpoint resumed from)
        path = self.save(self.cfg.out_dir / f"checkpoint-{self.step}")
        command = command_line(
            self.cfg.model_copy(update={"model": path}), exclude={"api_key", "fresh", "resume"}
        )
        tqdm.write(
            f"saved checkpoint {path} (step {self.step}, policy v{self.version}); resume with:\n"
            f"  adaptive-rollout train {shlex.join(command)}",
            file=sys.stderr,
        )

    def evaluate(self) -> dict[str, float]:
        """The held-out score per domain on `cfg.eval_files` (greedy accuracy by default)."""
        from trainer_client.evaluate import read_rows

        return self.evaluate_rows(self.model, self.tokenizer, read_rows(self.cfg.eval_files))

    def _log_eval(self, when: str) -> dict[str, float]:
        acc = self.evaluate()
        record = {
            "when": when,
            "step": self.step,
            "policy_version": self.version,
            "greedy_accuracy": acc,
        }
        with (self.cfg.out_dir / "eval.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.evals.append(record)
        tqdm.write(
            f"eval ({when}, step {self.step}): " + " ".join(f"{d}={a:.3f}" for d, a in acc.items())
        )
        return acc

    def _check_lag(self, metrics: dict[str, float]) -> None:
        """Say once when the groups trained on lag the trainer's weights by more than the
        threshold: the sampler then generates far ahead of this trainer, on older weights."""
        if self._lag_warned:
            return
        message = lag_warning(
            metrics["version_lag_mean"],
            metrics["version_lag_max"],
            threshold=self.cfg.lag_warning,
            max_staleness=self._max_staleness,
            held_ahead=self._held_ahead,
        )
        if message is not None:
            self._lag_warned = True
            tqdm.write(f"warning: step {self.step} {message}", file=sys.stderr)

    # -- plumbing ---------------------------------------------------------------------------
    def _push(self, version: int) -> None:
        self.client.push_weights(self.model.state_dict(), version)
        self.version = version

    def _prepare_sampler(self) -> None:
        """Serve this trainer's weights before its first step: its groups must be sampled by
        the weights it trains. A sampler serving a newer policy (a rerun after a crash, or
        someone else's pushes) gets them as a new version, said loudly: the versions
        trained after this start's weights are rolled back. Versions only grow."""
        served = self.client.wait_ready().policy_version
        if served > self.version:
            origin = f"{self.start} (step {self.step})" if self.step else f"--model {self.start}"
            tqdm.write(
                f"warning: the sampler serves policy v{served}, newer than this trainer's "
                f"v{self.version}: pushing the weights of {origin} as v{served + 1} rolls back "
                f"what v{self.version + 1}..v{served} learned",
                file=sys.stderr,
            )
            self._push(served + 1)
        elif served < self.version:  # the sampler restarted from an older state
            self._push(self.version)
        if self.cfg.configure_sampler:
            config = self.client.get_config()
            if config.get("batch_groups") != self.cfg.batch_groups:
                config = self.client.update_config(batch_groups=self.cfg.batch_groups)
            self._remember(config)

    def _remember(self, config: dict[str, Any]) -> None:
        """Keep what training reads of a sampler config: the temperature it sampled under,
        by config version, and the staleness bound the lag warning measures against."""
        self._temperatures[config["config_version"]] = float(config["temperature"])
        self._max_staleness = config.get("max_staleness")

    def _batches(self) -> Generator[TrainBatch, None, None]:
        assembler = BatchAssembler(self.cfg.batch_groups, self.pad_id)
        groups = self.client.groups()
        try:
            yield from assembler.batches(groups)
        finally:
            groups.close()

    def _temperature_of(self, batch: TrainBatch) -> torch.Tensor:
        """Per-sample sampling temperature, from the config version each group was admitted under."""
        versions = {g.config_version for g in batch.groups}
        if not versions <= self._temperatures.keys():
            self._remember(self.client.get_config())

        def temp(v: int) -> float:
            if v in self._temperatures:
                return self._temperatures[v]
            known = [k for k in self._temperatures if k <= v] or list(self._temperatures)
            return self._temperatures[max(known)]  # unchanged since the newest version we know

        per_group = torch.tensor([temp(g.config_version) for g in batch.groups])
        return per_group[batch.group_index]

    def _record(
        self, batch: TrainBatch, metrics: dict[str, float], acked: int, **timing: float
    ) -> dict[str, Any]:
        domains = Counter(batch.domains)
        return {
            "step": self.step,
            "time": time.time(),
            "policy_version": self.version,
            **batch.summary(),
            **metrics,
            "acked": acked,
            "domains": dict(domains),
            "domain_generated": dict(
                sum((Counter({g.domain: g.stats.n_generated}) for g in batch.groups), Counter())
            ),
            "domain_reward": _domain_means(batch),
            "stop_reasons": dict(Counter(g.stop_reason for g in batch.groups)),
            "group_ids": batch.group_ids,
            **{k: round(v, 4) for k, v in timing.items()},
        }

    def save(self, path: Path) -> Path:
        """A complete HF model directory plus trainer_state.json and the optimizer state."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        gen = self.cfg.model / "generation_config.json"
        if gen.is_file():
            (path / "generation_config.json").write_bytes(gen.read_bytes())
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        state = {
            "step": self.step,
            "policy_version": self.version,
            "config": self.cfg.model_dump(mode="json", exclude={"api_key"}),
        }
        # Written last: a directory without it (a save cut short) is no checkpoint.
        (path / checkpoints.STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
        return path


def _domain_means(batch: TrainBatch) -> dict[str, float]:
    """Mean reward over ALL answers generated for the batch's prompts, per domain."""
    total: dict[str, list[float]] = {}
    for g in batch.groups:
        t = total.setdefault(g.domain, [0.0, 0.0])
        t[0] += g.stats.reward_mean * g.stats.n_generated
        t[1] += g.stats.n_generated
    return {d: s / n for d, (s, n) in total.items() if n and not math.isnan(s)}


def train(cfg: TrainConfig, on_trainer: Callable[[GRPOTrainer], None] | None = None) -> GRPOTrainer:
    """Build a trainer from `cfg`, run it, and return it (its model holds the final weights)."""
    trainer = GRPOTrainer(cfg)
    if on_trainer:
        on_trainer(trainer)
    try:
        trainer.train()
    finally:
        trainer.client.close()
    return trainer


def held_pushes(credit: int, batch_groups: int, sync_every: int) -> int:
    """Weight pushes a handed-out group can wait through in the trainer's hands: a stream
    credit of `credit` groups holds whole steps beyond the one training, and a push
    follows every `sync_every` steps."""
    steps_ahead = max(0, math.ceil(credit / batch_groups) - 1)
    return math.ceil(steps_ahead / sync_every)


def lag_warning(
    lag_mean: float,
    lag_max: float,
    *,
    threshold: float | None,
    max_staleness: int | None,
    held_ahead: int,
) -> str | None:
    """What to say about a step whose groups lag the trainer's weights by `lag_mean`
    versions on average, or None when that is expected.

    A bounded sampler hands out groups at most `max_staleness` versions behind its
    weights, and the trainer trains them up to `held_ahead` pushes later, so a lag up to
    their sum is what the bound asked for; the default threshold (None) is that sum, or 2
    versions when the sampler has no bound.
    """
    if threshold == 0:  # --lag-warning 0: never
        return None
    allowed = None if max_staleness is None else max_staleness + held_ahead
    limit = threshold if threshold is not None else (2.0 if allowed is None else allowed)
    if lag_mean <= limit:
        return None
    said = (
        f"trained on groups {lag_mean:.1f} policy versions behind its weights on average "
        f"(max {lag_max:.0f}), more than {limit:g}: the sampler generates far ahead of "
        "this trainer; "
    )
    if max_staleness is None:
        return said + "bound it with its max_staleness (PATCH /v1/config)"
    return said + (
        f"lower its max_staleness ({max_staleness} now; a group may lag it plus the "
        f"{held_ahead} push(es) this trainer holds it through, {allowed} in all)"
    )
