"""NeMo-RL recipes as they are (grpo.config.nemo_rl.recipe, grpo.config.nemo_rl.rules): recognition, NeMo-RL's defaults and
interpolation, hydra-style overrides, the translation table, refusals, --check-config. The recipes are ours,
written in NeMo-RL's format under tests/fixtures/nemo_rl/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config.load import ConfigError, load_config
from grpo.config.nemo_rl.recipe import is_nemo_rl_recipe, load_nemo_rl, load_recipe, looks_like_nemo_rl

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "nemo_rl"
BASE = FIX / "base_math.yaml"
CHILD = FIX / "recipes" / "llm" / "grpo-fixture-child.yaml"
GRANDCHILD = FIX / "recipes" / "llm" / "more" / "grpo-fixture-grandchild.yaml"
DAPO = FIX / "recipes" / "llm" / "grpo-fixture-dapo-megatron.yaml"


def table_of(rows, kind):
    return {key: why for k, key, why in rows if k == kind}


# --------------------------------------------------------------------------------------------------
# Recognition: NeMo-RL's shape, never a native config
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, marker", [
    ({"policy": {"dtensor_cfg": {"enabled": True}}}, "policy.dtensor_cfg"),
    ({"policy": {"megatron_cfg": {"enabled": False}}}, "policy.megatron_cfg"),
    ({"policy": {"optimizer": {"name": "torch.optim.AdamW", "kwargs": {}}}}, "policy.optimizer.kwargs"),
    ({"policy": {"scheduler": [{"milestones": [1]}]}}, "policy.scheduler (a list)"),
    ({"data": {"train": {"dataset_name": "DeepScaler"}}}, "data.train"),
    ({"data": {"default": {"env_name": "math"}}}, "data.default"),
    ({"env": {"math": {"num_workers": 8}}}, "env.math"),
    ({"policy": {"logprob_batch_size": "${policy.train_micro_batch_size}"}}, "policy.logprob_batch_size"),
])
def test_nemo_rl_markers(raw, marker):
    assert looks_like_nemo_rl(raw).startswith(marker)


def test_native_configs_are_not_recipes_and_load_as_before():
    natives = [REPO / "tests" / "configs" / "tiny.yaml", *sorted((REPO / "configs").glob("*.yaml"))]
    for path in natives:
        assert not is_nemo_rl_recipe(path), path
    # ${...} in free text (a prompt template) is no marker; env.tasks (a native env field) neither.
    assert looks_like_nemo_rl({"data": {"prompt_template": "cost ${x} {}"}, "env": {"tasks": {"a": {}}}}) is None
    # A native config keeps extra="forbid": a NeMo-RL-only key it does not carry is still an unknown key.
    with pytest.raises(ConfigError, match="policy.offload_optimizer_for_logprob: unknown key"):
        load_config(REPO / "tests" / "configs" / "tiny.yaml", ["policy.offload_optimizer_for_logprob=false"])


def test_all_fixtures_are_recipes():
    for path in (BASE, CHILD, GRANDCHILD, DAPO):
        assert is_nemo_rl_recipe(path), path


# --------------------------------------------------------------------------------------------------
# NeMo-RL's loading: defaults chain, _override_, interpolation, overrides before interpolation
# --------------------------------------------------------------------------------------------------
def test_defaults_chain_two_levels_relative_paths_and_override_marker():
    nrl = load_nemo_rl(GRANDCHILD)
    assert nrl["grpo"]["num_generations_per_prompt"] == 8          # grandchild
    assert nrl["grpo"]["num_prompts_per_step"] == 4                # child
    assert nrl["grpo"]["max_num_steps"] == 100                     # base
    assert nrl["policy"]["generation"]["temperature"] == 0.9       # child, merged into base's section
    assert nrl["policy"]["generation"]["top_p"] == 0.95            # grandchild
    assert nrl["cluster"] == {"gpus_per_node": 2}                  # _override_: replaced, not merged
    cfg, rows = load_recipe(GRANDCHILD)
    assert cfg.cluster.num_nodes is None and "cluster.master_port_range_low" not in table_of(rows, "ignored")


def test_interpolation_with_nemo_rl_resolvers_and_relative_keys():
    nrl = load_nemo_rl(CHILD)
    p = nrl["policy"]
    assert p["dynamic_batching"]["train_mb_tokens"] == 24 * 8           # ${mul:...}
    assert p["make_sequence_length_divisible_by"] == 1                 # ${max:...}
    assert p["generation"]["val_temperature"] == 0.9                    # ${.temperature} follows the child's value
    assert p["generation"]["max_new_tokens"] == 24 and p["logprob_batch_size"] == 8
    dapo = load_nemo_rl(DAPO)
    assert dapo["policy"]["generation"]["max_new_tokens"] == 16        # ${mul:32, 0.5}
    assert dapo["grpo"]["reward_shaping"]["max_response_length"] == 16


def test_overrides_apply_before_interpolation():
    cfg, _ = load_recipe(CHILD, ["policy.max_total_sequence_length=48", "policy.train_micro_batch_size=4",
                                 "policy.generation.temperature=0.7"])
    assert cfg.policy.generation.max_new_tokens == 48
    assert cfg.policy.generation.vllm_cfg.max_model_len == 48
    assert cfg.data.max_input_seq_length == 48
    assert cfg.policy.logprob_batch_size == 4
    assert cfg.grpo.reward_shaping.max_response_length == 48
    assert cfg.policy.generation.val_temperature == 0.7


def test_an_override_replaces_an_interpolation_without_resolving_it_first(tmp_path):
    """NeMo-RL's Gym recipes set ``train_global_batch_size: ${mul:...}``: overriding such a key must not resolve the
    value it replaces (it failed with 'Unsupported interpolation type mul' before the resolvers were registered)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: {CHILD}\npolicy:\n  train_global_batch_size: ${{mul:${{grpo.no_such_key}}, 2}}\n")
    cfg, _ = load_recipe(recipe, ["policy.train_global_batch_size=16"])
    assert cfg.policy.train_global_batch_size == 16


