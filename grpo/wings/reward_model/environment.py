"""A reward model as an environment: NeMo-RL's ``env.reward_model`` (``RewardModelEnvironment``, a Bradley-Terry
sequence classifier that scores the whole conversation).

Each conversation is rendered as NeMo-RL's ``RewardModelEnvironment.preprocess_data`` renders it
(``get_formatted_message_log`` with ``add_bos_token=True, add_eos_token=True, add_generation_prompt=False``,
nemo_rl/data/llm_message_utils.py at 7ea279a): with the *reward model's* tokenizer and chat template, message by
message (message i's text is what rendering messages[: i + 1] adds to rendering messages[: i]; each piece is
tokenised alone, without special tokens), the tokenizer's BOS put in front when the text does not start with it,
its EOS appended when the last message (trailing newlines aside) does not end with it. The reward is the
classifier's head logit over those tokens (NeMo-RL's ``score``: ``logits.squeeze(-1)`` in float32), computed in
batches of ``batch_size`` conversations.

Running the model is not this module's business (it knows nothing of devices, DeepSpeed or ranks): it gets a
*scorer*, an object with ``tokenizer`` (the reward model's) and ``score(token_ids: list[list[int]]) -> [B]
float32 tensor`` (one batch); `grpo.wings.reward_model.scorer` builds it. A conversation longer than ``max_model_len``
tokens is not cut (that would score another text): the sample fails (``env_malformed``, retried, then masked;
`grpo.tasks.failures`), and counted; NeMo-RL has no such bound in its scoring path.

Deferred scoring. A scorer with ``deferred = True`` (a ZeRO-3 engine sharded over the ranks, whose every forward is a
collective) is not run in `RewardModelEnvironment.step`, which runs per rank, in a worker thread, retried per sample:
the step checks and renders each conversation and leaves a `PendingScore` in the sample's metadata (under
`PENDING`), reward 0 for now; the rollout scores every rank's pending samples together at one collective point
after its conversations end (`grpo.wings.reward_model.scorer.RewardModels.score_pending`, at `grpo.system.deferred`'s
point), adding the score to the reward (`grpo.tasks.pending`).

`global_post_process_and_metrics` gives what NeMo-RL computes there: ``reward_model_env/{num_samples,
mean_reward, std_reward, min_reward, max_reward}``, over the samples that did not fail (logged here as
``train/env/<task>/reward_model_env/...``; NeMo-RL's loop drops these metrics).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

from grpo.tasks.failures import Failure
from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.tasks.pending import PENDING, PendingScore

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


class Scorer(Protocol):
    """What scores one batch of rendered conversations (`scorer.RewardModelScorer`). ``deferred``
    (optional, False when absent): scores are computed at the rollout's collective point, not in `score` calls from
    the environment; ``index``: the scorer's number in the run (which model a `PendingScore` needs); ``on_device()``
    (optional): a context around a scoring pass (an offloaded model on the device inside)."""

    tokenizer: PreTrainedTokenizerBase

    def score(self, token_ids: list[list[int]]) -> torch.Tensor: ...


def first_difference(a: str, b: str) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one is a prefix of the other):
    NeMo-RL's ``get_first_index_that_differs``.

        >>> first_difference("<s>user: hi</s>", "<s>user: hi</s><s>bot: yo</s>"), first_difference("ab", "ax")
        (15, 1)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def render_conversation(tokenizer, messages: list[dict]) -> list[int]:
    """The reward model's tokens of a conversation, as NeMo-RL renders it for its reward model (module docstring).

    Only ``role`` and ``content`` of each message are rendered (what a chat template reads)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    ids: list[int] = []
    previous = ""
    for i in range(len(messages)):
        text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, add_generation_prompt=False)
        chunk = text[first_difference(previous, text):]
        previous = text
        if i == 0:
            if tokenizer.bos_token is None:
                warnings.warn("the reward model's tokenizer has no BOS token: none is added (as in NeMo-RL)")
            elif not chunk.startswith(tokenizer.bos_token):
                chunk = tokenizer.bos_token + chunk
        if i == len(messages) - 1 and tokenizer.eos_token is not None and \
                not chunk.rstrip("\n").endswith(tokenizer.eos_token):
            chunk += tokenizer.eos_token
        ids += tokenizer(chunk, add_special_tokens=False)["input_ids"]
    return ids


