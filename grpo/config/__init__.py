"""Run configuration: pydantic models for every section of NeMo-RL's ``MasterConfig``.

Field names and defaults follow NeMo-RL (``nemo_rl.algorithms.grpo`` / ``loss_functions``) so a
NeMo-RL recipe reads the same here. Every model forbids unknown keys. Loading (YAML recipes with
``defaults:`` inheritance, dotted command-line overrides, readable errors) is `grpo.config.load`.

This module imports only pydantic and the task catalogue (`grpo.tasks.catalogue`, for the built-in task
names; it imports nothing heavy): a bad config fails before torch, deepspeed or a model is ever
loaded, with an error naming the dotted key, the value and what was expected.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo.tasks.catalogue import ENV_NAMES, TASKS, TOY_MODELS


def dhms_seconds(spec: str, key: str = "duration") -> int:
    """Seconds in a "DD:HH:MM:SS" duration (NeMo-RL's `checkpoint_must_save_by` format).

        >>> dhms_seconds("00:03:45:00"), dhms_seconds("0:0:0:1")
        (13500, 1)
    """
    parts = spec.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{key}={spec!r}: expected a duration \"DD:HH:MM:SS\" such as \"00:03:45:00\" "
                         "(two-digit fields: YAML reads 1:00:00:00 as a base-60 number)")
    days, hours, minutes, seconds = (int(p) for p in parts)
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_toy_model(name: Optional[str], key: str) -> Optional[str]:
    """``name`` unchanged, or a ValueError for a ``toy:<name>`` that `grpo.tasks.catalogue` does not build (listing those).

        >>> check_toy_model("toy:nonexistent", "policy.model_name")
        Traceback (most recent call last):
        ...
        ValueError: policy.model_name='toy:nonexistent': no such toy model; expected one of ['toy:demo', ...
    """
    if name is not None and name.startswith("toy:"):
        if name[len("toy:"):] not in TOY_MODELS:
            raise ValueError(f"{key}={name!r}: no such toy model; expected one of {['toy:' + k for k in TOY_MODELS]} "
                             "(built locally), a local directory or a hub name")
    return name


def model_path_problem(name: Optional[str], key: str) -> Optional[str]:
    """Why ``name`` cannot be a model (or tokenizer) for ``from_pretrained``, as far as the file system tells before
    anything loads, else None. A name that is there must be a directory; a name that is not there can only be a hub
    name (``name`` or ``namespace/name``, huggingface_hub's rule), so anything else (an absolute path, ``./``,
    ``../``, ``~/``, more than one ``/``) is a local path that does not exist. Whether a hub name exists, or is in
    the cache under ``HF_HUB_OFFLINE=1``, is known only when it loads; ``toy:`` names are `check_toy_model`'s.

        >>> model_path_problem("Skywork/Skywork-Reward-V2-Qwen3-0.6B", "k") is None
        True
        >>> model_path_problem("/no/such/rm", "env.reward_model.model_name")[:74]
        "env.reward_model.model_name='/no/such/rm': no such directory (a local path"
    """
    if name is None or name.startswith("toy:") or os.path.isdir(name):
        return None
    if os.path.exists(name):
        return (f"{key}={name!r}: a file, not a directory (a model is a from_pretrained directory: config.json and "
                "its weights)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
        return None  # a hub name: checked when it loads
    except HFValidationError:
        tilde = "; ~ is not expanded: give the whole path" if name.startswith("~") else ""
        return f"{key}={name!r}: no such directory (a local path; a hub name is 'name' or 'namespace/name'{tilde})"


# --------------------------------------------------------------------------------------------------
# loss_fn
# --------------------------------------------------------------------------------------------------
class ClippedPGLossConfig(_Section):
    """NeMo-RL's ``ClippedPGLossConfig``: the clipped policy-gradient loss (GRPO / DAPO / GSPO)."""

    disable_ppo_ratio: bool = Field(
        False, description="Drop the ratio r = pi/pi_old: the loss is -A * logprob (REINFORCE / RLOO).")
    token_level_loss: bool = Field(True, description=(
        "true: sum over every valid token / the step's valid tokens; false: per-sequence mean, then mean over "
        "sequences."))
    sequence_level_importance_ratios: bool = Field(False, description=(
        "GSPO: one ratio per sequence, exp(mean_t(logprobs - prev_logprobs)); needs token_level_loss=false."))
    ratio_clip_min: float = Field(
        0.2, ge=0, description="PPO clip: r is clamped to [1 - ratio_clip_min, 1 + ratio_clip_max].")
    ratio_clip_max: float = Field(
        0.2, ge=0, description="Upper clip of r is 1 + ratio_clip_max (DAPO's clip-higher: above ratio_clip_min).")
    ratio_clip_c: Optional[float] = Field(
        None, description="Dual clip c > 1 (usually 3): L = min(L, -c*A) where A < 0; null: off.")
    reference_policy_kl_penalty: float = Field(0.01, ge=0, allow_inf_nan=False, description=(
        "beta: weight of KL(pi || pi_ref) in the loss (0: no reference model is needed)."))
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator: k1, k2 or k3 (http://joschu.net/blog/kl-approx.html).")
    kl_input_clamp_value: Optional[float] = Field(
        20.0, description="The log-ratio ref - logprob is clamped to +- this before the KL estimator (null: no clamp).")
    kl_output_clamp_value: Optional[float] = Field(
        10.0, description="The per-token KL is clamped to +- this (null: no clamp).")
    use_kl_in_reward: bool = Field(
        False, description="Put beta * KL into the reward (Reinforce++) instead of the loss.")
    use_importance_sampling_correction: bool = Field(False, description=(
        "Multiply the policy term by w = exp(prev_logprobs - generation_logprobs) (required by async GRPO)."))
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = Field(None, description=(
        "tis: clamp w to [min, max]; icepop: w = 0 outside [min, max]; seq-mask-tis: w = 0 on sequences whose "
        "geometric-mean w is outside."))
    truncated_importance_sampling_ratio: Optional[float] = Field(
        None, description="Upper bound (max) of the truncated importance weights.")
    truncated_importance_sampling_ratio_min: Optional[float] = Field(
        None, description="Lower bound (min) of the truncated importance weights (tis: default 0).")
    use_on_policy_kl_approximation: bool = Field(
        False, description="Weight the per-token KL by exp(logprob - generation_logprob) (on-policy KL estimate).")
    force_on_policy_ratio: bool = Field(False, description=(
        "r = exp(logprobs - stopgrad(logprobs)) == 1 with the PPO gradient; one optimizer update per rollout."))
    use_cispo: bool = Field(False, description=(
        "CISPO (MiniMax-M1, arXiv:2506.13585): per-token loss -A * stopgrad(clamp(r, 1 - ratio_clip_min, "
        "1 + ratio_clip_max)) * logprob; needs token_level_loss=true and no dual clip, GSPO, forced or disabled "
        "ratio."))
    positive_example_nll_weight: float = Field(0.0, ge=0, allow_inf_nan=False, description=(
        "VAPO (arXiv:2504.05118, Eq. 10): adds mu * NLL of the tokens of correct samples (reward > 0), "
        "a mean over those tokens of the step; 0: off."))

    @model_validator(mode="after")
    def _check(self) -> "ClippedPGLossConfig":
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"loss_fn.ratio_clip_c={self.ratio_clip_c}: expected a value > 1 (usually 3) or null")
        if self.use_cispo:  # NeMo-RL's ClippedPGLossFn rejects the same combinations
            for key, bad, why in (
                ("disable_ppo_ratio", self.disable_ppo_ratio, "CISPO weights by the ratio pi/pi_old"),
                ("force_on_policy_ratio", self.force_on_policy_ratio, "a ratio forced to 1 leaves no weight to clip"),
                ("sequence_level_importance_ratios", self.sequence_level_importance_ratios,
                 "CISPO's weights are per token"),
                ("ratio_clip_c", self.ratio_clip_c is not None, "dual clipping is a PPO clip; set it to null"),
                ("token_level_loss", not self.token_level_loss, "CISPO is defined per token; set it to true"),
            ):
                if bad:
                    raise ValueError(f"loss_fn.use_cispo=true cannot be combined with loss_fn.{key}="
                                     f"{getattr(self, key)}: {why}")
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ValueError(
                "loss_fn.sequence_level_importance_ratios=true (GSPO) needs loss_fn.token_level_loss=false"
            )
        t = self.truncated_importance_sampling_type
        if t is not None:
            if not self.use_importance_sampling_correction:
                raise ValueError(
                    f"loss_fn.truncated_importance_sampling_type={t!r} needs "
                    "loss_fn.use_importance_sampling_correction=true"
                )
            hi, lo = self.truncated_importance_sampling_ratio, self.truncated_importance_sampling_ratio_min
            if hi is None or hi <= 0:
                raise ValueError(
                    f"loss_fn.truncated_importance_sampling_ratio={hi}: expected a positive number when "
                    f"truncated_importance_sampling_type={t!r}"
                )
            if t in ("icepop", "seq-mask-tis") and lo is None:
                raise ValueError(
                    f"loss_fn.truncated_importance_sampling_ratio_min=None: expected a number when "
                    f"truncated_importance_sampling_type={t!r}"
                )
            if lo is not None and lo > hi:
                raise ValueError(
                    f"loss_fn.truncated_importance_sampling_ratio_min={lo}: expected <= "
                    f"truncated_importance_sampling_ratio={hi}"
                )
            if t == "seq-mask-tis" and self.sequence_level_importance_ratios:
                raise ValueError(
                    "loss_fn.truncated_importance_sampling_type='seq-mask-tis' is token-level correction with "
                    "sequence masks; it cannot be combined with loss_fn.sequence_level_importance_ratios=true"
                )
        return self


# --------------------------------------------------------------------------------------------------
# grpo
# --------------------------------------------------------------------------------------------------
class RewardScalingConfig(_Section):
    """Clamp rewards to [source_min, source_max], then map linearly onto [target_min, target_max]."""

    enabled: bool = Field(False, description="Scale rewards linearly (after penalties, before shaping).")
    source_min: float = Field(0.0, description="Rewards are clamped to [source_min, source_max] first.")
    source_max: float = Field(1.0, description="Upper end of the source range.")
    target_min: float = Field(0.0, description="source_min maps to target_min.")
    target_max: float = Field(1.0, description="source_max maps to target_max.")

    @model_validator(mode="after")
    def _check(self) -> "RewardScalingConfig":
        if self.enabled and not self.source_max > self.source_min:
            raise ValueError(
                f"grpo.reward_scaling.source_max={self.source_max}: expected > source_min={self.source_min}"
            )
        return self


class RewardShapingConfig(_Section):
    """DAPO overlong reward shaping and the stop-properly penalty."""

    enabled: bool = Field(
        False, description="Shape rewards by response length (DAPO's overlong buffer, or the stop-properly penalty).")
    overlong_buffer_length: Optional[int] = Field(None, description=(
        "Responses longer than max_response_length - overlong_buffer_length are penalised linearly..."))
    overlong_buffer_penalty: Optional[float] = Field(
        None, description="... reaching -overlong_buffer_penalty at max_response_length.")
    max_response_length: Optional[int] = Field(
        None, description="Length (generated tokens) at which the overlong penalty is full.")
    stop_properly_penalty_coef: Optional[float] = Field(
        None, description="Rewards of truncated responses are multiplied by this (0: zero reward, 1: no penalty).")

    @model_validator(mode="after")
    def _check(self) -> "RewardShapingConfig":
        if not self.enabled:
            return self
        overlong = (self.overlong_buffer_length, self.overlong_buffer_penalty, self.max_response_length)
        if any(v is not None for v in overlong) and any(v is None for v in overlong):
            raise ValueError(
                "grpo.reward_shaping: overlong_buffer_length, overlong_buffer_penalty and max_response_length "
                f"must be set together (got {overlong})"
            )
        if self.overlong_buffer_length is not None and not (
            0 < self.overlong_buffer_length <= self.max_response_length
        ):
            raise ValueError(
                f"grpo.reward_shaping.overlong_buffer_length={self.overlong_buffer_length}: expected "
                f"0 < value <= max_response_length={self.max_response_length}"
            )
        c = self.stop_properly_penalty_coef
        if c is not None and self.overlong_buffer_length is not None:
            raise ValueError(
                "grpo.reward_shaping: set either the overlong buffer (overlong_buffer_length, ...) or "
                f"stop_properly_penalty_coef={c}, not both (the penalty coefficient would replace the buffer)"
            )
        if c is not None and not 0.0 <= c <= 1.0:
            raise ValueError(f"grpo.reward_shaping.stop_properly_penalty_coef={c}: expected a value in [0, 1]")
        if all(v is None for v in overlong) and c is None:
            raise ValueError(
                "grpo.reward_shaping.enabled=true but neither the overlong buffer nor "
                "stop_properly_penalty_coef is set"
            )
        return self


class AdvEstimatorConfig(_Section):
    """Advantage estimator, chosen by name: grpo, gdpo, reinforce_plus_plus or one a fork registered with
    ``grpo.advantages.register_estimator`` (checked against `grpo.registry` when the config loads)."""

    name: str = Field("grpo", description=(
        "Advantage estimator: grpo, gdpo, reinforce_plus_plus, or one registered with "
        "grpo.advantages.register_estimator."))
    normalize_rewards: Optional[bool] = Field(
        None, description="Divide by the per-prompt std (null: grpo.normalize_rewards).")
    use_leave_one_out_baseline: Optional[bool] = Field(
        None, description="Leave-one-out baseline (null: grpo.use_leave_one_out_baseline).")
    reward_weights: Optional[list[float]] = Field(
        None, description="GDPO: weight of each reward component in the sum (null: all 1).")
    minus_baseline: bool = Field(
        True, description="Reinforce++: subtract the per-prompt mean reward before the global whitening.")
    kl_returns_to_go: bool = Field(False, description=(
        "Reinforce++ with the KL in the reward: false (NeMo-RL) subtracts kl_coef*KL_t per token; true the KL "
        "returns-to-go (OpenRLHF)."))



class AsyncGRPOConfig(_Section):
    enabled: bool = Field(
        False, description="Run the asynchronous loop (train_async_grpo.py): generation in a background thread.")
    max_trajectory_age_steps: int = Field(
        1, ge=1, description="Trajectories older than this many optimizer steps are never trained on.")
    max_generation_failures: int = Field(0, ge=0, description=(
        "Consecutive rollout failures tolerated (each retried on the next prompts) before the run stops."))
    in_flight_weight_updates: bool = Field(False, description=(
        "NeMo-RL's meaning: weights may change while a prompt batch is generated. hf thread: new weights are loaded "
        "between generation chunks (policy.generation_batch_size prompts). Generation ranks "
        "(policy.generation.colocated.enabled=false): the batch is decoded in chunks of "
        "async_grpo.in_flight_chunk_tokens tokens and, between chunks, the newest staged weights are loaded and the "
        "unfinished requests continue from their partial output (a sample may then span several versions; its "
        "version is the oldest)."))
    recompute_kv_cache_after_weight_updates: bool = Field(False, description=(
        "NeMo-RL's meaning: after an in-flight weight update, the continued requests recompute their KV cache "
        "(generation ranks: vLLM's prefix cache is reset, so no block computed with the old weights is reused); "
        "false: cached blocks of the old weights are reused where vLLM's prefix cache holds them. hf thread: holds "
        "by construction (chunks start fresh)."))
    in_flight_chunk_tokens: int = Field(16, gt=0, description=(
        "grpo-ds, generation ranks with in_flight_weight_updates: tokens decoded per request between two weight "
        "checks."))
    generation_threads: Optional[int] = Field(
        None, description="CPU: torch threads of the generation thread (null: half of the trainer's).")

    @model_validator(mode="after")
    def _check(self) -> "AsyncGRPOConfig":
        if self.recompute_kv_cache_after_weight_updates and not self.in_flight_weight_updates:
            raise ValueError(
                "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true needs "
                "grpo.async_grpo.in_flight_weight_updates=true"
            )
        return self


class RolloutFailureConfig(_Section):
    """What becomes of a sample whose environment or reward call failed (`grpo.tasks.failures`): NeMo-RL's
    ``async_rl.rollout_failure`` keys, for both loops. A failed call is retried within its class's budget; a
    sample that still fails is masked (out of the loss and out of its group's baseline), never scored 0."""

    max_infra_attempts_per_prompt: int = Field(5, ge=1, description=(
        "Attempts in all (the first included) of an environment or reward call that failed for an infrastructure "
        "reason (timeout, connection, HTTP 5xx / 408 / 429), with exponential backoff between them."))
    max_data_attempts_per_prompt: int = Field(2, ge=1, description=(
        "Attempts in all of a call that failed for a data reason (malformed return, an exception of the "
        "environment's or reward's own code); retried at once. The two budgets are independent counters."))
    backoff_base_s: float = Field(1.0, gt=0, description="Wait before the first infra retry; doubled per retry.")
    max_backoff_s: float = Field(30.0, gt=0, description="Ceiling of the exponential backoff.")
    min_step_batch_fraction: float = Field(0.9, gt=0, le=1, description=(
        "A step trains only when at least this fraction of its samples did not fail (after retries); else, with "
        "dynamic sampling, more prompts are drawn, or the step is skipped and counted."))
    max_consecutive_skipped_steps: int = Field(3, ge=1, description=(
        "grpo-ds: steps in a row skipped for failures (min_step_batch_fraction) before the run stops with a "
        "checkpoint of its last trained step and one error line naming the environment and its last error."))

    @model_validator(mode="after")
    def _check(self) -> "RolloutFailureConfig":
        if self.max_backoff_s < self.backoff_base_s:
            raise ValueError(f"grpo.rollout_failure.max_backoff_s={self.max_backoff_s} must be >= "
                             f"grpo.rollout_failure.backoff_base_s={self.backoff_base_s}")
        return self


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(32, gt=0, description="Prompts per training step.")
    num_generations_per_prompt: int = Field(
        16, gt=0, description="Samples (conversations) per prompt: the group of each baseline.")
    max_num_epochs: int = Field(1, gt=0, description="Passes over the training prompts at most.")
    max_num_steps: int = Field(1000000, gt=0, description="Training steps at most.")
    max_rollout_turns: int = Field(
        1, gt=0, description="Assistant turns per conversation at most (1: single-turn tasks).")
    normalize_rewards: bool = Field(
        True, description="Divide advantages by the per-prompt reward std (where it is > 0).")
    advantage_clip_low: Optional[float] = Field(
        None, description="Advantages are clipped to [advantage_clip_low, advantage_clip_high] last (null: no bound).")
    advantage_clip_high: Optional[float] = Field(None, description="Upper advantage clip (null: no bound).")
    use_leave_one_out_baseline: bool = Field(
        True, description="Baseline of a sample = mean reward of the other samples of its prompt.")
    val_period: int = Field(
        10, ge=0, description="Validate every this many steps (0: never, except val_at_start / val_at_end).")
    val_start_at: int = Field(-1, ge=-1, description=(
        "First step eligible for periodic validation (steps >= this that are multiples of val_period); -1: no "
        "delay. val_at_start and val_at_end do not wait for it."))
    val_batch_size: Optional[int] = Field(256, gt=0, description="Validation prompts per rollout call.")
    val_at_start: bool = Field(False, description="Validate before the first step (its metric can stop the run early).")
    val_at_end: bool = Field(False, description="Validate after the last step.")
    max_val_samples: Optional[int] = Field(
        256, gt=0, description="Validation prompts (each with val_num_generations_per_prompt samples).")
    val_num_generations_per_prompt: int = Field(
        1, gt=0, description="Samples per validation prompt; k > 1 also reports pass_k (pass@k).")
    stop_at_validation_metric: Optional[str] = Field(None, description=(
        "Stop once this validation metric reaches the threshold: accuracy, pass_k (with "
        "val_num_generations_per_prompt > 1), avg_length, ... (NeMo-RL's names; the old reward_mean, pass@k are "
        "read as accuracy, pass_k)."))
    stop_at_validation_threshold: Optional[float] = Field(None, description="Threshold of stop_at_validation_metric.")
    skip_reference_policy_logprobs_calculation: Optional[bool] = Field(False, description=(
        "Skip the reference model and its logprobs; needs loss_fn.reference_policy_kl_penalty=0. As in NeMo-RL, "
        "a penalty of 0 skips them whatever this says (null: the same as false)."))
    skip_previous_policy_logprobs_calculation: Optional[bool] = Field(None, description=(
        "Skip the separate previous-policy logprob pass (the training forward's own, detached, stand in; exact "
        "when one optimizer step uses the whole rollout); null: skipped whenever that holds and nothing reads "
        "them before training."))
    seed: int = Field(42, description="Seed of sampling, data order and model init.")
    async_grpo: AsyncGRPOConfig = Field(
        default_factory=AsyncGRPOConfig, description="The asynchronous loop's settings.")
    rollout_failure: RolloutFailureConfig = Field(default_factory=RolloutFailureConfig, description=(
        "Retries, masking and step budgets for samples whose environment or reward failed (both loops)."))
    overlong_filtering: bool = Field(False, description="Truncated samples leave the loss (they stay in the baseline).")
    use_dynamic_sampling: bool = Field(False, description=(
        "DAPO dynamic sampling: drop prompt groups whose task reward does not vary and generate more."))
    dynamic_sampling_max_gen_batches: int = Field(
        10, gt=0, description="Generation batches per step before dynamic sampling gives up.")
    batch_multiplier: float = Field(1.0, ge=1.0, description=(
        "With dynamic sampling, each generation batch has num_prompts_per_step * batch_multiplier prompts."))
    reward_shaping: RewardShapingConfig = Field(
        default_factory=RewardShapingConfig, description="Length-based reward shaping.")
    reward_scaling: RewardScalingConfig = Field(
        default_factory=RewardScalingConfig, description="Linear reward scaling.")
    calculate_advantages_on_gpu: bool = Field(False, description=(
        "Run the advantages phase (logprob-error masking, advantages, penalties, clipping) on the GPU when there is one."))
    seq_logprob_error_threshold: Optional[float] = Field(
        None, description="Mask sequences whose mean exp|gen - prev| exceeds this (e.g. 1.5); null: metrics only.")
    invalid_tool_call_advantage: Optional[float] = Field(None, description=(
        "Advantage written over the tokens of an assistant message flagged invalid_tool_call (null: off); "
        "it wins over malformed_thinking_advantage."))
    malformed_thinking_advantage: Optional[float] = Field(None, description=(
        "Advantage written over the tokens of an assistant message with malformed think tags (null: off)."))
    adv_estimator: AdvEstimatorConfig = Field(
        default_factory=AdvEstimatorConfig, description="The advantage estimator.")

    @model_validator(mode="after")
    def _check(self) -> "GRPOConfig":
        # One source of truth for the estimator: the top-level (NeMo-RL legacy) fields fill its gaps.
        est = self.adv_estimator
        if est.normalize_rewards is None:
            est.normalize_rewards = self.normalize_rewards
        if est.use_leave_one_out_baseline is None:
            est.use_leave_one_out_baseline = self.use_leave_one_out_baseline
        lo, hi = self.advantage_clip_low, self.advantage_clip_high
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"grpo.advantage_clip_low={lo}: expected < grpo.advantage_clip_high={hi}")
        if (self.stop_at_validation_metric is None) != (self.stop_at_validation_threshold is None):
            raise ValueError(
                "grpo.stop_at_validation_metric and grpo.stop_at_validation_threshold must be set together "
                f"(got {self.stop_at_validation_metric!r} and {self.stop_at_validation_threshold!r})"
            )
        if self.seq_logprob_error_threshold is not None and self.seq_logprob_error_threshold < 1.0:
            raise ValueError(
                f"grpo.seq_logprob_error_threshold={self.seq_logprob_error_threshold}: expected >= 1.0 "
                "(it is on the scale of token_mult_prob_error, which is >= 1)"
            )
        return self


# --------------------------------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------------------------------
# What grpo.system.chat.ChatFormat passes to apply_chat_template itself (chat_template_kwargs may not repeat them).
CHAT_TEMPLATE_ARGS_SET_BY_GRPO = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


class TokenizerConfig(_Section):
    name: Optional[str] = Field(None, description="Tokenizer to load (null: the model's own).")
    chat_template: Optional[str] = Field(None, description=(
        "null: plain-text prompts; default: the tokenizer's chat template; anything else: a Jinja template."))
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "Extra variables of the chat template, passed to every apply_chat_template (prompts, observations; "
        "NeMo-RL's chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3; one the template does not read "
        "changes nothing."))

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_kwargs(cls, v):
        taken = sorted(set(v or ()) & CHAT_TEMPLATE_ARGS_SET_BY_GRPO)
        if taken:
            raise ValueError(f"policy.tokenizer.chat_template_kwargs: {taken} are set by grpo-ds "
                             "(grpo/system/chat.py), not template variables")
        return v


