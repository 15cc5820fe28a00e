"""Run configuration: pydantic models for every section of NeMo-RL's ``MasterConfig``.

Field names and defaults follow NeMo-RL (``nemo_rl.algorithms.grpo`` / ``loss_functions``) so a
NeMo-RL recipe reads the same here. Every model forbids unknown keys. Loading (YAML recipes with
``defaults:`` inheritance, dotted command-line overrides, readable errors) is `grpo.config_load`.

This module imports only pydantic: a bad config fails before torch, deepspeed or a model is ever
loaded, with an error naming the dotted key, the value and what was expected.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


# --------------------------------------------------------------------------------------------------
# loss_fn
# --------------------------------------------------------------------------------------------------
class ClippedPGLossConfig(_Section):
    """NeMo-RL's ``ClippedPGLossConfig``: the clipped policy-gradient loss (GRPO / DAPO / GSPO)."""

    # Ratio r = pi/pi_old is not used; the loss becomes -A * logprob (REINFORCE/RLOO).
    disable_ppo_ratio: bool = False
    # Token-level: sum over all valid tokens / global valid tokens. Sequence-level: per-sequence mean,
    # then mean over sequences.
    token_level_loss: bool = True
    # GSPO: one ratio per sequence, exp(mean_t(logprobs - prev_logprobs)); requires token_level_loss=false.
    sequence_level_importance_ratios: bool = False
    # PPO clip: r is clamped to [1 - ratio_clip_min, 1 + ratio_clip_max] (DAPO clip-higher: max > min).
    ratio_clip_min: float = Field(0.2, ge=0)
    ratio_clip_max: float = Field(0.2, ge=0)
    # Dual clip (c > 1, usually 3): L = min(L, -c*A) where A < 0. None disables it.
    ratio_clip_c: Optional[float] = None
    # beta: weight of KL(pi || pi_ref) in the loss.
    reference_policy_kl_penalty: float = Field(0.01, ge=0, allow_inf_nan=False)
    # KL estimator: k1, k2 or k3 (http://joschu.net/blog/kl-approx.html).
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    # log-ratio is clamped to +-kl_input_clamp_value, the KL to +-kl_output_clamp_value (None: no clamp).
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    # Put beta*KL into the reward (Reinforce++) instead of the loss.
    use_kl_in_reward: bool = False
    # Multiply the policy term by w = exp(prev_logprobs - generation_logprobs) (required by async GRPO).
    use_importance_sampling_correction: bool = False
    # "tis": clamp w to [min, max]; "icepop": zero w outside [min, max]; "seq-mask-tis": zero whole
    # sequences whose geometric-mean w falls outside [min, max].
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = None
    truncated_importance_sampling_ratio: Optional[float] = None
    truncated_importance_sampling_ratio_min: Optional[float] = None
    # KL approximation with the importance weight of the current sample (on-policy KL).
    use_on_policy_kl_approximation: bool = False
    # r = exp(logprobs - stopgrad(logprobs)) == 1 with the PPO gradient; one update per rollout only.
    force_on_policy_ratio: bool = False

    @model_validator(mode="after")
    def _check(self) -> "ClippedPGLossConfig":
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"loss_fn.ratio_clip_c={self.ratio_clip_c}: expected a value > 1 (usually 3) or null")
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

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _check(self) -> "RewardScalingConfig":
        if self.enabled and not self.source_max > self.source_min:
            raise ValueError(
                f"grpo.reward_scaling.source_max={self.source_max}: expected > source_min={self.source_min}"
            )
        return self


class RewardShapingConfig(_Section):
    """DAPO overlong reward shaping and the stop-properly penalty."""

    enabled: bool = False
    # Responses longer than max_response_length - overlong_buffer_length are penalised linearly,
    # reaching -overlong_buffer_penalty at max_response_length.
    overlong_buffer_length: Optional[int] = None
    overlong_buffer_penalty: Optional[float] = None
    max_response_length: Optional[int] = None
    # Rewards of truncated responses are multiplied by this (0: zero reward, 1: no penalty).
    stop_properly_penalty_coef: Optional[float] = None

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

    name: str = "grpo"
    # GRPO: divide by the per-prompt std; use the leave-one-out baseline. None (default): take
    # grpo.normalize_rewards / grpo.use_leave_one_out_baseline (NeMo-RL's top-level names).
    normalize_rewards: Optional[bool] = None
    use_leave_one_out_baseline: Optional[bool] = None
    # GDPO: weights of the reward components in the aggregation (None: all 1).
    reward_weights: Optional[list[float]] = None
    # Reinforce++: subtract the per-prompt mean before global whitening.
    minus_baseline: bool = True
    # Reinforce++ with loss_fn.use_kl_in_reward: false (NeMo-RL) subtracts kl_coef * KL_t at each token;
    # true subtracts the KL returns-to-go kl_coef * sum_{t' >= t} KL_t' (OpenRLHF, the Reinforce++ paper).
    kl_returns_to_go: bool = False



