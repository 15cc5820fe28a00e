"""python -m grpo.tools.inspect: a step's best / median / worst samples from the dumps, and clear errors."""

from __future__ import annotations

import subprocess
import sys

from grpo.system.dumps import RolloutDumper
from grpo.tools.inspect import main
from tests.helpers.e2e import REPO, child_env
from tests.helpers.rollout_records import make_record


def _dump(tmp_path, step: int, rewards: list[float], split: str = "train", **over) -> None:
    records = [make_record(step=step, split=split, reward=r, group_id=i // 2, **over) for i, r in enumerate(rewards)]
    records[0]["messages"][1]["content"] = f"answer-of-sample-0-step-{step}"
    RolloutDumper(tmp_path, every=1, max_samples=None, rank=0).write(split, step, records)


def test_best_median_worst_with_marks_and_reasons(tmp_path, capsys):
    _dump(tmp_path, 4, [0.5, 1.0, 0.0, 0.25, 0.75])
    records_dir = tmp_path / "rollouts"
    assert main([str(tmp_path), "--step", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{records_dir / 'train_step_4.jsonl'}: train step 4, 5 samples dumped, reward mean 0.5")
    headers = [line for line in out.splitlines() if line.startswith("====")]
    assert [h.split(":")[0] for h in headers] == ["==== best", "==== median", "==== worst"]
    assert "reward 1 " in headers[0] and "reward 0.5 " in headers[1] and "reward 0 " in headers[2]
    assert "[assistant, 3 tokens, TRAINED]" in out and "> 12" in out and "  7+5=" in out
    assert "masked: no" in out and "finish stop" in out and "reference answer: '12'" in out


def test_n_and_the_last_step_by_default(tmp_path, capsys):
    _dump(tmp_path, 2, [0.0, 1.0])
    _dump(tmp_path, 10, [0.0] * 6, masked=True, mask_reason="overlong", finish_reason="length", truncated=True)
    assert main([str(tmp_path), "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert "train step 10, 6 samples dumped" in out and "6 masked" in out
    assert sum(line.startswith("====") for line in out.splitlines()) == 6  # 2 best, 2 median, 2 worst
    assert "masked: overlong" in out and "finish length (truncated)" in out


def test_val_split(tmp_path, capsys):
    _dump(tmp_path, 0, [1.0], split="val")
    assert main([str(tmp_path), "--split", "val"]) == 0
    out = capsys.readouterr().out
    assert "val step 0, 1 samples dumped" in out and "advantage -" in out


def test_no_dumps_says_how_to_get_them(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no train rollout dumps" in err and "logger.dump_rollouts=true" in err


def test_a_step_without_a_dump_lists_the_dumped_steps(tmp_path, capsys):
    for step in (1, 3):
        _dump(tmp_path, step, [1.0])
    assert main([str(tmp_path), "--step", "2"]) == 2
    assert "no train dump for step 2" in capsys.readouterr().err.replace("\n", " ")


def test_module_runs_with_m_and_does_not_shadow_the_standard_inspect(tmp_path):
    """``grpo/tools/inspect.py`` must not hide the standard library's inspect (torch, pydantic, pytest use it)."""
    _dump(tmp_path, 1, [1.0, 0.0])
    code = ("import sysconfig, inspect, grpo.tools.inspect, grpo.system.dumps, grpo.tools.plot; "
            "assert inspect.__file__.startswith(sysconfig.get_paths()['stdlib']), inspect.__file__; "
            "assert callable(inspect.signature) and grpo.tools.inspect.__name__ == 'grpo.tools.inspect'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(1), check=True, timeout=120)
    p = subprocess.run([sys.executable, "-m", "grpo.tools.inspect", str(tmp_path)], cwd=REPO, env=child_env(1),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "answer-of-sample-0-step-1" in p.stdout


def test_failed_samples_are_dumped_first_and_listed_with_their_reason_and_error(tmp_path, capsys):
    """Issue 31: a dump keeps its failed samples (reason, class, error text) and ``--failed`` lists them."""
    from grpo.tools.inspect import main
    from grpo.system.dumps import RolloutDumper
    from tests.helpers.rollout_records import make_record

    records = [make_record(reward=float(i), group_id=i) for i in range(6)]
    records.append(make_record(reward=0.0, group_id=6, masked=True, mask_reason="failed", error="env_timeout",
                               failure_kind="infra", error_detail="Traceback...\nTimeoutError: no answer in 5 s",
                               retries=4))
    dumper = RolloutDumper(str(tmp_path), 1, 3, 0, enabled=True)
    kept = dumper.select(records)
    assert len(kept) == 3 and kept[0]["error"] == "env_timeout"  # kept whatever its "reward"
    dumper.write("train", 3, records)
    assert main([str(tmp_path), "--failed"]) == 0
    out = capsys.readouterr().out
    assert "1 failed train samples in 1 dumped steps: env_timeout 1" in out
    assert "env_timeout (infra) after 4 retries" in out and "TimeoutError: no answer in 5 s" in out