class OptimizerConfig(_Section):
    name: Literal["adamw"] = Field("adamw", description="Optimizer (torch AdamW).")
    lr: float = Field(5.0e-6, gt=0, description="Learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")


class SchedulerConfig(_Section):
    name: Literal["cosine", "constant", "linear"] = Field(
        "constant", description="After warmup: cosine decay to min_lr_ratio * lr, constant, or linear decay.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    warmup_start_factor: Optional[float] = Field(None, ge=0, le=1, description=(
        "Warmup from this fraction of lr: step t < warmup_steps uses s + (1 - s) * t / warmup_steps (torch LinearLR, "
        "Megatron's lr_warmup_init / lr); null: (t + 1) / warmup_steps."))
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The learning rate decays to min_lr_ratio * lr.")
    decay_steps: Optional[int] = Field(None, gt=0, description=(
        "Optimizer step at which the decay reaches min_lr_ratio * lr and stays (Megatron's lr_decay_iters, a "
        "CosineAnnealingLR's milestone + T_max); null: the run's last step."))

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"policy.scheduler.decay_steps={self.decay_steps}: expected > "
                             f"policy.scheduler.warmup_steps={self.warmup_steps}")
        return self


# What grpo.system.generation.vllm_params.llm_kwargs passes to vllm.LLM itself (vllm_kwargs may not repeat them).
VLLM_KWARGS_SET_BY_GRPO = frozenset({
    "model", "tokenizer", "dtype", "trust_remote_code", "seed", "tensor_parallel_size", "max_model_len",
    "enforce_eager", "enable_prefix_caching", "gpu_memory_utilization", "kv_cache_memory_bytes", "enable_sleep_mode",
    "logprobs_mode", "generation_config", "distributed_executor_backend", "hf_overrides"})


# With policy.lora: what vllm_params.lora_llm_kwargs passes to vllm.LLM, and vLLM's largest LoRA rank.
VLLM_LORA_KWARGS = frozenset({"enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"})
VLLM_MAX_LORA_RANK = 512


# NeMo-RL passes these to vLLM's OpenAIServingChat. grpo-ds's own parsers (the hf backend's; compact on both); on the
# vLLM backend the endpoint uses vLLM's, any name the installed vLLM registers (`vllm_parser_names`).
TOOL_PARSERS = ("hermes", "compact")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
_VLLM_PARSER_TABLES = {"tool_parser": ("tool_parsers", "_TOOL_PARSERS_TO_REGISTER"),
                       "reasoning_parser": ("reasoning", "_REASONING_PARSERS_TO_REGISTER")}


