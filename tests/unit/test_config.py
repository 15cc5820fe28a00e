"""The config system: NeMo-RL names and defaults, YAML inheritance, dotted overrides, load-time checks."""

import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import ClusterConfig, MasterConfig, cluster_mismatch, resolve_skip_flags
from grpo.config.load import ConfigError, apply_overrides, build_config, load_config, load_yaml

REPO = Path(__file__).resolve().parents[2]


def bad(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        build_config(apply_overrides({}, list(overrides)))
    return str(e.value)


def test_defaults_are_nemo_rl_defaults():
    c = MasterConfig()
    assert (c.grpo.num_prompts_per_step, c.grpo.num_generations_per_prompt) == (32, 16)
    assert c.grpo.use_leave_one_out_baseline and c.grpo.normalize_rewards
    assert c.grpo.dynamic_sampling_max_gen_batches == 10 and c.grpo.batch_multiplier == 1.0
    assert c.grpo.async_grpo.max_trajectory_age_steps == 1 and c.grpo.async_grpo.max_generation_failures == 0
    loss = c.loss_fn
    assert (loss.ratio_clip_min, loss.ratio_clip_max, loss.ratio_clip_c) == (0.2, 0.2, None)
    assert (loss.reference_policy_kl_penalty, loss.reference_policy_kl_type) == (0.01, "k3")
    assert (loss.kl_input_clamp_value, loss.kl_output_clamp_value) == (20.0, 10.0)
    assert loss.token_level_loss and not loss.use_importance_sampling_correction
    assert c.grpo.reward_scaling.model_dump() == dict(enabled=False, source_min=0.0, source_max=1.0,
                                                      target_min=0.0, target_max=1.0)
    # the estimator inherits the top-level (legacy NeMo-RL) switches unless set itself
    assert c.grpo.adv_estimator.normalize_rewards is True
    assert load_config(None, ["grpo.use_leave_one_out_baseline=false"]).grpo.adv_estimator.use_leave_one_out_baseline \
        is False


def test_dotted_overrides_parse_yaml_values(tmp_path):
    c = load_config(None, ["grpo.num_prompts_per_step=8", "loss_fn.ratio_clip_max=0.28", "policy.generation.top_k=null",
                           "policy.generation.stop_strings=['</answer>', 'END']", "grpo.val_at_start=true",
                           "policy.train_global_batch_size=128"])
    assert c.grpo.num_prompts_per_step == 8 and c.loss_fn.ratio_clip_max == 0.28
    assert c.policy.generation.top_k is None and c.policy.generation.stop_strings == ["</answer>", "END"]
    assert c.grpo.val_at_start is True


def test_recipe_inheritance_merges_deeply(tmp_path):
    (tmp_path / "base.yaml").write_text("grpo:\n  num_prompts_per_step: 4\n  seed: 1\npolicy:\n"
                                        "  train_global_batch_size: 64\n")
    (tmp_path / "mid.yaml").write_text("defaults: base.yaml\ngrpo:\n  seed: 2\n")
    (tmp_path / "top.yaml").write_text("defaults: mid.yaml\ngrpo:\n  num_generations_per_prompt: 16\n")
    c = load_config(tmp_path / "top.yaml", ["grpo.seed=3"])
    assert (c.grpo.num_prompts_per_step, c.grpo.num_generations_per_prompt, c.grpo.seed) == (4, 16, 3)
    (tmp_path / "loop.yaml").write_text("defaults: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_yaml(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_recipe_loads(path):
    load_config(REPO / path)


@pytest.mark.parametrize("overrides, key, expected", [
    (["grpo.num_prompt_per_step=4"], "grpo.num_prompt_per_step", "unknown key"),
    (["policy.optimizer.lrr=1"], "policy.optimizer.lrr", "unknown key"),
    (["grpo.num_prompts_per_step=abc"], "grpo.num_prompts_per_step", "valid integer"),
    (["grpo.num_generations_per_prompt=0"], "grpo.num_generations_per_prompt", "greater than 0"),
    (["policy.precision=fp8"], "policy.precision", "'float32', 'bfloat16' or 'float16'"),
    (["loss_fn.reference_policy_kl_type=k4"], "loss_fn.reference_policy_kl_type", "'k1', 'k2' or 'k3'"),
    (["grpo.adv_estimator.name=ppo"], "grpo.adv_estimator.name", "['gdpo', 'grpo', 'opd', 'reinforce_plus_plus'"),
    (["grpo.advantage_clip_low=2", "grpo.advantage_clip_high=1"], "grpo.advantage_clip_low", "expected <"),
    (["grpo.async_grpo.enabled=true"], "grpo.async_grpo.enabled", "use_importance_sampling_correction=true"),
    (["reward_penalties.penalize_unwanted_tokens=true"], "reward_penalties.token_ids.unwanted", "list of token ids"),
    (["loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.use_importance_sampling_correction=true",
      "loss_fn.truncated_importance_sampling_ratio=2"], "truncated_importance_sampling_ratio_min", "expected a number"),
    (["loss_fn.sequence_level_importance_ratios=true"], "loss_fn.token_level_loss=false", "GSPO"),
    (["policy.train_global_batch_size=100"], "policy.train_global_batch_size=100", "divisor"),
    (["grpo.stop_at_validation_metric=reward_mean"], "grpo.stop_at_validation_threshold", "set together"),
    (["env.name=function"], "env.reward_fn", "package.module:function"),
    (["checkpointing.checkpoint_must_save_by=3:45:00"], "checkpointing.checkpoint_must_save_by", "DD:HH:MM:SS"),
    (["checkpointing.checkpoint_must_save_by=1:00:00:00"], "checkpointing.checkpoint_must_save_by='216000'",
     "base-60"),
    (["checkpointing.checkpoint_must_save_by=00:03:45:00", "checkpointing.enabled=false"],
     "checkpointing.checkpoint_must_save_by='00:03:45:00'", "checkpointing.enabled=true"),
    (["loss_fn.use_kl_in_reward=true", "loss_fn.force_on_policy_ratio=true", "grpo.adv_estimator.name=reinforce_plus_plus",
      "policy.train_global_batch_size=512"], "loss_fn.use_kl_in_reward", "force_on_policy_ratio"),
])
def test_bad_values_name_the_key_and_what_was_expected(overrides, key, expected):
    msg = bad(*overrides)
    assert key in msg and expected in msg, msg


def test_the_async_loop_takes_agents_and_the_endpoint():
    """train_async_grpo.py serves the endpoint (issue 32): an agent recipe and expose_http_server load with it."""
    on = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
    assert load_config(REPO / "configs" / "cpu_demo_agent.yaml", on).env.name == "agent"
    assert load_config(None, [*on, "policy.generation.vllm_cfg.expose_http_server=true"]).grpo.async_grpo.enabled


@pytest.mark.parametrize("nodes, gpus, world, local, expected", [
    (None, None, 16, 8, None),                              # unset: whatever the launcher started
    (2, 8, 16, 8, None),
    (1, 8, 2, 2, "cluster.num_nodes=1 x cluster.gpus_per_node=8 = 8 ranks, but the launcher started 2"),
    (None, 8, 16, 4, "cluster.gpus_per_node=8, but the launcher started 4 ranks on this node"),
    (None, 8, 8, None, None),                               # a launcher that does not say LOCAL_WORLD_SIZE
    (3, None, 8, 4, "cluster.num_nodes=3 does not divide the 8 ranks"),
])
def test_cluster_is_checked_against_the_launcher(nodes, gpus, world, local, expected):
    msg = cluster_mismatch(ClusterConfig(num_nodes=nodes, gpus_per_node=gpus), world, local)
    assert msg == expected if expected is None else expected in msg


def test_kl_in_reward_with_force_on_policy_is_allowed_when_its_inputs_exist():
    base = ["loss_fn.use_kl_in_reward=true", "loss_fn.force_on_policy_ratio=true",
            "grpo.adv_estimator.name=reinforce_plus_plus", "policy.train_global_batch_size=512"]
    build_config(apply_overrides({}, base + ["grpo.seq_logprob_error_threshold=2.0"]))
    build_config(apply_overrides({}, base + ["loss_fn.reference_policy_kl_penalty=0"]))


@pytest.mark.parametrize("overrides, flags", [
    ([], (True, False)),                                      # one optimizer step per rollout: exact
    (["policy.train_global_batch_size=8"], (False, False)),   # several optimizer steps: its own pass
    (["loss_fn.reference_policy_kl_penalty=0"], (True, True)),
    (["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=512"], (True, False)),
    (["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=512",
      "grpo.seq_logprob_error_threshold=2"], (False, False)),
    (["loss_fn.reference_policy_kl_penalty=0", "loss_fn.use_kl_in_reward=true",
      "grpo.adv_estimator.name=reinforce_plus_plus"], (True, True)),   # a 0-weighted reward KL: no reference
    # NeMo-RL (grpo.py setup): a penalty of 0 turns the flag on, whatever the config says
    (["loss_fn.reference_policy_kl_penalty=0", "grpo.skip_reference_policy_logprobs_calculation=false"],
     (True, True)),
    (["loss_fn.reference_policy_kl_penalty=0", "grpo.skip_reference_policy_logprobs_calculation=true"],
     (True, True)),
    (["grpo.skip_reference_policy_logprobs_calculation=null"], (True, False)),   # null: false
])
def test_skip_flag_resolution(overrides, flags):
    assert resolve_skip_flags(build_config(apply_overrides({}, overrides))) == flags


def test_skipping_the_reference_needs_a_kl_penalty_of_0_as_in_nemo_rl():
    msg = bad("grpo.skip_reference_policy_logprobs_calculation=true")  # the default penalty is 0.01
    assert "grpo.skip_reference_policy_logprobs_calculation=true requires loss_fn.reference_policy_kl_penalty == 0" in msg
    assert "(got 0.01)" in msg


@pytest.mark.parametrize("value, expected", [
    ("val:accuracy", "val:accuracy"), ("val:avg_length", "val:avg_length"), ("train:loss", "train:loss"),
    ("train:mean_total_reward", "train:mean_total_reward"),
    # grpo-ds's former forms are read as NeMo-RL's
    ("val_reward", "val:accuracy"), ("val/reward_mean", "val:accuracy"), ("val/pass@4", "val:pass_k"),
    ("validation/accuracy", "val:accuracy"), ("val:reward_mean", "val:accuracy"), ("train/loss", "train:loss"),
])
def test_checkpoint_metric_name_takes_nemo_rl_form_and_reads_the_former_ones(value, expected):
    cfg = build_config(apply_overrides({}, [f"checkpointing.metric_name={value}",
                                            "grpo.val_num_generations_per_prompt=4"]))
    assert cfg.checkpointing.metric_name == expected


@pytest.mark.parametrize("value, expected", [
    ("accuracy", ["checkpointing.metric_name='accuracy'", "expected NeMo-RL's form 'val:<name>'",
                  "'train:<name>'"]),
    ("loss", ["checkpointing.metric_name='loss'", "'train:<name>' (a train/ metric, e.g. train:loss)"]),
    ("val_accuracy", ["checkpointing.metric_name='val_accuracy'", "expected NeMo-RL's form"]),
    ("val:reward", ["checkpointing.metric_name='val:reward'", "validation reports ['accuracy', 'avg_length'"]),
    ("val:pass_k", ["checkpointing.metric_name='val:pass_k'", "pass_k needs grpo.val_num_generations_per_prompt > 1"]),
])
def test_checkpoint_metric_name_errors_name_key_value_and_the_form(value, expected):
    msg = bad(f"checkpointing.metric_name={value}")
    for part in expected:
        assert part in msg, msg


def test_checkpoint_metric_name_default_is_nemo_rl_recipe_one():
    assert MasterConfig().checkpointing.metric_name == "val:accuracy"


@pytest.mark.parametrize("value, k, expected", [
    ("accuracy", 1, "accuracy"), ("reward_mean", 1, "accuracy"), ("pass_k", 4, "pass_k"), ("pass@k", 4, "pass_k"),
    ("pass@4", 4, "pass_k"), ("validation/avg_length", 1, "avg_length"), ("response_length_mean", 1, "avg_length"),
])
def test_stop_at_validation_metric_takes_nemo_rl_names(value, k, expected):
    cfg = build_config(apply_overrides({}, [f"grpo.stop_at_validation_metric={value}",
                                            "grpo.stop_at_validation_threshold=0.5",
                                            f"grpo.val_num_generations_per_prompt={k}"]))
    assert cfg.grpo.stop_at_validation_metric == expected


def test_stop_at_pass_k_without_groups_says_why():
    msg = bad("grpo.stop_at_validation_metric=pass_k", "grpo.stop_at_validation_threshold=0.5")
    assert "grpo.stop_at_validation_metric='pass_k'" in msg and "needs grpo.val_num_generations_per_prompt > 1" in msg


def test_val_start_at_and_val_sampling_fields():
    cfg = MasterConfig()
    assert cfg.grpo.val_start_at == -1
    g = cfg.policy.generation
    assert (g.val_temperature, g.val_top_p, g.val_top_k) == (None, None, None)
    assert "grpo.val_start_at" in bad("grpo.val_start_at=-2")
    assert "policy.generation.val_top_p" in bad("policy.generation.val_top_p=1.5")


def test_config_module_imports_nothing_heavy():
    code = "import sys, grpo.config; print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
