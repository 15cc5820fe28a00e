"""The typed data of a rollout: `Message`, `Trajectory` (one sample: a conversation and what the environments
made of it), `Rollout` (a scored prompt batch) and why a sample failed (`REASONS`, `Failure`). A leaf: it imports
nothing of grpo, so every layer reads the same types (the rollout loop in `grpo.system.rollout` makes them, the
environments' hooks, the batch builder, the replay deque, the dumps and the agents read them). The rules that
classify an exception as a failure and retry it are `grpo.tasks.failures`'.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

INFRA, DATA = "infra", "data"

# reason -> the class it has when nothing more is known (None: it depends on the exception,
# `grpo.tasks.failures.classify_exception`).
REASONS: dict[str, str | None] = {
    "env_error": None,        # the environment's step raised
    "env_timeout": INFRA,     # the environment's step ran past env.step_timeout_s
    "env_malformed": DATA,    # the environment returned something check_return refuses
    "reward_error": None,     # the reward function raised
    "reward_timeout": INFRA,  # the reward function ran past env.timeout_s
    "http_5xx": INFRA,        # a server answered 5xx
    "http_408": INFRA,        # request timeout
    "http_429": INFRA,        # too many requests
    "http_4xx": DATA,         # any other 4xx: the request itself is wrong, another try answers the same
    "connection": INFRA,      # no answer: refused, reset, DNS, TLS
}


@dataclass(frozen=True)
class Failure:
    """One failed attempt: its ``reason`` (a key of `REASONS`), its ``kind`` (``"infra"`` / ``"data"``) and the
    ``detail`` a person reads (a traceback or a message, its last 4000 characters).

        >>> Failure.of("env_timeout", "no return within 5 s").kind
        'infra'
    """

    reason: str
    kind: str
    detail: str = ""

    @classmethod
    def of(cls, reason: str, detail: str = "", kind: str | None = None) -> Failure:
        """A failure of ``reason``, its class ``kind`` or the reason's default (data where it has none)."""
        if reason not in REASONS:
            raise ValueError(f"failure reason {reason!r}: expected one of {sorted(REASONS)}")
        kind = kind or REASONS[reason] or DATA
        if kind not in (INFRA, DATA):
            raise ValueError(f"failure kind {kind!r}: expected {INFRA!r} or {DATA!r}")
        return cls(reason, kind, str(detail)[-4000:])


@dataclass
class Message:
    """One message of a conversation. ``generation_logprobs`` is set exactly on assistant messages the
    policy generated in this rollout: those are the trained ones (prompt-history assistant messages are
    context). ``flags``: names raised on the message (``invalid_tool_call``, ``malformed_thinking``)."""

    role: str
    content: str
    token_ids: list[int]
    generation_logprobs: list[float] | None = None
    flags: list[str] = field(default_factory=list)

    @property
    def trained(self) -> bool:
        return self.generation_logprobs is not None


