"""The translation rules of NeMo-RL's NeMo-Gym recipes (``env.should_use_nemo_gym: true``), in one place.
`grpo.config.nemo_rl.rules` calls `gym_data_and_env` for a Gym recipe's ``data`` and ``env``, and `gym_grpo_and_penalties`
for every recipe's ``grpo`` Gym keys and ``reward_penalties``. ``w`` is `grpo.config.nemo_rl.rules.Walk` (its methods
only: this module imports nothing of the rules, so there is no import cycle).

NeMo-RL key                                   grpo-ds key
env.should_use_nemo_gym                       env.should_use_nemo_gym (same)
env.nemo_gym (the whole section: NeMo-RL's    env.nemo_gym (same; effort_levels checked here against
  keys and Gym's config)                        `grpo.config.EffortLevelsConfig`)
env.should_log_nemo_gym_responses             env.should_log_nemo_gym_responses (same)
env.should_mask_flagged_samples               env.should_mask_flagged_samples (same)
data.train (NemoGymDataset: data_path)        data.train_data_path, data.input_key=responses_create_params
data.validation (NemoGymDataset: data_path,   data.val_data_path, data.val_repeat
  repeat)
data.{train,validation}.{seed,                ignored: NeMo-RL warns that NemoGymDataset ignores them
  split_validation_size, ...}                   (GYM_IGNORED_SPEC_KEYS)
reward_penalties.token_ids.*                  reward_penalties.token_ids.* (same)
reward_penalties.penalize_* without Gym       refused: NeMo-RL's _raise_if_reward_penalties_enabled_without_nemo_gym
grpo.invalid_tool_call_advantage /            refused without Gym: NeMo-RL's _resolve_message_level_advantage_penalties
  malformed_thinking_advantage
"""

from __future__ import annotations

from pathlib import Path

GYM_DATASET = "NemoGymDataset"
GYM_INPUT_KEY = "responses_create_params"  # NemoGymDataset's rows: the whole record, posted to the agent's /run
# Dataset-spec keys of a NemoGymDataset and what grpo-ds makes of them (NeMo-RL: nemogym_dataset.py takes data_path
# and repeat; the processor nemo_gym_data_processor keeps each JSONL record whole).
GYM_SPEC_KEYS = ("dataset_name", "data_path", "repeat", "env_name", "processor", "prompt_file", "system_prompt_file")
# Dataset keys NeMo-RL's load_response_dataset warns about and ignores when the class takes no such argument
# (nemo_rl/data/datasets/utils.py, _BEHAVIORAL_DATASET_CONFIG_KEYS; NemoGymDataset takes data_path and repeat): a Gym
# recipe inherits them from its base's math dataset (grpo_math_1B.yaml's split_validation_size, seed). Ignored here
# too, where NeMo-RL warns (not null; split_validation_size not 0).
GYM_IGNORED_SPEC_KEYS = ("chosen_key", "download_dir", "input_key", "output_key", "prompt_key", "rejected_key", "seed",
                         "split", "split_validation_size", "subset")
# Keys of NeMo-Gym recipes that NeMo-RL's GRPOConfig (extra="allow") accepts and no code at 7ea279a reads.
STALE_GRPO_KEYS = ("use_best_at_k", "best_at_k_k", "best_at_k_m", "use_combined_training",
                   "combined_training_weight_mode", "combined_training_best_at_k_weight",
                   "combined_training_pass_at_1_weight", "dynamic_sampling_oversample_ratio")
MESSAGE_ADVANTAGE_KEYS = ("invalid_tool_call_advantage", "malformed_thinking_advantage")


def is_gym_recipe(w) -> bool:
    return bool(w.get("env.should_use_nemo_gym"))


def _path(path: str) -> str:
    local = path.endswith((".jsonl", ".json")) or path.startswith((".", "/", "~"))
    return str(Path(path).expanduser().resolve()) if local and not path.startswith("/") else path


def _gym_spec(w, key: str, spec: dict, default: dict) -> dict | None:
    """One ``data.train`` / ``data.validation`` spec (over ``data.default``, whose nulls do not win) -> its
    ``data_path`` and ``repeat``, or None after refusing what grpo-ds cannot read."""
    full = {**{k: v for k, v in default.items() if v is not None}, **spec}
    ok = True
    if full.get("dataset_name") != GYM_DATASET:
        w.refuse(f"{key}.dataset_name", f"with env.should_use_nemo_gym=true the rows are NeMo-Gym rows ({GYM_DATASET}: "
                 "responses_create_params, agent_ref); grpo-ds reads no other dataset on the Gym path",
                 value=full.get("dataset_name"))
        ok = False
    for k in full:
        if k in GYM_IGNORED_SPEC_KEYS and k in spec and full[k] is not None and (
                k != "split_validation_size" or full[k]):
            w.ignore(f"{key}.{k}", f"{GYM_DATASET} takes data_path and repeat: NeMo-RL warns that it ignores "
                     f"{k}={full[k]!r} (no split, the rows of data_path whole; validation rows come from "
                     "data.validation.data_path)")
        elif k not in GYM_SPEC_KEYS and k not in GYM_IGNORED_SPEC_KEYS:
            w.refuse(f"{key}.{k}", f"a {GYM_DATASET} key grpo-ds does not translate (NeMo-RL's dataset takes "
                     "data_path and repeat)", value=full[k])
            ok = False
    for k in ("prompt_file", "system_prompt_file"):
        if full.get(k) is not None:
            w.refuse(f"{key}.{k}", "NeMo-Gym rows carry their whole prompt (responses_create_params.input); NeMo-RL's "
                     "nemo_gym_data_processor reads no prompt file", value=full[k])
            ok = False
    if full.get("env_name", "nemo_gym") != "nemo_gym":
        w.refuse(f"{key}.env_name", "with env.should_use_nemo_gym=true every row is played by NeMo-Gym's agents",
                 value=full["env_name"])
        ok = False
    if not isinstance(full.get("data_path"), str) or not full["data_path"]:
        w.refuse(f"{key}.data_path", f"{GYM_DATASET} needs a JSONL file of Gym rows (NeMo-RL opens data_path)",
                 value=full.get("data_path"))
        ok = False
    repeat = full.get("repeat", 1)
    return {"path": full["data_path"], "repeat": int(repeat or 1)} if ok else None


