"""The whole config (``MasterConfig``, NeMo-RL's sections) and the rules that read more than one section."""

from __future__ import annotations

from contextlib import contextmanager

from pydantic import Field, model_validator

from grpo.config.algorithm import (ClippedPGLossConfig, GRPOConfig, OnPolicyDistillationConfig, RewardPenaltyConfig,
                                   loaded_teachers, teacher_ranks)
from grpo.config.base import _Section
from grpo.config.data import DataConfig
from grpo.config.env import EnvConfig
from grpo.config.policy import PolicyConfig, generation_ranks
from grpo.config.run import CheckpointingConfig, ClusterConfig, LoggerConfig, validation_metric_name
from grpo.tasks.catalogue import TASKS


@contextmanager
def _collected(problems: list[str]):
    """A rule that raises ValueError on its own (a helper shared with other callers) adds its message to
    ``problems`` instead of stopping the others."""
    try:
        yield
    except ValueError as err:
        problems.append(str(err))


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
        """The rules that read more than one section. Every broken rule is reported (one ValueError, a line each),
        so --check-config lists them all in one run."""
        problems: list[str] = []
        g, loss, p = self.grpo, self.loss_fn, self.policy
        n_per_step = g.num_prompts_per_step * g.num_generations_per_prompt
        if p.train_global_batch_size % p.train_micro_batch_size:
            problems.append(
                f"policy.train_global_batch_size={p.train_global_batch_size}: expected a multiple of "
                f"policy.train_micro_batch_size={p.train_micro_batch_size}"
            )
        if n_per_step % p.train_global_batch_size:
            problems.append(
                f"policy.train_global_batch_size={p.train_global_batch_size}: expected a divisor of "
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {n_per_step}"
            )
        if loss.force_on_policy_ratio and p.train_global_batch_size != n_per_step:
            problems.append(
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
            problems.append(
                "loss_fn.use_kl_in_reward=true is incompatible with loss_fn.force_on_policy_ratio=true: the "
                "reward KL needs previous-policy logprobs, which force_on_policy_ratio skips. Set "
                "grpo.seq_logprob_error_threshold (which computes them), set "
                "loss_fn.reference_policy_kl_penalty=0, or turn one of the two off"
            )
        if g.async_grpo.enabled and not loss.use_importance_sampling_correction:
            problems.append(
                "grpo.async_grpo.enabled=true needs loss_fn.use_importance_sampling_correction=true: "
                "async trajectories are generated by older weights"
            )
        if g.async_grpo.enabled and g.use_dynamic_sampling:
            problems.append("grpo.use_dynamic_sampling=true is not supported with grpo.async_grpo.enabled=true")
        if g.skip_previous_policy_logprobs_calculation:
            one_update = p.train_global_batch_size == n_per_step
            needed = prev_logprobs_needed_before_training(self)
            if needed is not None or not (one_update or loss.force_on_policy_ratio):
                why = needed or (f"policy.train_global_batch_size={p.train_global_batch_size} < {n_per_step} samples "
                                 "per step: later optimizer steps of a step need the logprobs of the weights before it")
                problems.append("grpo.skip_previous_policy_logprobs_calculation=true but the run needs "
                                 f"previous-policy logprobs ({why}): set it to null or false")
        if g.skip_reference_policy_logprobs_calculation and needs_reference(self):
            problems.append(  # NeMo-RL asserts the same (nemo_rl/algorithms/grpo.py, setup)
                "grpo.skip_reference_policy_logprobs_calculation=true requires "
                f"loss_fn.reference_policy_kl_penalty == 0 (got {loss.reference_policy_kl_penalty}): the KL "
                "penalty reads the reference logprobs; set the penalty to 0 or the flag to false"
            )
        if loss.use_kl_in_reward and g.adv_estimator.name != "reinforce_plus_plus":
            problems.append(
                f"loss_fn.use_kl_in_reward=true is only used by grpo.adv_estimator.name='reinforce_plus_plus' "
                f"(got {g.adv_estimator.name!r})"
            )
        opd = self.on_policy_distillation
        if g.adv_estimator.name == "opd" and not opd.enabled:
            problems.append("grpo.adv_estimator.name='opd' needs teacher logprobs: set on_policy_distillation.enabled="
                            "true with on_policy_distillation.teacher_model_by_agent_name (or teacher_model_name)")
        if g.adv_estimator.name == "opd" and opd.kl_coef != 1.0:
            problems.append(f"on_policy_distillation.kl_coef={opd.kl_coef} with grpo.adv_estimator.name='opd': expected "
                            "1.0 (the default): the opd advantage is the teacher-student logprob gap itself, with no "
                            "coefficient (NeMo-RL's); use another estimator to add kl_coef times the gap to its "
                            "advantages")
        if g.reward_shaping.enabled and g.reward_shaping.max_response_length is not None:
            if g.reward_shaping.max_response_length > p.generation.max_new_tokens:
                problems.append(
                    f"grpo.reward_shaping.max_response_length={g.reward_shaping.max_response_length}: expected "
                    f"<= policy.generation.max_new_tokens={p.generation.max_new_tokens}"
                )
        if p.generation.max_new_tokens > p.max_total_sequence_length:
            problems.append(
                f"policy.generation.max_new_tokens={p.generation.max_new_tokens}: expected <= "
                f"policy.max_total_sequence_length={p.max_total_sequence_length} (generation stops at "
                "whichever comes first)"
            )
        # NeMo-Gym: null validates every validation row in one batch (NeMo-RL's run_grpo_nemo_gym.py sets it so)
        if g.val_period > 0 and g.val_batch_size is None and not getattr(self.env, "should_use_nemo_gym", False):
            problems.append("grpo.val_batch_size=None: expected a positive integer when grpo.val_period > 0 "
                             "(null only with env.should_use_nemo_gym=true: the whole validation set in one batch)")
        if g.stop_at_validation_metric is not None:
            with _collected(problems):
                g.stop_at_validation_metric = validation_metric_name(
                    g.stop_at_validation_metric, g.val_num_generations_per_prompt, "grpo.stop_at_validation_metric")
        if g.batch_multiplier != 1.0 and not g.use_dynamic_sampling:
            problems.append(f"grpo.batch_multiplier={g.batch_multiplier} only acts with "
                             "grpo.use_dynamic_sampling=true (NeMo-RL asserts the same): set it to 1 or turn dynamic "
                             "sampling on")
        name = self.checkpointing.metric_name
        if name is not None and name.startswith("val:"):  # the form is CheckpointingConfig's; the name is known here
            with _collected(problems):
                val_name = "val:" + validation_metric_name(name[len("val:"):], g.val_num_generations_per_prompt,
                                                           "checkpointing.metric_name", name)
                if val_name != name:
                    self.checkpointing.metric_name = val_name
        if self.env.should_use_nemo_gym:
            with _collected(problems):
                self._nemo_gym_checks()
        task = TASKS.get(self.env.name)
        if task is not None and task.dataset_prefix and not self.data.dataset_name.startswith(f"{self.env.name}:"):
            problems.append(
                f"env.name={self.env.name!r} needs data.dataset_name='{self.env.name}:<task>' "
                f"(got {self.data.dataset_name!r})"
            )
        colocated = p.generation.colocated
        if g.async_grpo.enabled and p.generation.backend == "vllm" and colocated.enabled:
            problems.append(  # NeMo-RL's async_grpo_train asserts non-colocated vLLM inference the same way
                "policy.generation.backend='vllm' with grpo.async_grpo.enabled=true needs "
                "policy.generation.colocated.enabled=false (generation on ranks of its own, "
                "colocated.resources.gpus_per_node of them); or use policy.generation.backend=hf (a transformers "
                "copy in a thread), or train_grpo.py for colocated vLLM"
            )
        tp = p.generation.vllm_cfg.tensor_parallel_size
        if p.generation.backend == "vllm" and colocated.enabled and tp > 1 and serves_endpoint(self):
            problems.append(  # each rank's endpoint generates when its own agents call: its TP group never agrees
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp} with colocated vLLM and the endpoint "
                "(policy.generation.vllm_cfg.expose_http_server or an agent / nemo_gym task): expected "
                "tensor_parallel_size=1, or policy.generation.colocated.enabled=false (generation ranks, which the "
                "trainers' endpoints share)")
        if not colocated.enabled:
            with _collected(problems):
                check_generation_resources(self)
        if teacher_ranks(self.on_policy_distillation):
            with _collected(problems):
                check_teacher_resources(self)
        if problems:
            raise ValueError("\n".join(problems))
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


