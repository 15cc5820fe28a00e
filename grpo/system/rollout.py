"""Rollouts: conversations between the policy and its environments, as typed trajectories.

A prompt batch of P rows becomes P x G `Trajectory` objects (G = generations per prompt), each a message
log that starts with the row's prompt messages. `run_conversations` then alternates, for up to
``grpo.max_rollout_turns`` turns, one batched generation over the still-active samples with one
environment step per environment; a single-turn task is an environment that ends every sample after the
first turn, so every rollout takes this one code path. NeMo-RL's ``run_multi_turn_rollout`` is the model.

    prompt messages -> [assistant turn -> environment step -> observation]* -> reward, done

Token in, token out: an assistant message holds exactly the generated token ids and their generation
logprobs; observations are tokenised by `grpo.system.chat.ChatFormat`, appended at the end: their content alone
(NeMo-RL's way) or rendered by the chat template, as the environment's ``observation_format`` says
(`grpo.tasks.router.Environments.observation_format`). A sample ends when
its environment says so, when it has used ``max_rollout_turns`` turns, when the next turn would not fit
``policy.max_total_sequence_length`` (then it counts as truncated), or when a fork's turn-level stopping rule
says so (`TurnSettings.stop`: ``setup(..., turn_stop=my_rule)`` in a copy of a training script).

Data parallelism: every rank runs the conversations of its contiguous share of the samples
(`rank_slice`), then `generate_rollout` gathers them, so every rank holds the whole rollout.
Sampling seeds are keyed per sample and turn (`sample_seed`): a completion does not depend on which rank
generated it, nor on the other samples of its batch.
"""

from __future__ import annotations

import hashlib
import logging
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from grpo.trajectory import Failure, Message, Rollout, Trajectory
from grpo.tasks.interface import MESSAGE_FLAGS
from grpo.system.chat import ChatFormatError
from grpo.tasks.rows import DataError, PromptRow
from grpo.batch import rank_slice
from grpo.system.dist import all_gather_objects
from grpo.config import Sampling
from grpo.system.generation.base import chunk_slices
from grpo.system.media import concat_media
from grpo.system.vision import (
    content_text, cut_observation, encode_observation, has_images, observation_raw_text, template_messages,
)

logger = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """Generation or an environment broke on some rank (every rank raises it together)."""


# --------------------------------------------------------------------------------------------------
# Seeds, shares, gathers
# --------------------------------------------------------------------------------------------------
def sample_seed(base_seed: int, step: int, sample_index: int, stream: str = "train", turn: int = 0) -> int:
    """A 63-bit seed for one turn of one sample: hash(base_seed, stream, step, sample_index[, turn]).

    Generation randomness keyed per sample makes a completion independent of batch composition,
    world size and resume: the same (seed, step, index, turn) always samples the same tokens.
    """
    key = f"{base_seed}:{stream}:{step}:{sample_index}" + (f":{turn}" if turn else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def row_stop_strings(row: PromptRow) -> list[str] | None:
    """A data row's ``stop_strings`` (NeMo-RL's ``DatumSpec.stop_strings``, read by its rollout for the first
    turn): a top-level key of the row, or a column of a file row (which lands in ``meta``); None without one.

        >>> row = PromptRow(0, "q", "a", "t", [], [], meta={"stop_strings": ["</action>"]})
        >>> row_stop_strings(row), row_stop_strings(PromptRow(0, "q", "a", "t", [], []))
        (['</action>'], None)
    """
    value = row.extra.get("stop_strings", (row.meta or {}).get("stop_strings"))
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{row.source or f'row {row.index}'}: stop_strings={value!r}: expected a list of strings "
                         "or null")
    return list(value)