def test_hydra_override_forms():
    with pytest.raises(ConfigError, match=r"policy.max_total_seq_length: the recipe has no such key.*\+policy"):
        load_recipe(BASE, ["policy.max_total_seq_length=8"])
    with pytest.raises(ConfigError, match=r"\+grpo.seed: the recipe already has grpo.seed"):
        load_recipe(BASE, ["+grpo.seed=3"])
    cfg, _ = load_recipe(BASE, ["++grpo.seed=3", "+policy.tokenizer.chat_template=null"])
    assert cfg.grpo.seed == 3 and cfg.data.split_validation_seed == 3  # ${grpo.seed} follows
    assert cfg.policy.tokenizer.chat_template is None
    cfg, _ = load_recipe(BASE, ["data.train={dataset_name: ResponseDataset, data_path: x.jsonl}"])
    assert cfg.data.train_data_path.endswith("x.jsonl") and cfg.data.split_validation_size == 0.05  # merged


def test_missing_mandatory_value_and_bad_interpolation_name_the_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE.read_text().replace("model_name: toy:demo", "model_name: ???"))
    with pytest.raises(ConfigError, match="policy.model_name"):
        load_recipe(recipe)
    # As in NeMo-RL, ??? in a child keeps the parent's value (a child may leave it to the parent or an override).
    recipe.write_text(f"defaults: {BASE}\npolicy:\n  model_name: ???\n")
    assert load_recipe(recipe)[0].policy.model_name == "toy:demo"
    recipe.write_text(f"defaults: {BASE}\ngrpo:\n  seed: ${{policy.nope}}\n")
    with pytest.raises(ConfigError, match="grpo.seed: cannot interpolate"):
        load_recipe(recipe)


# --------------------------------------------------------------------------------------------------
# Translated keys
# --------------------------------------------------------------------------------------------------
def test_dtensor_path_optimizer_scheduler_and_data():
    cfg, rows = load_recipe(BASE)
    o, s = cfg.policy.optimizer, cfg.policy.scheduler
    assert (o.name, o.lr, o.weight_decay, tuple(o.betas), o.eps) == ("adamw", 1e-3, 0.0, (0.9, 0.99), 1e-8)
    assert (s.name, s.warmup_steps, s.warmup_start_factor, s.decay_steps) == ("constant", 4, 0.25, None)
    assert cfg.policy.tokenizer.name is None and cfg.policy.tokenizer.chat_template == "default"
    d = cfg.data
    assert (d.dataset_name, d.train_split, d.input_key, d.output_key) == (
        "nvidia/OpenMathInstruct-2", "train_1M", "problem", "expected_answer")
    assert (d.split_validation_size, d.split_validation_seed) == (0.05, 7)
    assert d.prompt_file == str(REPO / "configs" / "prompts" / "cot.txt")  # our wording: the path is not here
    assert (cfg.env.name, cfg.env.num_workers) == ("math", 2)
    assert cfg.grpo.val_start_at == -1 and cfg.cluster.gpus_per_node == 8
    translated = table_of(rows, "translated")
    assert "LinearLR + ConstantLR" in translated["policy.scheduler"]
    assert "configs/prompts/cot.txt" in translated["data.default.prompt_file"]


def test_scheduler_matches_torch_sequential_lr():
    import torch

    from grpo.system.engines import lr_lambda

    def torch_lrs(schedulers, milestones, n, lr=1.0):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        made = [getattr(torch.optim.lr_scheduler, name)(opt, **kw) for name, kw in schedulers]
        seq = torch.optim.lr_scheduler.SequentialLR(opt, made, milestones=milestones)
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            seq.step()
        return out

    const = [("LinearLR", dict(start_factor=0.25, end_factor=1.0, total_iters=4)),
             ("ConstantLR", dict(factor=1.0, total_iters=10**9))]
    cfg, _ = load_recipe(BASE)
    s = cfg.policy.scheduler
    ours = [lr_lambda(t, name=s.name, warmup_steps=s.warmup_steps, total_steps=50,
                      warmup_start_factor=s.warmup_start_factor, decay_steps=s.decay_steps) for t in range(12)]
    assert ours == pytest.approx(torch_lrs(const, [4], 12))

    cosine = [("LinearLR", dict(start_factor=0.1, end_factor=1.0, total_iters=3)),
              ("CosineAnnealingLR", dict(T_max=10, eta_min=1e-4))]
    cfg, rows = load_recipe(BASE, [
        "policy.scheduler=[{name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, total_iters: 3}},"
        " {name: torch.optim.lr_scheduler.CosineAnnealingLR, kwargs: {T_max: 10, eta_min: 1.0e-4}}, {milestones: [3]}]"])
    s = cfg.policy.scheduler
    assert (s.name, s.warmup_steps, s.decay_steps, s.min_lr_ratio) == ("cosine", 3, 13, pytest.approx(0.1))
    ours = [lr_lambda(t, name=s.name, warmup_steps=s.warmup_steps, total_steps=50, min_lr_ratio=s.min_lr_ratio,
                      warmup_start_factor=s.warmup_start_factor, decay_steps=s.decay_steps) for t in range(14)]
    expected = torch_lrs(cosine, [3], 14, lr=1e-3)  # the recipe's lr: eta_min / lr is the floor
    assert [x * 1e-3 for x in ours] == pytest.approx(expected, rel=1e-6)


