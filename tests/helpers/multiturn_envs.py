"""Environments the end-to-end tests load by name (env.name=class, env.env_class=tests.helpers.multiturn_envs:...)."""

from __future__ import annotations

import re

import torch

from grpo.tasks.interface import Environment, EnvironmentReturn


class HintThenCheck(Environment):
    """Two turns: the first answer gets a hint ("=<answer>"), the second is scored (1 if its first integer is
    the answer) and ends the sample. ``mask_every``: mask the samples of every that-many-th question (by its
    first digit), to exercise mask_sample through the loop."""

    def __init__(self, hint: str = "=", mask_every: int = 0):
        self.hint, self.mask_every = hint, mask_every

    def step(self, message_logs, metadata):
        obs, rewards, done, meta = [], [], [], []
        for log, md in zip(message_logs, metadata):
            turns = sum(m["role"] == "assistant" for m in log)
            if turns == 1:
                obs.append({"role": "user", "content": f"{self.hint}{md['answer']} "})
                rewards.append(0.0)
                done.append(False)
            else:
                found = re.search(r"-?\d+", log[-1]["content"])
                obs.append({"role": "user", "content": ""})
                rewards.append(float(found is not None and found.group() == md["answer"]))
                done.append(True)
            first = int(re.search(r"\d", md["question"]).group())
            meta.append({**md, "mask_sample": bool(self.mask_every) and first % self.mask_every == 0})
        n = len(message_logs)
        return EnvironmentReturn(obs, meta, [None] * n, torch.tensor(rewards), torch.tensor(done), [None] * n)


class FailsOnBoom(Environment):
    """Single-turn arithmetic scoring whose whole rollout batch fails (``global_post_process_and_metrics``
    raises) when one of its questions is "boom": a generation failure on demand for the async loop's tests."""

    def step(self, message_logs, metadata):
        rewards = [float(re.search(r"-?\d+", log[-1]["content"] or "x") is not None
                         and re.search(r"-?\d+", log[-1]["content"]).group() == md["answer"])
                   for log, md in zip(message_logs, metadata)]
        n = len(message_logs)
        return EnvironmentReturn([{"role": "user", "content": ""}] * n, list(metadata), [None] * n,
                                 torch.tensor(rewards), torch.ones(n, dtype=torch.bool), [None] * n)

    def global_post_process_and_metrics(self, batch):  # NeMo-RL's batch (grpo.tasks.router.rollout_batch)
        if any(md["question"] == "boom" for md in batch["extra_env_info"]):
            raise RuntimeError("boom in this prompt batch")
        return batch, {}
