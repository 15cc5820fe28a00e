"""Advantage estimators by name: the fork point of phase 7, importable without torch.

An estimator is a function of keyword arguments that returns advantages ``[B]`` (broadcast over the
tokens) or ``[B, T]``::

    from grpo.advantages import register_estimator, grpo_advantages

    @register_estimator("my_rloo")
    def my_rloo(*, group_ids, rewards, valid_mask, token_mask, cfg, **extra):
        return grpo_advantages(group_ids, rewards, valid_mask, leave_one_out=True, normalize_rewards=False)

``group_ids`` ``[B]``, ``rewards`` ``[B]`` (after penalties, scaling, shaping), ``valid_mask`` ``[B]``,
``token_mask`` ``[B, T]``, ``cfg``: the ``grpo.adv_estimator`` config; ``extra`` holds
``reward_components`` (``[B, K]`` or None), ``kl_bt`` (the reward KL or None) and ``kl_coef``. Select it
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
}


def register_estimator(name: str) -> Callable[[Callable], Callable]:
    """Decorator: make ``fn`` the advantage estimator called ``name`` (replacing one of that name)."""

    def add(fn: Callable) -> Callable:
        _ESTIMATORS[name] = fn
        return fn

    return add


def estimator_names() -> list[str]:
    """Every registered name, sorted.

        >>> estimator_names()[:3]
        ['gdpo', 'grpo', 'reinforce_plus_plus']
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