def test_megatron_path_translates_megatron_optimizer_and_scheduler_and_dapo_data():
    cfg, rows = load_recipe(DAPO)
    o, s = cfg.policy.optimizer, cfg.policy.scheduler
    assert (o.lr, o.weight_decay, tuple(o.betas), o.eps) == (2e-6, 0.01, (0.9, 0.98), 1e-8)
    assert (s.name, s.warmup_steps, s.decay_steps) == ("cosine", 10, 100)
    assert s.warmup_start_factor == pytest.approx(0.1) and s.min_lr_ratio == pytest.approx(0.1)
    assert cfg.policy.activation_checkpointing is True
    d = cfg.data
    assert (d.dataset_name, d.input_key, d.output_key) == (
        "BytedTsinghua-SIA/DAPO-Math-17k", "prompt.0.content", "reward_model.ground_truth")
    assert (d.val_data_path, d.val_split, d.prompt_file, d.split_validation_size) == (
        "BytedTsinghua-SIA/AIME-2024", "train", None, 0)
    g = cfg.grpo
    assert g.use_dynamic_sampling and g.batch_multiplier == 2 and cfg.loss_fn.ratio_clip_max == 0.28
    assert g.reward_shaping.enabled and g.reward_shaping.max_response_length == 16
    ignored = table_of(rows, "ignored")
    assert "Megatron parallelism" in ignored["policy.megatron_cfg"]
    assert "megatron_cfg.enabled=true" in ignored["policy.optimizer"]
    assert "DAPOMath17K takes no split_validation_size" in ignored["data.train.split_validation_size"]


def test_vllm_cfg_kwargs_backend_and_async():
    cfg, rows = load_recipe(BASE, ["policy.generation.vllm_kwargs={compilation_config: {backend: eager}, "
                                   "kv_cache_memory_bytes: 1048576}", "policy.generation.backend=sglang"])
    v = cfg.policy.generation.vllm_cfg
    assert v.vllm_kwargs == {"compilation_config": {"backend": "eager"}} and v.kv_cache_memory_bytes == 1048576
    assert (v.enforce_eager, v.gpu_memory_utilization, v.max_model_len) == (True, 0.5, 32)
    assert cfg.policy.generation.backend == "vllm"
    assert "sglang" in table_of(rows, "translated")["policy.generation.backend"]
    cfg, rows = load_recipe(BASE, ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"])
    assert cfg.grpo.async_grpo.enabled and cfg.policy.generation.backend == "hf"
    assert "hf backend" in table_of(rows, "translated")["policy.generation.backend"]


def test_cispo_and_vapo_nll_weight_are_honored():
    """grpo.loss implements both (tests/unit/test_loss_cispo_vapo.py); CISPO's recipe bounds pass as they are."""
    cfg, rows = load_recipe(BASE, ["loss_fn.use_cispo=true", "loss_fn.ratio_clip_min=1.0", "loss_fn.ratio_clip_max=5.0",
                                   "loss_fn.use_importance_sampling_correction=true"])
    lf = cfg.loss_fn
    assert (lf.use_cispo, lf.ratio_clip_min, lf.ratio_clip_max, lf.positive_example_nll_weight) == (True, 1.0, 5.0, 0.0)
    assert "loss_fn.use_cispo" not in table_of(rows, "translated")
    cfg, rows = load_recipe(BASE, ["loss_fn.positive_example_nll_weight=0.1"])
    assert cfg.loss_fn.positive_example_nll_weight == 0.1 and not cfg.loss_fn.use_cispo
    assert "only ppo.py does" in table_of(rows, "translated")["loss_fn.positive_example_nll_weight"]


@pytest.mark.parametrize("override, key", [
    ("loss_fn.ratio_clip_c=3.0", "loss_fn.ratio_clip_c"),
    ("++loss_fn.force_on_policy_ratio=true", "loss_fn.force_on_policy_ratio"),
    ("loss_fn.token_level_loss=false", "loss_fn.token_level_loss"),
    ("++loss_fn.disable_ppo_ratio=true", "loss_fn.disable_ppo_ratio"),
])
def test_cispo_combinations_nemo_rl_rejects_are_rejected(override, key):
    with pytest.raises(ConfigError, match=f"use_cispo=true cannot be combined with {key}="):
        load_recipe(BASE, ["loss_fn.use_cispo=true", override])


def test_checkpoint_metric_name_and_validation_sampling():
    cfg, _ = load_recipe(BASE)
    assert cfg.checkpointing.metric_name in ("val:accuracy", "val/reward_mean")  # passed through once accepted
    cfg, _ = load_recipe(BASE, ["policy.generation.val_top_p=0.5"])
    assert cfg.policy.generation.val_top_p == 0.5 and cfg.policy.generation.top_p == 1.0


def test_non_colocated_generation_translates_to_generation_ranks():
    on_own_ranks = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=4",
                    "cluster.gpus_per_node=8", "cluster.num_nodes=1"]
    cfg, _ = load_recipe(BASE, on_own_ranks)
    c = cfg.policy.generation.colocated
    assert (c.enabled, c.resources.gpus_per_node, c.resources.num_nodes) == (False, 4, None)
    async_on = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
    cfg, _ = load_recipe(BASE, [*on_own_ranks, *async_on, "policy.generation.backend=vllm"])
    assert cfg.policy.generation.backend == "vllm"  # async on vLLM: generation ranks, as in NeMo-RL
    cfg, rows = load_recipe(BASE, [*async_on, "policy.generation.backend=vllm"])
    assert cfg.policy.generation.backend == "hf" and "colocated" in table_of(rows, "translated")["policy.generation.backend"]
    with pytest.raises(ConfigError, match="gpus_per_node=None"):  # NeMo-RL asks for it on one node too
        load_recipe(BASE, ["policy.generation.colocated.enabled=false"])


