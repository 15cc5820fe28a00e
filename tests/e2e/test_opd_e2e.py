"""On-policy distillation with a teacher per task or NeMo-Gym agent (NeMo-RL's MOPD keys, ``grpo.adv_estimator.name=opd``),
end to end on the CPU: each loop trains a few steps of tests/configs/tiny.yaml on rows of three tasks, two of them
mapped to two different toy teachers (toy:tiny, toy:small) and the third falling back to ``default_teacher_alias``;
slow: the same on two ranks with ZeRO-3 teachers, and the NeMo-Gym demo keyed by its agent's name.

The run is the real script; a driver records what the logprobs phase returned (the batch's tokens, each row's key and
its teacher logprobs) and the test checks every row against a plain transformers forward of the teacher its key maps
to, and that the other teacher would have given other numbers."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.e2e import REPO, TINY, launcher, paths, run, train_rows

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
    if rank == 0:
            torch.save({"input_ids": batch.input_ids_bt, "attention_mask": batch.attention_mask_bt,
                    "token_mask": batch.token_mask_bt, "teacher": batch.teacher_logprobs_bt,
                    "keys": [trajectory_teacher_key(t) for t in batch.trajectories]}, f"{out_dir}/step_{len(calls)}.pt")
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


def run_with_two_teachers(tmp: Path, script: str, *extra: str, ranks: int = 1):
    """``script`` (train_grpo / train_async_grpo) on rows of three tasks with a teacher per task, through the
    recording driver; ``ranks`` > 1: under torchrun. Returns the finished process."""
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    data = three_task_rows(tmp)
    if script == "train_async_grpo":
        extra = ("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true", *extra)
    launch = [sys.executable] if ranks == 1 else [*launcher("torchrun"), "--standalone", "--nproc_per_node", str(ranks)]
    return run([*launch, str(driver), str(tmp), script, "--config", TINY, *paths(tmp), *extra,
         f"data.train_data_path={data}", f"data.val_data_path={data}", "env.tasks.sum.name=arithmetic",
         "env.tasks.carry.name=arithmetic", "grpo.max_num_steps=2", "checkpointing.enabled=false",
         "grpo.adv_estimator.name=opd", "on_policy_distillation.enabled=true",
         *[f"on_policy_distillation.teacher_model_by_agent_name.{k}={v}" for k, v in TEACHERS.items()],
         "on_policy_distillation.default_teacher_alias=arithmetic"], threads=1 if ranks > 1 else 2)


@pytest.mark.slow  # three processes: 16-23 s per loop, more than the default suite has room for
@pytest.mark.parametrize("script", ["train_grpo", "train_async_grpo"])
def test_teachers_on_ranks_of_their_own_score_each_row_with_its_tasks_teacher(tmp_path, script):
    """NeMo-RL's MOPD with non_colocated_teachers: toy:tiny and toy:small on a teacher rank each (torchrun, 3 ranks:
    1 train, 2 teach); trainer 0 sends each teacher its rows and puts the answers back in row order."""
    p = run_with_two_teachers(tmp_path, script, "on_policy_distillation.non_colocated_teachers.enabled=true",
                              "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.gpus_per_node=1",
                              ranks=3)
    assert ("3 ranks: 1 train, 2 teach (on_policy_distillation.non_colocated_teachers: 'arithmetic' on teacher "
            "rank 0, 'sum' on 1)") in p.stdout + p.stderr
    check_rows_against_their_teachers(tmp_path)


def check_rows_against_their_teachers(tmp: Path, expected: dict[str, str] = EXPECTED, steps: int = 2) -> None:
    """Every recorded row's teacher logprobs are a plain forward of the teacher its key (task or agent) maps to in
    ``expected`` (1e-5), and not the other teacher's; every key of ``expected`` is seen."""
    from grpo.tasks.catalogue import resolve_model_name

    rows = train_rows(tmp)
    assert sorted(rows) == list(range(1, steps + 1))
    assert all("train/on_policy_distillation/teacher_student_logprob_gap_mean" in r for r in rows.values())
    dirs = {name: resolve_model_name(name) for name in set(expected.values())}
    seen = set()
    for step in range(1, steps + 1):
        rec = torch.load(tmp / f"step_{step}.pt")
        mask = rec["token_mask"] > 0
        forward = {name: teacher_logprobs(d, rec["input_ids"], rec["attention_mask"]) for name, d in dirs.items()}
        for b, key in enumerate(rec["keys"]):
            seen.add(key)
            mine = expected[key]
            got = rec["teacher"][b][mask[b]]
            torch.testing.assert_close(got, forward[mine][b][mask[b]], rtol=0, atol=1e-5,
                                       msg=lambda m: f"step {step} row {b} ({key}): not {mine}'s logprobs: {m}")
            for other in set(dirs) - {mine}:
                assert (got - forward[other][b][mask[b]]).abs().max() > 1e-3, (step, b, key)
    assert seen == set(expected)


@pytest.mark.parametrize("script", ["train_async_grpo", "train_grpo"])
def test_each_row_is_scored_by_its_tasks_teacher(tmp_path, script):
    run_with_two_teachers(tmp_path, script)
    check_rows_against_their_teachers(tmp_path)


@pytest.mark.slow  # two processes on the CPU: ~1 min
def test_two_ranks_with_zero3_teachers_score_each_row_with_its_tasks_teacher(tmp_path):
    """Each teacher a ZeRO-3 engine over both ranks: every sub-batch a collective that both ranks run."""
    run_with_two_teachers(tmp_path, "train_async_grpo", "policy.reference_placement=zero3", ranks=2)
    check_rows_against_their_teachers(tmp_path)


@pytest.mark.slow  # NeMo-Gym's servers start: ~30 s
def test_nemo_gym_rows_are_scored_by_their_agents_teacher(tmp_path):
    """NeMo-RL's key: the agent's name (agent_ref.name), not the task (nemo_gym); strict, so a row keyed by its task
    would stop the run."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run([sys.executable, str(driver), str(tmp_path), "train_grpo", "--config", str(REPO / "configs" / "cpu_demo_gym.yaml"),
         *paths(tmp_path), "checkpointing.enabled=false", "grpo.max_num_steps=1", "grpo.val_period=0",
         "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.num_prompts_per_step=4",
         "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
         "policy.logprob_batch_size=8", "policy.generation_batch_size=16", "logger.progress_bar=false",
         "grpo.adv_estimator.name=opd", "on_policy_distillation.enabled=true",
         "on_policy_distillation.teacher_model_by_agent_name.calc_simple_agent=toy:tiny",
         "on_policy_distillation.strict_agent_name_match=true"], timeout=900)
    check_rows_against_their_teachers(tmp_path, {"calc_simple_agent": "toy:tiny"}, steps=1)