@functools.cache
def vllm_parser_names(kind: str) -> Optional[tuple[str, ...]]:
    """The parser names the installed vLLM registers (``kind``: "tool_parser" or "reasoning_parser"), read from its
    registry's source (``vllm/tool_parsers/__init__.py``, ``vllm/reasoning/__init__.py``) without importing vLLM
    (15-30 s); None when vLLM is not installed (or its registry has moved)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package, table = _VLLM_PARSER_TABLES[kind]
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], package, "__init__.py")) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == table
                and isinstance(node.value, ast.Dict)):
            return tuple(sorted(k.value for k in node.value.keys if isinstance(k, ast.Constant)))
    return None


def parser_problem(kind: str, name: Optional[str], backend: str) -> Optional[str]:
    """Why ``http_server_serving_chat_kwargs.<kind>=name`` cannot parse on ``backend``, or None: the hf backend
    has grpo-ds's parsers; the vLLM backend vLLM's (those the installed vLLM registers; any name when vLLM is not
    installed here, as the run then fails at the engine) and ``compact``.

        >>> parser_problem("tool_parser", "mistral", "hf")
        "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser='mistral': the hf backend's endpoint parses with grpo-ds's parsers: expected one of ['compact', 'hermes'] (policy.generation.backend=vllm uses vLLM's)"
    """
    ours = TOOL_PARSERS if kind == "tool_parser" else REASONING_PARSERS
    if name is None or name in ours:
        return None
    key = f"policy.generation.vllm_cfg.http_server_serving_chat_kwargs.{kind}={name!r}"
    if backend == "hf":
        return (f"{key}: the hf backend's endpoint parses with grpo-ds's parsers: expected one of {sorted(ours)} "
                "(policy.generation.backend=vllm uses vLLM's)")
    names = vllm_parser_names(kind)
    if names is None or name in names:
        return None
    return f"{key}: neither vLLM nor grpo-ds has that parser: expected one of {sorted(set(names) | set(ours))}"


class ServingChatKwargs(_Section):
    """NeMo-RL's ``policy.generation.vllm_cfg.http_server_serving_chat_kwargs`` (vLLM's OpenAIServingChat
    arguments): the endpoint's chat rendering and output parsing, on every backend."""

    tool_parser: Optional[str] = Field(None, description=(
        "How the model's tool-call text becomes OpenAI tool_calls. backend=vllm: any parser vLLM registers (vLLM's "
        "own code parses); hf: hermes (<tool_call>{json}</tool_call>: Qwen2.5, Qwen3, Hermes); both: compact "
        "(<name>argument</name>: the char-level toy); null: no parsing (the text is the content)."))
    reasoning_parser: Optional[str] = Field(None, description=(
        "Split <think>...</think> into message.reasoning_content. backend=vllm: any parser vLLM registers; hf: "
        "qwen3 (thinking on unless enable_thinking=false: no </think> yet, all reasoning) and deepseek_r1, as the "
        "installed vLLM's; null: no split."))
    chat_template: Optional[str] = Field(None, description=(
        "The endpoint's chat template: a Jinja string or a file path (null: policy.tokenizer.chat_template, else "
        "the tokenizer's own)."))
    default_chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "Template variables of every request (a request's chat_template_kwargs override them), e.g. "
        "{enable_thinking: false}."))
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "The older spelling of default_chat_template_kwargs (NeMo-RL accepts both); both set is an error."))

    @model_validator(mode="after")
    def _one_spelling(self) -> "ServingChatKwargs":
        if self.chat_template_kwargs is not None and self.default_chat_template_kwargs is not None:
            raise ValueError("policy.generation.vllm_cfg.http_server_serving_chat_kwargs: chat_template_kwargs and "
                             "default_chat_template_kwargs are both set: keep default_chat_template_kwargs")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.default_chat_template_kwargs or self.chat_template_kwargs or {})


class HttpServerConfig(_Section):
    """grpo-ds's settings of the endpoint (NeMo-RL's keys are vllm_cfg.expose_http_server and
    vllm_cfg.http_server_serving_chat_kwargs)."""

    host: str = Field("127.0.0.1", description=(
        "Address the endpoint binds (loopback by default: only this machine's agents reach it; every request also "
        "needs the run's bearer token)."))
    max_concurrent_requests: int = Field(256, gt=0, description=(
        "Requests in flight at once; one more is answered 429."))
    max_body_bytes: int = Field(8 * 2**20, gt=0, description="A request body over this many bytes is answered 413.")
    batch_window_s: float = Field(0.02, ge=0, description=(
        "Requests generate in one batch while they keep coming: a batch closes once no request has come for this "
        "long while the server reads or answers no other, or once it holds policy.generation_batch_size."))
    max_wait_s: float = Field(30.0, gt=0, description=(
        "How long a request waits for a generation window (the run generates only during rollouts; weights change "
        "between them) before it is answered 503 with a Retry-After header."))
    model_name: Optional[str] = Field(None, description=(
        "The model name /v1/models lists and requests send (null: policy.model_name)."))
    read_timeout_s: float = Field(30.0, gt=0, description=(
        "A request body that has not arrived in full this long after its headers is answered 408; until its body "
        "is read a request holds none of the max_concurrent_requests slots."))
    trust_request_chat_template: bool = Field(False, description=(
        "vLLM's --trust-request-chat-template: a request's own chat_template replaces the run's; false (default): "
        "a request that sends one is answered 400 (the run's template is what the policy trains on)."))
    render_timeout_s: float = Field(10.0, gt=0, description=(
        "Rendering a request with the chat template (off the server's event loop) is stopped after this long and "
        "the request answered 400."))


class VllmConfig(_Section):
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs per vLLM engine (a divisor of the world size).")
    gpu_memory_utilization: float = Field(
        0.6, gt=0, le=1, description="Share of GPU memory vLLM may take (weights + KV cache).")
    kv_cache_memory_bytes: Optional[int] = Field(
        None, gt=0, description="Explicit KV cache size in bytes (CPU default 256 MiB: vLLM would reserve 92% of RAM).")
    max_model_len: Optional[int] = Field(
        None, gt=0, description="vLLM's context length (null: policy.max_total_sequence_length).")
    enforce_eager: bool = Field(
        False, description="No CUDA graphs / torch.compile in vLLM (faster start, slower decode).")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of shared prefixes (a group's prompt, a conversation's earlier turns).")
    sleep_level: Literal[1, 2] = Field(1, description=(
        "1: offload weights and discard the KV cache while training (default); 2: discard both (reports of "
        "wrong output after wake)."))
    offload_optimizer_during_generation: bool = Field(
        False, description="GPU: move DeepSpeed's optimizer states to the host while vLLM generates.")
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "More keyword arguments of vllm.LLM (NeMo-RL's policy.generation.vllm_kwargs), e.g. compilation_config; "
        "one that grpo-ds sets itself is an error."))
    expose_http_server: bool = Field(False, description=(
        "NeMo-RL's key: serve an OpenAI-compatible endpoint over the policy being trained "
        "(grpo/system/generation/endpoint.py: /v1/chat/completions, /tokenize, /v1/models, /health). It lives here "
        "for every backend: an hf-backend run reads the same key (and http_server_serving_chat_kwargs) from "
        "policy.generation.vllm_cfg, so a NeMo-RL recipe turns it on unchanged. env.name=agent starts it without "
        "this key. grpo-ds's own server settings: policy.generation.http_server."))
    http_server_serving_chat_kwargs: Optional[ServingChatKwargs] = Field(None, description=(
        "NeMo-RL's key (any backend, see expose_http_server): how the endpoint renders and parses chat: "
        "tool_parser, reasoning_parser, chat_template, default_chat_template_kwargs (null: none of them)."))

    @field_validator("vllm_kwargs")
    @classmethod
    def _own_keys(cls, v):
        taken = sorted(set(v) & VLLM_KWARGS_SET_BY_GRPO)
        if taken:
            raise ValueError(f"policy.generation.vllm_cfg.vllm_kwargs: {taken} are set by grpo-ds "
                             "(grpo/system/generation/vllm_params.py); set them through their policy.* fields")
        return v


class ColocatedResourcesConfig(_Section):
    """The ranks that generate when ``colocated.enabled=false`` (NeMo-RL's ``colocated.resources``)."""

    gpus_per_node: Optional[int] = Field(None, gt=0, description=(
        "Generation ranks per node (NeMo-RL's meaning): on one node the last gpus_per_node ranks generate and the "
        "others train; with cluster.num_nodes > 1 it must equal cluster.gpus_per_node (whole nodes generate)."))
    num_nodes: Optional[int] = Field(None, gt=0, description=(
        "Nodes that generate (null: 1). Generation ranks = gpus_per_node x num_nodes, the last ranks of the launch."))


class ColocatedConfig(_Section):
    """Where generation runs (NeMo-RL's ``policy.generation.colocated``): on the training ranks (``enabled=true``,
    the default) or on ranks of its own (`grpo.system.generation.remote`)."""

    enabled: bool = Field(True, description=(
        "true: every rank trains and generates; false: the last colocated.resources ranks of the launch only "
        "generate (vLLM or hf, never sleeping), the others train; prompts, trajectories and weights go over a "
        "bridge between trainer rank 0 and them (train_async_grpo.py with vllm needs false, as in NeMo-RL)."))
    resources: ColocatedResourcesConfig = Field(
        default_factory=ColocatedResourcesConfig, description="The generation ranks (colocated.enabled=false).")
    bridge_timeout_s: float = Field(600.0, gt=0, description=(
        "grpo-ds: seconds trainer rank 0 waits for a generation rank's answer (a batch's generation, a weight "
        "load) before it stops the run naming that rank as hung."))


class GenerationConfig(_Section):
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="hf: transformers generate on a plain copy (any device); vllm: a vLLM engine (colocated "
                          "with training, or on ranks of its own: colocated.enabled=false).")
    max_new_tokens: int = Field(512, gt=0, description="Generated tokens per assistant turn at most.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer's logprobs use it too).")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling (the trainer's logprobs apply the same filter).")
    top_k: Optional[int] = Field(
        None, gt=0, description="Top-k sampling (null: off; the trainer's logprobs apply the same filter).")
    val_temperature: Optional[float] = Field(
        None, gt=0, description="Validation's sampling temperature (null: temperature, the training value).")
    val_top_p: Optional[float] = Field(
        None, gt=0, le=1, description="Validation's nucleus sampling (null: top_p, the training value).")
    val_top_k: Optional[int] = Field(
        None, gt=0, description="Validation's top-k sampling (null: top_k, the training value).")
    stop_token_ids: Optional[list[int]] = Field(
        None, description="Extra token ids that end a turn (besides the tokenizer's and the model's EOS).")
    stop_strings: Optional[list[str]] = Field(
        None, description="Strings that end a turn (an environment may set per-turn ones).")
    hf_drop_finished_rows: bool = Field(True, description=(
        "hf backend: samples that end leave the batch and its KV cache (once they are a quarter of it), so a "
        "generation call costs about the sum of its samples' lengths (grpo/system/generation/hf.py "
        "decode_dropping_finished); false: transformers' "
        "generate, every row decoded until the call's longest ends. The same samples either way."))
    refit_bucket_numel: int = Field(2**28, gt=0, description=(
        "Elements per weight-refit push: ZeRO-3 gathers whole decoder layers until a bucket holds this many."))
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine settings.")
    port_range_low: int = Field(3000, gt=0, lt=65536, description=(
        "NeMo-RL's key: the endpoint (vllm_cfg.expose_http_server, env.name=agent) takes the first free port from "
        "port_range_low to port_range_high."))
    port_range_high: int = Field(4999, gt=0, lt=65536, description="See port_range_low (inclusive).")
    http_server: HttpServerConfig = Field(default_factory=HttpServerConfig, description=(
        "grpo-ds's endpoint settings: bind address, concurrency and body limits, batching window."))
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig, description=(
        "Generation on the training ranks (default) or on ranks of its own (NeMo-RL's colocated section)."))

    @model_validator(mode="after")
    def _parsers(self) -> "GenerationConfig":
        serving = self.vllm_cfg.http_server_serving_chat_kwargs
        for kind in ("tool_parser", "reasoning_parser"):
            problem = parser_problem(kind, getattr(serving, kind) if serving else None, self.backend)
            if problem is not None:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _port_range(self) -> "GenerationConfig":
        if self.port_range_low > self.port_range_high:
            raise ValueError(f"policy.generation.port_range_low={self.port_range_low} is above "
                             f"port_range_high={self.port_range_high}: expected low <= high")
        return self

    def for_validation(self) -> "GenerationConfig":
        """This config with validation's sampling (NeMo-RL's val_temperature / val_top_p / val_top_k) in place of
        temperature / top_p / top_k; itself when none is set."""
        update = {name: getattr(self, f"val_{name}") for name in ("temperature", "top_p", "top_k")
                  if getattr(self, f"val_{name}") is not None}
        return self.model_copy(update=update) if update else self


