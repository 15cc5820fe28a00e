"""Run configuration: pydantic models for every section of NeMo-RL's ``MasterConfig``, one module per section.

Field names and defaults follow NeMo-RL (``nemo_rl.algorithms.grpo`` / ``loss_functions``) so a
NeMo-RL recipe reads the same here. Every model forbids unknown keys. Loading (YAML recipes with
``defaults:`` inheritance, dotted command-line overrides, readable errors) is `grpo.config.load`.

    base.py        what every section shares: the strict base model, durations, the model-name checks
    algorithm.py   grpo (GRPOConfig and its parts), loss_fn, reward_penalties, on_policy_distillation
    policy.py      policy: tokenizer, optimizer, scheduler, generation (vLLM, the endpoint), LoRA, packing
    data.py        data: prompt files, hub datasets, built-in tasks
    env.py         env: environments, agents, reward models, LLM judges, NeMo-Gym
    run.py         logger, cluster, checkpointing; the metric names validation reports
    master.py      MasterConfig (the whole config) and the rules that read more than one section

Every public name is re-exported here (``from grpo.config import GRPOConfig``). These modules import only
pydantic and the task catalogue (`grpo.tasks.catalogue`, for the built-in task names; it imports nothing
heavy): a bad config fails before torch, deepspeed or a model is ever loaded, with an error naming the
dotted key, the value and what was expected.
"""

from grpo.config.base import check_toy_model, dhms_seconds, model_path_problem
from grpo.config.algorithm import (AdvEstimatorConfig, AsyncGRPOConfig, ClippedPGLossConfig, GRPOConfig,
                                   NEMO_RL_PENALTY_FLAGS, NonColocatedTeachersConfig, OnPolicyDistillationConfig,
                                   RewardPenaltyConfig, RewardPenaltyTokenIdsConfig, RewardScalingConfig,
                                   RewardShapingConfig, RolloutFailureConfig, TeacherResourcesConfig,
                                   reward_penalties_without_nemo_gym, teacher_ranks,
                                   loaded_teachers, ranks_per_teacher)
from grpo.config.policy import (CHAT_TEMPLATE_ARGS_SET_BY_GRPO, ColocatedConfig, ColocatedResourcesConfig,
                                DynamicBatchingConfig, GenerationConfig, HttpServerConfig, LoraConfig, OptimizerConfig,
                                PolicyConfig, REASONING_PARSERS, Sampling, SchedulerConfig, SequencePackingConfig,
                                ServingChatKwargs, TOOL_PARSERS, TokenizerConfig, VLLM_KWARGS_SET_BY_GRPO,
                                VLLM_LORA_KWARGS, VLLM_MAX_LORA_RANK, VisionConfig, VllmConfig, generation_ranks,
                                generation_split_problem, parser_problem, vllm_parser_names)
from grpo.config.data import DataConfig, DataSource
from grpo.config.env import (AgentConfig, EffortLevelsConfig, EnvConfig, EnvSpec, JudgeConfig, MOVED_MODULES,
                             NEMO_RL_ONLY_GYM_KEYS, NemoGymConfig, RewardModelConfig, RewardModelTokenizerConfig,
                             RewardModelTypeConfig)
from grpo.config.run import (CheckpointingConfig, ClusterConfig, LoggerConfig, VALIDATION_METRIC_ALIASES, WandbConfig,
                             checkpoint_metric_form, cluster_mismatch, validation_metric_name, validation_metric_names)
from grpo.config.master import (MasterConfig, check_generation_resources, check_teacher_resources, needs_reference,
                                prev_logprobs_needed_before_training, resolve_skip_flags, serves_endpoint)

__all__ = [
    "check_toy_model", "dhms_seconds", "model_path_problem", "AdvEstimatorConfig", "AsyncGRPOConfig",
    "ClippedPGLossConfig", "GRPOConfig", "NEMO_RL_PENALTY_FLAGS", "OnPolicyDistillationConfig", "RewardPenaltyConfig",
    "RewardPenaltyTokenIdsConfig", "RewardScalingConfig", "RewardShapingConfig", "RolloutFailureConfig",
    "reward_penalties_without_nemo_gym", "NonColocatedTeachersConfig", "TeacherResourcesConfig", "teacher_ranks",
    "loaded_teachers", "ranks_per_teacher",
    "check_teacher_resources", "CHAT_TEMPLATE_ARGS_SET_BY_GRPO", "ColocatedConfig",
    "ColocatedResourcesConfig", "DynamicBatchingConfig", "GenerationConfig", "HttpServerConfig", "LoraConfig",
    "OptimizerConfig", "PolicyConfig", "REASONING_PARSERS", "Sampling", "SchedulerConfig", "SequencePackingConfig",
    "ServingChatKwargs", "TOOL_PARSERS", "TokenizerConfig", "VLLM_KWARGS_SET_BY_GRPO", "VLLM_LORA_KWARGS",
    "VLLM_MAX_LORA_RANK", "VisionConfig", "VllmConfig", "generation_ranks", "generation_split_problem",
    "parser_problem", "vllm_parser_names", "DataConfig", "DataSource", "AgentConfig", "EffortLevelsConfig", "EnvConfig", "EnvSpec",
    "JudgeConfig", "MOVED_MODULES", "NEMO_RL_ONLY_GYM_KEYS", "NemoGymConfig", "RewardModelConfig",
    "RewardModelTokenizerConfig", "RewardModelTypeConfig", "CheckpointingConfig", "ClusterConfig", "LoggerConfig",
    "VALIDATION_METRIC_ALIASES", "WandbConfig", "checkpoint_metric_form", "cluster_mismatch", "validation_metric_name",
    "validation_metric_names", "MasterConfig", "check_generation_resources", "needs_reference",
    "prev_logprobs_needed_before_training", "resolve_skip_flags", "serves_endpoint",
]
