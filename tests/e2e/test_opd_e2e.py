"""On-policy distillation with a teacher per task (NeMo-RL's MOPD keys, ``grpo.adv_estimator.name=opd``), end to end on
the CPU: each loop trains a few steps of tests/configs/tiny.yaml on rows of three tasks, two of them mapped to two
different toy teachers (toy:tiny, toy:small) and the third falling back to ``default_teacher_alias``.

The run is the real script; a driver records what the logprobs phase returned (the batch's tokens, each row's task and
its teacher logprobs) and the test checks every row against a plain transformers forward of the teacher its task maps
to, and that the other teacher would have given other numbers."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.e2e import REPO, TINY, paths, run, train_rows

TEACHERS = {"arithmetic": "toy:tiny", "sum": "toy:small"}  # the third task, "carry", falls back to "arithmetic"
EXPECTED = {"arithmetic": "toy:tiny", "sum": "toy:small", "carry": "toy:tiny"}

DRIVER = """
import sys, torch
import grpo.system.training as training
from grpo.distillation import trajectory_teacher_key

out_dir, script = sys.argv[1], sys.argv[2]
original, calls = training.step_logprobs, []

def recording(cfg, batch, engines, rank, world_size):
    batch = original(cfg, batch, engines, rank, world_size)
    calls.append(1)
    torch.save({"input_ids": batch.input_ids_bt, "attention_mask": batch.attention_mask_bt,
                "token_mask": batch.token_mask_bt, "teacher": batch.teacher_logprobs_bt,
                "prev": batch.prev_logprobs_bt, "keys": [trajectory_teacher_key(t) for t in batch.trajectories]},
               f"{out_dir}/step_{len(calls)}.pt")
    return batch

training.step_logprobs = recording
main = __import__(script).main
sys.exit(main(sys.argv[3:]) or 0)
"""


def three_task_rows(tmp: Path) -> Path:
    """48 addition rows, a third each of the tasks arithmetic (the top-level environment), sum and carry."""
    path = tmp / "train.jsonl"
    tasks = ["arithmetic", "sum", "carry"]
    path.write_text("".join(json.dumps({"input": f"{a}+{b}=", "output": str(a + b), "task_name": tasks[(a + b) % 3]})
                            + "\n" for a in range(8) for b in range(6)))
    return path


def teacher_logprobs(model_dir: str, input_ids_bt, attention_mask_bt) -> torch.Tensor:
    """log p(token t | tokens < t) under the teacher at temperature 1 (tiny.yaml's), 0 at t = 0: a plain forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids_bt, attention_mask=attention_mask_bt).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids_bt[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


@pytest.mark.parametrize("script", ["train_async_grpo", "train_grpo"])
def test_each_row_is_scored_by_its_tasks_teacher(tmp_path, script):
    data = three_task_rows(tmp_path)
    extra = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"] \
        if script == "train_async_grpo" else []
    run([sys.executable, "-c", DRIVER, str(tmp_path), script, "--config", TINY, *paths(tmp_path), *extra,
         f"data.train_data_path={data}", f"data.val_data_path={data}", "env.tasks.sum.name=arithmetic",
         "env.tasks.carry.name=arithmetic", "grpo.max_num_steps=2", "checkpointing.enabled=false",
         "grpo.adv_estimator.name=opd", "on_policy_distillation.enabled=true",
         *[f"on_policy_distillation.teacher_model_by_agent_name.{k}={v}" for k, v in TEACHERS.items()],
         "on_policy_distillation.default_teacher_alias=arithmetic"])
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    assert all("train/on_policy_distillation/teacher_student_logprob_gap_mean" in r for r in rows.values())

    from grpo.tasks.catalogue import resolve_model_name

    dirs = {name: resolve_model_name(name) for name in set(TEACHERS.values())}
    seen = set()
    for step in (1, 2):
        rec = torch.load(tmp_path / f"step_{step}.pt")
        mask = rec["token_mask"] > 0
        forward = {name: teacher_logprobs(d, rec["input_ids"], rec["attention_mask"]) for name, d in dirs.items()}
        for b, key in enumerate(rec["keys"]):
            seen.add(key)
            mine, other = EXPECTED[key], next(n for n in dirs if n != EXPECTED[key])
            got = rec["teacher"][b][mask[b]]
            torch.testing.assert_close(got, forward[mine][b][mask[b]], rtol=0, atol=1e-5,
                                       msg=lambda m: f"step {step} row {b} ({key}): not {mine}'s logprobs: {m}")
            assert (got - forward[other][b][mask[b]]).abs().max() > 1e-3, (step, b, key)
    assert seen == set(EXPECTED)