class LoraConfig(_Section):
    """LoRA adapters on the policy (NeMo-RL's ``policy.dtensor_cfg.lora_cfg``, same names and defaults), built with
    peft (grpo/system/engines.py ``apply_lora``): only the adapters train and have optimizer states; the reference
    is the policy with its adapters off (no second model); checkpoints hold the adapters."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of the whole policy.")
    target_modules: list[str] = Field(default_factory=list, description=(
        "Modules to adapt (with match_all_linear=false): a module's own name (q_proj) or a pattern with * over its "
        "full dotted name (*.layers.0.*.q_proj)."))
    exclude_modules: list[str] = Field(default_factory=list, description=(
        "Modules never adapted, named as target_modules (applies with match_all_linear too)."))
    match_all_linear: bool = Field(True, description=(
        "Adapt every linear layer but the output head (peft's all-linear); target_modules must then be empty."))
    dim: int = Field(8, gt=0, description="LoRA rank r.")
    alpha: float = Field(32, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / dim.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability of the adapter path.")
    dropout_position: Literal["pre", "post"] = Field("post", description=(
        "pre: dropout on the adapter's input, dropout(x) -> A -> B (peft's); post: on its output, "
        "dropout(B(A(x)) * alpha / dim) (NeMo-RL's default). The same when dropout is 0."))
    lora_A_init: Literal["xavier", "uniform"] = Field("xavier", description=(
        "Initialization of A (B starts at 0, so the adapted model starts as the base): xavier (normal) or "
        "uniform (kaiming uniform, a=sqrt(5): peft's default)."))

    @model_validator(mode="after")
    def _check(self) -> "LoraConfig":
        if self.enabled and not self.match_all_linear and not self.target_modules:
            raise ValueError("policy.lora: match_all_linear=false with no target_modules adapts nothing: name the "
                             "modules (e.g. [q_proj, v_proj]) or set match_all_linear=true")
        if self.match_all_linear and self.target_modules:
            raise ValueError(f"policy.lora: match_all_linear=true adapts every linear layer, target_modules="
                             f"{self.target_modules} would be ignored: set match_all_linear=false to adapt only those")
        return self


class SequencePackingConfig(_Section):
    """NeMo-RL's ``policy.sequence_packing`` (same names and meanings; grpo/packing.py, grpo/system/packed.py): the
    logprob and training forwards fill micro-batches up to a token budget with a bin-packing algorithm and run each
    with its samples back to back (positions restarting at 0 in each, so attention never crosses samples), where
    that puts fewer tokens through the model than padded rows or shared prompts. Same logprobs and gradients as the
    padded forward up to float rounding; exclusive with dynamic_batching."""

    enabled: bool = Field(True, description=(
        "Micro-batches of up to *_mb_tokens tokens, their samples packed back to back where that runs fewer tokens "
        "(on by default, as in NeMo-RL's recipes: 0.26x TRL's step on the long-tail workload against 0.68x padded, "
        "and a micro-batch whose lengths are even runs padded or with shared prompts as before; docs/packing.md). "
        "Left at its default it gives way to dynamic_batching.enabled=true, and to a model whose "
        "attention cannot take packed rows (the startup line says so); set explicitly, both are errors."))
    train_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Real tokens per training micro-batch (sdpa / eager rows of the longest sample can hold up to twice that in "
        "slots); null: max_total_sequence_length x train_micro_batch_size (NeMo-RL's default)."))
    logprob_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Tokens per logprob micro-batch; null: max_total_sequence_length x logprob_batch_size."))
    algorithm: Literal["modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle",
                       "concatenative"] = Field("modified_first_fit_decreasing", description=(
                           "Bin packing (grpo/packing.py PACKING_ALGORITHMS, NeMo-RL's four)."))
    microbatch_order: Literal["packer", "largest_first"] = Field("packer", description=(
        "Order the bins run in: the packer's, or the fullest first."))
    sequence_length_round: int = Field(1, gt=0, description=(
        "Packed rows are padded to a multiple of this many tokens (steadier shapes for GPU kernels; NeMo-RL's "
        "recipes say 64); 1: no padding."))


class DynamicBatchingConfig(_Section):
    """NeMo-RL's ``policy.dynamic_batching`` (same names and meanings; grpo/packing.py dynamic_micro_batches): a
    rank's samples sorted by length and cut into micro-batches of at most *_mb_tokens padded tokens (rows x the
    longest rounded length), so short samples run many at a time. Works with any attention implementation;
    exclusive with sequence_packing."""

    enabled: bool = Field(False, description="Micro-batches by token budget instead of by row count.")
    train_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Padded tokens per training micro-batch; null: max_total_sequence_length x train_micro_batch_size."))
    logprob_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Padded tokens per logprob micro-batch; null: max_total_sequence_length x logprob_batch_size."))
    sequence_length_round: int = Field(1, gt=0, description=(
        "Each micro-batch is padded to a multiple of this many columns (NeMo-RL's recipes say 64); 1: none."))


class PolicyConfig(_Section):
    model_name: str = Field(
        "Qwen/Qwen2.5-1.5B", description="Local directory, hub name (needs network), or toy:<name> (built locally).")

    @field_validator("model_name")
    @classmethod
    def _toy_model(cls, v):
        return check_toy_model(v, "policy.model_name")

    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer and chat template.")
    train_global_batch_size: int = Field(512, gt=0, description=(
        "Samples per optimizer step across all ranks (a divisor of prompts x generations per step)."))
    train_micro_batch_size: int = Field(4, gt=0, description="Samples per forward/backward on each rank.")
    generation_batch_size: int = Field(32, gt=0, description="Conversations per generation call on each rank.")
    logprob_batch_size: int = Field(
        4, gt=0, description="Samples per logprob forward (previous policy, reference) on each rank.")
    max_total_sequence_length: int = Field(
        512, gt=0, description="Tokens of a whole conversation at most (prompt + every turn).")
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Training precision (float32 on CPUs: bf16 is 5-30x slower there).")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="Gradient-norm clipping (null: off).")
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in backward (saves memory, costs a forward).")
    trust_remote_code: bool = Field(
        False, description="Allow model code from the checkpoint (transformers' trust_remote_code).")
    hf_config_overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "Changes to the checkpoint's model config for every copy of the policy (training, reference, generation, "
        "vLLM's hf_overrides; NeMo-RL's hf_config_overrides), e.g. {rope_scaling: {rope_type: yarn, factor: 4, "
        "original_max_position_embeddings: 32768}}. A dict into a sub-config (text_config) updates its keys, "
        "any other value replaces the attribute; a key the config does not have is an error "
        "(grpo/system/model_config.py)."))
    logprob_chunk_size: Optional[int] = Field(
        None, gt=0, description="Rows per chunk of the logprob computation (null: 2^24 / vocabulary size).")
    shared_prompt_forward: Literal["auto", True, False] = Field("auto", description=(
        "A prompt that several samples share goes through the model once, their continuations over its KV cache: "
        "in the hf backend's prefill, and in the logprob and training forwards except under ZeRO-3 "
        "(grpo/system/shared_prefix.py; same values up to rounding). auto: for models of 10M parameters or more "
        "(below, the extra forward call costs more than the prompt tokens save)."))
    deepspeed_config: str = Field("auto", description=(
        "DeepSpeed JSON of the policy (its auto values are filled from this config); auto: on one rank "
        "ds_configs/zero0.json in float32 (nothing to partition) or zero1.json in 16-bit, zero3.json on several."))
    reference_deepspeed_config: str = Field(
        "ds_configs/zero3_reference.json", description="DeepSpeed JSON of the frozen reference (and teacher).")
    reference_placement: Literal["auto", "plain", "zero3"] = Field("auto", description=(
        "The frozen reference / teacher: plain (a module on each rank, no ZeRO hooks), zero3 (sharded over the "
        "ranks), or auto: plain on one rank or when its weights take at most 1/4 of the free device memory."))
    max_nonfinite_steps: int = Field(3, ge=1, description=(
        "Non-finite steps (loss, gradient norm or rewards) in a row before the run stops with exit 1."))
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Learning-rate schedule.")
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Generation (sampling, backend, stop rules).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description=(
        "LoRA adapters (NeMo-RL's dtensor_cfg.lora_cfg); off by default."))
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig, description=(
        "Samples packed into rows by token budget in the logprob and training forwards (NeMo-RL's)."))
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig, description=(
        "Micro-batches by token budget in the logprob and training forwards (NeMo-RL's)."))

    def mb_tokens(self, phase: Literal["train", "logprob"]) -> Optional[int]:
        """The token budget of a ``phase`` micro-batch under packing or dynamic batching (None: both off)."""
        section = (self.sequence_packing if self.sequence_packing.enabled
                   else self.dynamic_batching if self.dynamic_batching.enabled else None)
        if section is None:
            return None
        rows = self.train_micro_batch_size if phase == "train" else self.logprob_batch_size
        value = section.train_mb_tokens if phase == "train" else section.logprob_mb_tokens
        return value if value is not None else self.max_total_sequence_length * rows

    @model_validator(mode="after")
    def _token_batching(self) -> "PolicyConfig":
        """Packing and dynamic batching are exclusive (as in NeMo-RL); packing left at its default (on) gives way
        to dynamic batching; a budget must hold the longest sample."""
        if (self.sequence_packing.enabled and self.dynamic_batching.enabled
                and "enabled" not in self.sequence_packing.model_fields_set):
            self.sequence_packing.enabled = False
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are both true: they "
                             "are exclusive (as in NeMo-RL); enable one")
        name = ("sequence_packing" if self.sequence_packing.enabled
                else "dynamic_batching" if self.dynamic_batching.enabled else None)
        if name is None:
            return self
        rnd = getattr(self, name).sequence_length_round
        longest = self.max_total_sequence_length if name == "sequence_packing" else \
            -(-self.max_total_sequence_length // rnd) * rnd
        for phase in ("train", "logprob"):
            if self.mb_tokens(phase) < longest:
                raise ValueError(f"policy.{name}.{phase}_mb_tokens={self.mb_tokens(phase)}: a sample of "
                                 f"policy.max_total_sequence_length={self.max_total_sequence_length} tokens "
                                 f"({longest} rounded) would not fit; expected >= {longest}")
        return self

    @model_validator(mode="after")
    def _lora_on_vllm(self) -> "PolicyConfig":
        """LoRA with the vLLM backend (grpo/system/generation/vllm.py AdapterSync): vLLM keeps the checkpoint's base
        weights for the run and loads the adapters (ranks up to 512, vLLM 0.32-0.33 config/lora.py)."""
        if not (self.lora.enabled and self.generation.backend == "vllm"):
            return self
        v = self.generation.vllm_cfg
        if self.lora.dim > VLLM_MAX_LORA_RANK:
            raise ValueError(f"policy.lora.dim={self.lora.dim}: vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK} "
                             "(policy.generation.backend=vllm); lower it or use backend=hf")
        if v.sleep_level == 2:
            raise ValueError("policy.generation.vllm_cfg.sleep_level=2 discards vLLM's weights while training; with "
                             "policy.lora the base weights are loaded once and never pushed again: use sleep_level=1")
        taken = sorted(set(v.vllm_kwargs) & VLLM_LORA_KWARGS)
        if taken:
            raise ValueError(f"policy.generation.vllm_cfg.vllm_kwargs: {taken} are set by grpo-ds with policy.lora "
                             "(grpo/system/generation/vllm_params.py lora_llm_kwargs)")
        return self


# --------------------------------------------------------------------------------------------------
# data, env
# --------------------------------------------------------------------------------------------------
class DataSource(_Section):
    """One dataset of several (``data.train_sources`` / ``data.val_sources``). A field left null takes the
    ``data.*`` field of the same name, as NeMo-RL's ``data.default`` fills its dataset specs; ``split`` takes
    data.train_split / val_split, ``num_samples`` data.num_train_samples / num_val_samples and ``repeat``
    data.val_repeat (validation) or 1 (training) by side."""

    dataset_name: Optional[str] = Field(None, description=(
        "What data.dataset_name takes (a built-in task, a local file or directory, a hub name); on the validation "
        "side a local file or hub name is read as data.val_data_path is."))
    dataset_config: Optional[str] = Field(None, description="Config name of a hub dataset.")
    split: Optional[str] = Field(None, description="Split (hub) or file stem (directory) of this source.")
    input_key: Optional[str] = Field(None, description="Column holding the prompt.")
    output_key: Optional[str] = Field(None, description="Column holding the reference answer.")
    prompt_file: Optional[str] = Field(None, description="This source's prompt template file.")
    prompt_template: Optional[str] = Field(None, description="This source's prompt template.")
    system_prompt_file: Optional[str] = Field(None, description="This source's system prompt file.")
    system_prompt: Optional[str] = Field(None, description="This source's system prompt.")
    task_name: Optional[str] = Field(None, description=(
        "The task (environment, see env.tasks) that scores this source's rows; null: a row's data.task_key "
        "column, else env's task."))
    num_samples: Optional[int] = Field(None, gt=0, description="Rows of a procedural source (a built-in task).")
    split_validation_size: Optional[float] = Field(None, ge=0, description=(
        "Training sources: hold out this share (< 1) or number (>= 1) of the source's rows; they join the "
        "validation rows, before data.val_sources (NeMo-RL's split_validation_size)."))
    split_validation_seed: Optional[int] = Field(None, description="Seed of that split (null: grpo.seed).")
    repeat: Optional[int] = Field(None, gt=0, description=(
        "Each of this source's rows appears this many times (validation: NeMo-RL's repeat; training: a weight in "
        "the mix)."))


class DataConfig(_Section):
    dataset_name: str = Field("arithmetic", description=(
        "arithmetic, guess_number, calculator, reasoning_gym:<task>, a local .jsonl/.json/.parquet/.arrow file "
        "or directory, or a hub name."))
    dataset_config: Optional[str] = Field(
        None, description="Config name of a hub dataset (e.g. main for openai/gsm8k).")
    train_data_path: Optional[str] = Field(
        None, description="Local training file (overrides dataset_name for training).")
    val_data_path: Optional[str] = Field(
        None, description="Local validation file (overrides dataset_name for validation).")
    train_split: Optional[str] = Field(None, description="Split (hub) or file stem (directory) of the training data.")
    val_split: Optional[str] = Field(None, description="Split (hub) or file stem (directory) of the validation data.")
    input_key: str = Field(
        "input", description="Column holding the prompt (a string, or a list of role/content messages).")
    output_key: str = Field("output", description="Column holding the reference answer.")
    prompt_file: Optional[str] = Field(
        None, description="File holding the prompt template ({} or {input} for the question).")
    prompt_template: Optional[str] = Field(None, description="Prompt template with {} or {input} for the question.")
    system_prompt_file: Optional[str] = Field(None, description="File holding the system prompt.")
    system_prompt: Optional[str] = Field(None, description="System prompt.")
    max_input_seq_length: Optional[int] = Field(
        None, gt=0, description="Prompts longer than this (tokens) are filtered out and counted.")
    split_validation_size: float = Field(0, ge=0, description=(
        "Hold out this share (< 1) or number (>= 1) of the training rows; they join the validation rows, before "
        "data.val_data_path's (NeMo-RL's split_validation_size); 0: off."))
    split_validation_seed: Optional[int] = Field(None, description="Seed of that split (null: grpo.seed).")
    val_repeat: int = Field(1, gt=0, description="Each validation row appears this many times (NeMo-RL's repeat).")
    shuffle: bool = Field(True, description="Shuffle the training prompts (seeded; resumes exactly).")
    on_bad_row: Literal["error", "skip"] = Field("error", description=(
        "error: a malformed row stops the run naming file and row; skip: it is skipped and counted."))
    num_train_samples: int = Field(
        2048, gt=0, description="Size of procedural training sets (arithmetic, guess_number, reasoning_gym).")
    num_val_samples: int = Field(128, gt=0, description="Size of procedural validation sets.")
    arithmetic_max_operand: int = Field(
        9, gt=0, description="Built-in arithmetic: operands are drawn from [0, arithmetic_max_operand].")
    guess_number_high: int = Field(
        9, gt=0, description="Built-in guess_number: secrets are drawn from [0, guess_number_high].")
    calculator_max_operand: int = Field(99, ge=10, description=(
        "Built-in calculator task: a*b with a, b drawn from [10, calculator_max_operand]."))
    num_workers: int = Field(0, ge=0, description="Data loader worker processes (0: load in the trainer).")
    task_key: str = Field("task_name", description=(
        "Column naming each row's task (its environment, see env.tasks); rows without it use env's."))
    train_sources: list[DataSource] = Field(default_factory=list, description=(
        "Several training datasets, concatenated in order (then shuffled together), each a mapping of "
        "dataset_name, dataset_config, split, input_key, output_key, prompt_file/prompt_template, "
        "system_prompt_file/system_prompt, task_name (the environment scoring its rows), num_samples, "
        "split_validation_size/split_validation_seed, repeat; a field left null takes data.<field> (NeMo-RL's "
        "data.default). Empty: the single source of data.dataset_name / train_data_path."))
    val_sources: list[DataSource] = Field(default_factory=list, description=(
        "Several validation datasets (the same mappings; repeat null takes data.val_repeat), after the rows "
        "held out by split_validation_size; empty: data.val_data_path, else the held-out rows alone, else each "
        "training source's own validation split."))

    @model_validator(mode="after")
    def _sources(self) -> "DataConfig":
        for side, keys in (("train", ("train_data_path", "train_split")), ("val", ("val_data_path", "val_split"))):
            given = [k for k in keys if getattr(self, k) is not None]
            if getattr(self, f"{side}_sources") and given:
                raise ValueError(f"data.{side}_sources and data.{'/'.join(given)} are both set: give each source's "
                                 f"dataset_name / split in data.{side}_sources")
        for i, src in enumerate(self.val_sources):
            if src.split_validation_size:
                raise ValueError(f"data.val_sources.{i}.split_validation_size: only training sources hold rows out "
                                 "for validation")
        return self


class AgentConfig(_Section):
    """``env.agent`` (``env.name: agent``): a user's agent plays each sample through the run's OpenAI-compatible
    endpoint (grpo/tasks/agent.py has the contract)."""

    fn: Optional[str] = Field(None, description=(
        "package.module:function, an async function fn(row, base_url, api_key, model) -> float or dict with "
        "reward, optional reward_components and mask_sample."))
    command: Optional[list[str]] = Field(None, description=(
        "A program (argv list) run per sample: GRPO_BASE_URL, GRPO_API_KEY, GRPO_MODEL (and OPENAI_BASE_URL, "
        "OPENAI_API_KEY) in its environment, the row as JSON on stdin; it prints the result JSON (as fn returns) "
        "on stdout."))
    max_concurrency: int = Field(64, gt=0, description="Agents running at once on a rank.")
    timeout_s: float = Field(300.0, gt=0, description=(
        "Per-attempt deadline in seconds, whatever the agent does: an agent still running is abandoned (cancelled, "
        "a program killed) and the attempt fails (env_timeout: retried within grpo.rollout_failure, then masked, "
        "never scored 0)."))

    @model_validator(mode="after")
    def _one(self) -> "AgentConfig":
        if (self.fn is None) == (self.command is None):
            raise ValueError(f"env.agent: expected exactly one of fn (got {self.fn!r}) and command (got "
                             f"{self.command!r})")
        if self.fn is not None and ":" not in self.fn:
            raise ValueError(f"env.agent.fn={self.fn!r}: expected 'package.module:function'")
        if self.command is not None and not self.command:
            raise ValueError("env.agent.command=[]: expected a program and its arguments")
        return self


class RewardModelTokenizerConfig(_Section):
    name: Optional[str] = Field(None, description="The reward model's tokenizer and chat template (null: model_name).")


class RewardModelTypeConfig(_Section):
    """NeMo-RL's ``env.reward_model.reward_model_cfg``."""

    enabled: bool = Field(True, description="Must be true (NeMo-RL asserts it).")
    reward_model_type: Literal["bradley_terry"] = Field("bradley_terry", description=(
        "bradley_terry: a sequence classifier with one output, the score of the whole conversation."))


