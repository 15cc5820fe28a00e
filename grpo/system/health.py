"""Is the run healthy? Non-finite steps, a collapsed policy, rollouts that keep failing.

Pure pieces the training loop calls between phases; none of them stops anything by itself: each says
what happened and the loop decides (skip the step, warn, stop with exit status 1).

    guard = NonFiniteGuard(cfg.policy.max_nonfinite_steps)
    ...after scoring:      problem = nonfinite(rewards_b=batch["rewards"])   # skip training if not None
    ...after training:     problem = problem or nonfinite(loss, grad_norm)
    match guard.update(problem): "ok" | "skip" (the step was not applied, counted) | "stop" (guard.message())

A non-finite optimizer step is never applied: `skip_nonfinite_loss` wraps the loss closure so that DeepSpeed's
own overflow check discards it (see there); `overflow_check_gap` says at setup when an engine would not.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Non-finite steps
# --------------------------------------------------------------------------------------------------
def nonfinite(loss: float | None = None, grad_norm: float | None = None, rewards_b=None) -> str | None:
    """What went non-finite first in a step, in the order a step computes them (rewards, loss, gradient
    norm), or None when all are finite. Rewards are checked as float32, the dtype they are trained in:
    1e39 is finite in float64 but inf in float32. None skips a quantity.

    >>> nonfinite(0.5, 1.0, [1.0, 2.0]) is None
    True
    >>> nonfinite(float("nan"), float("inf"))
    'train/loss is nan'
    >>> nonfinite(0.1, 2.0, [0.0, 1e39])
    'the reward of sample 1 is inf as float32 (1e+39)'
    """
    if rewards_b is not None:
        as_f32 = torch.as_tensor(rewards_b, dtype=torch.float64).to(torch.float32).reshape(-1)
        bad = (~torch.isfinite(as_f32)).nonzero()
        if len(bad):
            i = int(bad[0])
            original = float(torch.as_tensor(rewards_b, dtype=torch.float64).reshape(-1)[i])
            return f"the reward of sample {i} is {_name(float(as_f32[i]))} as float32 ({original:g})"
    for name, value in (("train/loss", loss), ("train/grad_norm", grad_norm)):
        if value is not None and not math.isfinite(float(value)):
            return f"{name} is {_name(float(value))}"
    return None


def _name(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


class NonFiniteGuard:
    """Counts non-finite steps; `update` says "ok", "skip" (non-finite: the step is not applied) or "stop"
    (``max_consecutive`` non-finite steps in a row: `message` names what went non-finite first).
    ``count`` is ``train/nonfinite_steps``, the non-finite steps of the whole run.

        >>> g = NonFiniteGuard(2)
        >>> [g.update(p) for p in (None, "train/loss is nan", None, "a", "b")], g.count
        (['ok', 'skip', 'ok', 'skip', 'stop'], 3)
    """

    def __init__(self, max_consecutive: int):
        if max_consecutive < 1:
            raise ValueError(f"policy.max_nonfinite_steps={max_consecutive}: expected >= 1")
        self.max_consecutive = max_consecutive
        self.count = 0
        self.consecutive = 0
        self.first: str | None = None  # what went non-finite first in the current run of bad steps

    def update(self, problem: str | None) -> str:
        if problem is None:
            self.consecutive, self.first = 0, None
            return "ok"
        self.count += 1
        self.consecutive += 1
        self.first = self.first or problem
        return "stop" if self.consecutive >= self.max_consecutive else "skip"

    def message(self) -> str:
        return (f"{self.consecutive} non-finite steps in a row (policy.max_nonfinite_steps={self.max_consecutive}); "
                f"the first: {self.first}. None of them was applied: the last checkpoint holds the last good "
                "weights. Lower policy.optimizer.lr, check the rewards, or set policy.max_grad_norm")


def skip_nonfinite_loss(loss_closure: Callable) -> Callable:
    """Wrap a `grpo.system.training.train_on_batch` loss closure so that a micro-batch whose loss is not finite makes
    its optimizer step a no-op.

    DeepSpeed's ZeRO optimizers discard a step whose gradient norm is inf or NaN (ZeRO-3 always; ZeRO-1/2
    unless bf16 with ``bf16.check_grad_overflow=false``; without ZeRO in fp32, `grpo.system.engines.CheckedAdamW`): weights, Adam moments and step count and the LR
    schedule stay as they were, the gradients are cleared, ``engine.skipped_steps`` counts it and
    ``engine.was_step_applied()`` is False. A non-finite loss can still have finite gradients (an inf term
    that does not depend on the weights), which DeepSpeed would apply; the wrapper adds
    ``nan * logprobs_bt.sum()`` to such a loss, so every trained gradient is NaN and the check fires on every
    rank (the gradients are all-reduced). The loss of that micro-batch then reads NaN.
    """

    def closure(logprobs_bt: torch.Tensor, mb: dict, **extras):
        loss, metrics = loss_closure(logprobs_bt, mb, **extras)
        if not bool(torch.isfinite(loss.detach()).all()):
            loss = loss + logprobs_bt.sum() * float("nan")
        return loss, metrics

    return closure


def overflow_check_gap(engine) -> str | None:
    """Why DeepSpeed would APPLY an optimizer step with a NaN or inf gradient on this engine, or None when it
    discards such steps (what `skip_nonfinite_loss` relies on). Call once at setup."""
    stage = engine.zero_optimization_stage()
    if stage == 0 and not hasattr(engine.optimizer, "overflow"):
        return ("policy.deepspeed_config has no ZeRO stage: in 16-bit its optimizer applies NaN gradients; use a "
                "ZeRO config (ds_configs/zero1.json, zero2.json or zero3.json)")
    if engine.bfloat16_enabled() and stage in (1, 2) and not engine._config.bfloat16_config.check_grad_overflow:
        return "policy.deepspeed_config sets bf16.check_grad_overflow=false: ZeRO-1/2 then apply NaN gradients"
    return None


# --------------------------------------------------------------------------------------------------
# A collapsed policy
# --------------------------------------------------------------------------------------------------
class CollapseWatch:
    """Warns once (per kind) when training has stopped making sense while the run goes on:

    - the policy collapsed to a uniform distribution: the sampled-token entropy reaches
      ``(1 - entropy_tol) * ln(vocab_size)`` for ``patience`` steps in a row (a far too high learning rate);
    - the gradient norm is exactly 0 for ``patience`` steps in a row while the rewards of the step vary
      (advantages exist but nothing reaches the weights: a frozen or detached model, a zero loss scale).

    `update` returns the warning text the first time a condition holds (and logs it), else None.

        >>> w = CollapseWatch(vocab_size=100, patience=2)
        >>> [w.update(entropy=4.6, grad_norm=1.0, rewards_b=[0.0, 1.0]) is None for _ in range(3)]
        [True, False, True]
    """

    def __init__(self, vocab_size: int, patience: int = 3, entropy_tol: float = 0.02):
        self.max_entropy = math.log(vocab_size)
        self.patience = patience
        self.entropy_tol = entropy_tol
        self.streaks = {"entropy": 0, "grad": 0}
        self.warned: set[str] = set()

    def update(self, entropy: float | None, grad_norm: float | None, rewards_b: Sequence[float] | None) -> str | None:
        rewards = torch.as_tensor(rewards_b if rewards_b is not None else [], dtype=torch.float64)
        varied = len(rewards) > 1 and bool(rewards.max() > rewards.min())
        flat = entropy is not None and entropy >= (1.0 - self.entropy_tol) * self.max_entropy
        frozen = grad_norm is not None and grad_norm == 0.0 and varied
        self.streaks["entropy"] = self.streaks["entropy"] + 1 if flat else 0
        self.streaks["grad"] = self.streaks["grad"] + 1 if frozen else 0
        message = None
        if self.streaks["entropy"] >= self.patience and "entropy" not in self.warned:
            message = (f"the policy collapsed to a uniform distribution: train/approx_entropy {entropy:.3f} ~ "
                       f"ln(vocab size) = {self.max_entropy:.3f} for {self.patience} steps; the learning rate "
                       "(policy.optimizer.lr) is likely far too high")
            self.warned.add("entropy")
        elif self.streaks["grad"] >= self.patience and "grad" not in self.warned:
            message = (f"train/grad_norm is exactly 0 for {self.patience} steps while the rewards vary: nothing "
                       "reaches the weights (frozen parameters? a loss that does not depend on the logprobs?)")
            self.warned.add("grad")
        if message is not None:
            logger.warning(message)
        return message


# --------------------------------------------------------------------------------------------------
# Rollouts that keep failing: the step budget (grpo.rollout_failure)
# --------------------------------------------------------------------------------------------------
class RolloutBudget:
    """``grpo.rollout_failure.min_step_batch_fraction`` / ``max_consecutive_skipped_steps``: a step trains only
    when at least that fraction of its samples did not fail (after the environments' retries); a step that
    falls short is *skipped* (no optimizer step, its prompts consumed, counted); ``max_consecutive`` skipped
    steps in a row stop the run (an outage must not become hours of training on nothing).

        trainable(scored_b)    Σ scored_b ≥ min_fraction · n     (TrainBatch.scored_b: the samples with a score)
        skipped(trajectories)  count a skipped step, remember the environment's last error; True: stop now
        trained()              a step trained: the streak ends

    ``skipped_steps`` (run total) and ``consecutive`` are saved with each checkpoint (`state_dict`), with the
    run's failed samples per reason and retries (`count`).

        >>> b = RolloutBudget(min_fraction=0.75, max_consecutive=2)
        >>> b.trainable(torch.tensor([True, True, True, False])), b.trainable(torch.tensor([True, True, False, False]))
        (True, False)
        >>> from types import SimpleNamespace as T
        >>> from grpo.trajectory import Failure
        >>> bad = [T(task_name="judge", failure=Failure.of("http_5xx", "Traceback...\\n503 down"))]
        >>> b.skipped(bad), b.skipped(bad), b.skipped_steps
        (False, True, 2)
        >>> b.message()[:96]
        '2 steps in a row skipped (grpo.rollout_failure.max_consecutive_skipped_steps=2): fewer than 75% '
    """

    def __init__(self, min_fraction: float, max_consecutive: int):
        if not 0.0 < min_fraction <= 1.0 or max_consecutive < 1:
            raise ValueError(f"grpo.rollout_failure.min_step_batch_fraction={min_fraction}, "
                             f"max_consecutive_skipped_steps={max_consecutive}: expected a fraction in (0, 1] and >= 1")
        self.min_fraction, self.max_consecutive = min_fraction, max_consecutive
        self.skipped_steps = 0
        self.consecutive = 0
        self.failed_samples: dict[str, int] = {}  # run totals per reason
        self.retries = 0
        self.last_error: str | None = None

    def trainable(self, scored_b: torch.Tensor) -> bool:
        """At least ``min_fraction`` of the samples are scored (``scored_b``: bool ``[B]``)."""
        return int(scored_b.sum()) >= self.min_fraction * scored_b.numel() - 1e-9

    def count(self, trajectories: Sequence) -> None:
        """Add a rollout's failed samples and retries to the run totals; remember its last error."""
        for t in trajectories:
            if t is None:
                continue
            self.retries += int(getattr(t, "retries", 0))
            if t.failure is not None:
                self.failed_samples[t.failure.reason] = self.failed_samples.get(t.failure.reason, 0) + 1
                self.last_error = last_error_text(t)

    def skipped(self, trajectories: Sequence) -> bool:
        """Count a skipped step (its failed samples name the environment's last error); True: the run stops."""
        self.skipped_steps += 1
        self.consecutive += 1
        failed = [t for t in trajectories if t is not None and t.failure is not None]
        if failed:
            self.last_error = last_error_text(failed[-1])
        return self.consecutive >= self.max_consecutive

    def trained(self) -> None:
        self.consecutive = 0

    def skip_note(self, step: int, scored_b: torch.Tensor) -> str:
        num_failed, num_samples = int((~scored_b).sum()), scored_b.numel()
        return (f"step {step} skipped: {num_failed} of {num_samples} samples failed, more than "
                f"grpo.rollout_failure.min_step_batch_fraction={self.min_fraction} allows ({self.consecutive} in a row "
                f"of max_consecutive_skipped_steps={self.max_consecutive}); last error: {self.last_error}")

    def message(self) -> str:
        """The stop line (one line): the streak, the rule, the environment and its last error."""
        return (f"{self.consecutive} steps in a row skipped (grpo.rollout_failure.max_consecutive_skipped_steps="
                f"{self.max_consecutive}): fewer than {self.min_fraction:.0%} of their samples got a score "
                f"(min_step_batch_fraction); last error: {self.last_error or '(none recorded)'}")

    def metrics(self) -> dict:
        """The run totals as ``rollout/*`` metrics."""
        return {"rollout/skipped_steps": self.skipped_steps,
                "rollout/failed_samples_total": sum(self.failed_samples.values())}

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "consecutive_skipped_steps": self.consecutive,
                "failed_samples": dict(self.failed_samples), "retries": self.retries}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive = int(state.get("consecutive_skipped_steps", 0))
        self.failed_samples = {str(k): int(v) for k, v in state.get("failed_samples", {}).items()}
        self.retries = int(state.get("retries", 0))