def test_no_validation_data_turns_periodic_validation_off():
    cfg, rows = load_recipe(BASE, ["data.train.split_validation_size=0"])
    assert (cfg.grpo.val_period, cfg.grpo.val_at_start, cfg.grpo.val_at_end) == (0, False, False)
    assert "no validation data" in table_of(rows, "translated")["data.validation"]


def test_sequence_packing_and_dynamic_batching_translate_with_their_values():
    cfg, rows = load_recipe(BASE, ["++policy.sequence_packing.sequence_length_round=64",
                                   "++policy.sequence_packing.algorithm=first_fit_decreasing",
                                   "++policy.dynamic_batching={enabled: false, sequence_length_round: 64}"])
    sp, p = cfg.policy.sequence_packing, cfg.policy
    assert sp.enabled and not p.dynamic_batching.enabled
    assert (sp.algorithm, sp.microbatch_order, sp.sequence_length_round) == ("first_fit_decreasing", "packer", 64)
    assert sp.train_mb_tokens == p.max_total_sequence_length * p.train_micro_batch_size   # the recipe's interpolation
    assert table_of(rows, "translated")["policy.dynamic_batching"] == "-> policy.dynamic_batching.enabled=False"
    cfg, _ = load_recipe(BASE, ["policy.sequence_packing.enabled=false",
                                "++policy.dynamic_batching={enabled: true, train_mb_tokens: 4096}"])
    assert not cfg.policy.sequence_packing.enabled and cfg.policy.dynamic_batching.train_mb_tokens == 4096
    with pytest.raises(ConfigError, match="exclusive"):
        load_recipe(BASE, ["++policy.dynamic_batching={enabled: true}"])
    with pytest.raises(ConfigError, match="algorithm"):
        load_recipe(BASE, ["++policy.sequence_packing.algorithm=best_fit"])


# --------------------------------------------------------------------------------------------------
# Ignored keys, each with its reason; refused keys, each naming the key and why
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key, reason", [
    ([], "policy.megatron_cfg", "megatron_cfg.enabled=false"),
    ([], "policy.dtensor_cfg", "DTensor (FSDP2) internals"),
    ([], "policy.dtensor_cfg.lora_cfg", "full fine-tuning"),
    ([], "policy.generation.vllm_cfg", "vLLM engine internals"),
    ([], "policy.tokenizer.use_fastokens", "tokenizer"),
    ([], "logger.mlflow_enabled", "MLflow"),
    ([], "cluster.master_port_range_low", "Ray cluster ports"),
    ([], "data_plane", "TransferQueue"),
    (["policy.dtensor_cfg.tensor_parallel_size=2"], "policy.dtensor_cfg.tensor_parallel_size", "the same math"),
    (["++policy.generation.trtllm_cfg={x: 1}"], "policy.generation.trtllm_cfg", "TRT-LLM"),
    (["checkpointing.save_optimizer=false"], "checkpointing.save_optimizer", "always hold the optimizer"),
])
def test_ignored_keys_are_listed_with_their_reason(overrides, key, reason):
    _, rows = load_recipe(BASE, overrides)
    assert reason in table_of(rows, "ignored")[key]


def test_http_server_keys_are_kept():
    """NeMo-RL's endpoint keys mean the same here (grpo/wings/agents/endpoint.py): the port range, the switch
    and the chat kwargs the endpoint implements; vLLM's serving internals among them are ignored, named."""
    cfg, rows = load_recipe(BASE, ["++policy.generation.vllm_cfg.expose_http_server=true",
                                   "++policy.generation.vllm_cfg.http_server_serving_chat_kwargs={tool_parser: hermes, "
                                   "enable_auto_tools: true}"])
    g = cfg.policy.generation
    assert (g.port_range_low, g.port_range_high) == (3000, 4000)
    assert g.vllm_cfg.expose_http_server and g.vllm_cfg.http_server_serving_chat_kwargs.tool_parser == "hermes"
    assert "serving internals" in table_of(rows, "ignored")["policy.generation.vllm_cfg.http_server_serving_chat_kwargs"]


