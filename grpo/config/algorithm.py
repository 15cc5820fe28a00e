"""The algorithm's sections: ``grpo`` (GRPOConfig and its parts), ``loss_fn`` (ClippedPGLossConfig),
``reward_penalties`` and ``on_policy_distillation``, with NeMo-RL's names and defaults."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from grpo.config.base import _Section, check_toy_model


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
    deduplicate_multimodal_data: bool = Field(False, description=(
        "NeMo-RL's key, accepted either way: grpo-ds always stores a prompt's images once for its group's samples "
        "(they reference the row's tensors, which nothing writes; grpo/system/vision.py), which trains exactly as "
        "a copy per sample would."))

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
# reward_penalties, on_policy_distillation
# --------------------------------------------------------------------------------------------------
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


class TeacherResourcesConfig(_Section):
    """The ranks of one teacher on ranks of its own (NeMo-RL's ``non_colocated_teachers.default_teacher_cfg``, its
    names and defaults; the Megatron parallel sizes and ``precision`` have no meaning here: the teacher runs at
    ``policy.precision``, whole on each teacher rank where it fits, else as a ZeRO-3 inference engine over them)."""

    gpus_per_node: int = Field(8, gt=0, description=(
        "Teacher ranks per node: on one node the teacher ranks come just before the generation ranks (the last of "
        "the launch); with cluster.num_nodes > 1 it must equal cluster.gpus_per_node (whole nodes run the teacher)."))
    num_nodes: int = Field(1, gt=0, description=(
        "Nodes that run the teacher. Teacher ranks = gpus_per_node x num_nodes."))
    micro_batch_size: Optional[int] = Field(None, gt=0, description=(
        "Rows per teacher forward on a teacher rank (NeMo-RL's; null: policy.logprob_batch_size)."))


class NonColocatedTeachersConfig(_Section):
    """NeMo-RL's ``on_policy_distillation.non_colocated_teachers``: the teachers on ranks of their own
    (`grpo.system.teacher`) instead of on the training ranks: each loaded teacher (`loaded_teachers`) gets
    ``default_teacher_cfg``'s ranks, the teachers' blocks one after the other (`teacher_ranks`)."""

    enabled: bool = Field(False, description=(
        "true: each teacher runs on ranks of its own (default_teacher_cfg's, per teacher), which score their rows of "
        "each step's batch while the trainers score the previous policy and the reference; false: on the training "
        "ranks, like the reference."))
    default_teacher_cfg: TeacherResourcesConfig = Field(
        default_factory=TeacherResourcesConfig, description="Each teacher's ranks.")
    teacher_overrides: dict[str, dict] = Field(default_factory=dict, description=(
        "NeMo-RL's per-alias resources: refused when not empty (every teacher gets default_teacher_cfg's ranks)."))
    timeout_s: float = Field(600.0, gt=0, description=(
        "grpo-ds: seconds trainer rank 0 waits for the teacher ranks' logprobs of a step before it stops the run "
        "naming them as hung."))

    @field_validator("teacher_overrides")
    @classmethod
    def _no_overrides(cls, v: dict) -> dict:
        if v:
            raise ValueError(f"on_policy_distillation.non_colocated_teachers.teacher_overrides={v!r}: expected {{}} "
                             "(grpo-ds gives every teacher default_teacher_cfg's ranks; size those for the largest "
                             "teacher)")
        return v


SINGLE_TEACHER = "teacher"  # the alias of grpo-ds's own single teacher (on_policy_distillation.teacher_model_name)


def teacher_models(opd_cfg: "OnPolicyDistillationConfig") -> dict[str, str]:
    """Alias -> checkpoint of the teachers an ``on_policy_distillation`` config names: its
    ``teacher_model_by_agent_name``, or ``{"teacher": teacher_model_name}`` (grpo-ds's single teacher); {} when off."""
    if not opd_cfg.enabled:
        return {}
    if opd_cfg.teacher_model_by_agent_name:
        return dict(opd_cfg.teacher_model_by_agent_name)
    return {SINGLE_TEACHER: opd_cfg.teacher_model_name}


def shared_teachers(teacher_models: Mapping[str, str], deduplicate: bool = True) -> dict[str, str]:
    """Alias -> the alias whose loaded teacher it uses: with ``deduplicate``, the first alias naming the same
    checkpoint (compared as written, as NeMo-RL's ``create_teacher_configs_from_opd_config``); else itself.

        >>> shared_teachers({"a": "m", "b": "m"}, deduplicate=False)
        {'a': 'a', 'b': 'b'}
    """
    first: dict[str, str] = {}
    out = {}
    for alias, model in teacher_models.items():
        out[alias] = first.setdefault(model, alias) if deduplicate else alias
    return out


def loaded_teachers(opd: "OnPolicyDistillationConfig") -> list[str]:
    """The primary aliases of the teachers a run loads, in the map's order (one per checkpoint under
    ``deduplicate_shared_teacher_checkpoints``); on ranks of their own, teacher i runs on the i-th block of
    `ranks_per_teacher` teacher ranks.

        >>> loaded_teachers(OnPolicyDistillationConfig(enabled=True, teacher_model_by_agent_name={
        ...     "math": "m", "chat": "m", "code": "c"}))
        ['math', 'code']
    """
    primary = shared_teachers(teacher_models(opd), opd.deduplicate_shared_teacher_checkpoints)
    return list(dict.fromkeys(primary.values()))


def ranks_per_teacher(opd: "OnPolicyDistillationConfig") -> int:
    """Ranks of one teacher on ranks of its own: ``default_teacher_cfg.gpus_per_node x num_nodes``."""
    t = opd.non_colocated_teachers.default_teacher_cfg
    return t.gpus_per_node * t.num_nodes


def teacher_ranks(opd: "OnPolicyDistillationConfig") -> int:
    """How many ranks of the launch only run teachers: 0 unless ``non_colocated_teachers.enabled`` (and
    distillation), else `ranks_per_teacher` times the number of loaded teachers (NeMo-RL's worker group per teacher).

        >>> teacher_ranks(OnPolicyDistillationConfig(enabled=True, teacher_model_name="t",
        ...               non_colocated_teachers={"enabled": True, "default_teacher_cfg": {"gpus_per_node": 2}}))
        2
        >>> teacher_ranks(OnPolicyDistillationConfig(enabled=True, teacher_model_by_agent_name={"a": "m1", "b": "m2"},
        ...               non_colocated_teachers={"enabled": True, "default_teacher_cfg": {"gpus_per_node": 2}}))
        4
    """
    if not (opd.enabled and opd.non_colocated_teachers.enabled):
        return 0
    return ranks_per_teacher(opd) * len(loaded_teachers(opd))


class OnPolicyDistillationConfig(_Section):
    """On-policy distillation from frozen teachers, on the training ranks or on ranks of their own
    (``non_colocated_teachers``). Two shapes:

    - grpo-ds's: one ``teacher_model_name``, its reverse KL added to the estimator's advantages with ``kl_coef``;
    - NeMo-RL's multi-teacher (MOPD): ``teacher_model_by_agent_name`` (alias -> checkpoint), each row scored by the
      teacher of its NeMo-Gym agent (``agent_ref.name``) or, for the other environments, of its task; with
      ``grpo.adv_estimator.name=opd`` the advantage is NeMo-RL's sg[log pi_teacher - log pi_student] per token.

    A row's alias is its agent or task name when the map has it; else ``default_teacher_alias``, or an error under
    ``strict_agent_name_match`` (NeMo-RL's ``resolve_reference_aliases``; checked on the training data at startup).
    """

    enabled: bool = Field(
        False, description="Distill from frozen teachers (on-policy distillation).")
    teacher_model_name: Optional[str] = Field(None, description=(
        "grpo-ds's single teacher (shares the policy's tokenizer); or teacher_model_by_agent_name, not both."))

    @field_validator("teacher_model_name")
    @classmethod
    def _toy_model(cls, v):
        return check_toy_model(v, "on_policy_distillation.teacher_model_name")

    kl_coef: float = Field(
        1.0, ge=0, description=("Weight of the per-token reverse KL: A += -kl_coef * (lp - lp_teacher); 1.0 with "
                                "grpo.adv_estimator.name=opd, whose advantage is that gap itself."))
    teacher_model_by_agent_name: dict[str, str] = Field(default_factory=dict, description=(
        "NeMo-RL's MOPD map: teacher alias (a NeMo-Gym agent name or a task name) -> the teacher's checkpoint "
        "(sharing the policy's tokenizer); each row is scored by the teacher of its agent or task."))
    default_teacher_alias: Optional[str] = Field(None, description=(
        "The alias (a key of teacher_model_by_agent_name) of rows whose agent or task the map does not name."))
    strict_agent_name_match: bool = Field(False, description=(
        "A row whose agent or task the map does not name is an error (checked on the training data at startup) "
        "instead of going to default_teacher_alias."))
    deduplicate_shared_teacher_checkpoints: bool = Field(True, description=(
        "Aliases naming the same checkpoint share one loaded teacher; false: one copy per alias."))

    @field_validator("teacher_model_by_agent_name")
    @classmethod
    def _teacher_models(cls, v: dict[str, str]) -> dict[str, str]:
        for alias, model in v.items():
            if not model:
                raise ValueError(f"on_policy_distillation.teacher_model_by_agent_name.{alias}={model!r}: expected a "
                                 "model (a local directory, a hub name or toy:<name>)")
            check_toy_model(model, f"on_policy_distillation.teacher_model_by_agent_name.{alias}")
        return v
    non_colocated_teachers: NonColocatedTeachersConfig = Field(
        default_factory=NonColocatedTeachersConfig, description="The teachers on ranks of their own (NeMo-RL's).")

    @model_validator(mode="after")
    def _check(self) -> "OnPolicyDistillationConfig":
        mapped = self.teacher_model_by_agent_name
        if self.teacher_model_name and mapped:
            raise ValueError(
                f"on_policy_distillation.teacher_model_name={self.teacher_model_name!r} with "
                f"on_policy_distillation.teacher_model_by_agent_name={mapped!r}: expected one of the two (one teacher, "
                "or teachers by agent / task name)")
        if self.enabled and not (self.teacher_model_name or mapped):
            raise ValueError(
                "on_policy_distillation.teacher_model_name=None: expected a model (or "
                "on_policy_distillation.teacher_model_by_agent_name) when on_policy_distillation.enabled=true"
            )
        if (self.default_teacher_alias is not None and not self.strict_agent_name_match
                and self.default_teacher_alias not in mapped):  # NeMo-RL's _validate_default_teacher_alias
            raise ValueError(
                f"on_policy_distillation.default_teacher_alias={self.default_teacher_alias!r}: expected a key of "
                f"on_policy_distillation.teacher_model_by_agent_name (available: {sorted(mapped)})")
        return self
