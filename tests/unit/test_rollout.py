"""grpo.system.rollout: the conversation loop (turns, observations, limits, failures), chunks and weight versions,
seeds, and a prompt batch across ranks. Fake generators and environments; the real ones run end to end."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from grpo.system.chat import ChatFormat
from grpo.tasks.failures import RetryPolicy
from grpo.tasks.router import Environments
from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.system.generation.base import GenerationBackend, GenerationOutput
from grpo.system.rollout import (
    RolloutError, TurnSettings, generate_rollout, new_trajectories, rank_slice, run_conversations, sample_seed,
)
from grpo.tasks.rows import PromptRow
from grpo.tasks.toy import build_char_tokenizer

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


class FakeGenerator(GenerationBackend):
    """Completion = one digit chosen by the seed, then <eos>; records calls and each sample's stop strings."""

    def __init__(self, fail_on_call: int | None = None):
        self.calls, self.events, self.stops, self.caps = [], [], [], []
        self.fail_on_call = fail_on_call

    def generate(self, prompt_ids, seeds, *, greedy=False, max_new_tokens=None, stop_strings=None, sampling=None):
        self.events.append("generate")
        self.calls.append(len(prompt_ids))
        self.stops.append(list(stop_strings))
        self.caps.append(list(max_new_tokens))
        if self.fail_on_call == len(self.calls):
            raise ValueError("prompt 0 has 99 tokens")
        out = []
        for p, s, cap in zip(prompt_ids, seeds, max_new_tokens):
            digit = str(s % 10)
            ids = (TOK(digit, add_special_tokens=False)["input_ids"] + [EOS])[:cap]
            out.append(GenerationOutput(list(p), ids, [-0.5] * len(ids), "stop" if len(ids) == 2 else "length", digit))
        return out

    def wake_up(self):
        self.events.append("wake_up")

    def sleep(self):
        self.events.append("sleep")


class Echo(Environment):
    """Answers every turn with "ok"; ends a sample once it has ``turns`` assistant messages, rewarding 1 per
    turn; flags turn 1 invalid_tool_call and masks samples whose question is "mask"."""

    def __init__(self, turns=2):
        self.turns, self.seen = turns, []

    def step(self, message_logs, metadata):
        self.seen.append([list(log) for log in message_logs])
        n_assistant = [sum(m["role"] == "assistant" for m in log) for log in message_logs]
        return EnvironmentReturn(
            observations=[{"role": "user", "content": "ok"} for _ in message_logs],
            metadata=[{**md, "invalid_tool_call": k == 1, "mask_sample": md["question"] == "mask"}
                      for md, k in zip(metadata, n_assistant)],
            next_stop_strings=[["!"] for _ in message_logs],
            rewards=torch.ones(len(message_logs)), terminateds=torch.tensor([k >= self.turns for k in n_assistant]),
            answers=None)


def rows(questions):
    return [PromptRow(index=i, question=q, answer="3", task_name="echo",
                      prompt_messages=[{"role": "user", "content": q, "token_ids": TOK(q)["input_ids"]}],
                      prompt_ids=TOK(q)["input_ids"]) for i, q in enumerate(questions)]


def play(env, questions=("ab", "cd"), generations=2, settings=None, weights=None, generator=None):
    trajs = new_trajectories(rows(questions), generations)
    keys = [(7, 1, i, "train") for i in range(len(trajs))]
    generator = generator or FakeGenerator()
    timing = run_conversations(trajs, keys, generator, Environments({"echo": env}, step_timeout_s=5),
                               ChatFormat(TOK), settings or TurnSettings(max_turns=4, max_total_len=64, chunk_size=3,
                                                                         max_new_tokens=8), weights)
    return trajs, generator, timing


