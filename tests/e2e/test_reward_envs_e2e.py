"""NeMo-RL's reward-model and multi-reward recipes train as they are: 2 steps on the CPU in one process, with only the
model, the data and the sizes overridden, in NeMo-RL's key names (recipes written in NeMo-RL's format under
tests/fixtures/nemo_rl/: gdpo_math.yaml has gdpo_math_1B.yaml's keys, grpo_rm.yaml grpo_rm_1B.yaml's)."""

import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, addition_jsonl, run, train_rows

FIX = REPO / "tests" / "fixtures" / "nemo_rl"

SMALL = [  # the model, the sizes, the paths; NeMo-RL's key names (hydra's + for keys the recipe lacks)
    "policy.model_name=toy:tiny", "+policy.tokenizer.chat_template=null", "policy.precision=float32",
    "policy.generation.backend=hf", "policy.max_total_sequence_length=16", "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8", "policy.generation_batch_size=16", "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", "grpo.max_val_samples=4", "grpo.val_batch_size=4",
    "cluster.gpus_per_node=1",
]


def _train(tmp: Path, recipe: Path, *extra: str) -> dict:
    p = run([sys.executable, "train_grpo.py", "--config", str(recipe), *SMALL, f"logger.log_dir={tmp}/logs",
             f"checkpointing.checkpoint_dir={tmp}/ckpt", *extra], timeout=600)
    assert "done: 2 steps" in p.stdout, p.stdout[-3000:]
    return train_rows(tmp)


@pytest.mark.slow  # ~100 s on a loaded 2-core machine; the translation is tests/unit/test_reward_envs.py's
def test_gdpo_math_recipe_trains_two_steps_over_nemo_rl_s_three_components(tmp_path):
    data = addition_jsonl(tmp_path)
    rows = _train(tmp_path, FIX / "gdpo_math.yaml", "env.math_multi_reward.num_workers=1",
                  "data.default.system_prompt_file=null", "data.train.dataset_name=ResponseDataset",
                  f"+data.train.data_path={data}", "data.validation.dataset_name=ResponseDataset",
                  f"+data.validation.data_path={data}")
    assert sorted(rows) == [1, 2]
    for r in rows.values():  # GDPO read the three components (it refuses fewer than two)
        assert {"train/reward/correctness/mean", "train/reward/format/mean", "train/reward/integer/mean"} <= set(r)
