"""Agent samples (``env.name: agent``): played by the user's agent over the endpoint, turned into trajectories from
the tokens the endpoint recorded.

`AgentPlayer.play` opens the endpoint for generation and plays each task's samples (`play_agents`): every attempt
of a sample gets a key of its own (`grpo.wings.agents.endpoint.Endpoint.open_session`, seeded by the sample's
seed key) and a base URL of its own (`Endpoint.rollout_url`: a harness that sends one key for all its conversations
is still attributed) and runs its agent in a thread of its own (`grpo.wings.agents.environment.AgentEnvironment.start`), which the run
stops waiting for at ``env.agent.timeout_s`` whatever the agent does (`grpo.wings.agents.call`). A failed attempt is
retried within ``grpo.rollout_failure``'s budgets, as the other environments' calls are (`grpo.tasks.failures`).
Then each trajectory is built from its last attempt's calls (`trajectory_messages`): NeMo-RL's NeMo-Gym path
(``nemo_rl/environments/nemo_gym.py``): call k's prompt must begin with everything seen so far (the earlier calls'
prompts and generations); its new prompt tokens become an untrained ``user`` message, its generated tokens a
trained ``assistant`` message with their logprobs. So the trainer scores exactly the tokens the model produced,
in the context it produced them in, never a re-templated text.

A sample whose calls are not contiguous (the agent compacted, rewrote or cut its history, ran a sub-agent, or used
``n > 1``) is trained as a tree: a row per branch (`grpo.wings.agents.branches`, ``Trajectory.branches``), each
generated token trained once, the sample's reward and advantage on each row, the sample counted once in its group
(NeMo-RL asserts instead). Only a sample with images whose calls part is kept as its contiguous head and masked
(``mask_sample``; ``metadata["agent_noncontiguous"]``, counted as ``env/<task>/noncontiguous_samples``). A sample
whose last attempt made no call, or whose agent failed, fails (`grpo.tasks.failures`: ``Trajectory.failure``, masked
by the step, never scored 0).
"""

from __future__ import annotations

import queue
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from grpo.tasks.rows import DataError
from grpo.trajectory import DATA, INFRA, Failure, Message
from grpo.wings.agents.environment import (
    AgentEnvironment, AgentOutcome, agent_messages, agent_row, outcome_of, timed_out,
)
from grpo.wings.agents.branches import branch_messages, grow_branches
from grpo.wings.agents.call import AgentCall
from grpo.tasks.failures import RetryPolicy