class RewardModelConfig(_Section):
    """``env.reward_model`` (``env.name: reward_model``), NeMo-RL's keys: a sequence classifier scoring each
    conversation rendered with its own chat template (grpo/tasks/reward_model.py, grpo/system/reward_model.py)."""

    model_name: str = Field(description="The reward model: a local directory or a hub name of a "
                            "ForSequenceClassification checkpoint (num_labels is set to 1, as NeMo-RL does), or "
                            "toy:demo_rm (built locally: the reward-model demo's).")

    @field_validator("model_name")
    @classmethod
    def _toy_model(cls, v):
        return check_toy_model(v, "env.reward_model.model_name")

    tokenizer: RewardModelTokenizerConfig = Field(default_factory=RewardModelTokenizerConfig, description=(
        "tokenizer.name: the reward model's tokenizer (null: model_name)."))
    precision: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="The reward model's dtype.")
    batch_size: int = Field(8, gt=0, description="Conversations per reward-model forward.")
    max_model_len: Optional[int] = Field(None, gt=0, description=(
        "Longest conversation (reward-model tokens) scored; a longer one fails (masked, counted), never cut. "
        "null: no bound."))
    checkpoint_path: Optional[str] = Field(None, description=(
        "Weights to load instead of model_name's (a local ForSequenceClassification directory); null: model_name."))
    reward_model_cfg: RewardModelTypeConfig = Field(default_factory=RewardModelTypeConfig, description=(
        "NeMo-RL's reward_model_cfg: enabled must be true, reward_model_type bradley_terry."))
    placement: Literal["auto", "plain", "zero3"] = Field("auto", description=(
        "grpo-ds's (NeMo-RL gives the reward model GPUs of its own: resources): plain, a frozen copy on each "
        "training rank; zero3, a ZeRO-3 inference engine sharded over the training ranks "
        "(policy.reference_deepspeed_config), scored collectively once per rollout; auto: as "
        "policy.reference_placement's auto (plain on one rank or when its weights take at most 1/4 of the free "
        "device memory, else zero3)."))
    offload: bool | Literal["auto"] = Field("auto", description=(
        "grpo-ds's: keep the reward model's weights in host memory while the policy trains (GPU runs; no effect on "
        "the CPU): a plain copy moves to the device only to score; a zero3 engine keeps its shards on the host "
        "(ZeRO's offload_param) and fetches each layer as it runs. auto: offload when the weights a rank holds "
        "(the whole copy, or its ZeRO-3 shard) take more than 1/4 of its free device memory once the policy is "
        "built, agreed over the ranks."))

    @model_validator(mode="before")
    @classmethod
    def _own_resources(cls, data):
        """NeMo-RL's ``resources`` (GPUs of the reward model's own) in a native config: refused with the reason (a
        NeMo-RL recipe's is translated: its GPUs join the training ranks, grpo/config/nemo_rl/rules.py)."""
        if isinstance(data, dict) and "resources" in data:
            raise ValueError(f"env.reward_model.resources={data['resources']!r}: grpo-ds has no ranks of the reward "
                             "model's own; it runs on the training ranks beside the policy (with generation on ranks "
                             "of its own, on the trainers), a frozen copy on each or a ZeRO-3 engine sharded over them: "
                             "remove resources and choose env.reward_model.placement (auto, plain, zero3), launching "
                             "the GPUs you meant for it as training ranks")
        return data

    @model_validator(mode="after")
    def _enabled(self) -> "RewardModelConfig":
        if not self.reward_model_cfg.enabled:
            raise ValueError("env.reward_model.reward_model_cfg.enabled=False: expected true (NeMo-RL: 'Please set "
                             "reward_model_cfg.enabled = True in the reward model environment config')")
        return self


