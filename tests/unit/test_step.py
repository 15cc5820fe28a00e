"""grpo.step: the phases both loops run after the rollout (the heavier ones are covered end to end)."""

from __future__ import annotations

import pytest
import torch

from grpo.batch import build_batch
from grpo.config.load import build_config
from grpo.trajectory import Message, Trajectory
from grpo.step import compose_advantages, initial_sample_mask, mask_invalid_samples, shape_rewards, step_advantages
from grpo.tasks.toy import build_char_tokenizer


def traj(group_id: int, reward: float, turns: list[tuple[list[int], list[float]]], prompt=(1, 5),
         flags: list[list[str]] | None = None, truncated=False, mask_sample=False) -> Trajectory:
    """A conversation: the prompt, then for each (assistant ids, observation ids) an assistant turn and the
    environment's answer (an empty observation list: none)."""
    messages = [Message("user", "p", list(prompt))]
    for k, (ids, obs) in enumerate(turns):
        messages.append(Message("assistant", f"a{k}", list(ids), [-0.5] * len(ids), (flags or [[]] * len(turns))[k]))
        if obs:
            messages.append(Message("user", f"o{k}", list(obs)))
    return Trajectory(group_id, group_id, "t", "q", "a", messages, {}, reward=reward, turns=len(turns),
                      truncated=truncated, mask_sample=mask_sample, num_prompt_messages=1)


