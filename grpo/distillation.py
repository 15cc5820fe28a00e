"""Which teacher scores which row (on-policy distillation, ``on_policy_distillation``): NeMo-RL's MOPD routing.

A row's key is its NeMo-Gym agent's name (the data's ``agent_ref.name``) or, for every other environment, its task
name. The key is the teacher's alias when ``teacher_model_by_agent_name`` has it, else ``default_teacher_alias``
(or an error with ``strict_agent_name_match``): NeMo-RL's ``resolve_reference_aliases`` (nemo_rl/algorithms/opd.py).
Aliases naming the same checkpoint share one loaded teacher under ``deduplicate_shared_teacher_checkpoints``.

    >>> resolve_teacher_aliases(["math", "code", "chat"], {"math": "m", "code": "c"}, default_teacher_alias="math")
    ['math', 'code', 'math']
    >>> shared_teachers({"math": "ckpt/a", "chat": "ckpt/a", "code": "ckpt/b"}, deduplicate=True)
    {'math': 'math', 'chat': 'math', 'code': 'code'}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Optional

from grpo.config.algorithm import SINGLE_TEACHER, shared_teachers, teacher_models  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from grpo.config import OnPolicyDistillationConfig

def routing(opd_cfg: OnPolicyDistillationConfig) -> tuple[dict[str, str], Optional[str], bool]:
    """``(alias -> checkpoint, default alias, strict)`` of a config: the single teacher takes every row."""
    models = teacher_models(opd_cfg)
    if not opd_cfg.teacher_model_by_agent_name:
        return models, SINGLE_TEACHER, False
    return models, opd_cfg.default_teacher_alias, opd_cfg.strict_agent_name_match


def teacher_key(task_name: str, agent_name: Optional[str] = None) -> str:
    """The name a row's teacher is looked up by: its NeMo-Gym agent's (NeMo-RL keys by ``agent_ref.name``), else its
    task's.

        >>> teacher_key("nemo_gym", "math_agent"), teacher_key("arithmetic")
        ('math_agent', 'arithmetic')
    """
    return agent_name if agent_name else task_name


def agent_name(meta: Optional[Mapping]) -> Optional[str]:
    """A data row's NeMo-Gym agent (``meta.agent_ref.name``), or None.

        >>> agent_name({"agent_ref": {"name": "math_agent"}}), agent_name({})
        ('math_agent', None)
    """
    ref = (meta or {}).get("agent_ref")
    return ref.get("name") if isinstance(ref, Mapping) else None


def trajectory_teacher_key(trajectory) -> str:
    """`teacher_key` of a sample (`grpo.trajectory.Trajectory`): NeMo-Gym's rollout records the agent as
    ``metadata["agent_name"]``; before, its row's ``meta.agent_ref.name`` says it."""
    metadata = trajectory.metadata or {}
    return teacher_key(trajectory.task_name, metadata.get("agent_name") or agent_name(metadata.get("meta")))


def resolve_teacher_aliases(keys: Sequence[str], teacher_model_by_agent_name: Mapping[str, str],
                            default_teacher_alias: Optional[str] = None,
                            strict_agent_name_match: bool = False) -> list[str]:
    """One teacher alias per row key (NeMo-RL's ``resolve_reference_aliases``): the key itself when the map names it;
    else a ValueError under ``strict_agent_name_match``; else ``default_teacher_alias``; else a ValueError.

        >>> resolve_teacher_aliases(["chat"], {"math": "m"}, strict_agent_name_match=True)
        Traceback (most recent call last):
        ...
        ValueError: on_policy_distillation.strict_agent_name_match=true: no teacher for agent or task 'chat' in on_policy_distillation.teacher_model_by_agent_name (available: ['math'])
    """
    aliases = []
    for key in keys:
        if key in teacher_model_by_agent_name:
            aliases.append(key)
        elif strict_agent_name_match:
            raise ValueError(f"on_policy_distillation.strict_agent_name_match=true: no teacher for agent or task {key!r} "
                             f"in on_policy_distillation.teacher_model_by_agent_name "
                             f"(available: {sorted(teacher_model_by_agent_name)})")
        elif default_teacher_alias:
            aliases.append(default_teacher_alias)
        else:
            raise ValueError(f"no teacher for agent or task {key!r} in on_policy_distillation.teacher_model_by_agent_name "
                             f"(available: {sorted(teacher_model_by_agent_name)}) and no "
                             "on_policy_distillation.default_teacher_alias")
    return aliases


def rows_by_teacher(keys: Sequence[str], opd_cfg: OnPolicyDistillationConfig) -> dict[str, list[int]]:
    """Row indices by the loaded teacher (its primary alias, `shared_teachers`) that scores them, in first-row order.

        >>> from grpo.config import OnPolicyDistillationConfig
        >>> cfg = OnPolicyDistillationConfig(enabled=True, teacher_model_by_agent_name={"a": "m1", "b": "m2", "c": "m1"},
        ...                                  default_teacher_alias="b")
        >>> rows_by_teacher(["c", "x", "a", "b"], cfg)
        {'a': [0, 2], 'b': [1, 3]}
    """
    models, default, strict = routing(opd_cfg)
    primary = shared_teachers(models, opd_cfg.deduplicate_shared_teacher_checkpoints)
    out: dict[str, list[int]] = {}
    for row, alias in enumerate(resolve_teacher_aliases(keys, models, default, strict)):
        out.setdefault(primary[alias], []).append(row)
    return out