class AsyncGRPOConfig(_Section):
    enabled: bool = False
    # Trajectories older than this many optimizer steps are never trained on.
    max_trajectory_age_steps: int = Field(1, ge=1)
    # Generation failures tolerated before the run stops (0: the first one is fatal).
    max_generation_failures: int = Field(0, ge=0)
    # Generation picks up new weights without draining in-flight requests.
    in_flight_weight_updates: bool = False
    # Recompute the KV cache of in-flight requests after an in-flight weight update.
    recompute_kv_cache_after_weight_updates: bool = False
    # CPU only: torch threads of the generation thread (None: half of the trainer's).
    generation_threads: Optional[int] = None

    @model_validator(mode="after")
    def _check(self) -> "AsyncGRPOConfig":
        if self.recompute_kv_cache_after_weight_updates and not self.in_flight_weight_updates:
            raise ValueError(
                "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true needs "
                "grpo.async_grpo.in_flight_weight_updates=true"
            )
        return self


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(32, gt=0)
    num_generations_per_prompt: int = Field(16, gt=0)
    max_num_epochs: int = Field(1, gt=0)
    max_num_steps: int = Field(1000000, gt=0)
    max_rollout_turns: int = Field(1, gt=0)
    normalize_rewards: bool = True
    # Advantages are clipped to [advantage_clip_low, advantage_clip_high] after normalisation.
    advantage_clip_low: Optional[float] = None
    advantage_clip_high: Optional[float] = None
    use_leave_one_out_baseline: bool = True
    val_period: int = Field(10, ge=0)
    val_batch_size: Optional[int] = Field(256, gt=0)
    val_at_start: bool = False
    val_at_end: bool = False
    # Counts prompts; with val_num_generations_per_prompt = k there are max_val_samples * k rollouts.
    max_val_samples: Optional[int] = Field(256, gt=0)
    # k > 1 also reports pass@k.
    val_num_generations_per_prompt: int = Field(1, gt=0)
    # Early stop once this validation metric (e.g. "reward_mean", "pass@k") reaches the threshold.
    stop_at_validation_metric: Optional[str] = None
    stop_at_validation_threshold: Optional[float] = None
    # None: resolved from the loss (skipped when beta == 0 and no KL in the reward).
    skip_reference_policy_logprobs_calculation: Optional[bool] = None
    seed: int = 42
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)
    # Truncated samples leave the loss (sample_mask = 0) but stay in the baseline.
    overlong_filtering: bool = False
    # DAPO dynamic sampling: drop prompt groups with zero reward std and generate more.
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = Field(10, gt=0)
    # With dynamic sampling, each generation batch has num_prompts_per_step * batch_multiplier prompts.
    batch_multiplier: float = Field(1.0, ge=1.0)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    # Run phase 7 (logprob-error masking, advantages, penalties, clipping) on the GPU when there is one.
    calculate_advantages_on_gpu: bool = False
    # Mask sequences whose mult-prob error exp|gen - prev| (mean over tokens) exceeds this (e.g. 1.5).
    seq_logprob_error_threshold: Optional[float] = None
    # Advantage written over the tokens of a flagged assistant message (None: off).
    invalid_tool_call_advantage: Optional[float] = None
    malformed_thinking_advantage: Optional[float] = None
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)

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
class TokenizerConfig(_Section):
    # None: the model's own tokenizer.
    name: Optional[str] = None
    # "default": the tokenizer's chat template; None: plain text prompts; anything else: a Jinja template.
    chat_template: Optional[str] = None


