"""Every config knob acts: each field of every config model is read, by its dotted path, outside grpo/config/.

A field that is accepted and then read by nothing is the worst kind of config bug (a user sets it, nothing
changes, nothing says so). The check is static: an attribute chain in the loops, grpo/ (the config modules and the
loaders excluded) or scripts/ must denote the field's whole dotted path (`tests/helpers/config_reads.py` says how
a chain's root is resolved: ``g = cfg.grpo; g.seed`` reads ``grpo.seed``, ``lora: LoraConfig`` reads
``policy.lora.*``). Fields that only the schema reads are listed below, each with why it is not a dead knob.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.load import config_fields
from tests.helpers.config_reads import dotted_reads

REPO = Path(__file__).resolve().parents[2]

READ_ONLY_BY_THE_SCHEMA = {
    "grpo.skip_reference_policy_logprobs_calculation":
        "resolved by grpo.config.resolve_skip_flags (true needs beta = 0, as in NeMo-RL), whose result the "
        "loops use (grpo/system/training.py LogprobEngines)",
    "grpo.skip_previous_policy_logprobs_calculation": "the same: resolve_skip_flags",
    "grpo.normalize_rewards":
        "NeMo-RL's top-level key; GRPOConfig's validator copies it into grpo.adv_estimator.normalize_rewards "
        "where that is null, and the estimators read the latter",
    "grpo.use_leave_one_out_baseline": "the same: copied into grpo.adv_estimator.use_leave_one_out_baseline",
    "cluster.gpus_per_node": "checked against the launcher by grpo.config.cluster_mismatch, called by grpo/run/serving.py and grpo/run/run_setup.py",
    "cluster.num_nodes": "the same: cluster_mismatch",
    "policy.generation.colocated.resources.gpus_per_node":
        "NeMo-RL's name; grpo.config.generation_ranks turns it into the number of generation ranks, which "
        "grpo/run/serving.py's start_split uses",
    "policy.generation.colocated.resources.num_nodes": "the same: generation_ranks",
    "on_policy_distillation.non_colocated_teachers.enabled":
        "NeMo-RL's name; grpo.config.teacher_ranks turns it into the number of teacher ranks (0 when false), which "
        "grpo/run/run_setup.py's split uses",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.gpus_per_node": "the same: teacher_ranks",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.num_nodes": "the same: teacher_ranks",
    "on_policy_distillation.non_colocated_teachers.teacher_overrides":
        "NeMo-RL's name, accepted only empty (its validator refuses per-teacher sizes by name)",
    "on_policy_distillation.teacher_model_name":
        "read through grpo.config.teacher_models (alias 'teacher' -> it), which grpo/system/teacher.py's "
        "build_teachers and grpo/distillation.py's routing use",
    "policy.sequence_packing.logprob_mb_tokens":
        "read through grpo.config.PolicyConfig.mb_tokens('logprob') (null: max_total_sequence_length x "
        "logprob_batch_size), which grpo/system/training.py token_batching calls for the logprob passes",
    "policy.dynamic_batching.logprob_mb_tokens": "the same: PolicyConfig.mb_tokens",
    "policy.sequence_packing.train_mb_tokens": "the same: PolicyConfig.mb_tokens('train')",
    "policy.dynamic_batching.train_mb_tokens": "the same: PolicyConfig.mb_tokens('train')",
    "policy.generation.val_temperature":
        "read by grpo.config.GenerationConfig.sampling (getattr of val_<name>), which grpo/run/run.py "
        "turn_settings calls for validation's rollouts",
    "policy.generation.val_top_p": "the same: GenerationConfig.sampling",
    "policy.generation.val_top_k": "the same: GenerationConfig.sampling",
    "policy.generation.stop_strings": "the same: GenerationConfig.sampling puts it in every backend's profile",
    "policy.generation.stop_token_ids": "the same: GenerationConfig.sampling puts it in every backend's profile",
    "env.should_use_nemo_gym":
        "NeMo-RL's switch; grpo.config.EnvConfig makes it env.name=nemo_gym (and MasterConfig's _nemo_gym_checks "
        "apply), which grpo/tasks/factory.py builds as the NeMo-Gym environment",
    "grpo.deduplicate_multimodal_data":
        "NeMo-RL's key, accepted either way: a prompt's images are always stored once for its group "
        "(grpo/system/vision.py), which trains exactly as a copy per sample (test_deduplicated_and_copied_media_train_the_same)",
    "policy.optimizer.name":
        "a one-value Literal (adamw, what grpo/system/engines.py builds), so a recipe asking for another optimizer "
        "fails at load instead of being ignored",
    "checkpointing.model_save_format":
        "NeMo-RL's name; a one-value Literal (safetensors, what grpo.system.weights.export_hf writes), so a recipe "
        "that asks for torch_save fails at load instead of being ignored",
}


def _sources() -> list[Path]:
    files = [*REPO.glob("train_*.py"), *(REPO / "grpo").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    # The loader and the NeMo-RL recipe translator name the fields to write them, not to act on them.
    config = REPO / "grpo" / "config"
    skip = {*config.glob("*.py"), config / "nemo_rl" / "recipe.py", config / "nemo_rl" / "rules.py"}
    return [p for p in files if p not in skip]


@pytest.fixture(scope="module")
def reads() -> set[str]:
    return dotted_reads(_sources())


def test_every_config_field_is_read_outside_the_schema(reads):
    unread = [key for key, *_ in config_fields() if key not in READ_ONLY_BY_THE_SCHEMA and key not in reads]
    assert unread == [], f"config fields nothing reads by their dotted path (wire them up, or allow-list with a " \
                         f"reason): {unread}"


def test_the_allow_list_holds_only_real_fields_that_are_still_unread(reads):
    keys = {key for key, *_ in config_fields()}
    assert set(READ_ONLY_BY_THE_SCHEMA) <= keys, set(READ_ONLY_BY_THE_SCHEMA) - keys
    read_now = sorted(set(READ_ONLY_BY_THE_SCHEMA) & reads)
    assert read_now == [], f"read now: unlist them: {read_now}"


def test_a_field_read_only_by_its_last_name_elsewhere_counts_as_unread(tmp_path):
    """The check this test replaced matched ``.enabled`` anywhere; this one must not."""
    src = tmp_path / "m.py"
    src.write_text("def f(cfg):\n    return cfg.policy.lora.enabled\n")
    got = dotted_reads([src])
    assert "policy.lora.enabled" in got and "policy.sequence_packing.enabled" not in got
    src.write_text("def f(run):\n    g = run.cfg.grpo\n    a = g.async_grpo\n    return g.seed, a.enabled\n")
    got = dotted_reads([src])
    assert {"grpo.seed", "grpo.async_grpo.enabled"} <= got and "policy.lora.enabled" not in got
    src.write_text("from grpo.config import LoggerConfig\n\nclass L:\n    def __init__(self, c: LoggerConfig):\n"
                   "        self.c = c\n\n    def go(self):\n        return self.c.wandb.project, getattr(self.c, 'log_dir')\n")
    got = dotted_reads([src])
    assert {"logger.wandb.project", "logger.log_dir"} <= got and "grpo.seed" not in got
