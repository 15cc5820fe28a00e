"""NeMo-RL's metric names (emitted by the phases; grpo.metrics.FORMER_NAMES reads older runs), its rollout metrics
on hand-made rollouts, the checkpoint
ranking metric in NeMo-RL's val:/train: form, val_start_at scheduling and validation-only sampling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo.config import MasterConfig, VALIDATION_METRIC_ALIASES, validation_metric_names
from grpo.config.load import apply_overrides, build_config
from grpo.metrics import FORMER_NAMES, checkpoint_metric, checkpoint_metric_keys, nemo_rl_name, rollout_counts
from grpo.rollout_metrics import percentile, rollout_summary
from grpo.step import due_validation
from grpo.system.health import RolloutBudget
from grpo.trajectory import Failure, Message, Trajectory


# ---- names -----------------------------------------------------------------------------------------------
def test_every_former_name_maps_to_a_nemo_rl_name_under_its_prefix():
    for old, new in FORMER_NAMES.items():
        assert old != new
        assert new.startswith(("train/", "validation/", "timing/train/", "timing/validation/")), new
        assert new not in FORMER_NAMES, f"{new} is itself renamed"
    # the validation rows are config's table (one source for config and the rows)
    for old, new in VALIDATION_METRIC_ALIASES.items():
        assert FORMER_NAMES[f"val/{old}"] == f"validation/{new}"
        assert new in validation_metric_names(4)


@pytest.mark.parametrize("old, new", [
    ("train/reward_mean", "train/mean_total_reward"), ("train/shaped_reward_mean", "train/reward"),
    ("train/kl", "train/kl_penalty"), ("train/turns_mean", "train/avg_turns_per_sample"),
    ("train/truncated_frac", "train/truncation_rate"), ("train/response_length_max", "train/max_gen_tokens_per_sample"),
    ("train/mask_sample_count", "train/num_mask_sample_filtered"),
    ("train/seq_logprob_error_max", "train/max_seq_mult_prob_error"),
    ("train/seq_logprob_error_after_min", "train/min_seq_mult_prob_error_after_mask"),
    ("train/num_masked_seqs", "train/num_masked_seqs_by_logprob_error"),
    ("val/reward_mean", "validation/accuracy"), ("val/pass@8", "validation/pass_k"),
    ("val/response_length_mean", "validation/avg_length"), ("val/validation_s", "timing/validation/total_validation_time"),
    ("timing/step_s", "timing/train/total_step_time"), ("timing/rollout_s", "timing/train/generation"),
    ("timing/train_s", "timing/train/policy_training"), ("timing/env_step_s", "timing/train/env_step_s"),
    # NeMo-RL's own names and ours without a NeMo-RL name stay
    ("train/loss", "train/loss"), ("train/reward_std", "train/reward_std"), ("async/buffer_size", "async/buffer_size"),
    ("timing/train/generation", "timing/train/generation"), ("validation/accuracy", "validation/accuracy"),
])
def test_nemo_rl_name(old, new):
    assert nemo_rl_name(old) == new


def test_an_old_row_keeps_one_value_per_nemo_rl_name_the_native_one_first():
    from grpo.tools.plot import legacy_row

    row = legacy_row({"train/kl_penalty": 0.2, "train/kl": 0.2, "train/response_length_mean": 7.0,
                      "train/mean_gen_tokens_per_sample": 6.0, "train/reward_mean": 0.5, "timing/step_s": 3.0,
                      "train/loss": 1.0})
    assert row == {"train/kl_penalty": 0.2, "train/mean_gen_tokens_per_sample": 6.0,
                   "train/mean_total_reward": 0.5, "timing/train/total_step_time": 3.0, "train/loss": 1.0}


def test_the_phases_emit_nemo_rl_names_at_their_source():
    """What the loops log comes out of each phase under NeMo-RL's name (no rename pass before the row is logged):
    the step's loss and reward metrics, the logprob-error masking's, the timed phases' seconds."""
    import torch

    from grpo.logprobs import mask_by_seq_logprob_error
    from grpo.step import step_metrics
    from grpo.system.tracking import timed
    from tests.helpers.batches import train_batch

    batch = train_batch(raw_rewards_b=torch.tensor([1.0, 0.0, 1.0]), rewards_b=torch.tensor([0.5, -0.5, 0.5]),
                        response_lengths_b=torch.tensor([3, 4, 5]), advantages_bt=torch.ones(3, 1))
    with_kl = step_metrics(batch, [{"loss": 0.5, "kl_penalty": 0.25}], seconds=1.0)
    without_kl = step_metrics(batch, [{"loss": 0.5}], seconds=1.0)
    _, masking = mask_by_seq_logprob_error(torch.zeros(3, 2), torch.zeros(3, 2), torch.ones(3, 2), torch.ones(3),
                                           torch.ones(3), threshold=2.0)
    timing: dict = {}
    for phase in ("rollout", "logprobs", "train"):
        with timed(timing, phase):
            pass
    keys = [*with_kl, *without_kl, *(f"train/{k}" for k in masking), *timing]
    assert [k for k in keys if nemo_rl_name(k) != k] == []
    assert with_kl["train/kl_penalty"] == 0.25 and without_kl["train/kl_penalty"] == 0.0
    assert with_kl["train/reward"] == pytest.approx(0.5 / 3)  # the shaped rewards the advantages read
    assert set(timing) == {"timing/train/generation", "timing/train/policy_and_reference_logprobs",
                           "timing/train/policy_training"}