class OptimizerConfig(_Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(5.0e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)


class SchedulerConfig(_Section):
    # Linear warmup over warmup_steps, then cosine decay to min_lr_ratio*lr, a constant lr or a linear decay.
    name: Literal["cosine", "constant", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class VllmConfig(_Section):
    tensor_parallel_size: int = Field(1, gt=0)
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    # Explicit KV cache size; required on CPU (vLLM otherwise reserves 92% of RAM).
    kv_cache_memory_bytes: Optional[int] = Field(None, gt=0)
    max_model_len: Optional[int] = Field(None, gt=0)
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    # 1: offload weights, discard KV cache; 2: discard both.
    sleep_level: Literal[1, 2] = 1
    # Offload the DeepSpeed optimizer states while generating (GPU only).
    offload_optimizer_during_generation: bool = False


class GenerationConfig(_Section):
    backend: Literal["hf", "vllm"] = "hf"
    max_new_tokens: int = Field(512, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, gt=0)
    stop_token_ids: Optional[list[int]] = None
    stop_strings: Optional[list[str]] = None
    # Elements per refit push: ZeRO-3 gathers whole decoder layers until a bucket holds this many.
    refit_bucket_numel: int = Field(2**28, gt=0)
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig)


class PolicyConfig(_Section):
    # Local directory or hub name (hub names need network access).
    model_name: str = "Qwen/Qwen2.5-1.5B"
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    # Completions per optimizer step across all ranks (num_prompts_per_step * num_generations_per_prompt).
    train_global_batch_size: int = Field(512, gt=0)
    train_micro_batch_size: int = Field(4, gt=0)
    generation_batch_size: int = Field(32, gt=0)
    logprob_batch_size: int = Field(4, gt=0)
    max_total_sequence_length: int = Field(512, gt=0)
    precision: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    activation_checkpointing: bool = False
    trust_remote_code: bool = False
    # Vocabulary chunk of the logprob computation (None: whole vocabulary in one pass).
    logprob_chunk_size: Optional[int] = Field(None, gt=0)
    # DeepSpeed JSON configs; "auto" values are filled from this run config.
    deepspeed_config: str = "ds_configs/zero3.json"
    reference_deepspeed_config: str = "ds_configs/zero3_reference.json"
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)


# --------------------------------------------------------------------------------------------------
# data, env
# --------------------------------------------------------------------------------------------------
class DataConfig(_Section):
    # "arithmetic" (built in), "reasoning_gym:<task>", a local .jsonl/.json/.parquet/.arrow file or
    # directory, or a `datasets.load_dataset` name.
    dataset_name: str = "arithmetic"
    # Config name of a hub dataset with several (e.g. "main" for openai/gsm8k).
    dataset_config: Optional[str] = None
    # Explicit local files; override dataset_name for train / validation.
    train_data_path: Optional[str] = None
    val_data_path: Optional[str] = None
    train_split: Optional[str] = None
    val_split: Optional[str] = None
    input_key: str = "input"
    output_key: str = "output"
    # Prompt template with "{}" or "{input}" where the question goes (from a file or inline).
    prompt_file: Optional[str] = None
    prompt_template: Optional[str] = None
    system_prompt_file: Optional[str] = None
    system_prompt: Optional[str] = None
    # Prompts longer than this (in tokens) are filtered out and counted.
    max_input_seq_length: Optional[int] = Field(None, gt=0)
    shuffle: bool = True
    # "error": a malformed row stops the run naming file and row; "skip": it is skipped and counted.
    on_bad_row: Literal["error", "skip"] = "error"
    # Size of procedural datasets (arithmetic, reasoning_gym) for train and validation.
    num_train_samples: int = Field(2048, gt=0)
    num_val_samples: int = Field(128, gt=0)
    # Built-in arithmetic task: operands are drawn from [0, arithmetic_max_operand].
    arithmetic_max_operand: int = Field(9, gt=0)
    # Built-in multi-turn task guess_number: secrets are drawn from [0, guess_number_high].
    guess_number_high: int = Field(9, gt=0)
    num_workers: int = Field(0, ge=0)
    # Data column naming each row's task (its environment, see env.tasks); rows without it use env's.
    task_key: str = "task_name"


class EnvSpec(_Section):
    """One environment: a reward function (single-turn), the built-in multi-turn task, or a user class."""

    # "math": math-verify in a process pool; "reasoning_gym": the task's own scorer; "arithmetic":
    # first integer equals the answer; "function": reward_fn below (all single-turn); "guess_number": the
    # built-in multi-turn task; "class": env_class below.
    name: Literal["math", "reasoning_gym", "arithmetic", "function", "guess_number", "class"] = "arithmetic"
    # "package.module:function" with signature fn(question, completion, answer, meta) -> float | dict.
    reward_fn: Optional[str] = None
    # "package.module:ClassName" of a grpo.envs.interface.Environment (NeMo-RL's interface).
    env_class: Optional[str] = None
    # Keyword arguments of the environment's constructor (class and guess_number).
    kwargs: dict[str, Any] = Field(default_factory=dict)
    num_workers: int = Field(2, gt=0)
    # Seconds a reward may take before the sample scores 0 (counted as a timeout).
    timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "EnvSpec":
        if self.name == "function" and not self.reward_fn:
            raise ValueError("env.reward_fn=None: expected 'package.module:function' when env.name='function'")
        if self.reward_fn and ":" not in self.reward_fn:
            raise ValueError(f"env.reward_fn={self.reward_fn!r}: expected 'package.module:function'")
        if self.name == "class" and (not self.env_class or ":" not in self.env_class):
            raise ValueError(f"env.env_class={self.env_class!r}: expected 'package.module:ClassName' when "
                             "env.name='class'")
        return self


