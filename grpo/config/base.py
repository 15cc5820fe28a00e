"""What every config section shares: the strict base model, durations, and the model-name checks."""

from __future__ import annotations

import os
from typing import Optional

from pydantic import BaseModel, ConfigDict

from grpo.tasks.catalogue import TOY_MODELS


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


def check_toy_model(name: Optional[str], key: str) -> Optional[str]:
    """``name`` unchanged, or a ValueError for a ``toy:<name>`` that `grpo.tasks.catalogue` does not build (listing those).

        >>> check_toy_model("toy:nonexistent", "policy.model_name")
        Traceback (most recent call last):
        ...
        ValueError: policy.model_name='toy:nonexistent': no such toy model; expected one of ['toy:demo', ...
    """
    if name is not None and name.startswith("toy:"):
        if name[len("toy:"):] not in TOY_MODELS:
            raise ValueError(f"{key}={name!r}: no such toy model; expected one of {['toy:' + k for k in TOY_MODELS]} "
                             "(built locally), a local directory or a hub name")
    return name


def model_path_problem(name: Optional[str], key: str) -> Optional[str]:
    """Why ``name`` cannot be a model (or tokenizer) for ``from_pretrained``, as far as the file system tells before
    anything loads, else None. A name that is there must be a directory; a name that is not there can only be a hub
    name (``name`` or ``namespace/name``, huggingface_hub's rule), so anything else (an absolute path, ``./``,
    ``../``, ``~/``, more than one ``/``) is a local path that does not exist. Whether a hub name exists, or is in
    the cache under ``HF_HUB_OFFLINE=1``, is known only when it loads; ``toy:`` names are `check_toy_model`'s.

        >>> model_path_problem("Skywork/Skywork-Reward-V2-Qwen3-0.6B", "k") is None
        True
        >>> model_path_problem("/no/such/rm", "env.reward_model.model_name")[:74]
        "env.reward_model.model_name='/no/such/rm': no such directory (a local path"
    """
    if name is None or name.startswith("toy:") or os.path.isdir(name):
        return None
    if os.path.exists(name):
        return (f"{key}={name!r}: a file, not a directory (a model is a from_pretrained directory: config.json and "
                "its weights)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
        return None  # a hub name: checked when it loads
    except HFValidationError:
        tilde = "; ~ is not expanded: give the whole path" if name.startswith("~") else ""
        return f"{key}={name!r}: no such directory (a local path; a hub name is 'name' or 'namespace/name'{tilde})"