# ---- rollout metrics ---------------------------------------------------------------------------------------
def traj(turn_tokens, env_tokens=(), *, reward=0.0, terminated=False, max_turns=False, truncated=False,
         mask=False, error=None):
    """A finished conversation: a 5-token prompt, then assistant turns of ``turn_tokens`` tokens with an
    observation of ``env_tokens[i]`` tokens after turn i."""
    messages = [Message("user", "q", [1] * 5)]
    for i, n in enumerate(turn_tokens):
        messages.append(Message("assistant", "a", [2] * n, [0.0] * n))
        if i < len(env_tokens):
            messages.append(Message("user", "o", [3] * env_tokens[i]))
    return Trajectory(group_id=0, prompt_index=0, task_name="t", question="q", answer="a", messages=messages,
                      metadata={}, truncated=truncated, turns=len(turn_tokens), done=True,
                      num_prompt_messages=1, terminated=terminated, max_turns_reached=max_turns, mask_sample=mask,
                      failure=error and Failure.of(error), reward=None if error else reward)


def test_rollout_summary_by_hand():
    trajs = [
        traj([4], reward=1.0, terminated=True),                         # the environment ended it
        traj([3, 5, 2], [2, 4], reward=0.5, max_turns=True),            # out of turns
        traj([6, 1], [3], reward=0.0, truncated=True),                  # ran out of room: neither rate
        traj([2, 2], [1], reward=0.25, terminated=True, mask=True),
    ]
    m = rollout_summary(trajs)
    assert m["total_turns"] == 8 and m["avg_turns_per_sample"] == 2.0 and m["max_turns_per_sample"] == 3
    assert m["natural_termination_rate"] == 0.5 and m["max_turns_reached_rate"] == 0.25
    assert m["truncation_rate"] == 0.25
    gen, env = [4, 10, 7, 4], [0, 6, 3, 1]
    assert m["mean_gen_tokens_per_sample"] == sum(gen) / 4 and m["max_gen_tokens_per_sample"] == 10.0
    assert m["mean_env_tokens_per_sample"] == sum(env) / 4
    assert m["mean_total_tokens_per_sample"] == (sum(gen) + sum(env)) / 4  # the prompts' 5 tokens not counted
    assert m["max_gen_tokens_per_turn/max"] == 6.0 and m["max_gen_tokens_per_turn/mean"] == (4 + 5 + 6 + 2) / 4
    assert m["max_gen_tokens_per_turn/p95"] == 6.0
    assert m["turns_per_sample/p95"] == 3.0 and m["turns_per_sample/p99"] == 3.0
    assert (m["mean_total_reward"], m["max_total_reward"], m["min_total_reward"]) == (1.75 / 4, 1.0, 0.0)
    counts = rollout_counts(trajs)
    assert counts["num_mask_sample_filtered"] == 1 and counts["total_turns"] == 8
    assert rollout_summary([]) == {}


def test_percentile_is_nemo_rl_pct():
    values = list(range(1, 101))
    assert percentile(values, 95) == 96.0 and percentile(values, 99) == 100.0 and percentile([7], 50) == 7.0