class EnvConfig(EnvSpec):
    # Task name of the top-level environment (None: env.name); rows without a task name use it.
    task_name: Optional[str] = None
    # More environments by task name; each data row's task name (data.task_key) picks one.
    tasks: dict[str, EnvSpec] = Field(default_factory=dict)
    # Validation's own environments for the tasks they name (the others use the training ones).
    val_tasks: Optional[dict[str, EnvSpec]] = None
    # Seconds one environment step (a batch of samples) may take before its samples end with reward 0.
    step_timeout_s: float = Field(300.0, gt=0)

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
    project: str = "grpo-ds"
    name: Optional[str] = None
    entity: Optional[str] = None


class LoggerConfig(_Section):
    log_dir: str = "logs"
    num_val_samples_to_print: int = Field(0, ge=0)
    wandb_enabled: bool = False
    tensorboard_enabled: bool = False
    # CUDA memory (and utilisation, with pynvml) of rank 0's device in every metrics row (gpu/*).
    monitor_gpus: bool = False
    # Console progress bar (tqdm) on rank 0.
    progress_bar: bool = True
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class ClusterConfig(_Section):
    """What the launcher is expected to start (None: whatever it starts); checked at startup
    (`cluster_mismatch`), so a recipe tuned for 8 GPUs does not silently run on 2."""

    gpus_per_node: Optional[int] = Field(None, gt=0)
    num_nodes: Optional[int] = Field(None, gt=0)


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
    enabled: bool = True
    checkpoint_dir: str = "results/grpo"
    # Keep the top k by metric_name (e.g. "val_reward"), or the last k when metric_name is None.
    metric_name: Optional[str] = "val_reward"
    higher_is_better: bool = True
    keep_top_k: Optional[int] = Field(3, gt=0)
    save_period: int = Field(10, gt=0)
    # Stop with a checkpoint before a job's time limit: "DD:HH:MM:SS" of wall time from the start of the
    # run (e.g. "00:03:45:00" under a 4-hour SLURM limit). A step is not started when the longest step
    # so far would not fit; rerunning the same command resumes.
    checkpoint_must_save_by: Optional[str] = None
    model_save_format: Literal["safetensors"] = "safetensors"
    # Write consolidated HF safetensors (from_pretrained-loadable) with each checkpoint and at the end.
    save_consolidated: bool = False
    # Resume from the newest checkpoint in checkpoint_dir when there is one.
    resume: bool = True
    # Async GRPO: restore the replay deque on resume (false: regenerate it from the rewound data).
    load_replay_buffer: bool = True

    @field_validator("checkpoint_must_save_by", mode="before")
    @classmethod
    def _deadline(cls, v):
        if v is not None:  # YAML reads an unquoted 1:00:00:00 as the base-60 integer 216000
            dhms_seconds(v if isinstance(v, str) else repr(v), key="checkpointing.checkpoint_must_save_by")
        return v

    @model_validator(mode="after")
    def _check(self) -> "CheckpointingConfig":
        if self.checkpoint_must_save_by is not None and not self.enabled:
            raise ValueError(
                f"checkpointing.checkpoint_must_save_by={self.checkpoint_must_save_by!r}: saving before the "
                "time limit needs checkpointing.enabled=true"
            )
        return self


class RewardPenaltyTokenIdsConfig(_Section):
    unwanted: Optional[list[int]] = None
    think_open: Optional[int] = None
    think_close: Optional[int] = None