def check_teacher_resources(cfg: "MasterConfig") -> None:
    """``on_policy_distillation.non_colocated_teachers.enabled=true``: the teachers' ranks (``default_teacher_cfg``'s
    per loaded teacher, `grpo.config.teacher_ranks`) fit the launch beside the training (and generation) ranks, as
    `check_generation_resources` asks of the generation ranks: ValueError naming the key, its value and what is
    expected."""
    cluster, gen = cfg.cluster, cfg.policy.generation.colocated
    opd = cfg.on_policy_distillation
    t, loaded = opd.non_colocated_teachers.default_teacher_cfg, loaded_teachers(opd)
    n = len(loaded)
    key = "on_policy_distillation.non_colocated_teachers.default_teacher_cfg"
    times = f" x {n} teachers ({', '.join(loaded)})" if n > 1 else ""
    gen_gpus = 0 if gen.enabled else (gen.resources.gpus_per_node or 0)
    if cluster.num_nodes is not None and cluster.num_nodes > 1:
        if cluster.gpus_per_node is not None and t.gpus_per_node != cluster.gpus_per_node:
            raise ValueError(f"{key}.gpus_per_node={t.gpus_per_node} with cluster.num_nodes={cluster.num_nodes}: "
                             f"expected cluster.gpus_per_node={cluster.gpus_per_node} (whole nodes run the teacher, "
                             "as in NeMo-RL)")
        gen_nodes = 0 if gen.enabled else (gen.resources.num_nodes or 1)
        if gen_nodes + t.num_nodes * n >= cluster.num_nodes:
            raise ValueError(f"{key}.num_nodes={t.num_nodes}{times}: expected < cluster.num_nodes={cluster.num_nodes}"
                             + (f" - {gen_nodes} generation nodes" if gen_nodes else "")
                             + " (at least one node must train)")
        return
    if t.num_nodes != 1:
        raise ValueError(f"{key}.num_nodes={t.num_nodes} with cluster.num_nodes={cluster.num_nodes}: expected 1 (a "
                         "teacher on several nodes needs cluster.num_nodes > 1)")
    if cluster.gpus_per_node is not None and t.gpus_per_node * n + gen_gpus >= cluster.gpus_per_node:
        raise ValueError(f"{key}.gpus_per_node={t.gpus_per_node}{times}"
                         + (f" + policy.generation.colocated.resources.gpus_per_node={gen_gpus}" if gen_gpus else "")
                         + f": expected < cluster.gpus_per_node={cluster.gpus_per_node} (at least one rank must train)")


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
