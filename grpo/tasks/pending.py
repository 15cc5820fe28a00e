"""Scores still to compute: what a sample carries from its environment's step to the rollout's deferred scoring
point (`grpo.system.deferred`), where a scorer that must run for all ranks' samples together (a ZeRO-3 reward
model, whose every forward is a collective) adds them to the rewards.

An environment whose scorer is deferred leaves a `PendingScore` per score in the sample's metadata (under
`PENDING`) and reward 0 for now; the scorer's `score_pending` pops them and folds each score in with `add_score`.
A combined environment (`grpo.tasks.combined`) keeps its parts' rewards under `OWN_REWARDS`, which a pending score
fills in for its part.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.tasks.failures import Failure, reward_problem

# The metadata key under which a sample's pending reward-model scores wait for the rollout's collective point.
PENDING = "reward_model_pending"
# The metadata key under which a combined environment (grpo.tasks.combined) keeps each of its parts' reward of the
# sample, for the parts' own metrics; a pending score fills its part's in.
OWN_REWARDS = "combined_rewards"


@dataclass
class PendingScore:
    """A reward-model score still to compute: ``model`` (the scorer's ``index``) over ``token_ids``. When scored as s,
    the sample's reward grows by ``weight`` * s; with ``component``, its reward component of that name grows by s
    (a combined environment's GDPO component); with ``own``, the combined environment's record of its parts'
    rewards (`OWN_REWARDS`) gets s under that name.

    The sum of the parts is what the combined environment would have computed with the score in hand:
    Σ_k w_k · r_k with r_rm = s (`grpo.tasks.combined.combine`)."""

    model: int
    token_ids: list[int]
    weight: float = 1.0
    component: str | None = None
    own: str | None = None


def add_score(t, p: PendingScore, score: float) -> str | None:
    """Fold the score of pending ``p`` into trajectory ``t`` (`grpo.trajectory.Trajectory`): reward += weight *
    score; its component (if named) += score; its combined environment's record of its parts (if named) = score.
    A score that is no reward (NaN or inf out of the model, `grpo.tasks.failures.reward_problem`) fails the sample
    instead (``env_malformed``; masked, counted), as an environment's NaN reward does; returns why, else None.

        >>> from grpo.trajectory import Trajectory
        >>> t = Trajectory(0, 0, "t", "q", "a", [], {"combined_rewards": {"math": 1.0, "rm": 0.0}}, reward=1.0,
        ...                reward_components={"math": 1.0, "rm": 0.0})
        >>> add_score(t, PendingScore(0, [5, 6], component="rm", own="rm"), 0.5)
        >>> t.reward, t.reward_components, t.metadata
        (1.5, {'math': 1.0, 'rm': 0.5}, {'combined_rewards': {'math': 1.0, 'rm': 0.5}})
        >>> add_score(t, PendingScore(0, [5, 6]), float("nan")), t.failure.reason, t.reward
        ("the reward model's score is nan: expected a finite number", 'env_malformed', None)
    """
    if not t.scored:  # failed already (by another reward model's score): nothing to add to
        return None
    problem = reward_problem(score, "the reward model's score") or reward_problem(t.reward + p.weight * score,
                                                                                 "the sample's reward with it")
    if problem is not None:
        t.fail(Failure.of("env_malformed", problem))
        return problem
    t.reward += p.weight * score
    if p.component is not None:
        t.reward_components = {**(t.reward_components or {}),
                               p.component: (t.reward_components or {}).get(p.component, 0.0) + score}
    if p.own is not None:
        t.metadata.setdefault(OWN_REWARDS, {})[p.own] = score
    return None