class JudgeConfig(_Section):
    """``env.judge`` (``env.name: judge``): an LLM judge behind any OpenAI-compatible URL (grpo/tasks/judge.py)."""

    base_url: str = Field(description="The server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="The judge's model name on that server.")
    prompt_template: str = Field(description=(
        "The judge's prompt: {question}, {completion} and {answer} are filled in (literal braces doubled)."))
    score_pattern: str = Field(r"Score:\s*(-?[0-9]+(?:\.[0-9]+)?)", description=(
        "Regex whose last match's group 1 is the score in the judge's answer; an answer without one fails the "
        "sample (env_malformed: retried, then masked), never scores 0."))
    max_score: float = Field(1.0, gt=0, description="reward = score / max_score.")
    timeout_s: float = Field(60.0, gt=0, description="Seconds one judge request may take (env_timeout past it).")
    max_concurrency: int = Field(16, gt=0, description="Judge requests in flight at once (per rank).")
    api_key_env: Optional[str] = Field(None, description=(
        "Environment variable holding the server's API key (null: no key)."))
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature.")
    max_tokens: Optional[int] = Field(None, gt=0, description="Most tokens the judge may answer (null: the server's).")

    @model_validator(mode="after")
    def _template(self) -> "JudgeConfig":
        import re

        try:
            self.prompt_template.format(question="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"env.judge.prompt_template: {type(err).__name__}: {err}; expected only {{question}}, "
                             "{completion}, {answer} (double literal braces)") from err
        if "{completion}" not in self.prompt_template:
            raise ValueError("env.judge.prompt_template has no {completion}: the judge would not see the answer")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as err:
            raise ValueError(f"env.judge.score_pattern={self.score_pattern!r}: {err}") from err
        if groups < 1:
            raise ValueError(f"env.judge.score_pattern={self.score_pattern!r}: expected a group around the score")
        return self


class EffortLevelsConfig(_Section):
    """``env.nemo_gym.effort_levels``: NeMo-RL's length shaping of NeMo-Gym rewards for low-effort prompts
    (``nemo_rl/experience/rollouts.py``, ``EffortLevelsConfig``; `grpo.gym_rewards.apply_effort_shaping`):

        length_reward = min(1, low_weight * (1 - response_len / low_ub))
        reward'       = reward + reward * max(length_reward, 0) + low_penalty * min(length_reward, 0)

    for samples whose last user message contains ``low_string``; off when low_weight <= 0 or low_string is empty."""

    low_weight: float = Field(0.0, description="Weight of the length-reward term (0: shaping off).")
    low_penalty: float = Field(1.0, description="Coefficient of the negative length-reward term.")
    low_ub: int = Field(64000, gt=0, description="Response length (tokens) that normalises the term.")
    low_string: str = Field("", description="Substring of the last user message that turns shaping on ('' : off).")


class NemoGymConfig(BaseModel):
    """``env.nemo_gym`` (``env.should_use_nemo_gym: true``): NeMo-RL's section, its own keys typed, every other key
    Gym's global config (kept as given and handed to the launcher), plus grpo-ds's keys for where the Gym servers
    come from: ``agent_urls`` / ``head_server_url`` (servers you started) or ``config_paths`` + ``launcher`` (grpo-ds
    starts them). grpo/tasks/nemo_gym.py has the protocol."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    invalid_tool_call_patterns: Optional[list[str]] = Field(None, description=(
        "NeMo-RL's key: substrings of an assistant message's text that mark an unexecuted tool call (null: "
        "NeMo-RL's <tool_call>, </tool_call>, <function_call>, </function_call>); read by the reward penalties."))
    thinking_tags: Optional[list[str]] = Field(None, description=(
        "NeMo-RL's key: the thinking tags checked for malformed thinking (null: <think>, </think>)."))
    effort_levels: Optional[EffortLevelsConfig] = Field(None, description=(
        "NeMo-RL's key: effort-level length shaping of Gym results (grpo.gym_rewards; never sent to Gym)."))
    port_range_low: int = Field(5000, gt=0, lt=65536, description=(
        "NeMo-RL's key: the Gym servers' ports (the head server grpo-ds starts takes the first free one); passed to "
        "Gym as its port_range_low."))
    port_range_high: int = Field(5999, gt=0, lt=65536, description="See port_range_low (inclusive).")
    config_paths: Optional[list[str]] = Field(None, description=(
        "Gym's key: the server configs grpo-ds's launcher starts (relative to launcher_cwd, Gym's checkout)."))
    agent_urls: dict[str, str] = Field(default_factory=dict, description=(
        "grpo-ds: agent servers you started, by the agent_ref.name of the rows they serve: {name: http://host:port}."))
    head_server_url: Optional[str] = Field(None, description=(
        "grpo-ds: the head server of Gym servers you started (ng_run prints it; http://127.0.0.1:11000 by default): "
        "the agents' addresses are read from its /global_config_dict_yaml."))
    launcher: list[str] = Field(default_factory=lambda: ["ng_run", "+config_paths=[{config_paths}]"], description=(
        "grpo-ds: the command that starts the Gym servers of config_paths (Gym needs Python >= 3.13 and Ray: "
        "e.g. [uv, run, --python, '3.13', ng_run, ...] or a path into Gym's own venv). {config_paths} is replaced by "
        "the comma-joined config_paths followed by the config grpo-ds writes (policy_base_url, policy_api_key, "
        "policy_model_name, head_server, the port range and Gym's other keys of this section), {config_file} by that "
        "file alone, {python} by the trainer's Python (a launcher script in grpo-ds's environment)."))
    launcher_cwd: Optional[str] = Field(None, description=(
        "grpo-ds: the launcher's working directory (Gym's checkout, where config_paths resolve; null: the run's)."))
    startup_timeout_s: float = Field(600.0, gt=0, description=(
        "grpo-ds: seconds to wait for the Gym servers (launched, or started by you) to answer."))
    request_timeout_s: float = Field(1800.0, gt=0, description=(
        "grpo-ds: seconds one row's POST /run may take before its sample fails (env_timeout: retried, then masked)."))
    max_concurrency: int = Field(256, gt=0, description="grpo-ds: rows posted to the agent servers at once.")

    @model_validator(mode="after")
    def _where(self) -> "NemoGymConfig":
        if self.port_range_low > self.port_range_high:
            raise ValueError(f"env.nemo_gym.port_range_low={self.port_range_low} is above port_range_high="
                             f"{self.port_range_high}: expected low <= high")
        if not (self.agent_urls or self.head_server_url or self.config_paths):
            raise ValueError("env.nemo_gym: say where the Gym servers are: agent_urls ({agent name: URL}) or "
                             "head_server_url for servers you started (ng_run), or config_paths (with launcher, "
                             "default ng_run) for grpo-ds to start them")
        if self.config_paths and (self.agent_urls or self.head_server_url):
            raise ValueError("env.nemo_gym: config_paths (grpo-ds starts the servers) and agent_urls / "
                             "head_server_url (servers you started) are both set: keep one")
        if not self.launcher:
            raise ValueError("env.nemo_gym.launcher=[]: expected a command, e.g. [ng_run, '+config_paths="
                             "[{config_paths}]']")
        for name, url in self.agent_urls.items():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"env.nemo_gym.agent_urls.{name}={url!r}: expected an http(s):// URL")
        return self

    def gym_keys(self) -> dict[str, Any]:
        """Gym's own keys of this section: everything but NeMo-RL's detection and shaping keys and grpo-ds's."""
        return {k: v for k, v in (self.model_extra or {}).items() if k not in NEMO_RL_ONLY_GYM_KEYS}


# Keys of env.nemo_gym that NeMo-RL pops before handing the section to Gym (run_grpo_nemo_gym.py, nemo_gym.py).
NEMO_RL_ONLY_GYM_KEYS = frozenset({"is_trajectory_collection", "pad_dynamic_image_shapes", "tokenizer_config",
                                   "num_gpu_nodes"})


# Modules that moved, by their old name: specs (package.module:function) naming the old one still load.
MOVED_MODULES = {"grpo.system.sandbox": "grpo.tasks.sandbox"}


class EnvSpec(_Section):
    """One environment: a reward function (single-turn), the built-in multi-turn task, or a user class."""

    name: Literal[ENV_NAMES] = Field(  # the built-in tasks of grpo.tasks.catalogue, function, tools, class
        "arithmetic", description=(
        "Single-turn reward functions: math (math-verify), reasoning_gym, arithmetic, function (reward_fn); "
        "multi-turn: guess_number; class: env_class; agent: env.agent, a program driving the policy over HTTP; "
        "reward_model: env.reward_model, a sequence classifier's score; judge: env.judge, an LLM judge over HTTP; "
        "combined: env.rewards, several rewards per sample."))
    reward_fn: Optional[str] = Field(None, description=(
        "package.module:function with signature fn(question, completion, answer, meta) -> float | dict."))
    env_class: Optional[str] = Field(
        None, description="package.module:ClassName of a grpo.tasks.interface.Environment (NeMo-RL's interface).")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's constructor (class, guess_number).")
    observation_format: Literal["auto", "raw", "chat_template"] = Field("auto", description=(
        "How the environment's observations become tokens. raw: the content as tokens, nothing added (NeMo-RL's "
        "rollout: the environment writes its own turn markup; the next assistant turn starts right after it); "
        "chat_template: the chat template's rendering of the observation messages and the next generation prompt "
        "(a role the template renders nothing for, e.g. Qwen2.5 and 'environment', stops the run at its first "
        "observation); auto: raw for env.name=class (environments written for NeMo-RL), chat_template for the "
        "built-ins (tools, guess_number). Without a chat template (policy.tokenizer.chat_template=null) both are "
        "the raw content."))
    num_workers: int = Field(2, gt=0, description="Reward worker processes (math, reasoning_gym, function).")
    timeout_s: float = Field(
        10.0, gt=0, description="Seconds a reward may take before its sample scores 0 (counted as a timeout).")
    math_verify_impl: Literal["hf_math_verify", "dapo_math_verify"] = Field("hf_math_verify", description=(
        "env.name=math: the verifier (NeMo-RL's env.math.math_verify_impl). hf_math_verify: math-verify, symbolic "
        "equivalence of the final answer; dapo_math_verify: DAPO's, the last 'Answer: ...' line in the "
        "completion's last 300 characters must equal the gold answer as a string after DAPO's normalisation."))
    tools: list[str] = Field(default_factory=list, description=(
        "env.name=tools: package.module:function of each tool (typed, documented; grpo.tasks.sandbox:python runs "
        "code in a sandbox)."))
    tool_call_format: Literal["hermes", "compact"] = Field("hermes", description=(
        "hermes: <tool_call>{json}</tool_call> (Qwen2.5 / Qwen3); compact: <name>argument</name> (the char toy)."))
    tool_timeout_s: float = Field(20.0, gt=0, description="Seconds one tool call may take before it is an error.")
    max_tool_result_chars: int = Field(1000, gt=0, description="Tool results are cut to this many characters.")
    max_tool_calls_per_turn: int = Field(4, gt=0, description="Tool calls run per assistant message at most.")
    disable_tools: bool = Field(False, description=(
        "Answer every tool call with an error (an ablation: same task, same model, no tool results)."))
    agent: Optional[AgentConfig] = Field(None, description=(
        "env.name=agent: the agent (fn or command), its concurrency and per-sample deadline."))
    reward_model: Optional[RewardModelConfig] = Field(None, description=(
        "env.name=reward_model: the reward model (NeMo-RL's env.reward_model keys)."))
    judge: Optional[JudgeConfig] = Field(None, description=(
        "env.name=judge: the LLM judge (base_url, model, prompt_template, score_pattern, timeouts)."))
    rewards: dict[str, "EnvSpec"] = Field(default_factory=dict, description=(
        "env.name=combined: the one-turn environments (name -> environment) whose rewards score each sample."))
    combine: Literal["weighted_sum", "components"] = Field("weighted_sum", description=(
        "env.name=combined: weighted_sum: one reward, the sum of env.weights[name] x each reward; components: each "
        "reward a named component for GDPO (grpo.adv_estimator.name=gdpo), the scalar reward their sum."))
    weights: dict[str, float] = Field(default_factory=dict, description=(
        "env.name=combined with combine=weighted_sum: the weight of each reward by name (default 1)."))

    @field_validator("tools")
    @classmethod
    def _moved_tools(cls, tools: list[str]) -> list[str]:
        """Tool specs whose module moved keep working: ``grpo.system.sandbox:python`` is ``grpo.tasks.sandbox:python``.

            >>> EnvSpec(name="tools", tools=["grpo.system.sandbox:python"], reward_fn="m:f").tools
            ['grpo.tasks.sandbox:python']
        """
        moved = []
        for spec in tools:
            module, colon, name = spec.partition(":")
            moved.append(MOVED_MODULES.get(module, module) + colon + name)
        return moved

    @model_validator(mode="after")
    def _check(self) -> "EnvSpec":
        if self.name == "function" and not self.reward_fn:
            raise ValueError("env.reward_fn=None: expected 'package.module:function' when env.name='function'")
        if self.reward_fn and ":" not in self.reward_fn:
            raise ValueError(f"env.reward_fn={self.reward_fn!r}: expected 'package.module:function'")
        if self.name == "tools" and (not self.tools or not self.reward_fn):
            raise ValueError(f"env.name='tools' needs env.tools (got {self.tools!r}) and env.reward_fn, the verifier "
                             f"of the final answer (got {self.reward_fn!r})")
        if self.math_verify_impl != "hf_math_verify" and self.name != "math":
            raise ValueError(f"env.math_verify_impl={self.math_verify_impl!r} picks the verifier of env.name='math' "
                             f"(got env.name={self.name!r}): remove it")
        if (self.name == "agent") != (self.agent is not None):
            raise ValueError(f"env.agent={self.agent!r} with env.name={self.name!r}: env.name='agent' needs an "
                             "env.agent section (fn or command), and only it takes one")
        if (self.name == "combined") != bool(self.rewards):
            raise ValueError(f"env.rewards={sorted(self.rewards)} with env.name={self.name!r}: env.name='combined' "
                             "needs env.rewards (name -> environment), and only it takes them")
        bad = sorted(k for k, spec in self.rewards.items() if spec.name in ("combined", "agent", "tools"))
        if bad:
            raise ValueError(f"env.rewards.{bad[0]}.name={self.rewards[bad[0]].name!r}: a combined reward takes one-turn "
                             "environments (a reward function, a reward model, math, ...)")
        if self.weights and (self.combine != "weighted_sum" or set(self.weights) - set(self.rewards)):
            raise ValueError(f"env.weights={self.weights!r}: expected weights of env.rewards' names "
                             f"{sorted(self.rewards)} with env.combine='weighted_sum' (got {self.combine!r}); GDPO's "
                             "weights are grpo.adv_estimator.reward_weights")
        if (self.name == "judge") != (self.judge is not None):
            raise ValueError(f"env.judge={self.judge!r} with env.name={self.name!r}: env.name='judge' needs an "
                             "env.judge section (base_url, model, prompt_template), and only it takes one")
        if (self.name == "reward_model") != (self.reward_model is not None):
            raise ValueError(f"env.reward_model={self.reward_model!r} with env.name={self.name!r}: env.name="
                             "'reward_model' needs an env.reward_model section (model_name, ...), and only it takes one")
        if self.name == "class" and (not self.env_class or ":" not in self.env_class):
            raise ValueError(f"env.env_class={self.env_class!r}: expected 'package.module:ClassName' when "
                             "env.name='class'")
        return self


EnvSpec.model_rebuild()


class EnvConfig(EnvSpec):
    task_name: Optional[str] = Field(None, description="Task name of the top-level environment (null: env.name).")
    tasks: dict[str, EnvSpec] = Field(default_factory=dict, description=(
        "More environments by task name; a data row's task name (data.task_key) picks one."))
    val_tasks: Optional[dict[str, EnvSpec]] = Field(
        None, description="Validation's own environments for the tasks they name.")
    step_timeout_s: float = Field(300.0, gt=0, description=(
        "Seconds one environment step (a batch of samples) may take before the call counts as failed (env_timeout: "
        "retried, then the samples are masked; grpo.rollout_failure)."))
    should_use_nemo_gym: bool = Field(False, description=(
        "NeMo-RL's key: NeMo-Gym's agent servers play the rollouts (env.nemo_gym; the data rows are Gym rows: "
        "responses_create_params, agent_ref, task fields). Sets env.name=nemo_gym."))
    nemo_gym: Optional[NemoGymConfig] = Field(None, description=(
        "NeMo-RL's section: its keys (invalid_tool_call_patterns, thinking_tags, effort_levels, port_range_low/high), "
        "Gym's global config, and grpo-ds's: where the Gym servers come from."))
    should_log_nemo_gym_responses: bool = Field(False, description=(
        "NeMo-RL's key: write every Gym result (the full /run answer, token fields left out) to "
        "<log_dir>/nemo_gym_responses/<stream>_step_<n>.jsonl."))
    should_mask_flagged_samples: bool = Field(True, description=(
        "NeMo-RL's key: a sample an environment flags mask_sample (NeMo-Gym's instance_config.mask_sample) is out of "
        "the loss and, in grpo-ds, out of its group's baseline too; false: the flag is ignored and the sample trains."))

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data):
        """env.max_error_rate / env.max_error_steps are gone: a failed sample is masked, not scored 0, and
        grpo.rollout_failure's step budget replaces them (one mechanism, not two)."""
        if isinstance(data, dict):
            for key in ("max_error_rate", "max_error_steps"):
                if key in data:
                    raise ValueError(
                        f"env.{key}={data[key]!r} was retired: failed samples are now retried and masked (never scored "
                        "0), and a step with too few valid samples is skipped. Use grpo.rollout_failure."
                        "min_step_batch_fraction (the share of a step's samples that must not fail) and "
                        "grpo.rollout_failure.max_consecutive_skipped_steps (skipped steps in a row before the run "
                        "stops) instead")
        return data

    @model_validator(mode="before")
    @classmethod
    def _gym_name(cls, data):
        """``should_use_nemo_gym: true`` makes the top-level environment NeMo-Gym's (``env.name: nemo_gym``)."""
        if isinstance(data, dict) and data.get("should_use_nemo_gym") and "name" not in data:
            data = {**data, "name": "nemo_gym"}
        return data

    @model_validator(mode="after")
    def _gym(self) -> "EnvConfig":
        if self.should_use_nemo_gym != (self.name == "nemo_gym"):
            raise ValueError(f"env.should_use_nemo_gym={self.should_use_nemo_gym} with env.name={self.name!r}: "
                             "NeMo-Gym is the top-level environment (env.name=nemo_gym) exactly when "
                             "env.should_use_nemo_gym=true")
        if self.should_use_nemo_gym and self.nemo_gym is None:
            raise ValueError("env.should_use_nemo_gym=true needs env.nemo_gym: agent_urls or head_server_url (Gym "
                             "servers you started) or config_paths (grpo-ds starts them with env.nemo_gym.launcher)")
        if self.nemo_gym is not None and not self.should_use_nemo_gym:
            raise ValueError("env.nemo_gym is set but env.should_use_nemo_gym is false: set it true, or remove "
                             "env.nemo_gym")
        gym_tasks = [t for t, spec in self.tasks.items() if spec.name == "nemo_gym"]
        if gym_tasks:
            raise ValueError(f"env.tasks.{gym_tasks[0]}.name=nemo_gym: NeMo-Gym is the top-level environment only "
                             "(env.should_use_nemo_gym=true)")
        return self

    @model_validator(mode="after")
    def _reward_model_paths(self) -> "EnvConfig":
        """Every reward model's local paths (weights, checkpoint, tokenizer) are there, each named by its key when
        not (`model_path_problem`); a hub name is checked when it loads."""
        def specs(key: str, spec: EnvSpec):
            yield key, spec
            for name, part in spec.rewards.items():
                yield from specs(f"{key}.rewards.{name}", part)

        sections = [("env", self), *((f"env.tasks.{t}", s) for t, s in self.tasks.items()),
                    *((f"env.val_tasks.{t}", s) for t, s in (self.val_tasks or {}).items())]
        for key, spec in (found for k, s in sections for found in specs(k, s)):
            rm = spec.reward_model
            for field, name in (("model_name", rm.model_name), ("checkpoint_path", rm.checkpoint_path),
                                ("tokenizer.name", rm.tokenizer.name)) if rm is not None else ():
                problem = model_path_problem(name, f"{key}.reward_model.{field}")
                if problem is not None:
                    raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _tasks(self) -> "EnvConfig":
        main = self.task_name or self.name
        if main in self.tasks:
            raise ValueError(f"env.tasks.{main}: the top-level environment already has the task name {main!r} "
                             "(set env.task_name to another name)")
        unknown = sorted(set(self.val_tasks or {}) - set(self.tasks) - {main})
        if unknown:
            raise ValueError(f"env.val_tasks: {unknown} are not training tasks (expected some of "
                             f"{sorted([main, *self.tasks])})")
        return self


# --------------------------------------------------------------------------------------------------
# logger, cluster, checkpointing, penalties, distillation
# --------------------------------------------------------------------------------------------------
class WandbConfig(_Section):
    project: str = Field("grpo-ds", description="wandb project.")
    name: Optional[str] = Field(None, description="wandb run name.")
    entity: Optional[str] = Field(None, description="wandb entity (team).")


