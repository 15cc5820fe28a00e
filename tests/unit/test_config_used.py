"""Every config knob acts: each field of every config model is read by code outside grpo/config.py.

A field that is accepted and then read by nothing is the worst kind of config bug (a user sets it, nothing
changes, nothing says so). The check is static: the field's name must appear as an attribute access
(``.name``) or a string key (``"name"``, for getattr / dumped dicts) in the loops, grpo/ (config.py itself
and the loader excluded) or scripts/. Fields that only the schema reads are listed below, each with why it is
not a dead knob.
"""

from __future__ import annotations

import re
from pathlib import Path

from grpo.config_load import config_fields

REPO = Path(__file__).resolve().parents[2]

READ_ONLY_BY_THE_SCHEMA = {
    "grpo.skip_reference_policy_logprobs_calculation":
        "resolved by grpo.config.resolve_skip_flags (true needs beta = 0, as in NeMo-RL), whose result the "
        "loops use (grpo/system/training.py LogprobEngines)",
    "grpo.skip_previous_policy_logprobs_calculation": "the same: resolve_skip_flags",
    "cluster.gpus_per_node": "checked against the launcher by grpo.config.cluster_mismatch, called by grpo/run.py",
    "cluster.num_nodes": "the same: cluster_mismatch",
    "policy.generation.colocated.resources.gpus_per_node":
        "NeMo-RL's name; grpo.config.generation_ranks turns it into the number of generation ranks, which "
        "grpo/run.py's start_split uses",
    "policy.generation.colocated.resources.num_nodes": "the same: generation_ranks",
    "policy.sequence_packing.logprob_mb_tokens":
        "read through grpo.config.PolicyConfig.mb_tokens('logprob') (null: max_total_sequence_length x "
        "logprob_batch_size), which grpo/system/training.py token_batching calls for the logprob passes",
    "policy.dynamic_batching.logprob_mb_tokens": "the same: PolicyConfig.mb_tokens",
    "checkpointing.model_save_format":
        "NeMo-RL's name; a one-value Literal (safetensors, what grpo.system.weights.export_hf writes), so a recipe "
        "that asks for torch_save fails at load instead of being ignored",
}


def _sources() -> dict[Path, str]:
    files = [*REPO.glob("train_*.py"), *(REPO / "grpo").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    # The loader and the NeMo-RL recipe translator name the fields to write them, not to act on them.
    skip = {REPO / "grpo" / n for n in ("config.py", "config_load.py", "nemo_rl_recipe.py", "nemo_rl_rules.py")}
    return {p: p.read_text() for p in files if p not in skip}


def test_every_config_field_is_read_outside_the_schema():
    sources = _sources()
    unread = []
    for key, *_ in config_fields():
        leaf = re.escape(key.rsplit(".", 1)[-1])
        pattern = re.compile(rf"\.{leaf}\b|[\"']{leaf}[\"']")
        if key not in READ_ONLY_BY_THE_SCHEMA and not any(pattern.search(s) for s in sources.values()):
            unread.append(key)
    assert unread == [], f"config fields nothing reads (wire them up, or allow-list with a reason): {unread}"


def test_the_allow_list_holds_only_real_fields_that_are_still_unread():
    keys = {key for key, *_ in config_fields()}
    assert set(READ_ONLY_BY_THE_SCHEMA) <= keys, set(READ_ONLY_BY_THE_SCHEMA) - keys
    sources = _sources()
    for key in READ_ONLY_BY_THE_SCHEMA:
        leaf = re.escape(key.rsplit(".", 1)[-1])
        assert not any(re.search(rf"\.{leaf}\b", s) for s in sources.values()), f"{key} is read now: unlist it"
