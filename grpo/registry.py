"""Advantage estimators by name: the fork point of the advantages phase, importable without torch.

An estimator is a function of keyword arguments that returns advantages ``[B]`` (broadcast over the
tokens) or ``[B, T]``::

    from grpo.advantages import register_estimator, grpo_advantages

    @register_estimator("my_rloo")
    def my_rloo(*, group_ids, rewards, valid_mask, token_mask, cfg, **extra):
        return grpo_advantages(group_ids, rewards, valid_mask, leave_one_out=True, normalize_rewards=False)

``group_ids`` ``[B]``, ``rewards`` ``[B]`` (after penalties, scaling, shaping), ``valid_mask`` ``[B]``,
``token_mask`` ``[B, T]``, ``cfg``: the ``grpo.adv_estimator`` config; ``extra`` holds
``reward_components`` (``[B, K]`` or None), ``kl_bt`` (the reward KL or None), ``kl_coef``, ``sample_mask``,
``prev_logprobs`` / ``teacher_logprobs`` / ``generation_logprobs`` (``[B, T]`` or None) and ``master_cfg`` (the run's whole config: a fork's own sections, `grpo.config.load.build_config`). Select it
with ``grpo.adv_estimator.name=my_rloo``: the config's name is checked against this registry when the
config loads (before any model), so register before calling the script's ``main()``.

The built-in estimators are named here and imported from `grpo.advantages` on first use, so checking a
name never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# name -> the estimator, or "module:attribute" of a built-in one not imported yet.
_ESTIMATORS: dict[str, Callable | str] = {
    "grpo": "grpo.advantages:grpo_estimator",
    "gdpo": "grpo.advantages:gdpo_estimator",
    "reinforce_plus_plus": "grpo.advantages:reinforce_plus_plus_estimator",
    "opd": "grpo.advantages:opd_estimator",
}


# name -> whether it needs a group of samples per prompt (a per-prompt baseline: one sample per prompt gives
# every advantage 0), as a bool or a function of the ``grpo.adv_estimator`` config. Unlisted: needs one.
_NEEDS_GROUP: dict[str, bool | Callable] = {
    "grpo": True,
    "gdpo": True,
    "reinforce_plus_plus": lambda cfg: cfg.minus_baseline,  # a global baseline only with minus_baseline=false
    "opd": False,  # a teacher per token, no baseline
}


def register_estimator(name: str, needs_group: bool | Callable = True) -> Callable[[Callable], Callable]:
    """Decorator: make ``fn`` the advantage estimator called ``name`` (replacing one of that name).
    ``needs_group``: whether it compares the samples of a prompt with each other (a per-prompt baseline), so
    that ``grpo.num_generations_per_prompt=1`` is refused at config load; a bool, or a function of the
    ``grpo.adv_estimator`` config."""

    def add(fn: Callable) -> Callable:
        _ESTIMATORS[name] = fn
        _NEEDS_GROUP[name] = needs_group
        return fn

    return add


def needs_group(name: str, cfg=None) -> bool:
    """Whether the estimator ``name`` needs several samples per prompt, with the ``grpo.adv_estimator`` config
    ``cfg`` (default: it does).

        >>> needs_group("grpo"), needs_group("my_fork_estimator")
        (True, True)
    """
    rule = _NEEDS_GROUP.get(name, True)
    return bool(rule(cfg) if callable(rule) else rule)


def estimator_names() -> list[str]:
    """Every registered name, sorted.

        >>> estimator_names()[:3]
        ['gdpo', 'grpo', 'opd']
    """
    return sorted(_ESTIMATORS)


def get_estimator(name: str) -> Callable:
    """The estimator called ``name``; a ValueError lists the registered names."""
    if name not in _ESTIMATORS:
        raise ValueError(f"grpo.adv_estimator.name={name!r}: expected one of {estimator_names()} "
                         "(register more with grpo.advantages.register_estimator)")
    fn = _ESTIMATORS[name]
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        fn = _ESTIMATORS[name] = getattr(importlib.import_module(module), attr)
    return fn