def trajectory_messages(records, decode) -> tuple[list, bool]:
    """``(messages, contiguous)``: the `grpo.trajectory.Message` list of a sample's calls (module docstring),
    up to the first call that does not continue the ones before it; ``contiguous`` is False when there was one.

        >>> from grpo.wings.agents.endpoint import CallRecord
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


def trajectory_media(records, used: int) -> dict | None:
    """The images of a trajectory built from the first ``used`` of ``records`` (`trajectory_messages`): its last
    call's (``CallRecord.media``). A call's prompt begins with every earlier call's tokens, so its media hold the
    images of all of them, in the order of their placeholders; None when that call had no image.

        >>> from grpo.wings.agents.endpoint import CallRecord
        >>> calls = [CallRecord([1], [2], [-.1], "stop", 0, {"pixel_values": 1}),
        ...          CallRecord([1, 2, 3], [4], [-.2], "stop", 0)]
        >>> trajectory_media(calls, 1), trajectory_media(calls, 2)
        ({'pixel_values': 1}, None)
    """
    return records[used - 1].media if used else None


def oldest_version(records) -> int:
    """A sample's generation version: the OLDEST weight version among its calls (``CallRecord.weight_version``), so
    the async loop's staleness bound (``grpo.async_grpo.max_trajectory_age_steps``, age = step - 1 - version) holds
    for every token it trains, as a multi-turn sample of its own is aged by its oldest turn.

        >>> from grpo.wings.agents.endpoint import CallRecord
        >>> oldest_version([CallRecord([1], [2], [-.1], "stop", v) for v in (4, 3, 5)])
        3
    """
    return min(r.weight_version for r in records)


ABANDON_GRACE_S = 1.0  # how long abandoned attempts have to end once cancelled before they are interrupted
POLL_S = 0.5  # how often a wait for the agents looks at the run's stop flag


@dataclass
class Played:
    """A sample's last attempt: its agent's outcome, the endpoint's records of that attempt's calls (no other's),
    and the attempts before it (``retries``)."""

    outcome: AgentOutcome
    records: list
    retries: int = 0


@dataclass(eq=False)
class _Sample:
    index: int
    seed_key: str
    failed: Counter = field(default_factory=Counter)  # failed attempts by class (infra / data)
    retries: int = 0
    not_before: float = 0.0  # a retry's backoff
    played: Played | None = None
    key: str = ""
    deadline: float = 0.0


def attempt_failure(outcome: AgentOutcome, records: list) -> Failure | None:
    """The failure of an attempt: its agent's, or ``env_malformed`` when it made no call (nothing to train on)."""
    if outcome.failure is None and not records:
        return Failure.of("env_malformed", "the agent made no call to the model (nothing to train on)")
    return outcome.failure


def play_agents(env: AgentEnvironment, rows: list[dict], seed_keys: list[str], endpoint, retry: RetryPolicy,
                stop_requested=lambda: False) -> list[Played]:
    """Play ``rows`` (one per sample) with ``env``'s agent over ``endpoint`` (open for generation): the `Played`
    of each, in order. At most ``env.max_concurrency`` attempts run at once, each abandoned at ``env.timeout_s``
    (``env_timeout``).

    An attempt's calls are recorded under a key of its own, closed when it ends or is abandoned: what an abandoned
    agent sends later is refused (401) and a call it had in flight is never read, so a trajectory is made of one
    attempt's calls, never two. Every attempt of a sample is seeded by its seed key: a retry draws what the failed
    attempt drew (the same weights give the same tokens), so a retried sample is the sample a first attempt that
    did not fail would have been. A failed attempt (`attempt_failure`) is retried while ``retry``'s budget for its
    class lasts (`grpo.tasks.failures.RetryPolicy`: infra after its backoff, data at once) and no stop was
    requested (``stop_requested()``, the run's stop signal: the samples keep the failures they have, so a stop
    waits for the attempts running, no longer than ``env.timeout_s``)."""
    samples = [_Sample(i, k) for i, k in enumerate(seed_keys)]
    waiting: deque[_Sample] = deque(samples)  # not started yet, or failed and waiting for their retry
    running: dict[AgentCall, _Sample] = {}
    ended: queue.SimpleQueue[AgentCall] = queue.SimpleQueue()
    abandoned: list[AgentCall] = []

    def finish(s: _Sample, outcome: AgentOutcome) -> None:
        s.played = Played(outcome, list(endpoint.close_session(s.key)), s.retries)
        failure = attempt_failure(outcome, s.played.records)
        if failure is None:
            return
        s.failed[failure.kind] += 1
        if retry.may_retry(failure.kind, s.failed[failure.kind]) and not stop_requested():
            s.retries += 1
            s.not_before = time.monotonic() + (retry.backoff_s(s.failed[INFRA]) if failure.kind == INFRA else 0.0)
            waiting.append(s)

    try:
        while waiting or running:
            now = time.monotonic()
            if stop_requested():  # no more retries; first attempts still run
                waiting = deque(s for s in waiting if s.played is None)
            for s in [s for s in waiting if s.not_before <= now][:env.max_concurrency - len(running)]:
                waiting.remove(s)
                s.key = endpoint.open_session(s.seed_key)
                s.deadline = now + env.timeout_s
                running[env.start(rows[s.index], endpoint.rollout_url(s.key), s.key, endpoint.model_name,
                                  ended.put)] = s
            wake = [now + POLL_S] + [s.deadline for s in running.values()]
            if len(running) < env.max_concurrency:
                wake += [s.not_before for s in waiting]
            for call in _ended(ended, max(0.0, min(wake) - time.monotonic())):
                if call in running:  # (an abandoned attempt that ended later is not)
                    finish(running.pop(call), outcome_of(call))
            now = time.monotonic()
            for call in [c for c, s in running.items() if s.deadline <= now]:
                call.abandon()
                abandoned.append(call)
                finish(running.pop(call), timed_out(env.timeout_s))
    except BaseException:  # Ctrl-C, a bug: no attempt keeps running, no key stays open
        for call, s in running.items():
            call.abandon()
            endpoint.close_session(s.key)
        raise
    finally:
        _settle(abandoned)
    return [s.played for s in samples]


def _ended(ended: queue.SimpleQueue, timeout: float) -> list[AgentCall]:
    """The attempts that end within ``timeout`` seconds: the first, and those queued with it."""
    calls = []
    try:
        calls.append(ended.get(timeout=timeout))
        while True:
            calls.append(ended.get_nowait())
    except queue.Empty:
        pass
    return calls


def _settle(abandoned: list[AgentCall]) -> None:
    """Give the abandoned attempts `ABANDON_GRACE_S` in all to end once cancelled, then interrupt those still running
    (`grpo.wings.agents.call.AgentCall.interrupt`: one spinning in Python code must not burn the trainer's CPU)."""
    until = time.monotonic() + ABANDON_GRACE_S
    for call in abandoned:
        if not call.join(max(0.0, until - time.monotonic())):
            call.interrupt()


def prompts_shown(trajs: list) -> list:
    """Each sample's prompt as its agent gets it (`grpo.wings.agents.environment.agent_messages`), made once per
    prompt group (its samples share their ``prompt_parts``: a picture is encoded once), or the `Failure` of a sample
    whose picture cannot be read (``env_error``, data)."""
    made: dict[int, list | Failure] = {}
    out = []
    for t in trajs:
        key = id(t.prompt_parts) if t.prompt_parts is not None else id(t)
        if key not in made:
            try:
                made[key] = agent_messages([{"role": m.role, "content": m.content} for m in t.messages],
                                           t.prompt_parts, f"prompt {t.prompt_index}")
            except DataError as err:
                made[key] = Failure.of("env_error", str(err), kind=DATA)
        out.append(made[key])
    return out


def fill_trajectory(t, played: Played, decode, fork_threshold_tokens: int = 0) -> None:
    """Sample ``t`` (a `grpo.trajectory.Trajectory`) from its last attempt (`Played`): its calls' branches
    (`grpo.wings.agents.branches.grow_branches`), the first as ``t.messages``, the others as ``t.branches``, each a
    training row. A sample with images whose calls part is kept as its contiguous head and masked, as all were before
    branches (a branch row would need images of its own)."""
    records, outcome = played.records, played.outcome
    failure = attempt_failure(outcome, records)
    branches = grow_branches(records, fork_threshold_tokens) if records else []
    contiguous = True
    if len(branches) > 1 and any(r.media is not None for r in records):
        messages, contiguous = trajectory_messages(records, decode)
        t.media = trajectory_media(records, len(messages) // 2)
        branches = []
    elif branches:
        messages = branch_messages(branches[0], decode)
        t.media = trajectory_media(records, len(records)) if len(branches) == 1 else None
        t.branches = [branch_messages(b, decode) for b in branches[1:]]
        t.metadata = {**(t.metadata or {}), "agent_branches": len(branches),
                      "agent_realigned_tokens": sum(b.realigned_tokens for b in branches)}
    else:
        messages = []
    if messages:
        t.messages, t.num_prompt_messages = messages, 1
    t.turns, t.retries = len(records), played.retries
    if records:
        t.finish_reason = records[-1].finish_reason
        t.truncated = any(r.finish_reason == "length" for r in records)
        t.generation_version = oldest_version(records)
    t.done = t.terminated = True
    if failure is not None:
        t.fail(failure)
        t.branches = []  # a failed sample trains nothing: no row more than its first (kept for the dumps)
        return
    t.reward, t.reward_components = outcome.reward, outcome.reward_components
    t.mask_sample = outcome.mask_sample or not contiguous
    if not contiguous:
        t.metadata = {**(t.metadata or {}), "agent_noncontiguous": True}


# Environment classes whose samples another wing plays over the endpoint, and how: class -> play(env, trajs,
# seed_keys, endpoint, retry, weight_version) (register_endpoint_game; NeMo-Gym's agent servers: grpo.wings.gym).
_GAMES: dict[type, Callable] = {}


def register_endpoint_game(env_cls: type, play: Callable) -> None:
    """Have the samples of ``env_cls`` environments played over the endpoint by ``play`` (a wing calls it)."""
    _GAMES[env_cls] = play


def agent_tasks(envs) -> set[str]:
    """The task names of ``envs`` (a `grpo.tasks.router.Environments`) whose samples are played over the endpoint:
    an agent's, or a registered game's (`register_endpoint_game`: NeMo-Gym's agent servers)."""
    return {task for task, env in getattr(envs, "envs", {}).items()
            if isinstance(env, (AgentEnvironment, *_GAMES))}


class AgentPlayer:
    """The agent samples' side of a rollout over the run's ``endpoint`` (`grpo.wings.agents.endpoint`).
    ``stop_requested``: the run's stop flag (`grpo.system.signals.StopRequest.requested`; None: never): once it is
    set, failed agent samples are not retried."""

    def __init__(self, endpoint, stop_requested=None):
        self.endpoint = endpoint
        self.stop_requested = stop_requested or (lambda: False)

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

    def hold_version(self, version: int) -> None:
        """The generation ranks loaded ``version`` mid-request: the batch in flight keeps recording the version it
        started with (the oldest), what the endpoint's next answers record."""
        self.endpoint.weight_version = version

    def play(self, trajs: list, seed_keys: list[tuple], envs, weight_version: int | None = None) -> float:
        """Play the agent samples ``trajs`` (in place; `play_agents`, within ``envs.retry``'s budgets); returns the
        seconds taken. ``weight_version``: the version of the weights the endpoint serves (None: the one it has);
        each sample is aged by its oldest call's (`oldest_version`)."""
        endpoint = self.endpoint
        t0 = time.perf_counter()
        by_task: dict[str, list[int]] = {}
        for i, t in enumerate(trajs):
            by_task.setdefault(t.task_name, []).append(i)
        decode = endpoint.tokenizer.decode
        for task, idx in by_task.items():
            env = envs.envs[task]
            game = next((play for cls, play in _GAMES.items() if isinstance(env, cls)), None)
            if game is not None:
                game(env, [trajs[i] for i in idx], [seed_keys[i] for i in idx], endpoint, envs.retry,
                     endpoint.weight_version if weight_version is None else weight_version)
                continue
            ready = []
            for i, shown in zip(idx, prompts_shown([trajs[i] for i in idx])):
                if isinstance(shown, Failure):  # its picture cannot be shown: the sample fails, not the run
                    trajs[i].fail(shown)
                else:
                    ready.append((i, shown))
            if not ready:
                continue
            idx = [i for i, _ in ready]
            rows = [agent_row(trajs[i].question, trajs[i].answer, trajs[i].metadata.get("meta", {}), task, shown,
                              endpoint.sampling("val" if "val" in seed_keys[i] else "train")) for i, shown in ready]
            with endpoint.serving(weight_version):
                played = play_agents(env, rows, [":".join(str(p) for p in seed_keys[i]) for i in idx], endpoint,
                                     envs.retry, self.stop_requested)
            for i, p in zip(idx, played):
                fill_trajectory(trajs[i], p, decode, env.fork_threshold_tokens)
        return time.perf_counter() - t0
