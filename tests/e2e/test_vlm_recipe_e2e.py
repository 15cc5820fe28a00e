"""NeMo-RL's vlm_grpo_3B.yaml as it is (tests/fixtures/nemo_rl/examples/configs, a verbatim copy) trains 2 CPU steps
with only the model (a tiny local LLaVA), the data (a few local rows in CLEVR-CoGenT's columns, pictures drawn with
PIL) and the sizes overridden, in NeMo-RL's key names; its rewards are NeMo-RL's format + exact_alnum."""

import json
import sys
from pathlib import Path

from tests.helpers.e2e import REPO, run, train_rows

RECIPE = REPO / "tests" / "fixtures" / "nemo_rl" / "examples" / "configs" / "vlm_grpo_3B.yaml"


def clevr_rows(tmp: Path, name: str, n: int) -> Path:
    """``n`` rows in CLEVR-CoGenT's columns (image, problem, solution): 1 to 3 white squares to count."""
    from PIL import Image, ImageDraw

    rows = []
    for i in range(n):
        count = i % 3 + 1
        img = Image.new("RGB", (16, 16))
        for c in range(count):
            ImageDraw.Draw(img).rectangle([c * 5, 2, c * 5 + 3, 5], fill=(255, 255, 255))
        path = tmp / f"{name}_{i}.png"
        img.save(path)
        rows.append({"image": str(path), "problem": "How many?", "solution": f"<answer> {count} </answer>"})
    out = tmp / f"{name}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_vlm_grpo_3b_recipe_trains_two_cpu_steps_on_a_tiny_vlm(tmp_path):
    (tmp_path / "prompt.txt").write_text("Q: {}")
    small = [  # the model, the data and the sizes; NeMo-RL's key names (hydra's + for keys the recipe lacks)
        "policy.model_name=toy:tiny_vlm", "policy.precision=float32", "policy.generation.backend=hf",
        "policy.max_total_sequence_length=64", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=4", "policy.generation.max_new_tokens=8", "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", "grpo.max_val_samples=2", "grpo.val_batch_size=2",
        "cluster.gpus_per_node=1", f"+data.train.data_path={clevr_rows(tmp_path, 'train', 6)}",
        f"+data.validation.data_path={clevr_rows(tmp_path, 'val', 2)}", f"data.default.prompt_file={tmp_path}/prompt.txt",
        f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
    ]
    p = run([sys.executable, "train_grpo.py", "--config", str(RECIPE), *small], timeout=300)
    assert "translated: env.clevr-cogent.reward_functions: -> env.name='vlm'" in p.stdout, p.stdout[-3000:]
    assert "data.row_format='clevr-cogent'" in p.stdout, p.stdout[-3000:]
    assert "6 train / 2 val prompts" in p.stdout and "0 malformed rows skipped" in p.stdout, p.stdout[-3000:]
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    # NeMo-RL's mix: 0.2 x format (0, 0.25, 0.75 or 1) + 0.8 x exact_alnum (0 or 1), so within [0, 1]
    assert all(0.0 <= r["train/mean_total_reward"] <= 1.0 for r in rows.values())


def geometry_rows(tmp: Path, name: str, n: int) -> Path:
    """``n`` rows in Geometry3K's columns (images, problem, answer): a picture list, ``<image>`` in the problem."""
    from PIL import Image

    rows = []
    for i in range(n):
        path = tmp / f"{name}_{i}.png"
        Image.new("RGB", (16, 16), (0, 40 * i % 256, 200)).save(path)
        rows.append({"images": [str(path)], "problem": f"<image>Find x if 2x = {2 * (i + 3)}.", "answer": str(i + 3)})
    out = tmp / f"{name}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_two_image_datasets_in_two_formats_train_one_step_together_each_scored_by_its_own_environment(tmp_path):
    """data.train_sources of a CLEVR-CoGenT file and a Geometry3K file (each source's data.row_format and prompt): one
    step trains on rows of both; each row is scored by its task's environment (NeMo-RL's VLM rewards for CLEVR, a
    constant 0.5 for Geometry3K: a row routed to the other environment would show)."""
    import yaml

    from grpo.system.dumps import dump_path, read_dump
    from grpo.tasks.vlm import combine

    clevr_rewards = [{"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}]
    sources = lambda side, n: [  # noqa: E731
        {"dataset_name": str(clevr_rows(tmp_path, f"clevr_{side}", n)), "row_format": "clevr-cogent",
         "task_name": "clevr", "prompt_template": "Count: {}"},
        {"dataset_name": str(geometry_rows(tmp_path, f"geo_{side}", n)), "row_format": "geometry3k",
         "task_name": "geo", "prompt_template": "Solve: {}"}]
    config = {
        "defaults": str(REPO / "configs" / "cpu_demo_vlm.yaml"),
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2, "max_num_steps": 1, "val_period": 0,
                 "val_at_start": False, "val_at_end": False, "max_val_samples": 2, "val_batch_size": 2},
        "policy": {"model_name": "toy:tiny_vlm", "train_global_batch_size": 8, "train_micro_batch_size": 4,
                   "logprob_batch_size": 8, "generation_batch_size": 8, "max_total_sequence_length": 64},
        "data": {"dataset_name": "unused", "shuffle": False, "train_sources": sources("train", 2),
                 "val_sources": sources("val", 1)},
        "env": {"name": "vlm", "task_name": "clevr", "kwargs": {"reward_functions": clevr_rewards},
                "tasks": {"geo": {"name": "function", "reward_fn": "tests.helpers.e2e:half_reward",
                                  "num_workers": 1}}},
        "logger": {"log_dir": str(tmp_path / "logs"), "dump_rollouts": True},
        "checkpointing": {"enabled": False, "checkpoint_dir": str(tmp_path / "ckpt")},
    }
    recipe = tmp_path / "two_formats.yaml"
    recipe.write_text(yaml.safe_dump(config))
    p = run([sys.executable, "train_grpo.py", "--config", str(recipe)], timeout=300)
    assert "4 train / 2 val prompts" in p.stdout, p.stdout[-3000:]
    assert sorted(train_rows(tmp_path)) == [1]
    records = read_dump(dump_path(tmp_path / "logs", "train", 1))
    by_task = {task: [r for r in records if r["task_name"] == task] for task in ("clevr", "geo")}
    assert len(by_task["clevr"]) == len(by_task["geo"]) == 4
    score = combine(clevr_rewards)
    for r in by_task["clevr"]:
        assert r["answer"] in ("1", "2") and r["messages"][0]["content"] == "<image>Count: How many?"
        assert r["reward"] == score(r["answer"], r["messages"][-1]["content"])[0]
    for r in by_task["geo"]:
        assert r["answer"] in ("3", "4") and r["messages"][0]["content"].startswith("<image>Solve: Find x")
        assert r["reward"] == 0.5
