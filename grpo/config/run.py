"""The sections of a run's machinery: ``logger``, ``cluster`` and ``checkpointing``, and the names of the metrics
validation reports (what ``checkpointing.metric_name`` and the early stop may name)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from grpo.config.base import _Section, dhms_seconds


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


# grpo-ds's former names of the validation metrics -> NeMo-RL's, which validation reports (``pass@<k>`` too:
# `validation_metric_name`). `grpo.metrics.FORMER_NAMES` builds its ``val/`` rows from this table.
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