def batches(n: int, size: int) -> list[range]:
    """Index ranges of ``n`` items in batches of ``size``.

        >>> [list(r) for r in batches(5, 2)]
        [[0, 1], [2, 3], [4]]
    """
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class RewardModelEnvironment(Environment):
    """One turn: every sample's conversation scored by the reward model, every sample terminated. Metadata is
    kept (NeMo-RL returns None, which its rollout reads as "keep")."""

    reward_kind = "scalar"

    def __init__(self, scorer: Scorer, batch_size: int, max_model_len: int | None = None):
        self.scorer = scorer
        self.batch_size = batch_size
        self.max_model_len = max_model_len

    def render(self, message_logs: list[list[dict]]) -> list[list[int]]:
        return [render_conversation(self.scorer.tokenizer, log) for log in message_logs]

    def step(self, message_logs: list, metadata: list) -> EnvironmentReturn:
        import torch

        n = len(message_logs)
        ids = self.render(message_logs)
        failures: list[Failure | None] = [None] * n
        if self.max_model_len is not None:
            for b, x in enumerate(ids):
                if len(x) > self.max_model_len:
                    failures[b] = Failure.of("env_malformed", f"the conversation is {len(x)} tokens under the reward "
                                             f"model's template, over env.reward_model.max_model_len="
                                             f"{self.max_model_len}: not scored (a cut text would score another one)")
        scored = [b for b in range(n) if failures[b] is None]
        rewards_b = torch.zeros(n, dtype=torch.float32)
        if getattr(self.scorer, "deferred", False):  # scored at the rollout's collective point (module docstring)
            out_meta = [{**(md or {}), PENDING: [PendingScore(self.scorer.index, ids[b])]} if failures[b] is None
                        else None for b, md in enumerate(metadata)]
            return self._return(message_logs, rewards_b, failures, out_meta)
        with getattr(self.scorer, "on_device", nullcontext)():  # an offloaded copy comes to the device to score
            for r in batches(len(scored), self.batch_size):
                idx = [scored[i] for i in r]
                scores = torch.as_tensor(self.scorer.score([ids[b] for b in idx]), dtype=torch.float32).reshape(-1)
                rewards_b[idx] = scores.cpu()
        return self._return(message_logs, rewards_b, failures, [None] * n)

    @staticmethod
    def _return(message_logs: list, rewards_b, failures: list, metadata: list) -> EnvironmentReturn:
        import torch

        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Environment: {float(r)}"} for r in rewards_b],
            metadata=metadata, next_stop_strings=[None] * n, rewards=rewards_b,
            terminateds=torch.ones(n, dtype=torch.bool), answers=[log[-1]["content"] for log in message_logs],
            failures=failures)

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict]:
        """NeMo-RL's ``reward_model_env/*`` over the samples that did not fail (a failed sample's reward is a
        placeholder, not a score)."""
        import torch

        trajectories = batch.get("trajectories") or []
        rewards = batch["rewards"]
        keep = torch.tensor([t.scored for t in trajectories], dtype=torch.bool) if trajectories else \
            torch.ones(len(rewards), dtype=torch.bool)
        r = rewards[keep]
        metrics: dict[str, float] = {"reward_model_env/num_samples": float(len(r))}
        if len(r):
            metrics.update({"reward_model_env/mean_reward": float(r.mean()),
                            "reward_model_env/std_reward": float(r.std()) if len(r) > 1 else 0.0,
                            "reward_model_env/min_reward": float(r.min()),
                            "reward_model_env/max_reward": float(r.max())})
        return batch, metrics

    def shutdown(self) -> None:
        close = getattr(self.scorer, "close", None)
        if close is not None:
            close()