def new_trajectories(prompts: list[PromptRow], num_generations: int) -> list[Trajectory]:
    """``num_generations`` fresh trajectories per prompt row (`grpo.tasks.rows.PromptRow`), consecutively, group
    ids 0..P-1. The environments' metadata of a sample is ``{"question", "answer", "meta", "task_name"}``; its
    first turn's stop strings are the row's (`row_stop_strings`)."""
    out = []
    for group_id, row in enumerate(prompts):
        stop_strings = row_stop_strings(row)
        for _ in range(num_generations):
            messages = [Message(m["role"], m["content"], list(m["token_ids"])) for m in row.prompt_messages]
            metadata = {"question": row.question, "answer": row.answer, "meta": row.meta or {},
                        "task_name": row.task_name}
            out.append(Trajectory(group_id=group_id, prompt_index=int(row.index), task_name=row.task_name,
                                  question=row.question, answer=row.answer, messages=messages,
                                  metadata=metadata, num_prompt_messages=len(messages),
                                  stop_strings=None if stop_strings is None else list(stop_strings),
                                  media=row.media,  # the row's images, stored once for the group
                                  prompt_parts=row.prompt_parts))
    return out


def single_turn(outputs: list) -> list[Trajectory]:
    """Trajectories of plain generation outputs (`grpo.system.generation.base.GenerationOutput`): the prompt as one
    user message, the completion as one generated assistant message; sample i is its own group."""
    return [Trajectory(i, i, "", "", "", [Message("user", "", list(o.prompt_ids)),
                                          Message("assistant", o.text, list(o.completion_ids), list(o.logprobs))],
                       {}, finish_reason=o.finish_reason, truncated=o.finish_reason == "length", turns=1,
                       num_prompt_messages=1) for i, o in enumerate(outputs)]


# --------------------------------------------------------------------------------------------------
# The conversation loop (one rank's share)
# --------------------------------------------------------------------------------------------------
@dataclass
class TurnSettings:
    """What `run_conversations` needs from the config: ``grpo.max_rollout_turns``,
    ``policy.max_total_sequence_length``, ``policy.generation_batch_size`` (prompts per generate call).

    ``stop``: a turn-level stopping rule, the fork point of multi-turn rollouts (None: none). Called with a
    sample after each environment step that left it going (not done, not failed, turns left); True ends the
    sample there, as running out of turns does (no observation appended, its reward so far kept)::

        def stop_when_answered(t: Trajectory) -> bool:        # in a copy of train_grpo.py
            return "ANSWER:" in t.messages[-1].content
        run = setup(argv, DEFAULT_CONFIG, asynchronous=False, description=__doc__, turn_stop=stop_when_answered)

    Samples that the run's player plays (`grpo.system.players`) end as it says. ``sampling``: the profile every
    `generate` call of the rollout samples with (`grpo.config.Sampling`; None: the backend's own, training's)."""

    max_turns: int
    max_total_len: int
    chunk_size: int
    greedy: bool = False
    max_new_tokens: int | None = None
    stop: Callable[[Trajectory], bool] | None = None
    sampling: Sampling | None = None


def _room(traj: Trajectory, settings: TurnSettings) -> int:
    return settings.max_total_len - len(traj.token_ids())