class LoggerConfig(_Section):
    log_dir: str = Field(
        "logs", description="Where metrics.jsonl, config.json (and tensorboard, wandb, rollout dumps) go.")
    num_val_samples_to_print: int = Field(
        0, ge=0, description="Validation conversations printed after each validation.")
    wandb_enabled: bool = Field(False, description="Log to wandb (offline without WANDB_API_KEY).")
    tensorboard_enabled: bool = Field(False, description="Log to tensorboard.")
    monitor_gpus: bool = Field(
        False, description="Add rank 0's CUDA memory (and utilisation, with pynvml) to every metrics row (gpu/*).")
    progress_bar: bool = Field(True, description="Console progress bar on rank 0.")
    dump_rollouts: bool = Field(
        False, description="Write each dumped step's samples to <log_dir>/rollouts/{train,val}_step_<N>.jsonl.")
    dump_rollouts_every: int = Field(1, ge=1, description="Dump every N steps.")
    dump_rollouts_max_samples: Optional[int] = Field(
        256, ge=1, description="Lines per dump at most: worst, best and evenly spaced by reward (null: all).")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb settings.")


class ClusterConfig(_Section):
    """What the launcher is expected to start (None: whatever it starts); checked at startup
    (`cluster_mismatch`), so a recipe tuned for 8 GPUs does not silently run on 2."""

    gpus_per_node: Optional[int] = Field(None, gt=0, description=(
        "Ranks per node the launcher must start (null: whatever it starts); checked at startup."))
    num_nodes: Optional[int] = Field(
        None, gt=0, description="Nodes the launcher must start (null: whatever it starts); checked at startup.")


def cluster_mismatch(cluster: ClusterConfig, world_size: int, local_world_size: int | None) -> str | None:
    """The error when the launcher started other ranks than ``cluster`` says, else None.

        >>> cluster_mismatch(ClusterConfig(num_nodes=1, gpus_per_node=8), world_size=2, local_world_size=2)
        'error: cluster.num_nodes=1 x cluster.gpus_per_node=8 = 8 ranks, but the launcher started 2 (WORLD_SIZE)'
    """
    n, g = cluster.num_nodes, cluster.gpus_per_node
    if n is not None and g is not None and n * g != world_size:
        return f"error: cluster.num_nodes={n} x cluster.gpus_per_node={g} = {n * g} ranks, but the launcher " \
               f"started {world_size} (WORLD_SIZE)"
    if g is not None and local_world_size is not None and g != local_world_size:
        return f"error: cluster.gpus_per_node={g}, but the launcher started {local_world_size} ranks on this " \
               "node (LOCAL_WORLD_SIZE)"
    if n is not None and world_size % n:
        return f"error: cluster.num_nodes={n} does not divide the {world_size} ranks the launcher started"
    return None


class CheckpointingConfig(_Section):
    enabled: bool = Field(True, description="Save checkpoints (and hf_final at the end).")
    checkpoint_dir: str = Field(
        "results/grpo", description="Where checkpoints go; one run per directory (a lock and a run fingerprint).")
    metric_name: Optional[str] = Field("val:accuracy", description=(
        "Keep the top keep_top_k checkpoints by this metric, in NeMo-RL's form: 'val:<name>' (a validation "
        "metric: accuracy, pass_k, avg_length, ...) or 'train:<name>' (a train/ metric of the saved step, e.g. "
        "train:loss); the old val_reward, val/..., train/... are read as that. null: the last k."))
    higher_is_better: bool = Field(True, description="Ranking direction of metric_name.")
    keep_top_k: Optional[int] = Field(3, gt=0, description="Checkpoints kept (the newest always stays); null: all.")
    save_period: int = Field(10, gt=0, description="Save every this many steps (and after the last one).")
    checkpoint_must_save_by: Optional[str] = Field(None, description=(
        "DD:HH:MM:SS of wall time from the start: save and stop (exit 0) once another step would not fit."))
    model_save_format: Literal["safetensors"] = Field(
        "safetensors", description="Format of exported weights (safetensors only; kept for NeMo-RL recipes).")
    save_consolidated: bool = Field(
        False, description="Write consolidated HF safetensors (from_pretrained) with every checkpoint.")
    resume: bool = Field(True, description="Resume from the newest intact checkpoint in checkpoint_dir.")
    load_replay_buffer: bool = Field(
        True, description="Async: restore the replay deque on resume (false: regenerate it).")
    allow_config_change: bool = Field(
        False, description="Resume although the config differs from the run's recorded fingerprint.")

    @field_validator("checkpoint_must_save_by", mode="before")
    @classmethod
    def _deadline(cls, v):
        if v is not None:  # YAML reads an unquoted 1:00:00:00 as the base-60 integer 216000
            dhms_seconds(v if isinstance(v, str) else repr(v), key="checkpointing.checkpoint_must_save_by")
        return v

    @model_validator(mode="after")
    def _check(self) -> "CheckpointingConfig":
        if self.metric_name is not None and checkpoint_metric_form(self.metric_name) != self.metric_name:
            self.metric_name = checkpoint_metric_form(self.metric_name)  # validated again: then in NeMo-RL's form
        if self.checkpoint_must_save_by is not None and not self.enabled:
            raise ValueError(
                f"checkpointing.checkpoint_must_save_by={self.checkpoint_must_save_by!r}: saving before the "
                "time limit needs checkpointing.enabled=true"
            )
        return self


class RewardPenaltyTokenIdsConfig(_Section):
    unwanted: Optional[list[int]] = Field(
        None, description="Token ids whose presence in a generated turn zeroes the reward (penalize_unwanted_tokens).")
    think_open: Optional[int] = Field(None, description="Token id of the think open tag (also checked on ids).")
    think_close: Optional[int] = Field(None, description="Token id of the think close tag.")


class RewardPenaltyConfig(_Section):
    """Reward-zeroing detectors; each sets the sample's reward to 0 and raises a per-sample flag. NeMo-RL's
    four check each generated assistant message (turn) of the sample: any flagged turn zeroes it."""

    penalize_duplicated_reasoning: bool = Field(
        False, description="Zero the reward where a turn's reasoning (its think block), stripped, equals its answer.")
    penalize_empty_final_answer: bool = Field(
        False, description="Zero the reward where the final answer (the last text after thinking) is missing or blank.")
    penalize_unwanted_tokens: bool = Field(
        False, description="Zero the reward where a generated turn holds a token of token_ids.unwanted.")
    penalize_malformed_think_tag: bool = Field(
        False, description="Zero the reward where a turn's think tags are not none or one open ... close pair.")
    penalize_repeated_lines: bool = Field(
        False, description="Zero the reward of completions that repeat a line or sentence (grpo-ds's own).")
    think_open_tag: str = Field("<think>", description="Think open tag.")
    think_close_tag: str = Field("</think>", description="Think close tag.")
    repeated_line_min_chars: int = Field(
        20, gt=0, description="Repeated lines: lines or sentences of at least this many characters...")
    repeated_line_min_repeats: int = Field(3, ge=2, description="... repeated at least this many times.")
    token_ids: Optional[RewardPenaltyTokenIdsConfig] = Field(None, description="Token ids of the detectors.")

    @model_validator(mode="after")
    def _check(self) -> "RewardPenaltyConfig":
        if self.penalize_unwanted_tokens and (self.token_ids is None or not self.token_ids.unwanted):
            raise ValueError(
                "reward_penalties.token_ids.unwanted=None: expected a list of token ids when "
                "reward_penalties.penalize_unwanted_tokens=true"
            )
        return self


def reward_penalties_without_nemo_gym(rp: RewardPenaltyConfig, enable_nemo_gym: bool) -> Optional[str]:
    """NeMo-RL's ``_raise_if_reward_penalties_enabled_without_nemo_gym`` (``nemo_rl/algorithms/grpo.py``) as a
    message: None with NeMo-Gym or with no NeMo-RL penalty on, else one line naming the first key that is on.
    NeMo-RL's penalties read NeMo-Gym results; grpo-ds's native runs apply them to its own environments' text
    (`grpo.rewards`), so only NeMo-RL recipes are held to this (`grpo.config.nemo_rl.rules`).

        >>> reward_penalties_without_nemo_gym(RewardPenaltyConfig(penalize_empty_final_answer=True), False)
        'reward_penalties.penalize_empty_final_answer=true: reward_penalties require the NeMo-Gym path (env.should_use_nemo_gym=true); they are not supported with the native generation path'
    """
    if enable_nemo_gym:
        return None
    for flag in NEMO_RL_PENALTY_FLAGS:
        if getattr(rp, flag):
            return (f"reward_penalties.{flag}=true: reward_penalties require the NeMo-Gym path "
                    "(env.should_use_nemo_gym=true); they are not supported with the native generation path")
    return None


# NeMo-RL's reward-zeroing switches (grpo.py, _REWARD_PENALTY_FLAGS); penalize_repeated_lines is grpo-ds's own.
NEMO_RL_PENALTY_FLAGS = ("penalize_duplicated_reasoning", "penalize_empty_final_answer", "penalize_unwanted_tokens",
                         "penalize_malformed_think_tag")


class OnPolicyDistillationConfig(_Section):
    enabled: bool = Field(
        False, description="Add a frozen teacher's reverse KL to the advantages (on-policy distillation).")
    teacher_model_name: Optional[str] = Field(None, description="The teacher (shares the policy's tokenizer).")

    @field_validator("teacher_model_name")
    @classmethod
    def _toy_model(cls, v):
        return check_toy_model(v, "on_policy_distillation.teacher_model_name")

    kl_coef: float = Field(
        1.0, ge=0, description="Weight of the per-token reverse KL: A += -kl_coef * (lp - lp_teacher).")

    @model_validator(mode="after")
    def _check(self) -> "OnPolicyDistillationConfig":
        if self.enabled and not self.teacher_model_name:
            raise ValueError(
                "on_policy_distillation.teacher_model_name=None: expected a model when "
                "on_policy_distillation.enabled=true"
            )
        return self


# --------------------------------------------------------------------------------------------------
# MasterConfig
# --------------------------------------------------------------------------------------------------
class MasterConfig(_Section):
    policy: PolicyConfig = Field(
        default_factory=PolicyConfig, description="The policy: model, batch sizes, precision, optimizer, generation.")
    loss_fn: ClippedPGLossConfig = Field(
        default_factory=ClippedPGLossConfig, description="The clipped policy-gradient loss.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environments (rewards, multi-turn tasks).")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="The algorithm.")
    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Metrics and logs.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="What the launcher is expected to start.")
    checkpointing: CheckpointingConfig = Field(
        default_factory=CheckpointingConfig, description="Checkpoints and resume.")
    reward_penalties: RewardPenaltyConfig = Field(
        default_factory=RewardPenaltyConfig, description="Reward-zeroing detectors.")
    on_policy_distillation: OnPolicyDistillationConfig = Field(
        default_factory=OnPolicyDistillationConfig, description="On-policy distillation from a teacher.")

    def _nemo_gym_checks(self) -> None:
        """NeMo-RL's assertions of the NeMo-Gym path (run_async_nemo_gym_rollout), and Gym rows as the data: rows
        are read as NeMo-RL's NemoGymDataset reads them (data.input_key=responses_create_params)."""
        gen = self.policy.generation
        for key in ("top_k", "val_top_k"):
            if getattr(gen, key) not in (None, -1):
                raise ValueError(f"policy.generation.{key}={getattr(gen, key)}: NeMo-Gym's agents sample with OpenAI's "
                                 "temperature and top_p only (NeMo-RL asserts top_k is unset): remove it")
        if self.data.input_key == "input":
            self.data.input_key = "responses_create_params"
        elif self.data.input_key != "responses_create_params":
            raise ValueError(f"data.input_key={self.data.input_key!r} with env.should_use_nemo_gym=true: Gym rows "
                             "carry their prompt in responses_create_params (leave data.input_key unset)")

    @model_validator(mode="after")
    def _cross_checks(self) -> "MasterConfig":
        g, loss, p = self.grpo, self.loss_fn, self.policy
        n_per_step = g.num_prompts_per_step * g.num_generations_per_prompt
        if p.train_global_batch_size % p.train_micro_batch_size:
            raise ValueError(
                f"policy.train_global_batch_size={p.train_global_batch_size}: expected a multiple of "
                f"policy.train_micro_batch_size={p.train_micro_batch_size}"
            )
        if n_per_step % p.train_global_batch_size:
            raise ValueError(
                f"policy.train_global_batch_size={p.train_global_batch_size}: expected a divisor of "
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {n_per_step}"
            )
        if loss.force_on_policy_ratio and p.train_global_batch_size != n_per_step:
            raise ValueError(
                f"loss_fn.force_on_policy_ratio=true needs one optimizer update per rollout batch: "
                f"policy.train_global_batch_size={p.train_global_batch_size} must equal "
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {n_per_step}"
            )
        if (
            loss.use_kl_in_reward
            and loss.force_on_policy_ratio
            and g.seq_logprob_error_threshold is None
            and loss.reference_policy_kl_penalty != 0
        ):
            raise ValueError(
                "loss_fn.use_kl_in_reward=true is incompatible with loss_fn.force_on_policy_ratio=true: the "
                "reward KL needs previous-policy logprobs, which force_on_policy_ratio skips. Set "
                "grpo.seq_logprob_error_threshold (which computes them), set "
                "loss_fn.reference_policy_kl_penalty=0, or turn one of the two off"
            )
        if g.async_grpo.enabled and not loss.use_importance_sampling_correction:
            raise ValueError(
                "grpo.async_grpo.enabled=true needs loss_fn.use_importance_sampling_correction=true: "
                "async trajectories are generated by older weights"
            )
        if g.async_grpo.enabled and g.use_dynamic_sampling:
            raise ValueError("grpo.use_dynamic_sampling=true is not supported with grpo.async_grpo.enabled=true")
        if g.skip_previous_policy_logprobs_calculation:
            one_update = p.train_global_batch_size == n_per_step
            needed = prev_logprobs_needed_before_training(self)
            if needed is not None or not (one_update or loss.force_on_policy_ratio):
                why = needed or (f"policy.train_global_batch_size={p.train_global_batch_size} < {n_per_step} samples "
                                 "per step: later optimizer steps of a step need the logprobs of the weights before it")
                raise ValueError("grpo.skip_previous_policy_logprobs_calculation=true but the run needs "
                                 f"previous-policy logprobs ({why}): set it to null or false")
        if g.skip_reference_policy_logprobs_calculation and needs_reference(self):
            raise ValueError(  # NeMo-RL asserts the same (nemo_rl/algorithms/grpo.py, setup)
                "grpo.skip_reference_policy_logprobs_calculation=true requires "
                f"loss_fn.reference_policy_kl_penalty == 0 (got {loss.reference_policy_kl_penalty}): the KL "
                "penalty reads the reference logprobs; set the penalty to 0 or the flag to false"
            )
        if loss.use_kl_in_reward and g.adv_estimator.name != "reinforce_plus_plus":
            raise ValueError(
                f"loss_fn.use_kl_in_reward=true is only used by grpo.adv_estimator.name='reinforce_plus_plus' "
                f"(got {g.adv_estimator.name!r})"
            )
        if g.reward_shaping.enabled and g.reward_shaping.max_response_length is not None:
            if g.reward_shaping.max_response_length > p.generation.max_new_tokens:
                raise ValueError(
                    f"grpo.reward_shaping.max_response_length={g.reward_shaping.max_response_length}: expected "
                    f"<= policy.generation.max_new_tokens={p.generation.max_new_tokens}"
                )
        if p.generation.max_new_tokens > p.max_total_sequence_length:
            raise ValueError(
                f"policy.generation.max_new_tokens={p.generation.max_new_tokens}: expected <= "
                f"policy.max_total_sequence_length={p.max_total_sequence_length} (generation stops at "
                "whichever comes first)"
            )
        # NeMo-Gym: null validates every validation row in one batch (NeMo-RL's run_grpo_nemo_gym.py sets it so)
        if g.val_period > 0 and g.val_batch_size is None and not getattr(self.env, "should_use_nemo_gym", False):
            raise ValueError("grpo.val_batch_size=None: expected a positive integer when grpo.val_period > 0 "
                             "(null only with env.should_use_nemo_gym=true: the whole validation set in one batch)")
        if g.stop_at_validation_metric is not None:
            g.stop_at_validation_metric = validation_metric_name(
                g.stop_at_validation_metric, g.val_num_generations_per_prompt, "grpo.stop_at_validation_metric")
        if g.batch_multiplier != 1.0 and not g.use_dynamic_sampling:
            raise ValueError(f"grpo.batch_multiplier={g.batch_multiplier} only acts with "
                             "grpo.use_dynamic_sampling=true (NeMo-RL asserts the same): set it to 1 or turn dynamic "
                             "sampling on")
        name = self.checkpointing.metric_name
        if name is not None and name.startswith("val:"):  # the form is CheckpointingConfig's; the name is known here
            val_name = "val:" + validation_metric_name(name[len("val:"):], g.val_num_generations_per_prompt,
                                                       "checkpointing.metric_name", name)
            if val_name != name:
                self.checkpointing.metric_name = val_name
        if self.env.should_use_nemo_gym:
            self._nemo_gym_checks()
        task = TASKS.get(self.env.name)
        if task is not None and task.dataset_prefix and not self.data.dataset_name.startswith(f"{self.env.name}:"):
            raise ValueError(
                f"env.name={self.env.name!r} needs data.dataset_name='{self.env.name}:<task>' "
                f"(got {self.data.dataset_name!r})"
            )
        colocated = p.generation.colocated
        if g.async_grpo.enabled and p.generation.backend == "vllm" and colocated.enabled:
            raise ValueError(  # NeMo-RL's async_grpo_train asserts non-colocated vLLM inference the same way
                "policy.generation.backend='vllm' with grpo.async_grpo.enabled=true needs "
                "policy.generation.colocated.enabled=false (generation on ranks of its own, "
                "colocated.resources.gpus_per_node of them); or use policy.generation.backend=hf (a transformers "
                "copy in a thread), or train_grpo.py for colocated vLLM"
            )
        tp = p.generation.vllm_cfg.tensor_parallel_size
        if p.generation.backend == "vllm" and colocated.enabled and tp > 1 and serves_endpoint(self):
            raise ValueError(  # each rank's endpoint generates when its own agents call: its TP group never agrees
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp} with colocated vLLM and the endpoint "
                "(policy.generation.vllm_cfg.expose_http_server or an agent / nemo_gym task): expected "
                "tensor_parallel_size=1, or policy.generation.colocated.enabled=false (generation ranks, which the "
                "trainers' endpoints share)")
        if not colocated.enabled:
            check_generation_resources(self)
        return self