def _batch():
    g = torch.Generator().manual_seed(0)
    trajs = [traj(b // 4, float(torch.rand(1, generator=g)), [([7, 7, 7, 2], [])]) for b in range(8)]
    batch = build_batch(trajs, pad_id=0)
    gen_lp = -torch.rand(batch.token_mask_bt.shape, generator=g) * batch.token_mask_bt
    prev_lp = gen_lp.clone()
    prev_lp[0] -= 3.0 * batch.token_mask_bt[0]  # sample 0 disagrees with its generation logprobs: masked
    return batch.replace(generation_logprobs_bt=gen_lp, prev_logprobs_bt=prev_lp)


def test_advantages_on_the_gpu_flag_gives_the_cpu_result_back_on_the_cpu(monkeypatch):
    cfg = build_config({"grpo": {"seq_logprob_error_threshold": 1.5}})
    cpu, cpu_metrics = step_advantages(cfg, _batch())
    assert cpu.sample_mask_b[0] == 0 and cpu.sample_mask_b[1:].all()

    # No GPU here: stand one in that copies tensors, and check what comes back and where it lands.
    moved = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: moved.append(1) or self.clone())
    gpu_cfg = build_config({"grpo": {"seq_logprob_error_threshold": 1.5, "calculate_advantages_on_gpu": True}})
    batch = _batch()
    on, on_metrics = step_advantages(gpu_cfg, batch)
    assert on_metrics.keys() == cpu_metrics.keys()
    assert len(moved) == sum(isinstance(v, torch.Tensor) for v in vars(batch).values())
    assert torch.equal(on.sample_mask_b, cpu.sample_mask_b) and torch.equal(on.advantages_bt, cpu.advantages_bt)


def test_a_three_turn_conversation_trains_exactly_its_generated_tokens():
    """Prompt (2 tokens), assistant turn 1 (2), observation (3), turn 2 (1), observation (1), turn 3 (2)."""
    t = traj(0, 1.0, [([10, 11], [20, 21, 22]), ([12], [23]), ([13, 2], [])])
    t.messages[0:1] = [Message("system", "s", [1]), Message("user", "p", [5]),
                       Message("assistant", "history", [30, 31]), Message("user", "p2", [6])]  # prompt history
    t.messages[4].generation_logprobs = [-0.1, -0.2]
    t.messages[6].generation_logprobs = [-0.3]
    t.messages[8].generation_logprobs = [-0.4, -0.5]
    b = build_batch([t], pad_id=0)
    assert b.input_ids_bt.tolist() == [[1, 5, 30, 31, 6, 10, 11, 20, 21, 22, 12, 23, 13, 2]]
    assert b.token_mask_bt.tolist() == [[0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1]]  # prompt-history turn untrained
    torch.testing.assert_close(b.generation_logprobs_bt,
                               torch.tensor([[0] * 5 + [-0.1, -0.2, 0, 0, 0, -0.3, 0, -0.4, -0.5]]))
    assert b.message_spans == [[(5, 7, ()), (10, 11, ()), (12, 14, ())]]
    assert b.response_lengths_b.tolist() == [5]


def test_phase_7_composes_estimator_distillation_message_penalties_and_clipping_as_documented():
    cfg = build_config({"grpo": {"use_leave_one_out_baseline": False, "normalize_rewards": False,
                                 "invalid_tool_call_advantage": -3.0, "malformed_thinking_advantage": -2.0,
                                 "advantage_clip_low": -2.5, "advantage_clip_high": 0.3},
                        "on_policy_distillation": {"enabled": True, "teacher_model_name": "t", "kl_coef": 0.5}})
    # One group of two conversations; sample 0 has two turns, its first flagged invalid_tool_call, its second
    # malformed_thinking; sample 1 has one turn.
    t0 = traj(0, 1.0, [([10, 11], [20]), ([12, 2], [])], flags=[["invalid_tool_call"], ["malformed_thinking"]])
    t1 = traj(0, 0.0, [([13, 14, 2], [])])
    b = build_batch([t0, t1], pad_id=0)
    prev = torch.zeros_like(b.token_mask_bt)
    teacher = torch.where(b.token_mask_bt > 0, torch.tensor(-0.4), torch.tensor(0.0))
    b = b.replace(prev_logprobs_bt=prev, teacher_logprobs_bt=teacher)
    adv, mask, _ = compose_advantages(cfg, b)
    # estimator: r - mean = +0.5 / -0.5; distillation: -0.5 * (0 - (-0.4)) = -0.2 on generated tokens
    # sample 0: prompt tokens 0,1 and observation token 4 (untrained): 0.5 clipped to 0.3; tokens 2,3 invalid
    # call -> -3 -> clipped to -2.5; tokens 5,6 malformed -> -2; sample 1: tokens 2,3,4: -0.5 - 0.2 = -0.7.
    expected0 = [0.3, 0.3, -2.5, -2.5, 0.3, -2.0, -2.0]
    expected1 = [-0.5, -0.5, -0.7, -0.7, -0.7, -0.5, -0.5]
    torch.testing.assert_close(adv, torch.tensor([expected0, expected1]))
    assert mask.tolist() == [1.0, 1.0]


def test_a_message_flagged_invalid_and_malformed_gets_the_invalid_advantage_and_counts_as_invalid():
    """NeMo-RL (_apply_message_level_advantage_penalties): ``if is_invalid: ... elif is_malformed_thinking``."""
    cfg = build_config({"grpo": {"invalid_tool_call_advantage": -3.0, "malformed_thinking_advantage": -2.0}})
    both = ["invalid_tool_call", "malformed_thinking"]
    t0 = traj(0, 1.0, [([10, 11], [20]), ([12, 2], [])], flags=[both, ["malformed_thinking"]])
    t1 = traj(0, 0.0, [([13, 14, 2], [])])
    adv, _, metrics = compose_advantages(cfg, build_batch([t0, t1], pad_id=0))
    assert adv[0, 2:4].tolist() == [-3.0, -3.0] and adv[0, 5:7].tolist() == [-2.0, -2.0]
    assert metrics["num_assistant_messages"] == 3
    assert metrics["num_invalid_tool_calls"] == 1 and metrics["num_malformed_thinking"] == 1
    assert metrics["invalid_tool_call_rate"] == pytest.approx(1 / 3)
    assert metrics["malformed_thinking_rate"] == pytest.approx(1 / 3)
    # With the invalid-call penalty off, the same message takes the malformed value and counts as malformed.
    cfg = build_config({"grpo": {"malformed_thinking_advantage": -2.0}})
    adv, _, metrics = compose_advantages(cfg, build_batch([t0, t1], pad_id=0))
    assert adv[0, 2:4].tolist() == [-2.0, -2.0]
    assert metrics["num_invalid_tool_calls"] == 0 and metrics["num_malformed_thinking"] == 2
    # Both off: no penalty metrics (NeMo-RL logs them only when a penalty is configured).
    assert "invalid_tool_call_rate" not in compose_advantages(build_config({}), build_batch([t0, t1], pad_id=0))[2]


@pytest.mark.parametrize("flag, value", [("invalid_tool_call", -1.0), ("malformed_thinking", -0.25)])
def test_each_message_penalty_changes_exactly_the_tokens_of_its_flagged_messages(flag, value):
    key = {"invalid_tool_call": "invalid_tool_call_advantage", "malformed_thinking": "malformed_thinking_advantage"}
    base = build_config({"grpo": {"use_leave_one_out_baseline": False}})
    cfg = build_config({"grpo": {"use_leave_one_out_baseline": False, key[flag]: value}})
    trajs = [traj(0, 1.0, [([10, 11], [20]), ([12], [21]), ([13, 2], [])], flags=[[], [flag], []]),
             traj(0, 0.0, [([14], [22]), ([15, 2], [])], flags=[[flag], []])]
    b = build_batch(trajs, pad_id=0)
    plain, _, _ = compose_advantages(base, b)
    penalised, _, _ = compose_advantages(cfg, b)
    changed = (plain != penalised).nonzero().tolist()
    assert changed == [[0, 5], [1, 2]]  # sample 0's second turn (1 token), sample 1's first turn (1 token)
    assert penalised[0, 5] == value and penalised[1, 2] == value


def test_sample_masks_keep_environment_masked_and_overlong_samples_out_of_the_loss():
    cfg = build_config({"grpo": {"overlong_filtering": True}})
    trajs = [traj(0, 1.0, [([7, 2], [])]), traj(0, 0.0, [([7, 7], [])], truncated=True),
             traj(0, 1.0, [([8, 2], [])], mask_sample=True)]
    b = build_batch(trajs, pad_id=0)
    assert initial_sample_mask(cfg, b).tolist() == [1.0, 0.0, 0.0]
    assert initial_sample_mask(build_config({}), b).tolist() == [1.0, 1.0, 0.0]


def test_shape_rewards_penalises_scales_and_marks_malformed_thinking():
    cfg = build_config({"reward_penalties": {"penalize_malformed_think_tag": True},
                        "grpo": {"reward_scaling": {"enabled": True, "target_min": -1.0}}})
    good, bad = traj(0, 1.0, [([7, 2], [])]), traj(0, 1.0, [([8, 2], [])])
    bad.messages[1].content = "<think>oops"
    b, metrics = shape_rewards(cfg, build_batch([good, bad], pad_id=0), build_char_tokenizer())
    assert b.raw_rewards_b.tolist() == [1.0, 1.0]
    assert b.rewards_b.tolist() == [1.0, -1.0]  # zeroed by the penalty, then scaled from [0, 1] to [-1, 1]
    assert b.task_rewards_b.tolist() == [1.0, -1.0]  # no shaping configured
    assert b.message_spans == build_batch([good, bad], pad_id=0).message_spans  # the penalty flags no message
    assert metrics == {"malformed_think_tag_rate": 0.5, "reward_penalty_rate": 0.5}  # NeMo-RL's name
    # grpo.malformed_thinking_advantage flags the message, on its own, and changes no reward.
    cfg = build_config({"grpo": {"malformed_thinking_advantage": -1.0}})
    b, metrics = shape_rewards(cfg, build_batch([good, bad], pad_id=0), build_char_tokenizer())
    assert b.rewards_b.tolist() == [1.0, 1.0] and metrics == {}
    assert b.message_spans[1][0][2] == ("malformed_thinking",) and b.message_spans[0][0][2] == ()


def test_a_prompt_that_opens_the_think_block_makes_a_closing_tag_well_formed():
    cfg = build_config({"grpo": {"malformed_thinking_advantage": -1.0}})
    tok = build_char_tokenizer()
    opened = traj(0, 1.0, [([7, 2], [])], prompt=tok("q <think>")["input_ids"])
    closed = traj(0, 1.0, [([7, 2], [])], prompt=tok("q")["input_ids"])
    for t in (opened, closed):
        t.messages[1].content = "hmm</think> 4"
    b, _ = shape_rewards(cfg, build_batch([opened, closed], pad_id=0), tok)
    assert [spans[0][2] for spans in b.message_spans] == [(), ("malformed_thinking",)]


def test_thinking_once_in_each_of_two_turns_keeps_its_reward_and_a_malformed_turn_is_caught():
    """Issue 20: the think-tag checks ran on all turns' text joined, so '<think>a</think>x<think>b</think>y' in
    two turns was malformed. NeMo-RL checks each (user, assistant) pair; so does shape_rewards, per turn."""
    cfg = build_config({"reward_penalties": {"penalize_malformed_think_tag": True, "penalize_empty_final_answer": True,
                                             "penalize_duplicated_reasoning": True},
                        "grpo": {"malformed_thinking_advantage": -1.0}})
    samples = []
    for second in ("<think>b</think>y", "<think>b</think>y</think>", "<think>b</think>"):
        t = traj(0, 1.0, [([10, 11], [20]), ([12, 2], [])])
        t.messages[1].content, t.messages[3].content = "<think>a</think>x", second
        samples.append(t)
    b, metrics = shape_rewards(cfg, build_batch(samples, pad_id=0), build_char_tokenizer())
    # 0: well formed; 1: its second turn has a stray close tag; 2: its last turn only thinks, so the final
    # answer is the first turn's 'x' (NeMo-RL walks back to the last content): not empty.
    assert b.rewards_b.tolist() == [1.0, 0.0, 1.0]
    assert [[f for _, _, f in spans] for spans in b.message_spans] == [[(), ()], [(), ("malformed_thinking",)],
                                                                       [(), ()]]
    assert metrics["malformed_think_tag_rate"] == pytest.approx(1 / 3)
    assert metrics["empty_final_answer_rate"] == 0.0 and metrics["reasoning_equal_to_final_answer_rate"] == 0.0


def test_dynamic_sampling_drops_a_group_of_wrong_answers_whose_overlong_penalties_differ():
    """The issue's example: 4 wrong answers of lengths [100, 3500, 4000, 4096], max 4096, buffer 1024, penalty 1
    are shaped to [0, -0.418, -0.906, -1]; their task reward does not vary, so DAPO drops the group."""
    from grpo.dynamic_sampling import DynamicSamplingCache
    from grpo.step import group_std_for_dynamic_sampling

    cfg = build_config({"policy": {"max_total_sequence_length": 8192, "generation": {"max_new_tokens": 4096}},
                        "grpo": {"reward_shaping": {"enabled": True, "max_response_length": 4096,
                                                    "overlong_buffer_length": 1024, "overlong_buffer_penalty": 1.0}}})
    wrong = [traj(0, 0.0, [([5] * n, [])]) for n in (100, 3500, 4000, 4096)]
    right = [traj(1, r, [([5] * 10, [])], prompt=(1, 6)) for r in (1.0, 0.0, 0.0, 0.0)]  # another prompt
    b, _ = shape_rewards(cfg, build_batch(wrong + right, pad_id=0), build_char_tokenizer())
    torch.testing.assert_close(b.rewards_b[:4], torch.tensor([0.0, -0.418, -0.906, -1.0]), atol=1e-3, rtol=0)
    kept, _ = DynamicSamplingCache(1, 4, 2).add(b, b.prompt_groups(), group_std_for_dynamic_sampling(b))
    assert kept is not None and kept.raw_rewards_b.tolist() == [1.0, 0.0, 0.0, 0.0]  # only the mixed group


def test_a_prompt_drawn_twice_is_one_group_for_the_filter_as_for_the_baseline():
    """One definition of a group (by prompt tokens): slots 0 and 1 hold the same prompt, all right and all wrong. The
    baseline sees one group of 4 that varies (non-zero advantages), so DAPO's filter must keep it, and count two
    prompts; slot 2 (another prompt, all wrong) is dropped."""
    from grpo.dynamic_sampling import DynamicSamplingCache
    from grpo.step import group_std_for_dynamic_sampling

    cfg = build_config({})
    trajs = [traj(0, 1.0, [([7], [])]), traj(0, 1.0, [([8], [])]), traj(1, 0.0, [([7], [])]), traj(1, 0.0, [([9], [])]),
             traj(2, 0.0, [([7], [])], prompt=(1, 6)), traj(2, 0.0, [([8], [])], prompt=(1, 6))]
    b, _ = mask_invalid_samples(build_batch(trajs, pad_id=0))
    assert b.prompt_groups().tolist() == [0, 0, 0, 0, 1, 1]
    adv_bt, _, _ = compose_advantages(cfg, b.replace(sample_mask_b=initial_sample_mask(cfg, b)))
    assert (adv_bt[:4].abs().sum(1) > 0).all() and (adv_bt[4:] == 0).all()
    std_b = group_std_for_dynamic_sampling(b)
    assert (std_b[:4] > 0).all() and (std_b[4:] == 0).all()
    kept, _ = DynamicSamplingCache(2, 2, 1).add(b, b.prompt_groups(), std_b)
    assert kept.raw_rewards_b.tolist() == [1.0, 1.0, 0.0, 0.0] and kept.group_ids_b.tolist() == [0, 0, 1, 1]


def test_a_sample_that_failed_before_generating_is_in_its_prompt_s_group():
    """A failed sample with no generated token (an agent or a Gym server that never answered) still counts in its
    prompt's group: the group of 2 it leaves with one valid member is dropped; dynamic sampling reads whole groups."""
    from grpo.dynamic_sampling import DynamicSamplingCache
    from grpo.step import group_std_for_dynamic_sampling
    from grpo.trajectory import Failure

    never = traj(0, 0.0, [])
    never.fail(Failure.of("connection", "refused"))
    trajs = [traj(0, 1.0, [([7, 8], [])]), never, traj(1, 1.0, [([7], [])], prompt=(1, 6)),
             traj(1, 0.0, [([8], [])], prompt=(1, 6))]
    b, counts = mask_invalid_samples(build_batch(trajs, pad_id=0))
    assert b.prompt_groups().tolist() == [0, 0, 1, 1]
    assert b.valid_b.tolist() == [False, False, True, True] and counts["rollout/dropped_groups"] == 1
    kept, _ = DynamicSamplingCache(1, 2, 1).add(b, b.prompt_groups(), group_std_for_dynamic_sampling(b))
    assert kept.raw_rewards_b.tolist() == [1.0, 0.0]


def test_validation_accuracy_counts_a_penalised_sample_as_wrong(monkeypatch):
    """NeMo-RL's validate passes its reward_penalties to the rollout, so validation/accuracy is that of the
    penalised rewards (a malformed-thinking answer scores 0 there as in training)."""
    from types import SimpleNamespace

    import grpo.run.validation as validation_mod

    cfg = build_config({"reward_penalties": {"penalize_malformed_think_tag": True},
                        "grpo": {"val_batch_size": 2, "max_val_samples": 2}})
    good, bad = traj(0, 1.0, [([10, 2], [])]), traj(1, 1.0, [([11, 2], [])])
    good.messages[1].content, bad.messages[1].content = "<think>a</think>x", "<think>a</think>x</think>"
    monkeypatch.setattr(validation_mod, "run_rollout", lambda *a, **k: SimpleNamespace(
        trajectories=[good, bad], timing={"generate_s": 0.0, "env_step_s": 0.0}))
    monkeypatch.setattr(validation_mod, "dump_rollouts", lambda *a, **k: None)
    logged = {}
    logger = SimpleNamespace(log=lambda row, step: logged.update(row), print_samples=lambda *a: None)
    run = SimpleNamespace(cfg=cfg, val_ds=[object(), object()], logger=logger, tokenizer=build_char_tokenizer())
    metrics = validation_mod.validate(run, object(), None, step=3)
    assert metrics["accuracy"] == 0.5 and metrics["malformed_think_tag_rate"] == 0.5
    assert logged["validation/accuracy"] == 0.5


# NeMo-RL's _placeholder_seq_logprob_error_metrics (nemo_rl/algorithms/grpo.py at 7ea279a), as it is written there.
NEMO_RL_PLACEHOLDER = {"max_seq_mult_prob_error": 0.0, "mean_seq_mult_prob_error": 0.0, "min_seq_mult_prob_error": 0.0,
                       "max_seq_mult_prob_error_after_mask": 0.0, "mean_seq_mult_prob_error_after_mask": 0.0,
                       "min_seq_mult_prob_error_after_mask": 0.0, "num_masked_seqs_by_logprob_error": 0,
                       "masked_correct_pct": 0.0}


def test_seq_logprob_error_metrics_are_zero_when_the_previous_logprob_pass_is_skipped():
    """Without previous-policy logprobs (the pass skipped: force_on_policy_ratio, one update per step) NeMo-RL logs
    the sequence logprob-error metrics at 0, not nothing; with them, the same names carry the measured values."""
    skipped = _batch().replace(prev_logprobs_bt=None)
    _, mask_b, metrics = compose_advantages(build_config({}), skipped)
    assert {k: metrics[k] for k in NEMO_RL_PLACEHOLDER} == NEMO_RL_PLACEHOLDER
    assert isinstance(metrics["num_masked_seqs_by_logprob_error"], int) and mask_b.all()
    _, _, measured = compose_advantages(build_config({}), _batch())
    assert measured.keys() >= NEMO_RL_PLACEHOLDER.keys() and measured["max_seq_mult_prob_error"] > 1.0


def test_the_reward_kl_honours_the_configured_kl_clamps_where_nemo_rl_uses_its_defaults():
    """NeMo-RL#3853 (open after 7ea279a): NeMo-RL's reward-side KL (use_kl_in_reward) calls calculate_kl without
    loss_fn.kl_input_clamp_value / kl_output_clamp_value, so it clamps at the defaults (20, 10) whatever the config
    says. grpo-ds keeps its own on purpose (docs/nemo_rl.md, differences): the reward KL is the loss's KL, clamped
    as configured; at the default clamps the two agree."""
    from grpo.advantages import compute_advantages
    from grpo.loss import calculate_kl

    def config(**clamps):
        return build_config({"grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}},
                             "loss_fn": {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.5, **clamps}})

    g = torch.Generator().manual_seed(1)
    batch = _batch()
    ref = batch.prev_logprobs_bt + torch.randn(batch.prev_logprobs_bt.shape, generator=g) * 2.0  # uneven KL per token
    batch = batch.replace(ref_logprobs_bt=ref * batch.token_mask_bt)

    def with_kl(cfg, input_clamp, output_clamp):
        return compute_advantages("reinforce_plus_plus", group_ids=batch.prompt_groups(), rewards=batch.rewards_b,
                                  valid_mask=batch.valid_b.float(), token_mask=batch.token_mask_bt,
                                  cfg=cfg.grpo.adv_estimator, kl_bt=calculate_kl(batch.prev_logprobs_bt,
                                                                                batch.ref_logprobs_bt, "k3",
                                                                                input_clamp, output_clamp),
                                  kl_coef=0.5, sample_mask=batch.sample_mask_b, master_cfg=cfg)

    tight = config(kl_input_clamp_value=0.5, kl_output_clamp_value=0.1)
    adv, _, _ = compose_advantages(tight, batch)
    m = batch.token_mask_bt.bool()
    torch.testing.assert_close(adv[m], with_kl(tight, 0.5, 0.1)[m])
    assert not torch.allclose(adv[m], with_kl(tight, 20.0, 10.0)[m])  # NeMo-RL's reward KL: the defaults
    default, _, _ = compose_advantages(config(), batch)
    torch.testing.assert_close(default[m], with_kl(config(), 20.0, 10.0)[m])
