"""Agent samples (``env.name: agent``): played by the user's agent over the endpoint, turned into trajectories from
the tokens the endpoint recorded.

`AgentPlayer.play` gives each sample its own key (`grpo.system.generation.endpoint.Endpoint.open_session`, seeded by the
sample's seed key), opens the endpoint for generation, runs the agents (`grpo.tasks.agent.AgentEnvironment.run`),
then builds each trajectory from its calls (`trajectory_messages`): NeMo-RL's NeMo-Gym path
(``nemo_rl/environments/nemo_gym.py``): call k's prompt must begin with everything seen so far (the earlier calls'
prompts and generations); its new prompt tokens become an untrained ``user`` message, its generated tokens a
trained ``assistant`` message with their logprobs. So the trainer scores exactly the tokens the model produced,
in the context it produced them in, never a re-templated text.

A sample whose calls are not contiguous (the agent rewrote or cut its history, or used ``n > 1``) is kept as its
contiguous head and masked (``mask_sample``; ``metadata["agent_noncontiguous"]``, counted as
``env/<task>/noncontiguous_samples``): NeMo-RL asserts instead. A sample that made no call, or whose agent failed,
fails (`grpo.tasks.failures`: ``Trajectory.error``, masked by the step, never scored 0).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from grpo.trajectory import Failure, Message
from grpo.tasks.agent import AgentEnvironment, agent_row
from grpo.tasks.nemo_gym import NemoGymEnvironment
from grpo.system.nemo_gym_rollout import play_gym


def trajectory_messages(records, decode) -> tuple[list, bool]:
    """``(messages, contiguous)``: the `grpo.trajectory.Message` list of a sample's calls (module docstring),
    up to the first call that does not continue the ones before it; ``contiguous`` is False when there was one.

        >>> from grpo.system.generation.endpoint import CallRecord
        >>> calls = [CallRecord([1, 2], [3, 4], [-.1, -.2], "stop", 0), CallRecord([1, 2, 3, 4, 5], [6], [-.3], "stop", 0)]
        >>> msgs, ok = trajectory_messages(calls, decode=str)
        >>> [(m.role, m.token_ids, m.trained) for m in msgs], ok
        ([('user', [1, 2], False), ('assistant', [3, 4], True), ('user', [5], False), ('assistant', [6], True)], True)
        >>> trajectory_messages(calls[::-1], decode=str)[1]
        False
    """
    seen: list[int] = []
    messages = []
    for rec in records:
        if rec.prompt_token_ids[:len(seen)] != seen:
            return messages, False
        new = rec.prompt_token_ids[len(seen):]
        messages.append(Message("user", decode(new), list(new)))
        messages.append(Message("assistant", decode(rec.generation_token_ids), list(rec.generation_token_ids),
                                list(rec.generation_log_probs)))
        seen = list(rec.prompt_token_ids) + list(rec.generation_token_ids)
    return messages, True


def oldest_version(records) -> int:
    """A sample's generation version: the OLDEST weight version among its calls (``CallRecord.weight_version``), so
    the async loop's staleness bound (``grpo.async_grpo.max_trajectory_age_steps``, age = step - 1 - version) holds
    for every token it trains, as a multi-turn sample of its own is aged by its oldest turn.

        >>> from grpo.system.generation.endpoint import CallRecord
        >>> oldest_version([CallRecord([1], [2], [-.1], "stop", v) for v in (4, 3, 5)])
        3
    """
    return min(r.weight_version for r in records)


def fill_trajectory(t, records, outcome, decode) -> None:
    """Sample ``t`` (a `grpo.trajectory.Trajectory`) from its agent's ``outcome`` and its recorded calls."""
    failure = outcome.failure
    if failure is None and not records:
        failure = Failure.of("env_malformed", "the agent made no call to the model (nothing to train on)")
    messages, contiguous = trajectory_messages(records, decode)
    if messages:
        t.messages, t.num_prompt_messages = messages, 1
    t.turns = len(records)
    if records:
        t.finish_reason = records[-1].finish_reason
        t.truncated = any(r.finish_reason == "length" for r in records)
        t.generation_version = oldest_version(records)
    t.done = t.terminated = True
    if failure is not None:
        t.error, t.error_detail, t.failure_kind = failure.reason, failure.detail, failure.kind
        t.reward, t.reward_components = 0.0, None
        return
    t.reward, t.reward_components = outcome.reward, outcome.reward_components
    t.mask_sample = outcome.mask_sample or not contiguous
    if not contiguous:
        t.metadata = {**(t.metadata or {}), "agent_noncontiguous": True}


def agent_tasks(envs) -> set[str]:
    """The task names of ``envs`` (a `grpo.tasks.router.Environments`) whose samples are played over the endpoint:
    an agent's, or NeMo-Gym's agent servers' (`grpo.system.nemo_gym_rollout`)."""
    return {task for task, env in getattr(envs, "envs", {}).items()
            if isinstance(env, (AgentEnvironment, NemoGymEnvironment))}


class AgentPlayer:
    """The agent samples' side of a rollout over the run's ``endpoint`` (`grpo.system.generation.endpoint`)."""

    def __init__(self, endpoint):
        self.endpoint = endpoint

    def tasks(self, envs) -> set[str]:
        return agent_tasks(envs)

    @contextmanager
    def sharing(self, generator, weight_version: int | None = None):
        """A generation window for the rollout's own samples: the endpoint is open for outside requests (served
        between the rollout's batches, `Endpoint.shared`), so they are answered while the run generates.
        ``weight_version``: the version of the weights the endpoint serves (None: the one it has)."""
        with self.endpoint.serving(weight_version):
            yield self.endpoint.shared(generator)

    def load_weights(self, load) -> int:
        """The async loop's weight change of the served backend (`Endpoint.load_weights`): ``load()`` runs while no
        batch generates; returns the version it loaded."""
        return self.endpoint.load_weights(load)

    def play(self, trajs: list, seed_keys: list[tuple], envs, weight_version: int | None = None) -> float:
        """Play the agent samples ``trajs`` (in place); returns the seconds taken. ``weight_version``: the version of
        the weights the endpoint serves (None: the one it has); each sample is aged by its oldest call's
        (`oldest_version`)."""
        endpoint = self.endpoint
        t0 = time.perf_counter()
        by_task: dict[str, list[int]] = {}
        for i, t in enumerate(trajs):
            by_task.setdefault(t.task_name, []).append(i)
        decode = endpoint.tokenizer.decode
        for task, idx in by_task.items():
            env = envs.envs[task]
            if isinstance(env, NemoGymEnvironment):
                play_gym(env, [trajs[i] for i in idx], [seed_keys[i] for i in idx], endpoint, envs.retry,
                         endpoint.weight_version if weight_version is None else weight_version)
                continue
            keys = [endpoint.open_session(":".join(str(p) for p in seed_keys[i])) for i in idx]
            rows = [agent_row(trajs[i].question, trajs[i].answer, trajs[i].metadata.get("meta", {}), task,
                              [{"role": m.role, "content": m.content} for m in trajs[i].messages],
                              endpoint.sampling("val" if "val" in seed_keys[i] else "train")) for i in idx]
            try:
                with endpoint.serving(weight_version):
                    outcomes = env.run(rows, endpoint.base_url, keys, endpoint.model_name)
            finally:
                records = [endpoint.close_session(k) for k in keys]
            for i, outcome, recs in zip(idx, outcomes, records):
                fill_trajectory(trajs[i], recs, outcome, decode)
        return time.perf_counter() - t0