def test_a_multi_turn_conversation_grows_at_the_end_with_observations_and_rewards():
    env = Echo(turns=3)
    trajs, gen, timing = play(env)
    t = trajs[0]
    assert t.turns == 3 and t.reward == 3.0 and t.done and not t.truncated
    assert [m.role for m in t.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    tokens = t.token_ids()
    assert tokens[:3] == TOK("ab")["input_ids"]
    assert TOK.decode(tokens, skip_special_tokens=False).count("ok") == 2  # observations as plain text
    assert t.messages[1].flags == ["invalid_tool_call"] and t.messages[3].flags == []
    assert gen.stops[0] == [None] * 3 and gen.stops[2] == [["!"]] * 3  # the environment's stop strings
    assert gen.calls == [3, 1, 3, 1, 3, 1]  # 4 active samples per turn, chunks of 3
    assert set(timing) == {"generate_s", "env_step_s"}
    # The environment saw each conversation as role/content messages ending with the assistant turn.
    assert env.seen[0][0][-1]["role"] == "assistant" and env.seen[1][0][-2] == {"role": "user", "content": "ok"}


def test_turn_limits_and_room_end_samples_and_count_truncation():
    trajs, _, _ = play(Echo(turns=10), settings=TurnSettings(max_turns=2, max_total_len=64, chunk_size=8,
                                                               max_new_tokens=8))
    assert all(t.turns == 2 and t.done and not t.truncated for t in trajs)
    assert [m.role for m in trajs[0].messages][-1] == "assistant"  # out of turns: no observation appended
    # Prompt 3 tokens + (2 generated + 2 observation) per turn: room for one turn and a cut observation.
    trajs, gen, _ = play(Echo(turns=10), settings=TurnSettings(max_turns=5, max_total_len=6, chunk_size=8,
                                                                 max_new_tokens=8))
    assert all(t.truncated and t.turns == 1 and len(t.token_ids()) == 6 for t in trajs)
    assert gen.caps == [[3, 3, 3, 3]]  # per-sample caps: min(max_new_tokens, room)


def test_a_turn_level_stopping_rule_ends_a_sample_after_its_environment_step():
    """The fork point of multi-turn rollouts (TurnSettings.stop): asked after each environment step that left the
    sample going; True ends it there like running out of turns, with the rewards it has."""
    asked = []

    def two_turns_are_enough(t) -> bool:
        asked.append(t.turns)
        return t.turns >= 2

    settings = TurnSettings(max_turns=4, max_total_len=64, chunk_size=8, max_new_tokens=8, stop=two_turns_are_enough)
    trajs, _, _ = play(Echo(turns=10), settings=settings)
    assert all(t.turns == 2 and t.done and t.reward == 2.0 for t in trajs)
    assert not any(t.max_turns_reached or t.terminated or t.truncated for t in trajs)
    assert [m.role for m in trajs[0].messages][-1] == "assistant"  # no observation appended after the stop
    assert asked == [1, 1, 1, 1, 2, 2, 2, 2]
    trajs, _, _ = play(Echo(turns=10), settings=TurnSettings(max_turns=4, max_total_len=64, chunk_size=8,
                                                               max_new_tokens=8))
    assert all(t.turns == 4 and t.max_turns_reached for t in trajs)  # without the rule: every turn


def test_a_mask_sample_flag_is_kept_and_seeds_depend_on_sample_and_turn():
    trajs, _, _ = play(Echo(turns=2), questions=("mask", "ab"))
    assert [t.mask_sample for t in trajs] == [True, True, False, False]
    again, _, _ = play(Echo(turns=2), questions=("mask", "ab"))
    assert [t.token_ids() for t in again] == [t.token_ids() for t in trajs]
    assert sample_seed(7, 1, 0, "train", turn=1) != sample_seed(7, 1, 0, "train")
    assert sample_seed(7, 1, 0, "train", turn=0) == sample_seed(7, 1, 0, "train")


class Raises(Echo):
    def step(self, message_logs, metadata):
        raise RuntimeError("the environment broke")


class Hangs(Echo):
    def step(self, message_logs, metadata):
        time.sleep(30)


class Malformed(Echo):
    def step(self, message_logs, metadata):
        return EnvironmentReturn([{"role": "user"}], [{}], None, torch.ones(1), torch.ones(1), None)


@pytest.mark.parametrize("env, error, kind", [(Raises(), "env_error", "data"), (Hangs(), "env_timeout", "infra"),
                                              (Malformed(), "env_malformed", "data")])
def test_an_environment_that_raises_hangs_or_returns_garbage_fails_only_its_samples_unscored(env, error, kind):
    trajs = new_trajectories(rows(["ab"]) + [dataclasses.replace(rows(["cd"])[0], index=1, task_name="good")], 2)
    sleeps = []
    envs = Environments({"echo": env, "good": Echo(turns=1)}, step_timeout_s=0.5,
                        retry=RetryPolicy(2, 2, 0.25, 1.0), sleep=sleeps.append)
    t0 = time.perf_counter()
    run_conversations(trajs, [(1, 1, i, "t") for i in range(4)], FakeGenerator(), envs, ChatFormat(TOK),
                      TurnSettings(max_turns=3, max_total_len=64, chunk_size=8, max_new_tokens=8))
    assert time.perf_counter() - t0 < 10
    assert [t.failure and t.failure.reason for t in trajs] == [error, error, None, None]
    assert [t.failure and t.failure.kind for t in trajs] == [kind, kind, None, None]
    assert trajs[0].failure.detail and [t.retries for t in trajs] == [1, 1, 0, 0]  # tried twice, failed twice
    assert [t.reward for t in trajs] == [None, None, 1.0, 1.0] and all(t.done for t in trajs)
    assert envs.num_failures == 4 and sleeps == ([0.25] if kind == "infra" else [])


class FailsOnce(Echo):
    """Echo whose second call (turn 2) raises once: the retry succeeds."""

    def step(self, message_logs, metadata):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            raise TimeoutError("the judge timed out")
        return super().step(message_logs, metadata)


def test_a_turn_retried_after_a_failure_plays_exactly_as_a_clean_one_and_counts_its_retry():
    clean, _, _ = play(Echo(turns=3))
    sleeps = []
    trajs = new_trajectories(rows(["ab", "cd"]), 2)
    run_conversations(trajs, [(7, 1, i, "train") for i in range(4)], FakeGenerator(),
                      Environments({"echo": FailsOnce(turns=3)}, 5, retry=RetryPolicy(3, 2, 0.5, 1.0),
                                   sleep=sleeps.append),
                      ChatFormat(TOK), TurnSettings(max_turns=4, max_total_len=64, chunk_size=3, max_new_tokens=8))
    assert [t.token_ids() for t in trajs] == [t.token_ids() for t in clean]
    assert [t.reward for t in trajs] == [t.reward for t in clean] and all(t.scored for t in trajs)
    assert [t.retries for t in trajs] == [1, 1, 1, 1] and sleeps == [0.5]


class Short(FakeGenerator):
    def generate(self, prompt_ids, seeds, **kw):
        return super().generate(prompt_ids, seeds, **kw)[:-1]


def test_a_rollout_that_comes_back_short_is_an_error_never_a_shorter_batch(monkeypatch):
    settings = TurnSettings(max_turns=1, max_total_len=64, chunk_size=4, max_new_tokens=8)
    kw = dict(base_seed=3, step=2, gen_batch=0, stream="train", rank=0, world_size=1)
    with pytest.raises(RolloutError, match="generation returned 3 outputs for 4 prompts"):
        generate_rollout(rows(["ab", "cd"]), 2, Short(), Environments({"echo": Echo()}, 5), ChatFormat(TOK),
                         settings, **kw)
    import grpo.system.rollout as rollout

    def drops_the_last_sample(objs, group=None):  # a gather that lost a sample on the way
        return [(objs[0][0][:-1], *objs[0][1:])]

    monkeypatch.setattr(rollout, "all_gather_objects", drops_the_last_sample)
    with pytest.raises(RolloutError, match=r"returned 3 samples for 2 prompts x 2 generations = 4 \(per rank: \[3\]\)"):
        generate_rollout(rows(["ab", "cd"]), 2, FakeGenerator(), Environments({"echo": Echo()}, 5), ChatFormat(TOK),
                         settings, **kw)


def test_the_rows_image_values_do_not_travel_with_the_gathered_samples(monkeypatch):
    """``Trajectory.prompt_parts`` (a row's pictures as the data gave them, for an agent's prompt) is dropped once
    the samples are played: the gather over ranks carries the samples' media, never the row's pictures again."""
    import grpo.system.rollout as rollout

    sent = []

    def gather(objs, group=None):
        sent.append([t.prompt_parts for t in objs[0][0]])
        return objs

    monkeypatch.setattr(rollout, "all_gather_objects", gather)
    prompts = rows(["ab", "cd"])
    prompts[0].prompt_parts = [[{"type": "image", "image": b"\x89PNG..."}, {"type": "text", "text": "ab"}]]
    settings = TurnSettings(max_turns=1, max_total_len=64, chunk_size=4, max_new_tokens=8)
    generate_rollout(prompts, 2, FakeGenerator(), Environments({"echo": Echo()}, 5), ChatFormat(TOK), settings,
                     base_seed=3, step=2, gen_batch=0, stream="train", rank=0, world_size=1)
    assert sent == [[None] * 4]


def test_chunks_tag_the_weight_version_they_were_generated_with():
    class Weights:
        versions = iter([5, 6, 7, 8])

        def load_newest(self):
            return next(self.versions)

    trajs, gen, _ = play(Echo(turns=2), questions=("ab", "cd", "ef"), generations=1,
                         settings=TurnSettings(max_turns=2, max_total_len=64, chunk_size=2, max_new_tokens=8),
                         weights=Weights())
    assert gen.calls == [2, 1, 2, 1]
    assert [t.generation_version for t in trajs] == [5, 5, 6]  # the oldest turn's version (turn 2: 7, 7, 8)


def test_a_prompt_batch_across_ranks_equals_one_rank_and_a_failure_is_a_rollout_error():
    settings = TurnSettings(max_turns=3, max_total_len=64, chunk_size=4, max_new_tokens=8)
    kw = dict(base_seed=3, step=2, gen_batch=1, stream="train", rank=0, world_size=1)
    gen = FakeGenerator()
    whole = generate_rollout(rows(["ab", "cd", "ef"]), 2, gen, Environments({"echo": Echo()}, 5), ChatFormat(TOK),
                             settings, **kw)
    assert gen.events[0] == "wake_up" and gen.events[-1] == "sleep"  # vLLM's order around the whole rollout
    assert [t.group_id for t in whole.trajectories] == [0, 0, 1, 1, 2, 2]
    # Rank r plays its share (rank_slice) with the same per-sample seeds: shares concatenate to the whole.
    parts = []
    for rank in range(2):
        trajs = new_trajectories(rows(["ab", "cd", "ef"]), 2)
        keys = [(3, 2, 1 * 6 + i, "train") for i in range(6)]
        mine = rank_slice(6, rank, 2)
        run_conversations(trajs[mine], keys[mine], FakeGenerator(), Environments({"echo": Echo()}, 5),
                          ChatFormat(TOK), settings)
        parts += trajs[mine]
    assert [t.token_ids() for t in parts] == [t.token_ids() for t in whole.trajectories]
    with pytest.raises(RolloutError, match="rank 0: ValueError: prompt 0 has 99 tokens"):
        generate_rollout(rows(["ab"]), 2, FakeGenerator(fail_on_call=1), Environments({"echo": Echo()}, 5),
                         ChatFormat(TOK), settings, **kw)


def test_the_reward_models_scoring_point_runs_once_on_every_rank_even_one_whose_rollout_failed():
    """A ZeRO-3 reward model's forwards are collectives: a rank whose conversations broke still joins the scoring
    point (with nothing to score), before the rollout error every rank raises."""
    settings = TurnSettings(max_turns=1, max_total_len=64, chunk_size=4, max_new_tokens=8)
    kw = dict(base_seed=3, step=2, gen_batch=0, stream="train", rank=0, world_size=1)
    calls = []

    def score_pending(trajs):
        calls.append([t.metadata["question"] for t in trajs])
        for t in trajs:
            t.reward += 10.0  # what the point adds comes back in the rollout, before the environments' metrics
        return 0.25

    r = generate_rollout(rows(["ab", "cd"]), 1, FakeGenerator(), Environments({"echo": Echo()}, 5), ChatFormat(TOK),
                         settings, score_pending=score_pending, **kw)
    assert calls == [["ab", "cd"]] and all(t.reward >= 10.0 for t in r.trajectories)
    assert r.timing["reward_model_s"] == 0.25 and r.timing["env_step_s"] >= 0.25
    with pytest.raises(RolloutError, match="rank 0: ValueError"):
        generate_rollout(rows(["ab"]), 2, FakeGenerator(fail_on_call=1), Environments({"echo": Echo()}, 5),
                         ChatFormat(TOK), settings, score_pending=score_pending, **kw)
    assert calls[-1] == []
