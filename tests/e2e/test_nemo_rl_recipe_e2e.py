"""NeMo-RL-format recipes train as they are: a grpo_math_1B-style recipe and a DAPO-style (Megatron-path) recipe each
run 2 steps on the CPU with only the model, the data and the sizes overridden, in NeMo-RL's key names."""

import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, addition_jsonl, run, train_rows

FIX = REPO / "tests" / "fixtures" / "nemo_rl"


def _train(tmp: Path, recipe: Path, *extra: str):
    small = [  # the model, the data and the sizes; NeMo-RL's key names (hydra's + for keys the recipe lacks)
        "policy.model_name=toy:demo", "+policy.tokenizer.chat_template=null", "policy.precision=float32",
        "policy.generation.backend=hf", "policy.max_total_sequence_length=16", "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8", "policy.generation_batch_size=16", "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", "grpo.max_val_samples=4", "grpo.val_batch_size=4",
        "cluster.gpus_per_node=1", "env.math.num_workers=1", "data.default.prompt_file=null",
        f"logger.log_dir={tmp}/logs", f"checkpointing.checkpoint_dir={tmp}/ckpt",
    ]
    p = run([sys.executable, "train_grpo.py", "--config", str(recipe), *small, *extra], timeout=240)
    assert "translated: policy.sequence_packing:" in p.stdout, p.stdout[-3000:]   # NeMo-RL's packing, kept
    return train_rows(tmp)


def test_math_1b_style_recipe_trains_two_steps(tmp_path):
    data = addition_jsonl(tmp_path)
    rows = _train(tmp_path, FIX / "base_math.yaml", "data.train.dataset_name=ResponseDataset",
                  f"+data.train.data_path={data}", "grpo.val_at_end=true")
    assert sorted(rows) == [1, 2] and all(0.0 <= r["train/mean_total_reward"] <= 1.0 for r in rows.values())


@pytest.mark.slow  # the default suite's twins: test_math_1b_style_recipe_trains_two_steps, and the Megatron-path
# translation (optimizer, scheduler, DAPO data) in tests/unit/test_nemo_rl_recipe.py
def test_dapo_style_megatron_recipe_trains_two_steps(tmp_path):
    data = addition_jsonl(tmp_path)
    rows = _train(tmp_path, FIX / "recipes" / "llm" / "grpo-fixture-dapo-megatron.yaml",
                  "data.train.dataset_name=ResponseDataset", f"+data.train.data_path={data}",
                  "data.train.split_validation_size=0", "data.validation.dataset_name=ResponseDataset",
                  f"+data.validation.data_path={data}", "grpo.reward_shaping.overlong_buffer_length=2")
    assert sorted(rows) == [1, 2]