def run_conversations(trajs: list[Trajectory], seed_keys: list[tuple], generator, envs, chat, settings: TurnSettings,
                      weights=None) -> dict[str, float]:
    """Play every trajectory of this rank to its end, in place; returns seconds per phase.

    Per turn: one `generator.generate` call per chunk of ``settings.chunk_size`` active samples (seed of
    sample i at turn k: ``sample_seed(*seed_keys[i], turn=k)``), then one `envs.step` per task for the
    samples of that task. ``weights``: the async loop's weight source; ``weights.load_newest()`` runs before
    each chunk (a safe point for new weights) and returns the version the chunk is generated with.

    The first turn stops at the data row's stop strings and its environment's (`first_stop_strings`), a
    later one at what the environment returned for it (``next_stop_strings``; None: the config's).
    """
    timing = {"generate_s": 0.0, "env_step_s": 0.0}
    stops = {i: first_stop_strings(t, envs) for i, t in enumerate(trajs)}
    for turn in range(settings.max_turns):
        active = [i for i, t in enumerate(trajs) if not t.done]
        for i in active:  # no room for even one new token: the conversation is over
            if _room(trajs[i], settings) <= 0:
                trajs[i].done, trajs[i].truncated = True, True
        active = [i for i in active if not trajs[i].done]
        # A tensor-parallel vLLM group generates in lockstep: every rank makes as many calls as the busiest.
        n_most = generator.lockstep_max(len(active))
        if n_most == 0:
            break
        t0 = time.perf_counter()
        for sl in chunk_slices(len(active), n_most, settings.chunk_size):
            chunk = active[sl]
            version = weights.load_newest() if weights is not None else 0
            caps = [min(settings.max_new_tokens or 10**9, _room(trajs[i], settings)) for i in chunk]
            media = [trajs[i].media for i in chunk]  # images go only to a backend that takes them (hf)
            outputs = generator.generate([trajs[i].token_ids() for i in chunk],
                                         [sample_seed(*seed_keys[i], turn=turn) for i in chunk],
                                         greedy=settings.greedy, max_new_tokens=caps,
                                         stop_strings=[stops.get(i) for i in chunk], sampling=settings.sampling,
                                         **({"media": media} if any(m is not None for m in media) else {}))
            if len(outputs) != len(chunk):  # never a shorter batch (NeMo-RL RL#2305: silent empty epochs)
                raise RolloutError(f"generation returned {len(outputs)} outputs for {len(chunk)} prompts")
            for i, out in zip(chunk, outputs):
                t = trajs[i]
                t.messages.append(Message("assistant", out.text, list(out.completion_ids), list(out.logprobs)))
                t.turns += 1
                t.finish_reason = out.finish_reason
                t.truncated = t.truncated or out.finish_reason == "length"
                t.generation_version = version if t.turns == 1 else min(t.generation_version, version)
        timing["generate_s"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        for task, idx in _by_task(trajs, active).items():
            ret, retries = envs.step(task, [_log(trajs[i]) for i in idx], [trajs[i].metadata for i in idx])
            for j, i in enumerate(idx):
                t = trajs[i]
                t.retries += retries[j]
                if ret.failures[j] is not None:  # still failed after its retries: it ends here, unscored
                    t.fail(ret.failures[j])
                    continue
                _apply_step(t, ret, j)
                if t.done:
                    continue
                if settings.stop is not None and settings.stop(t):  # the fork's rule ends it here
                    t.done = True
                    continue
                if turn == settings.max_turns - 1:
                    t.done = t.max_turns_reached = True  # out of turns: no observation is appended
                    continue
                new = ret.observations[j]
                try:
                    ids, media = _observation_ids(t, new, envs, chat)
                except DataError as err:  # an image the policy cannot take: this sample fails, named, not the run
                    t.fail(Failure.of("env_malformed", str(err)))
                    continue
                room = _room(t, settings)
                if len(ids) >= room:  # the observation (and a next turn) does not fit: cut it, end the sample
                    ids, media = cut_observation(ids, room, _image_token_id(chat)), None
                    t.done, t.truncated = True, True
                if media is not None:  # the observation's pictures follow the sample's earlier ones (a new dict:
                    t.media = media if t.media is None else concat_media([t.media, media])  # the group shares its)
                # Several observation messages (one per tool call) share one token run: it goes to the first.
                t.messages += [Message(m["role"], content_text(m["content"]), ids if k == 0 else [])
                               for k, m in enumerate(new)]
                stops[i] = ret.next_stop_strings[j]
        timing["env_step_s"] += time.perf_counter() - t0
    for t in trajs:
        t.done = True
    return timing


def first_stop_strings(t: Trajectory, envs) -> list[str] | None:
    """The data row's stop strings and the environment's first-turn ones (`grpo.tasks.router.Environments.
    first_stop_strings`), in that order without repeats; None when neither has any.

        >>> class Envs:
        ...     def first_stop_strings(self, task): return ["</tool_call>"]
        >>> t = Trajectory(0, 0, "t", "q", "a", [], {}, stop_strings=["</action>"])
        >>> first_stop_strings(t, Envs())
        ['</action>', '</tool_call>']
    """
    both = [*(t.stop_strings or []), *(envs.first_stop_strings(t.task_name) or [])]
    return list(dict.fromkeys(both)) or None


def _observation_ids(t: Trajectory, new: list[dict], envs, chat) -> tuple[list[int], dict | None]:
    """The tokens of sample t's observation ``new``: its raw content (NeMo-RL's) or the chat template's
    rendering, per the environment's observation format; a role the template drops stops the run, named. With
    the media of its images (None: none).

    A vision-language policy's processor (``chat.processor``) tokenises the text, an image part rendered as a data
    row's is (`grpo.system.vision.encode_observation`: placeholders expanded once); an image for a text policy, or
    one that cannot be read, is a `DataError` naming the environment (its sample fails, not the run)."""
    fmt = envs.observation_format(t.task_name) if hasattr(envs, "observation_format") else "chat_template"
    where = f"environment {t.task_name!r}'s observation"
    processor = chat.processor  # None: a text policy
    if processor is None and has_images(new):
        raise DataError(f"{where} holds an image but the policy is a text model (no vision_config): an observation "
                        "with images needs a vision-language policy")
    try:
        if processor is None:
            ids = (chat.raw_observation_ids(new) if fmt == "raw" else
                   chat.observation_ids(_log(t), new, t.messages[-1].token_ids))
            return ids, None
        if fmt == "raw" or chat.plain:  # the content as it is (a plain-text chat renders an observation so too)
            text = observation_raw_text(processor, new)
        else:
            text = chat.observation_text(_log(t), template_messages(new), chat.ended_with(t.messages[-1].token_ids))
    except ChatFormatError as err:
        env = getattr(envs, "envs", {}).get(t.task_name)
        raise ChatFormatError(
            f"environment {t.task_name!r} ({type(env).__name__}) with observation_format=chat_template: {err}. Set "
            "observation_format: raw in its env section (NeMo-RL's way: the content as tokens, the environment "
            "writes its own turn markup), or use a chat template that renders that role") from err
    return encode_observation(processor, text, new, where)


def _image_token_id(chat) -> int | None:
    """The image placeholder id of a vision-language policy's processor; None for a text policy."""
    return None if chat.processor is None else chat.processor.image_token_id


def _log(t: Trajectory) -> list[dict]:
    """The conversation as the environment sees it: role / content dicts."""
    return [{"role": m.role, "content": m.content} for m in t.messages]


def _by_task(trajs: list[Trajectory], idx: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in idx:
        out.setdefault(trajs[i].task_name, []).append(i)
    return out


# Metadata keys that describe one turn: read into the trajectory, not passed on to the next turn.
_PER_TURN_KEYS = (*MESSAGE_FLAGS, "reward_components")


def _apply_step(t: Trajectory, ret, j: int) -> None:
    """Fold sample j of an environment's (checked) return into its trajectory."""
    rewards = ret.rewards
    if isinstance(rewards, dict):  # named components (NeMo-RL's multi-reward environments)
        comps = {k: float(v[j]) for k, v in rewards.items()}
        t.reward += sum(comps.values())
        t.reward_components = {k: (t.reward_components or {}).get(k, 0.0) + v for k, v in comps.items()}
    else:
        t.reward += float(rewards[j])
    meta = ret.metadata[j]
    if meta is None:  # NeMo-RL's rollout keeps a sample's metadata when its environment returns None
        meta = t.metadata
    elif isinstance(meta, dict):
        if meta.get("reward_components") is not None:  # a reward function's components beside its scalar reward
            comps = meta["reward_components"]
            t.reward_components = {k: (t.reward_components or {}).get(k, 0.0) + float(v) for k, v in comps.items()}
        t.mask_sample = t.mask_sample or bool(meta.get("mask_sample", False))
        t.messages[-1].flags = [f for f in MESSAGE_FLAGS if meta.get(f)]
        meta = {k: v for k, v in meta.items() if k not in _PER_TURN_KEYS}
    t.metadata = meta
    t.done = t.terminated = bool(ret.terminateds[j])


# Seconds the player took (`grpo.system.players`) and the deferred scoring (`grpo.system.deferred`), in the timing of
# rollouts that had some (named for the first wings that use them: agents, reward models).
OPTIONAL_TIMING = ("agent_s", "reward_model_s")


class FixedWeights:
    """A weight source whose version never changes during the rollout (``weights`` of `generate_rollout`): the
    synchronous loop's (the weights of ``version`` = steps trained), and the async loop's without in-flight
    updates."""

    def __init__(self, version: int):
        self.version = version

    def load_newest(self) -> int:
        return self.version


def _play(trajs, seed_keys, generator, envs, chat, settings, weights, player) -> dict[str, float]:
    """`run_conversations` for the samples of environments stepped here, ``player.play`` for the samples of the tasks
    the run's player plays (`grpo.system.players`). With a player, outside requests generate between the rollout's
    own batches (``player.sharing``). ``weights`` None: a rollout on a backend whose weights the player does not
    version (the async loop's validation copy): it keeps the version it has. Every rank makes the same
    ``weights.load_newest`` calls, whatever its share of the player's samples: with generation ranks each is a
    collective of the trainers."""
    tasks = player.tasks(envs) if player is not None else set()
    played = [i for i, t in enumerate(trajs) if t.task_name in tasks]
    rest = [i for i in range(len(trajs)) if i not in set(played)]
    version = weights.load_newest() if weights is not None and player is not None else None  # the window's
    with player.sharing(generator, version) if player is not None else nullcontext(generator) as shared:
        timing = run_conversations([trajs[i] for i in rest], [seed_keys[i] for i in rest], shared, envs, chat,
                                   settings, weights)
    if player is not None and weights is not None:  # every rank, its samples or none (a trainer that skipped
        version = weights.load_newest()                 # this collective left the others waiting in it for ever)
    if played:
        timing["agent_s"] = player.play([trajs[i] for i in played], [seed_keys[i] for i in played], envs, version)
    return timing


# --------------------------------------------------------------------------------------------------
# A prompt batch across ranks
# --------------------------------------------------------------------------------------------------
def _failed(rank: int, step: int, err: Exception) -> str:
    """Log a rank's rollout failure with its traceback; the line every rank's `RolloutError` will carry."""
    logger.warning("rank %d: rollout of step %d failed:\n%s", rank, step, traceback.format_exc())
    return f"rank {rank}: {type(err).__name__}: {err}"


def generate_rollout(prompts: list[PromptRow], num_generations: int, generator, envs, chat,
                     settings: TurnSettings, *, base_seed: int, step: int, gen_batch: int, stream: str, rank: int,
                     world_size: int, weights=None, group=None, player=None,
                     score_pending: Callable[[list[Trajectory]], float] | None = None) -> Rollout:
    """Every sample of a prompt batch played to its end and scored; the same `Rollout` on every rank.

    Sample i (of P x G) is seeded with ``sample_seed(base_seed, step, gen_batch * P * G + i, stream, turn)``.
    Each rank plays its contiguous share between ``generator.wake_up()`` and ``generator.sleep()`` (vLLM's
    step order; no-ops for hf), runs its environments' ``global_post_process_and_metrics``, then the
    trajectories are gathered over ``group`` (None: the default group). An exception on any rank becomes a
    `RolloutError` on every rank, so no rank is left waiting in a collective; so does a rollout that comes back
    with more or fewer than P x G samples. Samples whose environment failed after its retries are in it, failed
    (``Trajectory.failure``): the trainer masks them. ``player``: the run's `grpo.system.players.Player` (None: none):
    the samples of its tasks are played by it instead of `run_conversations`. ``score_pending``: the deferred scoring point
    (`grpo.system.deferred.DeferredScorers.score_pending`), called once on every rank after its conversations end
    (with none when they failed), before the environments' metrics; its seconds are ``reward_model_s``, also
    counted in ``env_step_s``.
    """
    trajs = new_trajectories(prompts, num_generations)
    n = len(trajs)
    keys = [(base_seed, step, gen_batch * n + i, stream) for i in range(n)]
    mine = rank_slice(n, rank, world_size)
    local, error, timing, metrics = trajs[mine], None, {}, {}
    try:
        generator.wake_up()  # colocated vLLM: KV cache back (weights came with the last refit)
        try:
            timing = _play(local, keys[mine], generator, envs, chat, settings, weights, player)
        finally:
            generator.sleep()  # vLLM's order: free the device for training
    except Exception as err:  # reported to every rank below; the caller decides whether to go on
        error = _failed(rank, step, err)
    try:
        if score_pending is not None:  # every rank, in step: a ZeRO-3 reward model's forwards are collectives
            timing["reward_model_s"] = score_pending(local if error is None else [])
            timing["env_step_s"] = timing.get("env_step_s", 0.0) + timing["reward_model_s"]  # scoring is the env's
        if error is None:
            local, metrics = envs.post_process(local)
    except Exception as err:
        error = error or _failed(rank, step, err)
    for t in local:  # the row's image values were for its player (an agent's prompt): played, they do not travel
        t.prompt_parts = None
    parts = all_gather_objects([(local, error, timing, metrics)], group)
    errors = [p[1] for p in parts if p[1] is not None]
    if errors:
        raise RolloutError("; ".join(errors))
    gathered = [t for p in parts for t in p[0]]
    if len(gathered) != n:  # the same on every rank: every rank raises
        raise RolloutError(f"the rollout returned {len(gathered)} samples for {len(prompts)} prompts x "
                           f"{num_generations} generations = {n} (per rank: {[len(p[0]) for p in parts]}): a "
                           "rollout that comes back short is an error, never a shorter batch")
    slowest = {k: max(p[2].get(k, 0.0) for p in parts) for k in ("generate_s", "env_step_s", *OPTIONAL_TIMING)
               if k not in OPTIONAL_TIMING or any(k in p[2] for p in parts)}
    return Rollout(gathered, slowest, merge_rank_metrics([p[3] for p in parts]))


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The environments' metrics of the whole rollout from each rank's (each computed on that rank's samples), by
    the metric's name (its last ``/`` part): ``num_*`` summed, ``min_*`` / ``max_*`` the smallest / largest, and
    where a ``num_samples`` sits beside them (NeMo-RL's ``reward_model_env/*``) ``mean_*`` weighted by it and
    ``std_*`` pooled with its ``mean_*`` (the sample std of the union); any other metric is the mean over ranks.

        >>> m = merge_rank_metrics([{"e/num_samples": 2.0, "e/mean_r": 0.0, "e/std_r": 0.0, "e/min_r": 0.0, "e/max_r": 0.0},
        ...                         {"e/num_samples": 2.0, "e/mean_r": 2.0, "e/std_r": 0.0, "e/min_r": 2.0, "e/max_r": 2.0,
        ...                          "e/rate": 1.0}])
        >>> m["e/num_samples"], m["e/mean_r"], round(m["e/std_r"], 4), m["e/min_r"], m["e/max_r"], m["e/rate"]
        (4.0, 1.0, 1.1547, 0.0, 2.0, 1.0)
    """
    keys = list(dict.fromkeys(k for metrics in per_rank for k in metrics))
    out: dict[str, float] = {}
    for k in keys:
        prefix, _, name = k.rpartition("/")
        ranks = [m for m in per_rank if k in m]
        values = [m[k] for m in ranks]
        count_key = f"{prefix}/num_samples" if prefix else "num_samples"
        counts = [m.get(count_key) for m in ranks]
        counted = all(c is not None for c in counts) and sum(counts) > 0
        if name.startswith("num_"):
            out[k] = float(sum(values))
        elif name.startswith("min_"):
            out[k] = min(values)
        elif name.startswith("max_"):
            out[k] = max(values)
        elif name.startswith("mean_") and counted:
            out[k] = sum(c * v for c, v in zip(counts, values)) / sum(counts)
        elif name.startswith("std_") and counted and all(f"{prefix}/mean_{name[4:]}" in m for m in ranks):
            means = [m[f"{prefix}/mean_{name[4:]}"] for m in ranks]
            n = sum(counts)
            mean = sum(c * mu for c, mu in zip(counts, means)) / n
            within = sum((c - 1) * sd ** 2 for c, sd in zip(counts, values) if c > 1)
            between = sum(c * (mu - mean) ** 2 for c, mu in zip(counts, means))
            out[k] = ((within + between) / (n - 1)) ** 0.5 if n > 1 else 0.0
        else:
            out[k] = sum(values) / len(values)
    return out