def serves_endpoint(cfg: "MasterConfig") -> bool:
    """Whether the run serves the OpenAI-compatible endpoint: ``expose_http_server``, or an environment played over
    it (env.name agent or nemo_gym, in env / env.tasks / env.val_tasks)."""
    env = cfg.env
    specs = [env, *(env.tasks or {}).values(), *(env.val_tasks or {}).values()]
    return cfg.policy.generation.vllm_cfg.expose_http_server or any(s.name in ("agent", "nemo_gym") for s in specs)


def check_generation_resources(cfg: "MasterConfig") -> None:
    """``colocated.enabled=false``: the config-level rules of NeMo-RL's grpo.py setup (its non-colocated branch)
    plus grpo-ds's own: ValueError naming the key, its value and what is expected."""
    p, cluster = cfg.policy, cfg.cluster
    res = p.generation.colocated.resources
    key = "policy.generation.colocated.resources"
    if res.gpus_per_node is None:
        raise ValueError(f"{key}.gpus_per_node=None with policy.generation.colocated.enabled=false: expected the "
                         "number of generation ranks per node (> 0), as NeMo-RL asks")
    multi_node = cluster.num_nodes is not None and cluster.num_nodes > 1
    if multi_node:
        if res.num_nodes is None:
            raise ValueError(f"{key}.num_nodes=None with cluster.num_nodes={cluster.num_nodes}: expected the number of "
                             "whole nodes that generate (NeMo-RL's rule for several nodes)")
        if res.gpus_per_node != cluster.gpus_per_node:
            raise ValueError(f"{key}.gpus_per_node={res.gpus_per_node} with cluster.num_nodes={cluster.num_nodes}: "
                             f"expected cluster.gpus_per_node={cluster.gpus_per_node} (whole nodes generate, as in "
                             "NeMo-RL)")
        if res.num_nodes >= cluster.num_nodes:
            raise ValueError(f"{key}.num_nodes={res.num_nodes}: expected < cluster.num_nodes={cluster.num_nodes} "
                             "(at least one node must train)")
    elif cluster.num_nodes == 1 and res.num_nodes not in (None, 1):
        raise ValueError(f"{key}.num_nodes={res.num_nodes} with cluster.num_nodes=1: expected 1 or null")
    elif cluster.gpus_per_node is not None and res.gpus_per_node >= cluster.gpus_per_node:
        raise ValueError(f"{key}.gpus_per_node={res.gpus_per_node}: expected < cluster.gpus_per_node="
                         f"{cluster.gpus_per_node} (ranks left to train: cluster.gpus_per_node - {res.gpus_per_node})")
    n_gen = generation_ranks(p.generation)
    tp = p.generation.vllm_cfg.tensor_parallel_size
    if p.generation.backend == "vllm" and n_gen % tp:
        raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size={tp}: expected a divisor of the "
                         f"{n_gen} generation ranks ({key}.gpus_per_node x num_nodes)")
    if p.generation.backend == "hf" and tp != 1:
        raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size={tp} with policy.generation.backend=hf: "
                         "expected 1")
    if p.lora.enabled:
        raise ValueError("policy.lora.enabled=true with policy.generation.colocated.enabled=false: generation ranks "
                         "load whole weights only; use colocated generation for LoRA runs")


def generation_ranks(gen: GenerationConfig) -> int:
    """How many ranks of the launch only generate: 0 when colocated, else NeMo-RL's
    ``colocated.resources.gpus_per_node x num_nodes`` (num_nodes null: 1).

        >>> generation_ranks(GenerationConfig(colocated={"enabled": False, "resources": {"gpus_per_node": 4}}))
        4
    """
    c = gen.colocated
    return 0 if c.enabled else (c.resources.gpus_per_node or 0) * (c.resources.num_nodes or 1)


def generation_split_problem(gen: GenerationConfig, world_size: int) -> str | None:
    """Why a launch of ``world_size`` ranks cannot give ``generation_ranks`` of them to generation, or None.

        >>> generation_split_problem(GenerationConfig(colocated={"enabled": False, "resources": {"gpus_per_node": 2}}), 2)
        'policy.generation.colocated.resources: 2 generation ranks of the 2 the launcher started leave none to train'
    """
    n = generation_ranks(gen)
    if n and world_size - n < 1:
        return (f"policy.generation.colocated.resources: {n} generation ranks of the {world_size} the launcher "
                "started leave none to train")
    return None


# grpo-ds's former names of the validation metrics -> NeMo-RL's, which validation reports (``pass@<k>`` too:
# `validation_metric_name`). `grpo.metrics.NEMO_RL_NAMES` builds its ``val/`` rows from this table.
VALIDATION_METRIC_ALIASES = {"reward_mean": "accuracy", "pass@k": "pass_k", "response_length_mean": "avg_length",
                             "truncated_frac": "truncation_rate", "turns_mean": "avg_turns_per_sample"}


def validation_metric_names(k: int) -> list[str]:
    """The metrics validation reports (`grpo.run.validation.validate`, logged as ``validation/<name>``) with
    ``grpo.val_num_generations_per_prompt = k``; as in NeMo-RL, pass_k only when k > 1.

        >>> validation_metric_names(4)
        ['accuracy', 'avg_length', 'truncation_rate', 'avg_turns_per_sample', 'num_samples', 'pass_k']
    """
    return ["accuracy", "avg_length", "truncation_rate", "avg_turns_per_sample", "num_samples"] + (
        ["pass_k"] if k > 1 else [])


def validation_metric_name(name: str, k: int, key: str, given: str | None = None) -> str:
    """A validation metric's NeMo-RL name from ``name`` (NeMo-RL's, ``validation/<name>``, or a former name:
    `VALIDATION_METRIC_ALIASES`, ``pass@<k>``); ValueError naming ``key`` and its value (``given``, default
    ``name``) when validation does not report it.

        >>> validation_metric_name("pass@4", 4, "grpo.stop_at_validation_metric"), validation_metric_name("reward_mean", 1, "k")
        ('pass_k', 'accuracy')
    """
    bare = name.removeprefix("validation/").removeprefix("val/")
    bare = VALIDATION_METRIC_ALIASES.get(bare, "pass_k" if bare == f"pass@{k}" else bare)
    produced = validation_metric_names(k)
    if bare not in produced:
        note = (f"; pass_k needs grpo.val_num_generations_per_prompt > 1 (it is {k})"
                if bare == "pass_k" or bare.startswith("pass@") else "")
        raise ValueError(f"{key}={given or name!r}: validation reports {produced} (NeMo-RL's names; the former "
                         f"{sorted(VALIDATION_METRIC_ALIASES)} are read as those){note}")
    return bare


def checkpoint_metric_form(name: str) -> str:
    """``checkpointing.metric_name`` in NeMo-RL's form, ``val:<name>`` or ``train:<name>``; ValueError when it
    is neither nor a former form. MasterConfig then checks a ``val:`` name against what validation reports
    (`validation_metric_name`, which reads former names as NeMo-RL's); a ``train:`` name is checked at the first
    save, against the step's metrics (`grpo.metrics.checkpoint_metric`).

    Former forms: ``val_reward`` -> ``val:accuracy``; ``val/<name>`` (and ``validation/<name>``) ->
    ``val:<name>``; ``train/<name>`` -> ``train:<name>``.

        >>> checkpoint_metric_form("val_reward"), checkpoint_metric_form("val/pass@4"), checkpoint_metric_form("train/loss")
        ('val:accuracy', 'val:pass@4', 'train:loss')
    """
    key, given = "checkpointing.metric_name", name
    if name == "val_reward":
        name = "val:accuracy"
    for old, new in (("val/", "val:"), ("validation/", "val:"), ("train/", "train:")):
        if name.startswith(old):
            name = new + name[len(old):]
    prefix, _, metric = name.partition(":")
    if prefix not in ("val", "train") or not metric:
        raise ValueError(
            f"{key}={given!r}: expected NeMo-RL's form 'val:<name>' (a validation metric: "
            f"{', '.join(validation_metric_names(1))}, pass_k) or 'train:<name>' (a train/ metric, e.g. "
            "train:loss), or null (keep the last k)")
    return name


def needs_reference(cfg: MasterConfig) -> bool:
    """The reference policy is needed when the KL penalty weighs it (NeMo-RL loads it only then; a reward KL
    with a penalty of 0 is 0)."""
    return cfg.loss_fn.reference_policy_kl_penalty > 0


def prev_logprobs_needed_before_training(cfg: MasterConfig) -> str | None:
    """What reads previous-policy logprobs before the optimizer step (so they need their own pass), or None."""
    loss, g = cfg.loss_fn, cfg.grpo
    if g.seq_logprob_error_threshold is not None:
        return f"grpo.seq_logprob_error_threshold={g.seq_logprob_error_threshold}"
    if loss.use_kl_in_reward and loss.reference_policy_kl_penalty > 0:
        return "loss_fn.use_kl_in_reward=true"
    if cfg.on_policy_distillation.enabled:
        return "on_policy_distillation.enabled=true"
    return None


def resolve_skip_flags(cfg: MasterConfig) -> tuple[bool, bool]:
    """Return ``(skip_prev_logprobs, skip_reference_logprobs)`` for this run.

    - Reference logprobs are skipped, as in NeMo-RL, when ``grpo.skip_reference_policy_logprobs_calculation``
      says so (which needs beta = 0, checked at load) and whenever beta = 0 (NeMo-RL then turns the flag on:
      nothing weighs them; a reward KL is multiplied by beta too).
    - Previous-policy logprobs are skipped when the training forward's own, detached, are the same numbers:
      under ``force_on_policy_ratio``, or when one optimizer step uses the whole rollout (the weights that
      score them are the weights being trained); unless sequence logprob-error masking, the reward KL or
      distillation needs them before training (`prev_logprobs_needed_before_training`).
      ``grpo.skip_previous_policy_logprobs_calculation`` overrides the choice (true is validated at load).
    """
    skip_ref = bool(cfg.grpo.skip_reference_policy_logprobs_calculation) or not needs_reference(cfg)
    g, p = cfg.grpo, cfg.policy
    one_update = p.train_global_batch_size == g.num_prompts_per_step * g.num_generations_per_prompt
    skip_prev = g.skip_previous_policy_logprobs_calculation
    if skip_prev is None:
        exact = cfg.loss_fn.force_on_policy_ratio or one_update
        skip_prev = exact and prev_logprobs_needed_before_training(cfg) is None
    return skip_prev, skip_ref