@pytest.mark.parametrize("overrides, key, reason", [
    (["policy.draft.enabled=true"], "policy.draft.enabled", "draft model"),
    (["policy.dtensor_cfg.lora_cfg.enabled=true", "++policy.dtensor_cfg.lora_cfg.lora_A_init=gaussian"],
     "policy.dtensor_cfg.lora_cfg.lora_A_init", "xavier and uniform"),
    (["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.peft.enabled=true",
      "++policy.megatron_cfg.peft.lora_dtype=float32"], "policy.megatron_cfg.peft.lora_dtype", "model's dtype"),
    (["data.default.env_name=reward_model", "++env.reward_model={model_name: rm, dtensor_cfg: {enabled: true, "
      "cpu_offload: true}}"], "env.reward_model.dtensor_cfg.cpu_offload", "NeMo-RL asserts it"),
    (["++env.nemo_gym={x: 1}"], "env.nemo_gym", "NeMo-Gym"),
    (["env.math.math_verify_impl=sympy"], "env.math.math_verify_impl", "hf_math_verify and dapo_math_verify"),
    (["data.default.env_name=code"], "data.default.env_name", "code-execution"),
    (["data.train.dataset_name=NemoGymDataset"], "data.train.dataset_name", "NemoGymDataset"),
    (["policy.optimizer.name=torch.optim.SGD"], "policy.optimizer.name", "AdamW"),
    (["policy.scheduler=[{name: torch.optim.lr_scheduler.StepLR, kwargs: {step_size: 2}}]"], "policy.scheduler",
     "StepLR"),
    (["policy.generation.vllm_cfg.logprobs_mode=raw_logprobs"], "policy.generation.vllm_cfg.logprobs_mode",
     "processed_logprobs"),
    (["++policy.router_replay={enabled: true}"], "policy.router_replay.enabled", "routing replay"),
    (["++policy.quant_cfg=NVFP4"], "policy.quant_cfg", "quantization"),
    (["++policy.made_up_key=1"], "policy.made_up_key", "no translation"),
])
def test_refused_keys_name_the_key_and_why(overrides, key, reason):
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE, overrides)
    line = next((ln for ln in str(err.value).splitlines() if ln.strip().startswith(key + "=")), None)
    assert line is not None and reason in line, str(err.value)


def test_chat_template_kwargs_and_hf_config_overrides_are_honored():
    """Copied as they are: grpo.system.chat passes the kwargs to every rendering, grpo.system.model_config applies
    the overrides to every copy of the policy (tests/unit/test_chat_template_kwargs.py, test_hf_config_overrides.py)."""
    yarn = {"rope_type": "yarn", "rope_theta": 1000000, "factor": 2.0, "original_max_position_embeddings": 131072}
    cfg, _ = load_recipe(BASE, ["policy.tokenizer.chat_template_kwargs={enable_thinking: true}",
                                "policy.hf_config_overrides={rope_scaling: {rope_type: yarn, rope_theta: 1000000, "
                                "factor: 2.0, original_max_position_embeddings: 131072}, max_position_embeddings: 9}",
                                "++policy.hf_config_overrides.text_config={router_aux_loss_coef: 0.0}"])
    assert cfg.policy.tokenizer.chat_template_kwargs == {"enable_thinking": True}
    assert cfg.policy.hf_config_overrides == {"rope_scaling": yarn, "max_position_embeddings": 9,
                                              "text_config": {"router_aux_loss_coef": 0.0}}
    cfg, _ = load_recipe(BASE, [])  # chat_template_kwargs: null, hf_config_overrides: {}
    assert cfg.policy.tokenizer.chat_template_kwargs is None and cfg.policy.hf_config_overrides == {}
    with pytest.raises(ConfigError, match="chat_template_kwargs: \\['add_generation_prompt'\\] are set by grpo-ds"):
        load_recipe(BASE, ["policy.tokenizer.chat_template_kwargs={add_generation_prompt: false}"])


def test_every_refusal_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE, ["++env.nemo_gym={x: 1}", "policy.draft.enabled=true"])
    assert "env.nemo_gym" in str(err.value) and "policy.draft.enabled" in str(err.value)


def test_grpo_ds_validation_still_applies_to_the_translation():
    with pytest.raises(ConfigError, match="policy.train_global_batch_size=24"):
        load_recipe(BASE, ["policy.train_global_batch_size=24"])


# --------------------------------------------------------------------------------------------------
# Data: split_validation_size, val_repeat, nested keys (grpo.system.data)
# --------------------------------------------------------------------------------------------------
def test_split_validation_size_val_repeat_and_nested_keys(tmp_path):
    import json

    from grpo.config import DataConfig
    from grpo.system.data import load_rows

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}],
                                        "reward_model": {"ground_truth": str(i)}}) + "\n" for i in range(40)))
    cfg = DataConfig(train_data_path=str(path), input_key="prompt.0.content", output_key="reward_model.ground_truth",
                     split_validation_size=0.1, val_repeat=2)
    train, val = load_rows(cfg, "train", seed=1), load_rows(cfg, "val", seed=1)
    assert len(train) == 36 and len(val) == 8 and len({r["question"] for r in val}) == 4
    assert {r["question"] for r in train}.isdisjoint(r["question"] for r in val)
    assert {r["question"] for r in train} | {r["question"] for r in val} == {f"q{i}" for i in range(40)}
    assert all(r["answer"] == r["question"][1:] for r in train)
    assert [r["question"] for r in load_rows(cfg, "val", seed=1)] == [r["question"] for r in val]  # seeded
    other = load_rows(cfg.model_copy(update={"split_validation_seed": 5}), "val", seed=1)
    assert {r["question"] for r in other} != {r["question"] for r in val}


