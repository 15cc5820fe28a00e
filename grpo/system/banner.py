"""The line a run starts with: what will run and how (ranks, data, steps, engines, batching, generation), so a
log says in one place what its numbers came from."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from grpo.config import MasterConfig
    from grpo.system.data import PromptDataset
    from grpo.system.dist import Layout
    from grpo.system.engines import AdaptersOff, FrozenModel


def startup_line(cfg: MasterConfig, *, asynchronous: bool, world_size: int, layout: Layout | None,
                 train_ds: PromptDataset, val_ds: PromptDataset, num_malformed: int, total_steps: int,
                 policy: DeepSpeedEngine, reference: DeepSpeedEngine | AdaptersOff | FrozenModel | None,
                 skip_ref: bool, skip_prev: bool, tasks: list[str], packing_note: str) -> str:
    """``grpo-ds[ async]: <ranks>, <prompts>, <steps>, <reference>, <logprob passes>, <DeepSpeed config>, <tasks>,
    <turns>, <micro-batches>, <how a shared prompt runs>[, <hf decode>][, <linear layers on oneDNN>]``.
    ``layout``: the split into training and generation ranks
    (``policy.generation.colocated.enabled=false``) or None; ``num_malformed``: the training rows skipped as
    malformed; ``reference``: the reference model (None when ``skip_ref``); ``packing_note``: why the default
    sequence packing gave way, or ""."""
    from grpo.system.cpu_linear import OneDNNLinear
    from grpo.system.ds_config import policy_ds_config_path
    from grpo.system.shared_prefix import shares_prompts
    from grpo.system.training import describe_batching

    hf_decode = "" if cfg.policy.generation.backend != "hf" else (
        ", hf generation drops a sample from the batch when it ends" if cfg.policy.generation.hf_drop_finished_rows
        else ", hf generation decodes every sample until the longest ends")
    share = ("once" if shares_prompts(cfg.policy.shared_prompt_forward, policy.module)
             and policy.zero_optimization_stage() != 3 else "per sample")
    if share == "once" and cfg.policy.sequence_packing.enabled:
        share = "once or packed, whichever runs fewer tokens,"
    onednn = (", fp32 linear layers on oneDNN (policy.cpu_linear_kernel)"
              if any(isinstance(m, OneDNNLinear) for m in policy.module.modules()) else "")
    ranks = (f"{world_size} rank(s)" if layout is None else
             f"{layout.global_world_size} ranks: {world_size} train"
             + (f", {layout.num_teacher} teach (on_policy_distillation.non_colocated_teachers"
                f"{teacher_blocks(cfg.on_policy_distillation)})" if layout.num_teacher else "")
             + (f", {layout.num_generation} generate ({cfg.policy.generation.backend}, "
                "policy.generation.colocated.enabled=false)" if layout.num_generation else ""))
    return (f"grpo-ds{' async' if asynchronous else ''}: {ranks}, {len(train_ds)} train / "
            f"{len(val_ds)} val prompts ({train_ds.num_filtered} over data.max_input_seq_length filtered, "
            f"{train_ds.num_too_long} with no room under policy.max_total_sequence_length skipped, "
            f"{num_malformed} malformed rows skipped), {total_steps} steps, "
            f"reference {'skipped' if skip_ref else type(reference).__name__}, previous-policy logprobs "
            f"{'from the training forward' if skip_prev else 'in their own pass'}, DeepSpeed "
            "{} ({})".format(*policy_ds_config_path(cfg.policy, world_size)) + f", tasks {tasks}, "
            f"up to {cfg.grpo.max_rollout_turns} turn(s) per rollout, micro-batches: {describe_batching(cfg.policy)}"
            f"{packing_note}, a shared prompt runs {share} in the logprob and training forwards{hf_decode}{onednn}")


def teacher_blocks(opd) -> str:
    """Which teacher ranks serve which teacher, when there are several: ``": 'a' on teacher ranks 0-1, 'b' on
    2-3"`` (`grpo.system.dist.teacher_block`); "" for one teacher.

        >>> from grpo.config import OnPolicyDistillationConfig
        >>> teacher_blocks(OnPolicyDistillationConfig(enabled=True, teacher_model_by_agent_name={"a": "m", "b": "n"},
        ...                non_colocated_teachers={"enabled": True, "default_teacher_cfg": {"gpus_per_node": 2}}))
        ": 'a' on teacher ranks 0-1, 'b' on 2-3"
    """
    from grpo.config import loaded_teachers, ranks_per_teacher

    aliases, per = loaded_teachers(opd), ranks_per_teacher(opd)
    if len(aliases) < 2:
        return ""
    label = "teacher ranks " if per > 1 else "teacher rank "
    spans = [f"{alias!r} on {label if g == 0 else ''}{g * per}"
             + (f"-{(g + 1) * per - 1}" if per > 1 else "") for g, alias in enumerate(aliases)]
    return ": " + ", ".join(spans)