def test_the_conversation_loop_sets_terminated_and_max_turns_reached():
    """run_conversations with a scripted environment: sample 0 ends at turn 1 (terminated), sample 1 never does."""
    from grpo.system.generation.base import GenerationBackend, GenerationOutput
    from grpo.system.rollout import TurnSettings, run_conversations

    sampled_with = []

    class Gen(GenerationBackend):
        def generate(self, prompts, seeds, **kw):
            sampled_with.append(kw["sampling"])
            return [GenerationOutput(p, [7, 8], [0.0, 0.0], "stop", "ab") for p in prompts]

    class Envs:
        last_error = None

        def first_stop_strings(self, task):
            return None

        def step(self, task, logs, metas):
            done = [len(log) == 2 and i == 0 for i, log in enumerate(logs)]
            return SimpleNamespace(rewards=[1.0] * len(logs), terminateds=done, metadata=metas,
                                   observations=[[{"role": "user", "content": "o"}] for _ in logs],
                                   next_stop_strings=[None] * len(logs), failures=[None] * len(logs)), [0] * len(logs)

    class Chat:
        processor = None  # a text policy (grpo.system.chat.ChatFormat.processor)

        def observation_ids(self, log, new, last):
            return [9]

    trajs = [traj([]), traj([])]
    for t in trajs:
        t.turns, t.done = 0, False
        t.metadata = {}
    val = MasterConfig().policy.generation.sampling(validation=True)
    run_conversations(trajs, [(0, 0, i, "t") for i in range(2)], Gen(), Envs(), Chat(),
                      TurnSettings(max_turns=3, max_total_len=100, chunk_size=4, sampling=val))
    assert sampled_with == [val] * 3  # every turn's call samples with the rollout's profile
    assert [(t.turns, t.terminated, t.max_turns_reached) for t in trajs] == [(1, True, False), (3, False, True)]
    m = rollout_summary(trajs)
    assert m["natural_termination_rate"] == 0.5 and m["max_turns_reached_rate"] == 0.5 and m["total_turns"] == 4


# ---- checkpoint metric ---------------------------------------------------------------------------------------
def test_checkpoint_metric_reads_val_and_train_as_nemo_rl():
    step = {"train/loss": 0.5, "train/mean_total_reward": 0.25, "timing/train/total_step_time": 1.0}
    val = {"accuracy": 0.75, "avg_length": 9.0}
    assert checkpoint_metric("val:accuracy", step, val) == 0.75
    assert checkpoint_metric("train:loss", step, val) == 0.5
    assert checkpoint_metric("train:reward_mean", step, None) == 0.25  # a former name, read as NeMo-RL's
    assert checkpoint_metric("val:accuracy", step, None) is None       # no validation this step: ranks lowest
    with pytest.raises(KeyError) as err:
        checkpoint_metric("train:acuracy", step, val)
    assert "checkpointing.metric_name='train:acuracy'" in str(err.value)
    assert "available: train:loss, train:mean_total_reward" in str(err.value)


def test_older_checkpoints_are_ranked_by_their_former_keys():
    assert checkpoint_metric_keys("val:accuracy") == ["val:accuracy", "validation/accuracy", "val/reward_mean"]
    assert checkpoint_metric_keys("train:mean_total_reward")[-1] == "train/reward_mean"


def test_a_train_metric_name_no_metric_has_fails_at_the_first_save():
    from grpo.run.run import RunError, save

    cfg = build_config(apply_overrides({}, ["checkpointing.metric_name=train:nope"]))
    saved = []
    run = SimpleNamespace(cfg=cfg, state=SimpleNamespace(metrics={}, val_reward=0.0), policy=None,
                          ckpt=SimpleNamespace(save=lambda *a, **k: saved.append(a)),
                          checks=SimpleNamespace(rollouts=RolloutBudget(0.9, 3)))
    with pytest.raises(RunError, match=r"checkpointing.metric_name='train:nope'.*available: train:loss"):
        save(run, 1, {"train/loss": 1.0}, None, None)
    assert not saved
    run.cfg = build_config(apply_overrides({}, ["checkpointing.metric_name=val:accuracy"]))
    save(run, 2, {"train/loss": 1.0}, {"accuracy": 0.5, "avg_length": 3.0}, None)
    assert run.state.metrics["val:accuracy"] == 0.5 and run.state.metrics["validation/avg_length"] == 3.0
    assert run.state.val_reward == 0.5 and saved