# --------------------------------------------------------------------------------------------------
# --check-config: prints the config (and the table), exit codes, no torch
# --------------------------------------------------------------------------------------------------
def _check(script, *args):
    return subprocess.run([sys.executable, script, "--check-config", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_check_config_exit_codes_and_output():
    p = _check("train_grpo.py", "--config", str(BASE))
    assert p.returncode == 0, p.stderr
    assert "policy:" in p.stdout and "translated: policy.sequence_packing: -> policy.sequence_packing.enabled=True" \
        in p.stdout
    assert "translated: policy.scheduler:" in p.stdout
    p = _check("train_async_grpo.py", "--config", str(BASE), "policy.draft.enabled=true")
    assert p.returncode == 2 and "policy.draft.enabled=True: trains a speculative" in p.stderr
    assert "Traceback" not in p.stderr
    p = _check("train_grpo.py", "--config", "tests/configs/tiny.yaml")
    assert p.returncode == 0 and "model_name: toy:demo" in p.stdout and "ignored:" not in p.stdout


def test_check_config_imports_no_torch():
    code = ("import sys, train_grpo, grpo.run.cli\n"
            "try:\n    grpo.run.cli.load_run_config(sys.argv[1:], train_grpo.DEFAULT_CONFIG)\n"
            "except SystemExit as e:\n"
            "    print('EXIT', e.code, 'torch' in sys.modules, 'deepspeed' in sys.modules, file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code, "--config", str(BASE), "--check-config"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert "EXIT 0 False False" in p.stderr, p.stderr


# --------------------------------------------------------------------------------------------------
# env.<math|dapo>.math_verify_impl and the NeMo-Gym tool-call keys of grpo
# --------------------------------------------------------------------------------------------------
def test_math_verify_impl_dapo_is_translated_and_hf_is_the_default():
    cfg, rows = load_recipe(BASE)
    assert cfg.env.name == "math" and cfg.env.math_verify_impl == "hf_math_verify"
    assert "as NeMo-RL's hf_math_verify" in table_of(rows, "translated")["env.math"]
    cfg, rows = load_recipe(BASE, ["env.math.math_verify_impl=dapo_math_verify"])
    assert cfg.env.name == "math" and cfg.env.math_verify_impl == "dapo_math_verify"
    translated = table_of(rows, "translated")
    assert "env.math_verify_impl='dapo_math_verify'" in translated["env.math.math_verify_impl"]
    assert "as NeMo-RL's dapo_math_verify" in translated["env.math"]


def test_math_verify_impl_null_is_refused():
    # NeMo-RL passes null on to HFVerifyWorker.verify, which raises on it: every sample would score 0 there
    with pytest.raises(ConfigError, match=r"env.math.math_verify_impl=None: .*null included"):
        load_recipe(BASE, ["env.math.math_verify_impl=null"])


@pytest.mark.parametrize("override, key, instead", [
    ("++grpo.penalize_invalid_tool_call=true", "grpo.penalize_invalid_tool_call", "invalid_tool_call_advantage"),
    ("++grpo.invalid_tool_call_strategy=mask", "grpo.invalid_tool_call_strategy", "invalid_tool_call_advantage"),
    ("++grpo.penalize_malformed_thinking=true", "grpo.penalize_malformed_thinking", "malformed_thinking_advantage"),
])
def test_stale_nemo_gym_tool_call_keys_are_ignored(override, key, instead):
    cfg, rows = load_recipe(BASE, [override])
    assert "NeMo-RL reads no such key" in table_of(rows, "ignored")[key] and instead in table_of(rows, "ignored")[key]
    assert cfg.grpo.invalid_tool_call_advantage is None and cfg.grpo.malformed_thinking_advantage is None


# --------------------------------------------------------------------------------------------------
# Several datasets (NeMo-RL's lists, nemo_rl/data/utils.py setup_response_data), a split with a validation
# dataset, use_multiple_dataloader, the sliding-puzzle recipe
# --------------------------------------------------------------------------------------------------
MULTI = FIX / "recipes" / "llm" / "grpo-fixture-multiple-datasets.yaml"


def _write(path, records):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_dataset_lists_become_sources_and_validation_joins_the_held_out_rows(tmp_path):
    from grpo.system.data import load_rows

    a = _write(tmp_path / "a.jsonl", [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(6)])
    b = _write(tmp_path / "b.jsonl", [{"problem": f"{i}*2=", "solution": str(2 * i)} for i in range(4)])
    v = _write(tmp_path / "v.jsonl", [{"q": f"{i}-1=", "a": str(i - 1)} for i in range(1, 3)])
    cfg, rows = load_recipe(MULTI, [f"data.train.0.data_path={a}", f"data.train.1.data_path={b}",
                                    f"data.validation.0.data_path={v}"])
    t0, t1 = cfg.data.train_sources
    assert (t0.dataset_name, t0.input_key, t0.split_validation_size, t0.split_validation_seed) == (a, "q", 2, 3)
    assert t0.prompt_file.endswith("cot.txt") and t1.prompt_file is None  # data.default, then the spec's null
    assert (t1.dataset_name, t1.input_key, t1.output_key, t1.split_validation_size) == (b, "problem", "solution", None)
    (v0,) = cfg.data.val_sources
    assert (v0.dataset_name, v0.repeat) == (v, 3) and cfg.env.name == "math"
    assert "data.train_sources" in table_of(rows, "translated")["data.train"]
    assert "used only with data.use_multiple_dataloader=true" in table_of(rows, "ignored")["data.custom_dataloader"]
    train, val = load_rows(cfg.data, "train", 0), load_rows(cfg.data, "val", 0)
    assert len(train) == 4 + 4 and [r["question"] for r in train[4:]] == [f"{i}*2=" for i in range(4)]
    assert len(val) == 2 + 6 and [r["question"] for r in val[2:]] == ["1-1="] * 3 + ["2-1="] * 3


def test_a_split_with_a_validation_dataset_keeps_both(tmp_path):
    """NeMo-RL's setup_response_data: the split part joins the validation dataset (it used to be refused here)."""
    v = _write(tmp_path / "v.jsonl", [{"problem": "1+1=", "expected_answer": "2"}])
    cfg, _ = load_recipe(BASE, ["data.validation={dataset_name: ResponseDataset, data_path: " + v +
                                ", input_key: problem, output_key: expected_answer}"])
    d = cfg.data
    assert (d.split_validation_size, d.val_data_path, d.train_sources) == (0.05, v, [])


def test_use_multiple_dataloader_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE, ["data.use_multiple_dataloader=true"])
    assert "data.use_multiple_dataloader=True: one data loader per dataset" in str(err.value)


def test_the_sliding_puzzle_recipe_becomes_the_built_in_task():
    cfg, rows = load_recipe(BASE, ["++env.sliding_puzzle_game={cfg: {game_config: {size: 3, shuffle_moves: 5}, "
                                   "max_moves: 7}}", "grpo.max_num_steps=20000", "++data.add_system_prompt=false"])
    assert (cfg.env.name, cfg.env.task_name, cfg.env.kwargs, cfg.env.observation_format) == (
        "sliding_puzzle", "sliding_puzzle_game", {"max_moves": 7}, "raw")
    d = cfg.data
    assert (d.dataset_name, d.num_val_samples) == ("sliding_puzzle:size=3,shuffle_moves=5", 16)
    assert (d.num_train_samples, cfg.grpo.max_num_epochs, cfg.grpo.max_num_steps) == (100_000, 2, 20000)  # 8 x 20000 capped
    assert cfg.policy.tokenizer.chat_template == "default" and cfg.grpo.max_val_samples == 16
    ignored = table_of(rows, "ignored")
    assert "reads no dataset" in ignored["data"] and "data.add_system_prompt" in ignored
    cfg, _ = load_recipe(BASE, ["++env.sliding_puzzle_game={cfg: {max_moves: 7}}"])
    assert (cfg.data.num_train_samples, cfg.grpo.max_num_epochs) == (800, 1)  # 8 prompts x 100 steps


# --------------------------------------------------------------------------------------------------
# LoRA (issue 22): lora_cfg / megatron_cfg.peft -> policy.lora
# --------------------------------------------------------------------------------------------------
def test_lora_cfg_becomes_policy_lora_with_nemo_rl_s_names_and_use_triton_ignored():
    cfg, rows = load_recipe(BASE, ["policy.dtensor_cfg.lora_cfg.enabled=true", "++policy.dtensor_cfg.lora_cfg.dim=16",
                                   "++policy.dtensor_cfg.lora_cfg.alpha=64", "++policy.dtensor_cfg.lora_cfg.use_triton=true"])
    lora = cfg.policy.lora
    assert (lora.enabled, lora.match_all_linear, lora.dim, lora.alpha) == (True, True, 16, 64)
    assert (lora.dropout, lora.dropout_position, lora.lora_A_init) == (0.0, "post", "xavier")
    assert "adapters off" in table_of(rows, "translated")["policy.dtensor_cfg.lora_cfg"]
    assert "Triton" in table_of(rows, "ignored")["policy.dtensor_cfg.lora_cfg.use_triton"]


def test_lora_cfg_target_modules_need_match_all_linear_off_as_in_nemo_rl():
    on = ["policy.dtensor_cfg.lora_cfg.enabled=true", "++policy.dtensor_cfg.lora_cfg.target_modules=[q_proj]"]
    cfg, rows = load_recipe(BASE, on + ["++policy.dtensor_cfg.lora_cfg.match_all_linear=true"])
    assert cfg.policy.lora.match_all_linear and cfg.policy.lora.target_modules == []
    assert "overrides them" in table_of(rows, "translated")["policy.dtensor_cfg.lora_cfg"]
    cfg, _ = load_recipe(BASE, on + ["++policy.dtensor_cfg.lora_cfg.match_all_linear=false",
                                     "++policy.dtensor_cfg.lora_cfg.exclude_modules=[lm_head]"])
    assert (cfg.policy.lora.match_all_linear, cfg.policy.lora.target_modules) == (False, ["q_proj"])
    assert cfg.policy.lora.exclude_modules == ["lm_head"]


LORA = "policy.dtensor_cfg.lora_cfg"


def test_lora_cfg_module_names_as_one_string_are_one_entry_as_nemo_rl_reads_them():
    """Issue 37: a string was read as a list of its characters (exclude_modules: q_proj adapted q_proj anyway). NeMo-RL's
    DTensor LoRA reads module names through Automodel's ModuleMatcher, which wraps a string into a one-entry list."""
    on = [f"{LORA}.enabled=true", f"++{LORA}.match_all_linear=false"]
    cfg, _ = load_recipe(BASE, on + [f"++{LORA}.target_modules=q_proj"])
    assert cfg.policy.lora.target_modules == ["q_proj"]
    cfg, _ = load_recipe(BASE, [f"{LORA}.enabled=true", f"++{LORA}.exclude_modules=q_proj"])
    assert cfg.policy.lora.exclude_modules == ["q_proj"]
    cfg, _ = load_recipe(BASE, ["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.peft.enabled=true",
                                "++policy.megatron_cfg.peft.target_modules=linear_qkv"])
    assert cfg.policy.lora.target_modules == ["q_proj", "k_proj", "v_proj"]


@pytest.mark.parametrize("value, bad_key", [
    ("5", "target_modules"), ("{a: 1}", "target_modules"), ("[q_proj,3]", "target_modules"),
])
def test_lora_cfg_module_names_of_another_type_are_refused_naming_the_key(value, bad_key):
    with pytest.raises(ConfigError, match=rf"{LORA}\.{bad_key}=.*expected a list of module names"):
        load_recipe(BASE, [f"{LORA}.enabled=true", f"++{LORA}.match_all_linear=false", f"++{LORA}.{bad_key}={value}"])


@pytest.mark.parametrize("text, on", [("'false'", False), ("'False'", False), ("'no'", False), ("'0'", False),
                                      ("'true'", True), ("'yes'", True), ("1", True)])
def test_lora_cfg_enabled_parses_as_the_native_loader_parses_a_boolean(text, on):
    """Issue 37: enabled: "false" (a string) turned LoRA on; the native loader (pydantic) reads it as false."""
    from grpo.config import LoraConfig

    cfg, _ = load_recipe(BASE, [f"{LORA}.enabled={text}"])
    assert cfg.policy.lora.enabled is on is LoraConfig.model_validate({"enabled": text.strip("'")}).enabled
    cfg, _ = load_recipe(BASE, [f"{LORA}.enabled=true", f"++{LORA}.target_modules=[q_proj]",
                                f"++{LORA}.match_all_linear={text}"])
    assert cfg.policy.lora.match_all_linear is (on or False) and cfg.policy.lora.target_modules == ([] if on else ["q_proj"])


@pytest.mark.parametrize("override, key", [
    (f"{LORA}.enabled=maybe", f"{LORA}.enabled"),
    (f"{LORA}=[1,2]", LORA),
    (f"{LORA}=7", LORA),
    ("policy.megatron_cfg.peft=[1]", "policy.megatron_cfg.peft"),
])
def test_a_malformed_lora_section_or_flag_is_an_error_naming_it(override, key):
    """Issue 37: lora_cfg: [1, 2] was dropped with the reason "enabled=false"."""
    extra = ["policy.megatron_cfg.enabled=true"] if "megatron" in override else []
    with pytest.raises(ConfigError, match=rf"{key.replace('.', chr(92) + '.')}=.*expected a"):
        load_recipe(BASE, extra + [override])


def test_megatron_peft_maps_megatron_layer_names_to_the_hf_model_s():
    on = ["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.peft.enabled=true"]
    cfg, _ = load_recipe(BASE, on)
    assert cfg.policy.lora.enabled and cfg.policy.lora.match_all_linear  # empty target_modules: every linear layer
    cfg, _ = load_recipe(BASE, on + ["++policy.megatron_cfg.peft.target_modules=[linear_qkv,'*.layers.0.*.linear_fc2']",
                                     "++policy.megatron_cfg.peft.lora_A_init_method=uniform",
                                     "++policy.megatron_cfg.peft.dim=32"])
    lora = cfg.policy.lora
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "*.layers.0.*.down_proj"]
    assert (lora.match_all_linear, lora.lora_A_init, lora.dim) == (False, "uniform", 32)
    # a name that is not one of Megatron's four linears is kept (a pattern over the HF model's names)
    cfg, rows = load_recipe(BASE, on + ["++policy.megatron_cfg.peft.exclude_modules=['*out_proj*']"])
    assert cfg.policy.lora.match_all_linear and cfg.policy.lora.exclude_modules == ["*out_proj*"]
    assert "kept as they are" in table_of(rows, "translated")["policy.megatron_cfg.peft"]


@pytest.mark.parametrize("body", ["policy:\n  dtensor_cfg: {enabled: true}\n", "grpo: {seed: 3}\n"])
def test_a_missing_defaults_parent_names_the_recipe_that_refers_to_it(tmp_path, body):
    """NeMo-RL recipe or native config: the error names the file whose defaults: entry is missing, not as if
    --config itself were."""
    recipe = tmp_path / "child.yaml"
    recipe.write_text("defaults: base_missing.yaml\n" + body)
    with pytest.raises(ConfigError, match=r"child\.yaml: defaults: 'base_missing\.yaml': file not found"):
        load_config(str(recipe), [])


def test_rollout_failure_keys_translate_and_the_streaming_ones_are_named():
    """Issue 31: NeMo-RL's async_rl.rollout_failure budgets become grpo.rollout_failure (both loops); its prompt-drop
    and refill keys have no meaning here and are listed with the reason; should_mask_flagged_samples is honoured."""
    cfg, rows = load_recipe(BASE, [
        "++async_rl={sampler: {name: in_order}, rollout_failure: {max_infra_attempts_per_prompt: 7, "
        "max_data_attempts_per_prompt: 3, backoff_base_s: 0.5, max_backoff_s: 8.0, min_step_batch_fraction: 0.75, "
        "max_skipped_prompts: 0, on_dropped_prompt: shrink}}",
        "++env.should_mask_flagged_samples=false"])
    f = cfg.grpo.rollout_failure
    assert (f.max_infra_attempts_per_prompt, f.max_data_attempts_per_prompt, f.backoff_base_s, f.max_backoff_s,
            f.min_step_batch_fraction) == (7, 3, 0.5, 8.0, 0.75)
    assert cfg.env.should_mask_flagged_samples is False
    translated, ignored = table_of(rows, "translated"), table_of(rows, "ignored")
    assert "grpo.rollout_failure.min_step_batch_fraction=0.75" in translated[
        "async_rl.rollout_failure.min_step_batch_fraction"]
    assert "drops no prompt" in ignored["async_rl.rollout_failure.max_skipped_prompts"]
    assert "refill" in ignored["async_rl.rollout_failure.on_dropped_prompt"]
