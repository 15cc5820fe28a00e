"""python -m grpo.tools.plot: PNGs of one and of several runs, metric selection, clear failures (exit 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from grpo.tools.plot import choose_panels, main, merge_rows, read_run
from tests.helpers.e2e import REPO, TINY, child_env, run

C0, C1 = np.array([0x1F, 0x77, 0xB4]) / 255, np.array([0xFF, 0x7F, 0x0E]) / 255  # matplotlib's first two colours


def write_metrics(log_dir, rows) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


def synthetic_rows(offset: float = 0.0) -> list:
    """Train rows for steps 1-6 and validation rows, as MetricsLogger wrote them before grpo-ds took NeMo-RL's
    metric names (read under those), plus what real files hold: a resumed run repeating steps 5-6 (in NeMo-RL's
    names), nulls, "nan" strings, histogram lists, a half-written line."""
    rows = []
    for step in range(1, 7):
        rows.append({"step": step, "time": 1e9 + step, "train/reward_mean": offset + step / 10,
                     "train/kl": 0.01 * step, "train/approx_entropy": 1.0 - step / 20,
                     "train/response_length_mean": 3.0, "train/clip_fraction_high": 0.01, "train/clip_fraction_low": None,
                     "train/token_mult_prob_error": "nan" if step == 2 else 1.0, "advantages/histogram": [1.0, -1.0],
                     "timing/generate_s": 0.5, "timing/logprobs_s": 0.2, "timing/train_s": 1.0, "timing/refit_s": 0.1,
                     "timing/step_s": 1.9})
        if step % 3 == 0:
            rows.append({"step": step, "time": 1e9 + step, "val/reward_mean": offset + step / 8})
    rows.append({"step": 5, "time": 2e9, "train/mean_total_reward": -1.0})  # resumed: replaces step 5's value
    rows.append('{"step": 6, "train/rew')  # killed mid-write
    return rows


def read_png(path):
    from matplotlib.image import imread

    assert path.stat().st_size > 20_000, f"{path} is only {path.stat().st_size} bytes"
    return imread(path)


def has_color(image, rgb) -> bool:
    return bool((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.02).any())


def test_last_value_of_a_step_wins_and_only_numbers_are_kept(tmp_path):
    write_metrics(tmp_path, synthetic_rows())
    series = read_run(tmp_path)
    reward = series["train/mean_total_reward"]  # NeMo-RL's name of train/reward_mean
    assert reward[5] == -1.0 and reward[6] == pytest.approx(0.6)
    assert series["train/kl_penalty"][5] == pytest.approx(0.05)  # the resumed row does not erase other keys
    assert series["validation/accuracy"] == {3: 3 / 8, 6: 6 / 8}
    assert series["timing/train/total_step_time"][1] == pytest.approx(1.9)
    assert not any(k.startswith("val/") or k in ("train/reward_mean", "timing/step_s") for k in series)
    assert math.isnan(series["train/token_mult_prob_error"][2])
    assert "train/clip_fraction_low" not in series and "advantages/histogram" not in series and "time" not in series
    assert merge_rows([{"step": True, "a": 1}, {"a": 2}]) == {}


def test_one_run_png(tmp_path, capsys):
    write_metrics(tmp_path / "run_a", synthetic_rows())
    out = tmp_path / "plots" / "one.png"
    assert main([str(tmp_path / "run_a"), "--out", str(out)]) == 0
    assert "7 panels, 1 run" in capsys.readouterr().out
    image = read_png(out)
    assert image.shape[0] > 500 and image.shape[1] > 1000 and has_color(image, C0)


def test_two_runs_overlaid_with_their_own_colours(tmp_path, capsys):
    write_metrics(tmp_path / "a", synthetic_rows())
    write_metrics(tmp_path / "b", synthetic_rows(offset=0.3))
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    assert main([str(tmp_path / "a"), "--metrics", "train/reward_mean", "--out", str(one)]) == 0
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "base,tuned", "--metrics",
                 "train/reward_mean", "--out", str(two)]) == 0
    assert has_color(read_png(one), C0) and not has_color(read_png(one), C1)
    assert has_color(read_png(two), C0) and has_color(read_png(two), C1)
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "all.png")]) == 0
    assert "7 panels, 2 runs" in capsys.readouterr().out


def test_metrics_pick_panels_by_key_glob_and_plus():
    runs = {"a": {"timing/train/policy_training": {1: 1.0}, "timing/train/generation": {1: 0.5},
                  "train/mean_total_reward": {1: 0.1}, "validation/accuracy": {0: 0.2},
                  "train/kl_penalty": {1: float("nan")}}}
    assert choose_panels(["timing/*", "train/mean_total_reward+validation/accuracy", "train/kl_penalty"], runs) == [
        ("timing/*", ["timing/train/generation", "timing/train/policy_training"]),
        ("train/mean_total_reward+validation/accuracy", ["train/mean_total_reward", "validation/accuracy"]),
    ]  # train/kl_penalty has no finite value: no panel
    # a former name selects the metric's NeMo-RL name
    assert choose_panels(["train/reward_mean+val/reward_mean", "timing/train_s"], runs) == [
        ("train/reward_mean+val/reward_mean", ["train/mean_total_reward", "validation/accuracy"]),
        ("timing/train_s", ["timing/train/policy_training"]),
    ]
    assert [t for t, _ in choose_panels(None, runs)] == ["reward", "time per step by phase (s)"]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo.tools.plot", *args], cwd=REPO, env=child_env(1),
                          capture_output=True, text=True, timeout=120)


def test_a_directory_without_metrics_fails_clearly(tmp_path):
    p = _cli(str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"{tmp_path}/metrics.jsonl not found" in p.stderr and "logger.log_dir" in p.stderr
    assert not (tmp_path / "x.png").exists()


def test_nothing_plottable_or_bad_labels_exit_2(tmp_path, capsys):
    write_metrics(tmp_path / "empty", [{"step": 1, "time": 1.0, "train/kl": None, "note": "text"}])
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    write_metrics(tmp_path / "a", synthetic_rows())
    assert main([str(tmp_path / "a"), "--metrics", "nope/*", "--out", str(tmp_path / "x.png")]) == 2
    assert "matches no plottable metric" in capsys.readouterr().err
    assert main([str(tmp_path / "a"), "--labels", "x,y", "--out", str(tmp_path / "x.png")]) == 2
    assert "--labels has 2 labels for 1 LOG_DIRs" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_plots_of_one_and_two_cpu_demo_runs(tmp_path):
    """The tiny CPU demo config, 3 steps, twice (two seeds), then the plot command on its real logs."""
    for seed in (1, 2):
        run([sys.executable, "train_grpo.py", "--config", TINY, f"logger.log_dir={tmp_path}/seed{seed}",
             "checkpointing.enabled=false", "grpo.val_at_end=true", f"grpo.seed={seed}"], timeout=600)
    rows = [json.loads(line) for line in open(tmp_path / "seed1" / "metrics.jsonl")]
    assert {r["step"] for r in rows} == {1, 2, 3} and any("validation/accuracy" in r for r in rows)
    for dirs, name in (([tmp_path / "seed1"], "one.png"), ([tmp_path / "seed1", tmp_path / "seed2"], "two.png")):
        p = _cli(*map(str, dirs), "--out", str(tmp_path / name))
        assert p.returncode == 0, p.stderr
        assert "7 panels" in p.stdout
        image = read_png(tmp_path / name)
        assert image.shape[0] > 500 and has_color(image, C0)
    assert has_color(read_png(tmp_path / "two.png"), C1)
