"""End to end, issue 43 (7): a validation in which every sample failed reported accuracy 0, ranked checkpoints by that 0
and ended the run with "last validation/accuracy 0", a score made of nothing. It is reported as failed: NaN in the
logged metrics with the failed count, a line saying so, no checkpoint metric, and a closing line that says failed."""

from __future__ import annotations

import json
import sys

from tests.helpers.e2e import TINY, metrics, paths, run

# Validation's own environment for the run's task: a reward of 1e39 (inf in float32) fails every sample it scores.
FAILING_VALIDATION = "env.val_tasks={arithmetic: {name: function, reward_fn: 'tests.helpers.e2e_reward_fns:huge_reward'}}"


def test_a_validation_whose_samples_all_failed_is_reported_failed_never_as_accuracy_0(tmp_path):
    p = run([sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp_path), FAILING_VALIDATION,
             "grpo.max_num_steps=2", "grpo.val_period=1", "grpo.rollout_failure.max_data_attempts_per_prompt=1",
             "checkpointing.metric_name=val:accuracy", "checkpointing.keep_top_k=1", "checkpointing.save_period=1"])
    out = p.stdout.strip().splitlines()
    assert out[-1] == "done: 2 steps, last validation failed (none of its samples was scored)", p.stdout[-2000:]
    notes = [line for line in out if line.startswith("validation at step")]
    assert [n.split(", none was scored")[0] for n in notes] == [
        f"validation at step {s} failed: all 8 samples failed (reward_error: 8)" for s in (1, 2)]
    assert all("inf as float32" in n for n in notes)  # the first failure's own words
    val_rows = [r for r in metrics(tmp_path) if "validation/num_samples" in r]
    assert [(r["step"], r["validation/accuracy"], r["validation/failed_samples"]) for r in val_rows] == [
        (1, "nan", 8.0), (2, "nan", 8.0)]  # NaN, written as metrics.jsonl writes non-finite numbers: never 0
    state = json.loads((tmp_path / "ckpt" / "step_000002" / "train_state.json").read_text())
    assert "val:accuracy" not in state["metrics"] and "validation/accuracy" not in state["metrics"]
    assert state["val_reward"] == -99999999.0  # NeMo-RL's "no validation score", not 0
