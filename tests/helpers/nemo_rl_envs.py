"""Environments written to NeMo-RL's interface as NeMo-RL's own are (nemo_rl/environments/games/sliding_puzzle.py):
role "environment", the observation's content carries its own turn text, metadata None on later turns (NeMo-RL
keeps the last), None when the episode ends, ``global_post_process_and_metrics(batch) -> (batch, metrics)``
reading NeMo-RL's batch keys. Porting one to grpo-ds changes its imports only:

    from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn   # NeMo-RL
    from grpo.tasks.interface import EnvironmentInterface, EnvironmentReturn              # grpo-ds

Loaded by the tests with ``env.name=class env.env_class=tests.helpers.nemo_rl_envs:<Class>``.
"""

from __future__ import annotations

import re
from typing import Any, Optional, TypedDict

import torch

from grpo.tasks.interface import EnvironmentInterface, EnvironmentReturn


class HintMetadata(TypedDict):
    answer: str
    hints_given: int


class HintEnvironment(EnvironmentInterface[Optional[HintMetadata]]):
    """Three turns at most: after the first answer the environment tells the answer (``hint``, with the answer
    formatted in); after the second it says nothing new (metadata None: NeMo-RL keeps the last); a turn whose first
    integer is the answer ends the episode with reward 1. ``seen``: the metadata each step received."""

    def __init__(self, hint: str = "={answer} ", again: str = "again ", stop_strings: Optional[list[str]] = None):
        self.hint, self.again, self.next_stops = hint, again, stop_strings
        self.seen: list[list[Any]] = []

    def step(self, message_log_batch: list[list[dict[str, str]]],
             metadata: list[Optional[HintMetadata]]) -> EnvironmentReturn[Optional[HintMetadata]]:
        self.seen.append([None if m is None else dict(m) for m in metadata])
        observations, next_metadata, next_stops, rewards, terminateds, answers = [], [], [], [], [], []
        for log, meta in zip(message_log_batch, metadata):
            answer = str(meta["answer"])
            hints = meta.get("hints_given", 0)
            found = re.search(r"-?\d+", log[-1]["content"]) if log[-1]["role"] == "assistant" else None
            if found is not None and found.group() == answer:
                observations.append({"role": "environment", "content": "yes"})
                next_metadata.append(None)  # NeMo-RL's environments clear their metadata on termination
                rewards.append(1.0)
                terminateds.append(True)
            elif hints == 0:
                observations.append({"role": "environment", "content": self.hint.format(answer=answer)})
                next_metadata.append({"answer": answer, "hints_given": 1})
                rewards.append(0.0)
                terminateds.append(False)
            else:
                observations.append({"role": "environment", "content": self.again})
                next_metadata.append(None)  # nothing changed: keep the metadata (NeMo-RL's rollout does)
                rewards.append(0.0)
                terminateds.append(False)
            next_stops.append(self.next_stops)
            answers.append(found.group() if found else None)
        return EnvironmentReturn(observations=observations, metadata=next_metadata, next_stop_strings=next_stops,
                                 rewards=torch.tensor(rewards, dtype=torch.float32),
                                 terminateds=torch.tensor(terminateds, dtype=torch.bool), answers=answers)

    def shutdown(self) -> None:
        pass

    def global_post_process_and_metrics(self, batch) -> tuple[Any, dict]:
        # As sliding_puzzle.py's and math_environment.py's: NeMo-RL's batch keys.
        final_rewards = batch.get("total_reward", torch.tensor([0.0] * len(batch["idx"])))
        return batch, {"success_rate": (final_rewards == 1.0).float().mean().item(),
                       "fraction_of_samples_properly_ended": batch["is_end"].float().mean().item(),
                       "num_problems_in_batch": batch["is_end"].shape[0]}


class DictRewards(EnvironmentInterface):
    """One turn; rewards as a dict of named components (NeMo-RL's multi-reward environments)."""

    def step(self, message_log_batch, metadata):
        n = len(message_log_batch)
        return EnvironmentReturn([{"role": "environment", "content": ""}] * n, [None] * n, [None] * n,
                                 {"reward/correctness": torch.ones(n), "reward/format": torch.zeros(n)},
                                 torch.ones(n, dtype=torch.bool), [None] * n)

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class DeclaredDictRewards(DictRewards):
    """DictRewards that says so before its first step (a grpo-ds extension: mixed kinds fail at load)."""

    reward_kind = "dict"
