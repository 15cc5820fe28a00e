"""The environment interface: NeMo-RL's, so a NeMo-RL environment ports by changing its imports.

A rollout is a conversation. After every assistant turn the rollout loop calls the sample's environment
with the conversation so far and the sample's metadata; the environment answers with one observation
message per sample, a reward for the turn, whether the episode ended, and new metadata::

    class GuessTheNumber(Environment):
        def step(self, message_logs, metadata):
            guesses = [log[-1]["content"] for log in message_logs]     # the assistant's last message
            ...
            return EnvironmentReturn(observations=[{"role": "user", "content": "higher"}, ...],
                                     metadata=[...], next_stop_strings=[None, ...],
                                     rewards=torch.tensor([0.0, ...]), terminateds=torch.tensor([False, ...]),
                                     answers=[None, ...])

``message_logs[b]`` is sample b's conversation as ``[{"role": ..., "content": ...}, ...]``, ending with the
assistant message just generated. ``metadata[b]`` is whatever the environment returned for b last turn
(first turn: the dataset row's ``{"question", "answer", "meta", "task_name"}``); a sample whose returned
metadata is None keeps its previous metadata (NeMo-RL's rollout). `step` gets copies of the conversations and
metadata (as a NeMo-RL environment, a Ray actor, gets them serialised): return what changed, an in-place
change is not kept. Rewards of all turns add up to the sample's reward. A single-turn task is an environment that terminates every sample at once.

How an observation becomes tokens is ``env.observation_format`` (`grpo.system.chat`): for ``env.name: class``
environments, NeMo-RL's way by default: the content alone, as tokens (NeMo-RL's environments answer with
role ``environment`` and write their own turn markup: with Qwen's template, an observation that should read as
a user turn carries the ``<|im_start|>user`` ... ``<|im_end|>`` and the next ``<|im_start|>assistant`` header
itself); the built-ins render theirs with the chat template.

A data row's ``stop_strings`` column (a list of strings; NeMo-RL's ``DatumSpec.stop_strings``) stops the
sample's first turn, beside the environment's own ``stop_strings`` attribute; ``next_stop_strings`` set the next.

The rewards of the run's environments are all ``[B]`` tensors or all dicts of them: an environment of each
kind in one run stops it (NeMo-RL asserts the same), naming both: at load when both kinds are known then (the
built-in reward environments are scalar; a class may say ``reward_kind = "dict"`` or ``"scalar"``), else at
the first step that returns the second kind.

Per-sample flags an environment may put in ``metadata[b]`` (a dict):

- ``mask_sample: True``: the sample leaves the loss (NeMo-RL's ``_apply_mask_sample_filter``) and, with
  ``env.should_mask_flagged_samples`` (default true), its group's baseline too, as a failed sample does;
  counted in ``train/num_mask_sample_filtered``;
- ``invalid_tool_call: True`` / ``malformed_thinking: True``: flag the assistant message just answered,
  so ``grpo.invalid_tool_call_advantage`` / ``grpo.malformed_thinking_advantage`` overwrite the advantage
  of its tokens.

``rewards`` may also be a dict of ``[B]`` tensors (named reward components, GDPO); the scalar reward is
then their sum.

When something other than the policy's output breaks (`grpo.tasks.failures`): a call that raises, runs past
``env.step_timeout_s`` or returns what `check_return` refuses fails for all its samples, and the router
(`grpo.tasks.router.Environments`) retries it within ``grpo.rollout_failure``'s budgets. An environment that
can tell that only some samples of a call failed (a reward function that raised on one completion, an HTTP
request that got a 503 for one sample) says so per sample, in ``EnvironmentReturn.failures``::

    failures=[None, Failure.of("http_5xx", "503 from the judge"), None]     # grpo.trajectory.Failure

The router calls `step` again on those samples alone, with the same conversations and metadata (never new
generations), and keeps the others' results. A sample that still fails is masked (out of the loss and out of
its group's baseline), never scored: its other fields in the return are placeholders nobody reads (any valid
value: an empty observation, reward 0.0, its metadata). What the policy wrote (a wrong answer, a malformed tool
call) is never a failure: score it, flag it, penalise it.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from grpo.tasks.failures import reward_problem
from grpo.tasks.rows import content_problem
from grpo.trajectory import Failure

if TYPE_CHECKING:  # torch is imported where it is used: reward worker processes import this package
    import torch

MetadataT = TypeVar("MetadataT")
MessageLog = list[dict[str, Any]]

# Flags an environment's metadata may carry for the assistant message it just answered.
MESSAGE_FLAGS = ("invalid_tool_call", "malformed_thinking")


class EnvironmentReturn(NamedTuple, Generic[MetadataT]):
    """What `Environment.step` returns; every field has one entry per sample of the call.

    observations:       one message per sample, ``{"role": "environment" | "tool" | "user", "content": str}``,
                        or a list of messages (e.g. one ``tool`` message per call; a grpo-ds extension);
                        ignored for samples that terminate. For a vision-language policy the content may be a
                        list of parts as a data row's (``{"type": "text", "text": str}``, ``{"type": "image",
                        "image": <path | data: URL | bytes | PIL image>}``): the images join the sample's
                        (`grpo.system.rollout`; docs/vlm.md)
    metadata:           the sample's metadata for its next turn (and the flags above); None: keep the last
    next_stop_strings:  per sample, the stop strings of its next turn (None: the config's)
    rewards:            ``[B]`` reward of this turn (or a dict of named ``[B]`` components)
    terminateds:        ``[B]`` bool: the episode ended this turn
    answers:            per sample, the answer the environment extracted (for logs), or None
    failures:           grpo-ds: per sample, a `grpo.trajectory.Failure` when that sample failed for a reason
                        outside the policy (retried, then masked; see the module docstring), else None;
                        None (the default, NeMo-RL's six fields): no sample failed
    """

    observations: list[dict[str, Any] | list[dict[str, Any]]]
    metadata: list[MetadataT]
    next_stop_strings: list[list[str] | None] | list[None]
    rewards: torch.Tensor | dict[str, torch.Tensor]
    terminateds: torch.Tensor
    answers: list[str | None] | None
    failures: list[Failure | None] | None = None


class Environment(abc.ABC, Generic[MetadataT]):
    """Base class of environments (NeMo-RL's ``EnvironmentInterface``); only `step` is required."""

    @abc.abstractmethod
    def step(self, message_logs: list[MessageLog], metadata: list[MetadataT]) -> EnvironmentReturn[MetadataT]:
        """One turn for a batch of samples; see the module docstring."""

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict]:
        """After a whole rollout batch: metrics of this environment's samples (logged as
        ``train/env/<task>/<name>``), from ``batch``, a dict with NeMo-RL's rollout keys
        (`grpo.tasks.router.rollout_batch` lists them). Returns ``(batch, metrics)``; of the returned batch only
        ``batch["trajectories"]`` (grpo-ds's `grpo.trajectory.Trajectory` objects, one per sample) is read
        back: an environment may replace them there. Default: unchanged, no metrics."""
        return batch, {}

    def shutdown(self) -> None:
        """Release workers, sandboxes, connections. Called once at the end of the run."""


# NeMo-RL's name, for environments ported from it.
EnvironmentInterface = Environment


def check_return(ret: Any, n: int) -> EnvironmentReturn:
    """Validate an environment's return for a call with ``n`` samples; raises ValueError naming the field.

    Normalises what NeMo-RL allows: ``next_stop_strings`` / ``answers`` may be None (all None); rewards and
    terminateds may be lists; a plain tuple of NeMo-RL's six fields has no ``failures``. Each observation
    becomes a list of messages; rewards become float32, terminateds bool; ``failures`` becomes one entry per sample
    (None: did not fail). A reward (or component) that is no reward (`grpo.tasks.failures.reward_problem`: NaN, inf,
    1e300 that float32 makes inf) fails its sample alone (``env_malformed``, retried, then masked), as a failure the
    environment reported would; the call's other samples keep their rewards.

        >>> r = check_return(EnvironmentReturn([{"role": "user", "content": "hi"}], [{}], None, [1.0], [True], None), 1)
        >>> r.observations, r.rewards, r.terminateds, r.next_stop_strings, r.failures
        ([[{'role': 'user', 'content': 'hi'}]], tensor([1.]), tensor([True]), [None], [None])
    """
    import torch

    if not isinstance(ret, tuple) or len(ret) not in (6, 7):
        raise ValueError(f"step returned {type(ret).__name__}, expected an EnvironmentReturn (6 fields, or 7 with "
                         "failures)")
    observations, metadata, stops, rewards, terminateds, answers = ret[:6]
    failures = ret[6] if len(ret) == 7 else None
    stops = [None] * n if stops is None else list(stops)
    answers = [None] * n if answers is None else list(answers)
    failures = [None] * n if failures is None else list(failures)
    for i, f in enumerate(failures):
        if f is not None and not isinstance(f, Failure):
            raise ValueError(f"EnvironmentReturn.failures[{i}]={f!r}: expected None or a grpo.trajectory.Failure "
                             "(Failure.of(reason, detail))")
    for name, value in (("observations", observations), ("metadata", metadata), ("next_stop_strings", stops),
                        ("answers", answers), ("failures", failures)):
        if len(value) != n:
            raise ValueError(f"EnvironmentReturn.{name} has {len(value)} entries for {n} samples")
    observations = [list(obs) if isinstance(obs, (list, tuple)) else [obs] for obs in observations]
    for i, messages in enumerate(observations):
        for obs in messages:
            if not isinstance(obs, dict) or "role" not in obs or content_problem(obs.get("content", None)) is not None:
                raise ValueError(f"EnvironmentReturn.observations[{i}]={str(obs)[:200]}: expected {{'role': ..., "
                                 "'content': str or a list of text / image parts}} or a list of them")
    for i, s in enumerate(stops):
        if s is not None and (not isinstance(s, (list, tuple)) or not all(isinstance(x, str) for x in s)):
            raise ValueError(f"EnvironmentReturn.next_stop_strings[{i}]={s!r}: expected a list of strings or None")

    def as_rewards(value, what: str) -> torch.Tensor:
        """``[n]`` float32; a sample whose value is no reward (`reward_problem`) fails, its placeholder 0."""
        t = torch.as_tensor(value, dtype=torch.float64).reshape(-1)  # as given: 1e300 is still 1e300 here
        if t.numel() != n:
            raise ValueError(f"EnvironmentReturn.{what} has {t.numel()} values for {n} samples")
        for b, x in enumerate(t.tolist()):
            problem = reward_problem(x, f"EnvironmentReturn.{what}[{b}]")
            if problem is not None:
                failures[b] = failures[b] or Failure.of("env_malformed", problem)
                t[b] = 0.0
        return t.to(torch.float32)

    if isinstance(rewards, dict):
        rewards = {str(k): as_rewards(v, f"rewards[{k!r}]") for k, v in rewards.items()}
    else:
        rewards = as_rewards(rewards, "rewards")
    term = torch.as_tensor(terminateds).reshape(-1).bool()
    if term.numel() != n:
        raise ValueError(f"EnvironmentReturn.terminateds has {term.numel()} values for {n} samples")
    return EnvironmentReturn(list(observations), list(metadata), stops, rewards, term, answers, failures)