# ---- val_start_at ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, due", [
    ([], [2, 4, 6, 8, 10]),
    (["grpo.val_start_at=5"], [6, 8, 10]),       # NeMo-RL: step >= val_start_at and step % val_period == 0
    (["grpo.val_start_at=6"], [6, 8, 10]),
    (["grpo.val_start_at=9", "grpo.val_at_end=true"], [10]),
    (["grpo.val_start_at=11", "grpo.val_at_end=true"], [10]),   # val_at_end does not wait for it
    (["grpo.val_start_at=11"], []),
])
def test_val_start_at_delays_periodic_validation(overrides, due):
    cfg = build_config(apply_overrides({}, ["grpo.val_period=2", *overrides]))
    assert [s for s in range(1, 11) if due_validation(cfg, s, 10)] == due


# ---- validation-only sampling ---------------------------------------------------------------------------------
def test_validation_sampling_reaches_the_hf_backend(monkeypatch):
    import torch

    from grpo.system.generation import hf
    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model

    seen = []

    class Recorder(hf.SeededSampler):
        def __init__(self, seeds, temperature, top_k, top_p, greedy, device):
            seen.append((temperature, top_k, top_p))
            super().__init__(seeds, temperature, top_k, top_p, greedy, device)

    monkeypatch.setattr(hf, "SeededSampler", Recorder)
    tok = build_char_tokenizer()
    policy = MasterConfig.model_validate({"policy": {
        "model_name": "unused", "precision": "float32", "max_total_sequence_length": 32,
        "generation": {"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0,
                       "val_temperature": 0.5, "val_top_p": 0.9, "val_top_k": 3}}}).policy
    model = build_tiny_model(tok, seed=0).eval()
    gen = hf.HFGeneration(policy, tok, model.config, torch.device("cpu"), model=model)
    prompt = [tok("ab")["input_ids"]]
    gen.generate(prompt, [1])
    gen.generate(prompt, [1], sampling=policy.generation.sampling(validation=True))
    gen.generate(prompt, [1])  # the profile went with its call: nothing stayed behind on the backend
    assert seen == [(1.0, None, 1.0), (0.5, 3, 0.9), (1.0, None, 1.0)]


@pytest.mark.parametrize("stream, validation", [("train", False), ("val", True)])
def test_a_rollout_samples_with_its_streams_profile(monkeypatch, stream, validation):
    """run_rollout hands generate_rollout the profile of its stream: validation's rollouts (stream "val") sample
    with val_temperature / val_top_p / val_top_k, the training ones with the training values."""
    from grpo.run.run import run_rollout
    from grpo.system import rollout

    seen = []
    monkeypatch.setattr(rollout, "generate_rollout", lambda *a, **k: seen.append(a[5].sampling))
    cfg = MasterConfig.model_validate({"policy": {"generation": {"temperature": 0.8, "val_temperature": 0.1,
                                                                 "val_top_p": 0.5}}})
    run = SimpleNamespace(cfg=cfg, state=SimpleNamespace(current_step=0), chat=None, turn_stop=None, rank=0,
                          world_size=1, player=None, deferred=None)
    run_rollout(run, None, None, [], 0, 0, stream=stream)
    assert seen == [cfg.policy.generation.sampling(validation=validation)]
    assert (seen[0].temperature, seen[0].top_p) == ((0.1, 0.5) if validation else (0.8, 1.0))


def test_validation_sampling_reaches_vllm_sampling_params():
    import dataclasses

    from grpo.run.run import turn_settings
    from grpo.system.generation.vllm_params import sampling_kwargs

    cfg = MasterConfig.model_validate({"policy": {"generation": {"temperature": 0.8, "top_k": 20,
                                                                 "val_temperature": 0.1}}})
    val = turn_settings(cfg, validation=True).sampling  # validation's rollouts (stream "val") sample with it
    kw = sampling_kwargs(val, max_tokens=4, seed=1, greedy=False, stop_ids=[0])
    assert (kw["temperature"], kw["top_k"], kw["top_p"]) == (0.1, 20, 1.0)  # unset val_* keep the training value
    train = turn_settings(cfg).sampling
    assert (train.temperature, train.top_k, train.top_p) == (0.8, 20, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a profile is never changed in place
        train.temperature = 0.1