def last_error_text(t) -> str:
    """One line naming a failed sample's environment (task), its reason and class, and the last line of its
    error text.

        >>> from types import SimpleNamespace as T
        >>> from grpo.trajectory import Failure
        >>> last_error_text(T(task_name="math", failure=Failure.of("reward_timeout", "no score within 5 s\\n")))
        "environment 'math': reward_timeout (infra): no score within 5 s"
    """
    f = t.failure
    lines = [line.strip() for line in f.detail.splitlines() if line.strip()]
    return f"environment {t.task_name!r}: {f.reason} ({f.kind})" + (f": {lines[-1][:300]}" if lines else "")


# --------------------------------------------------------------------------------------------------
# All of it, once per step
# --------------------------------------------------------------------------------------------------
class HealthStop(enum.Enum):
    """Why the checks stopped the run (`StepChecks.stop_kind`): ``NONFINITE`` steps in a row (the state is not
    good: nothing is saved at the end), or too many ``ROLLOUTS`` skipped in a row (an outage: the state is good,
    the async replay deque's groups failed too)."""

    NONFINITE = "nonfinite"
    ROLLOUTS = "rollouts"


class StepChecks:
    """The checks both loops run on every step: after training (``policy.max_nonfinite_steps``), `after_step`
    returns the message that stops the run (exit 1), or None, and adds ``train/nonfinite_steps`` to the step's
    metrics; warnings are logged once. ``rollouts`` is the step budget the loops ask before training
    (`RolloutBudget`, ``grpo.rollout_failure``).

    A non-finite step needs no special path: `skip_nonfinite_loss` (which `grpo.system.training.train_step` applies)
    turns it into NaN gradients that DeepSpeed discards, so the weights stay as they were; here it is counted.
    """

    def __init__(self, cfg, vocab_size: int):
        self.guard = NonFiniteGuard(cfg.policy.max_nonfinite_steps)
        self.watch = CollapseWatch(vocab_size)
        f = cfg.grpo.rollout_failure
        self.rollouts = RolloutBudget(f.min_step_batch_fraction, f.max_consecutive_skipped_steps)
        self.stop_kind: HealthStop | None = None  # why the checks stopped the run, or None

    def after_step(self, raw_rewards_b: torch.Tensor, scored_b: torch.Tensor, train_results: list[dict],
                   metrics: dict) -> str | None:
        """``raw_rewards_b`` read under ``scored_b`` (`grpo.batch.TrainBatch`'s): a failed sample has no score."""
        raw_rewards_b = raw_rewards_b[scored_b]
        problem = nonfinite(rewards_b=raw_rewards_b)
        for r in train_results:
            problem = problem or nonfinite(r["loss"], r["grad_norm"])
        verdict = self.guard.update(problem)
        metrics["train/nonfinite_steps"] = self.guard.count
        if problem is None:
            self.watch.update(metrics.get("train/approx_entropy"), metrics.get("train/grad_norm"),
                              raw_rewards_b.tolist())
        if verdict == "stop":
            self.stop_kind = HealthStop.NONFINITE
            return self.guard.message()
        if verdict == "skip":
            logger.warning("step not applied: %s (train/nonfinite_steps %d)", problem, self.guard.count)
        return None