@dataclass
class Trajectory:
    """One sample: a conversation and what the environment made of it.

    ``group_id``: position of its prompt in the prompt batch (the G samples of a prompt share it);
    ``prompt_index``: the dataset row; ``reward``: sum of the turns' rewards; ``reward_components``:
    named components (GDPO), summed over turns, or None; ``finish_reason`` of the last generated turn;
    ``truncated``: a turn hit its length cap or the conversation ran out of room; ``generation_version``:
    the oldest weight version that generated one of its turns (async GRPO); ``mask_sample``: the
    environment asked to keep it out of the loss; ``failure``: None, or why the sample failed after its retries
    (a `Failure`: reason, kind, detail). A sample is *scored* (`scored`) exactly when it did not fail; a failed
    sample has ``reward`` None and no components (`fail`): it is masked out of the loss and out of its group's
    baseline, never scored 0 (``grpo.batch.TrainBatch.scored_b`` is this, per row); ``retries``: environment calls
    retried for it, successful retries included;
    ``terminated``: the environment ended it (``terminateds``); ``max_turns_reached``: ``max_rollout_turns`` ended
    it while the environment had not (NeMo-RL's rollout metrics count both: `grpo.rollout_metrics`);
    ``stop_strings``: the data row's stop strings for the first turn (`row_stop_strings`), or None.
    """

    group_id: int
    prompt_index: int
    task_name: str
    question: str
    answer: str
    messages: list[Message]
    metadata: dict
    reward: float | None = 0.0  # None exactly when failed (`fail`)
    reward_components: dict[str, float] | None = None
    finish_reason: str = "stop"
    truncated: bool = False
    turns: int = 0
    generation_version: int = 0
    mask_sample: bool = False
    failure: Failure | None = None
    retries: int = 0
    done: bool = False
    num_prompt_messages: int = 0
    terminated: bool = False
    max_turns_reached: bool = False
    stop_strings: list[str] | None = None
    media: dict | None = None  # its images as the model's tensors (grpo.system.vision), shared by its prompt group
    # a row with images: its prompt messages' content with the image values (`grpo.tasks.rows.PromptRow`), what an
    # agent is shown; shared by its prompt group, never in `to_dict` (a stored sample has been played)
    prompt_parts: list | None = None
    # the sample's further training rows, each a whole row's messages like ``messages`` (its first): an agent whose
    # calls rewrote the history (`grpo.wings.agents.branches`); its reward and advantage apply to each, counted once
    branches: list[list[Message]] = field(default_factory=list)

    def __post_init__(self):
        if self.failure is not None:  # a failed sample has no reward, whatever it was built with
            self.reward, self.reward_components = None, None
        elif self.reward is None:
            raise ValueError(f"trajectory of prompt {self.prompt_index}: reward None without a failure (a sample "
                             "has no reward exactly when it failed: Trajectory.fail)")

    @property
    def scored(self) -> bool:
        """The sample has a reward: it did not fail (every "is this sample trained / counted" reads this)."""
        return self.failure is None

    @property
    def observation_tokens(self) -> int:
        """Tokens the environments added (observations), prompt excluded."""
        return sum(len(m.token_ids) for m in self.messages[self.num_prompt_messages:] if not m.trained)

    def token_ids(self) -> list[int]:
        """The conversation's tokens: every message's, in order."""
        return [t for m in self.messages for t in m.token_ids]

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated for the sample, in all its rows (``messages`` and ``branches``)."""
        return sum(len(m.token_ids) for row in (self.messages, *self.branches) for m in row if m.trained)

    def completion_text(self) -> str:
        """The generated assistant messages' text, joined (a single-turn sample's completion)."""
        return "".join(m.content for m in self.messages if m.trained)

    def completion_ids(self) -> list[int]:
        return [t for m in self.messages if m.trained for t in m.token_ids]

    def fail(self, failure: Failure) -> None:
        """End this sample as failed: its `Failure`; no reward (None), neither this turn's nor the earlier turns'
        (the trainer masks it, `grpo.tasks.failures`)."""
        self.failure = failure
        self.reward, self.reward_components, self.done = None, None, True

    def to_dict(self) -> dict:
        """Plain python (checkpoints load it with ``torch.load(weights_only=True)``). ``media`` stays the same dict
        (never copied): the samples of a prompt group keep sharing one, so a replay group or a checkpoint holds a
        prompt's images once (``torch.save`` writes an object referenced several times once and loads it shared);
        ``failure`` as a dict. ``prompt_parts`` is left out (`from_dict` gives None; the stored form is the one it
        always had): the sample has been played, and a PIL image in it would not load with ``weights_only``."""
        d = asdict(replace(self, media=None, prompt_parts=None))
        del d["prompt_parts"]
        return {**d, "media": self.media}

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        """The inverse of `to_dict`; also reads the format before `Failure` was kept whole (flat ``error``,
        ``failure_kind``, ``error_detail`` keys and a failed sample's ``reward`` 0.0: now its failure, reward None).

            >>> old = {**Trajectory(0, 0, "t", "q", "a", [], {}).to_dict(), "error": "http_5xx",
            ...        "failure_kind": "infra", "error_detail": "503"}
            >>> del old["failure"]
            >>> t = Trajectory.from_dict(old)
            >>> t.failure, t.reward, t.scored
            (Failure(reason='http_5xx', kind='infra', detail='503'), None, False)
        """
        d = dict(d)
        reason, kind, detail = d.pop("error", None), d.pop("failure_kind", None), d.pop("error_detail", None)
        failure = d.get("failure")
        if failure is None and reason is not None:
            failure = {"reason": reason, "kind": kind or REASONS.get(reason) or DATA, "detail": detail or ""}
        if failure is not None:
            d["failure"], d["reward"] = Failure(**failure), None
        branches = [[Message(**m) for m in row] for row in d.get("branches", ())]
        return cls(**{**d, "messages": [Message(**m) for m in d["messages"]], "branches": branches})


# What a tensor of rewards holds for a sample that is not scored (its reward is None): a number only because a tensor
# needs one; every statistic reads such a tensor under the scored mask (`grpo.batch.TrainBatch.scored_b`).
UNSCORED_REWARD = 0.0


def filled_rewards(trajectories) -> list[float]:
    """Each sample's reward, `UNSCORED_REWARD` for one that is not scored: the one place a missing reward becomes a
    number (the training batch, the environments' batch and validation build their reward tensors with it).

        >>> ok, failed = Trajectory(0, 0, "t", "q", "a", [], {}, reward=1.0), Trajectory(0, 0, "t", "q", "a", [], {})
        >>> failed.fail(Failure.of("env_timeout"))
        >>> filled_rewards([ok, failed]), [ok.scored, failed.scored]
        ([1.0, 0.0], [True, False])
    """
    return [float(t.reward) if t.scored else UNSCORED_REWARD for t in trajectories]


def filled_components(trajectories, names) -> list[list[float]]:
    """Per sample, its reward components ``names`` (0.0 for one it has not got), all `UNSCORED_REWARD` for a sample
    that is not scored (its components are None, `Trajectory.fail`), as `filled_rewards`."""
    return [[float((t.reward_components or {}).get(k, 0.0)) if t.scored else UNSCORED_REWARD for k in names]
            for t in trajectories]


@dataclass
class Rollout:
    """A scored rollout of one prompt batch, the same on every rank. ``timing``: seconds per phase
    (``generate_s``, ``env_step_s``); ``metrics``: environments' own (``env/<task>/<name>``)."""

    trajectories: list[Trajectory]
    timing: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