def gym_data_and_env(w) -> None:
    """``data`` and ``env`` of a Gym recipe (module docstring's table)."""
    default = w.get("data.default") or {}
    w.take("data.default")
    train, val = w.get("data.train"), w.get("data.validation")
    if not isinstance(train, dict):
        w.refuse("data.train", f"expected one {GYM_DATASET} spec (grpo-ds reads one Gym training file)")
    if val is not None and not isinstance(val, dict):
        w.refuse("data.validation", f"expected one {GYM_DATASET} spec or null")
    t = _gym_spec(w, "data.train", train, default) if isinstance(train, dict) else None
    v = _gym_spec(w, "data.validation", val, default) if isinstance(val, dict) else None
    w.take("data.train")
    w.take("data.validation")
    if t is not None and t["repeat"] > 1:
        w.refuse("data.train.repeat", "grpo-ds repeats only validation rows (data.val_repeat); repeat the training "
                 "file's lines instead", value=t["repeat"])
    elif t is not None:
        w.translate("data.train", {"data.train_data_path": _path(t["path"]), "data.input_key": GYM_INPUT_KEY},
                    f"{GYM_DATASET}: each JSONL line a Gym row, kept whole and posted to its agent server's /run")
    if v is not None:
        targets = {"data.val_data_path": _path(v["path"])}
        if v["repeat"] > 1:
            targets["data.val_repeat"] = v["repeat"]
        w.translate("data.validation", targets, GYM_DATASET)
    elif val is None and t is not None:
        w.translate("data.validation", {"grpo.val_period": 0, "grpo.val_at_start": False, "grpo.val_at_end": False},
                    "no validation data: NeMo-RL does not validate either")
        for k in ("val_period", "val_at_start", "val_at_end"):
            w.take(f"grpo.{k}")

    w.honor("env.should_use_nemo_gym")
    section = w.get("env.nemo_gym")
    effort = section.get("effort_levels") if isinstance(section, dict) else None
    if effort is not None:
        from pydantic import ValidationError

        from grpo.config import EffortLevelsConfig

        try:
            EffortLevelsConfig.model_validate(effort)
        except ValidationError as err:
            w.refuse("env.nemo_gym.effort_levels", "not NeMo-RL's EffortLevelsConfig (low_weight, low_penalty, "
                     f"low_ub > 0, low_string): {err.errors()[0]['loc']}: {err.errors()[0]['msg']}")
    if not w.errors or not any(e.startswith("env.nemo_gym.") for e in w.errors):
        w.honor("env.nemo_gym")
    w.honor("env.should_log_nemo_gym_responses")
    w.honor("env.should_mask_flagged_samples")
    for name, value in (w.get("env") or {}).items():
        if isinstance(value, dict) and name != "nemo_gym":
            w.ignore(f"env.{name}", "with env.should_use_nemo_gym=true NeMo-Gym plays every row: the other "
                     "environment sections are unused, as in NeMo-RL")
    w.take("env")


def gym_grpo_and_penalties(w) -> None:
    """Stale ``grpo`` keys of Gym recipes, ``reward_penalties.token_ids``, and NeMo-RL's checks that its penalties
    and message-level advantages need the NeMo-Gym path."""
    for key in STALE_GRPO_KEYS:
        w.ignore(f"grpo.{key}", "NeMo-RL reads no such key (a stale key of NeMo-Gym recipes: no code at 7ea279a "
                 "reads it)")
    w.ignore("sif_dir", "read by NeMo-RL's examples/nemo_gym/download_swe_images.py (container images of the SWE "
             "environments), not by training")
    if is_gym_recipe(w) and w.get("grpo.max_val_samples") is not None:
        w.refuse("grpo.max_val_samples", "NeMo-RL's NeMo-Gym runner refuses a non-null max_val_samples (the "
                 "validation file is used whole, what you see is what you get): set it to null")
    token_ids = w.get("reward_penalties.token_ids")
    if isinstance(token_ids, dict):
        for k in token_ids:
            w.honor(f"reward_penalties.token_ids.{k}")
    if is_gym_recipe(w):
        return
    from grpo.config import NEMO_RL_PENALTY_FLAGS

    for flag in NEMO_RL_PENALTY_FLAGS:
        if w.get(f"reward_penalties.{flag}"):
            w.refuse(f"reward_penalties.{flag}", "reward_penalties require the NeMo-Gym path "
                     "(env.should_use_nemo_gym=true); they are not supported with the native generation path "
                     "(NeMo-RL refuses it at setup); grpo-ds's native configs apply them to their own environments")
    for key in MESSAGE_ADVANTAGE_KEYS:
        if w.get(f"grpo.{key}") is not None:
            w.refuse(f"grpo.{key}", "grpo.invalid_tool_call_advantage / grpo.malformed_thinking_advantage require the "
                     "NeMo-Gym path (env.should_use_nemo_gym=true) in NeMo-RL; grpo-ds's native configs flag messages "
                     "with their own environments (env.tools)")