class RewardPenaltyConfig(_Section):
    """Reward-zeroing detectors; each sets the reward to 0 and raises a per-sample flag."""

    penalize_duplicated_reasoning: bool = False
    penalize_empty_final_answer: bool = False
    penalize_unwanted_tokens: bool = False
    penalize_malformed_think_tag: bool = False
    think_open_tag: str = "<think>"
    think_close_tag: str = "</think>"
    # Duplicated reasoning: a sentence/line of at least this many characters repeated this many times.
    duplicate_min_chars: int = Field(20, gt=0)
    duplicate_min_repeats: int = Field(3, ge=2)
    token_ids: Optional[RewardPenaltyTokenIdsConfig] = None

    @model_validator(mode="after")
    def _check(self) -> "RewardPenaltyConfig":
        if self.penalize_unwanted_tokens and (self.token_ids is None or not self.token_ids.unwanted):
            raise ValueError(
                "reward_penalties.token_ids.unwanted=None: expected a list of token ids when "
                "reward_penalties.penalize_unwanted_tokens=true"
            )
        return self


class OnPolicyDistillationConfig(_Section):
    enabled: bool = False
    teacher_model_name: Optional[str] = None
    # Weight of the reverse KL to the teacher, per token (added to the advantage as -coef*(lp - lp_teacher)).
    kl_coef: float = Field(1.0, ge=0)

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
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    reward_penalties: RewardPenaltyConfig = Field(default_factory=RewardPenaltyConfig)
    on_policy_distillation: OnPolicyDistillationConfig = Field(default_factory=OnPolicyDistillationConfig)

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
        if g.skip_reference_policy_logprobs_calculation and needs_reference(self):
            raise ValueError(
                "grpo.skip_reference_policy_logprobs_calculation=true but the run needs reference logprobs "
                f"(loss_fn.reference_policy_kl_penalty={loss.reference_policy_kl_penalty}, "
                f"loss_fn.use_kl_in_reward={loss.use_kl_in_reward}): set the penalty to 0 or skip=false"
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
        if g.val_period > 0 and g.val_batch_size is None:
            raise ValueError("grpo.val_batch_size=None: expected a positive integer when grpo.val_period > 0")
        if (
            g.stop_at_validation_metric is not None
            and g.stop_at_validation_metric.startswith("pass@")
            and g.stop_at_validation_metric != f"pass@{g.val_num_generations_per_prompt}"
        ):
            raise ValueError(
                f"grpo.stop_at_validation_metric={g.stop_at_validation_metric!r}: validation reports "
                f"pass@{g.val_num_generations_per_prompt} (grpo.val_num_generations_per_prompt)"
            )
        if self.checkpointing.keep_top_k is not None and self.checkpointing.metric_name not in (
            None,
            "val_reward",
        ) and not self.checkpointing.metric_name.startswith(("val/", "train/")):
            raise ValueError(
                f"checkpointing.metric_name={self.checkpointing.metric_name!r}: expected 'val_reward', a logged "
                "'val/...' or 'train/...' key, or null (keep the last k)"
            )
        if self.env.name == "reasoning_gym" and not self.data.dataset_name.startswith("reasoning_gym:"):
            raise ValueError(
                f"env.name='reasoning_gym' needs data.dataset_name='reasoning_gym:<task>' "
                f"(got {self.data.dataset_name!r})"
            )
        if g.async_grpo.enabled and p.generation.backend != "hf":
            raise ValueError(
                f"policy.generation.backend={p.generation.backend!r} with grpo.async_grpo.enabled=true: async GRPO "
                "generates with its own transformers copy of the weights: use policy.generation.backend=hf "
                "(or train_grpo.py for colocated vLLM)"
            )
        return self


def needs_reference(cfg: MasterConfig) -> bool:
    """The reference policy is needed when the loss or the reward uses KL to it."""
    return cfg.loss_fn.reference_policy_kl_penalty > 0 or cfg.loss_fn.use_kl_in_reward


def resolve_skip_flags(cfg: MasterConfig) -> tuple[bool, bool]:
    """Return ``(skip_prev_logprobs, skip_reference_logprobs)`` for this run.

    - Reference logprobs are skipped when nothing reads them (beta = 0 and no KL in the reward), or
      when ``grpo.skip_reference_policy_logprobs_calculation`` says so (validated against that).
    - Previous-policy logprobs are skipped under ``force_on_policy_ratio`` (the training forward's
      own logprobs, detached, stand in for them), unless sequence logprob-error masking or the
      reward KL needs them before training.
    """
    skip_ref = cfg.grpo.skip_reference_policy_logprobs_calculation
    if skip_ref is None:
        skip_ref = not needs_reference(cfg)
    loss = cfg.loss_fn
    skip_prev = (
        loss.force_on_policy_ratio
        and cfg.grpo.seq_logprob_error_threshold is None
        and not (loss.use_kl_in_reward and loss.reference_policy_kl_penalty > 0)
    )
    return skip_prev, skip_ref
