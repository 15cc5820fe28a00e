"""Plot the curves of one or several runs from their ``metrics.jsonl``.

    python -m grpo.tools.plot LOG_DIR [LOG_DIR ...] --out curves.png [--labels a,b] [--metrics KEY_OR_GLOB,...]

Default panels: train and validation reward, KL, entropy, response length, clip fractions,
token_mult_prob_error, step time by phase. With several runs each run has its colour (legend at the top,
label = the directory's name or ``--labels``) and within a panel each metric its line style (legend in
the panel); with one run each metric has its colour.
``--metrics`` replaces the default panels: one panel per comma-separated item, holding every key that
matches it (a key, or a glob such as ``timing/*``); join items with ``+`` to share a panel
(``train/mean_total_reward+validation/accuracy``). Keys are NeMo-RL's, as runs log them: a metrics.jsonl written
before grpo-ds took them is read with its keys renamed (`legacy_row`, `grpo.metrics.FORMER_NAMES`), and a former key
in ``--metrics`` (``train/reward_mean``) selects the metric's NeMo-RL name. Exit status 2, with a message, when a directory has no
metrics.jsonl or nothing is plottable.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from pathlib import Path

DEFAULT_PANELS = (
    ("reward", ("train/mean_total_reward", "validation/accuracy")),
    ("KL", ("train/kl_penalty",)),
    ("entropy", ("train/approx_entropy",)),
    ("response length (tokens)", ("train/mean_gen_tokens_per_sample", "validation/avg_length")),
    ("clip fraction", ("train/clip_fraction_high", "train/clip_fraction_low")),
    ("token_mult_prob_error", ("train/token_mult_prob_error",)),
    ("time per step by phase (s)", ("timing/train/generation", "timing/train/policy_and_reference_logprobs",
                                    "timing/train/policy_training", "timing/train/prepare_for_generation/total",
                                    "timing/train/total_step_time")),
)
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


class PlotError(Exception):
    """A problem with the inputs: printed as ``error: ...`` with exit status 2."""


def to_float(value) -> float | None:
    """A metric value as a float, or None when it is not a number (null, a list, a bool, other text).

        >>> [to_float(v) for v in (3, 0.5, "nan", "-inf", None, [1, 2], True, "x")]
        [3.0, 0.5, nan, -inf, None, None, None, None]
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def legacy_row(row: dict) -> dict:
    """A metrics.jsonl row with NeMo-RL's keys, to read a run logged before grpo-ds took them (a current run's row
    comes back as it is): each former key as `grpo.metrics.nemo_rl_name` names it, in order. Where a row has a
    value under NeMo-RL's name already, that value stays (older runs logged e.g. ``train/mean_gen_tokens_per_sample``
    beside ``train/response_length_mean``); between two former names, the first.

        >>> legacy_row({"train/kl_penalty": 0.1, "train/kl": 0.1, "train/reward_mean": 0.5, "val/reward_mean": 1})
        {'train/kl_penalty': 0.1, 'train/mean_total_reward': 0.5, 'validation/accuracy': 1}
    """
    from grpo.metrics import nemo_rl_name

    out: dict = {}
    for key, value in row.items():
        name = nemo_rl_name(key)
        if name == key:
            out[key] = value
        elif name not in row and name not in out:
            out[name] = value
    return out


def merge_rows(rows: list[dict]) -> dict[str, dict[int, float]]:
    """Rows of metrics.jsonl -> {key: {step: value}} under NeMo-RL's keys (`legacy_row`: an older file's keys
    are renamed), numbers only (``to_float``); a key logged twice at a step (a resumed run repeats steps) keeps
    its last value; rows without an integer step are skipped.

        >>> merge_rows([{"step": 1, "a": 1.0}, {"step": 1, "b": "nan", "c": [1]}, {"step": 1, "a": 2, "time": 9}])
        {'a': {1: 2.0}, 'b': {1: nan}}
        >>> merge_rows([{"step": 2, "val/reward_mean": 0.5}])
        {'validation/accuracy': {2: 0.5}}
    """
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in legacy_row(row).items():
            v = to_float(value)
            if key in ("step", "time") or v is None:
                continue
            series.setdefault(key, {})[step] = v
    return series


def read_run(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """``merge_rows`` of ``LOG_DIR/metrics.jsonl``; a line that is not JSON (a run killed mid-write) is
    skipped with a warning. PlotError when the file is missing."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} not found: pass a run's logger.log_dir (the directory that holds metrics.jsonl)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                print(f"warning: {path}:{n} is not JSON; skipped", file=sys.stderr)
                continue
            if isinstance(row, dict):
                rows.append(row)
    return merge_rows(rows)


def finite_points(points: dict[int, float]) -> tuple[list[int], list[float]]:
    """(steps, values) sorted by step, without NaN / inf values.

        >>> finite_points({3: 1.0, 1: float("nan"), 2: 0.5})
        ([2, 3], [0.5, 1.0])
    """
    steps = sorted(s for s, v in points.items() if math.isfinite(v))
    return steps, [points[s] for s in steps]


def choose_panels(patterns: list[str] | None, runs: dict[str, dict]) -> list[tuple[str, list[str]]]:
    """(title, keys) of the panels to draw, keeping only keys with a finite value in some run and
    dropping empty panels. ``patterns`` None: ``DEFAULT_PANELS``; else one panel per pattern, ``+``
    joining several patterns into one, each a key or an fnmatch glob; a pattern that matches nothing is tried
    again as its NeMo-RL name (`grpo.metrics.nemo_rl_name`: ``train/kl`` -> ``train/kl_penalty``).

        >>> runs = {"a": {"train/kl_penalty": {1: 0.1}, "timing/train/policy_training": {1: 2.0},
        ...               "timing/train/generation": {1: 1.0}}}
        >>> choose_panels(None, runs)
        [('KL', ['train/kl_penalty']), ('time per step by phase (s)', ['timing/train/generation', 'timing/train/policy_training'])]
        >>> choose_panels(["timing/*", "train/kl+val/kl"], runs)
        [('timing/*', ['timing/train/generation', 'timing/train/policy_training']), ('train/kl+val/kl', ['train/kl_penalty'])]
    """
    from grpo.metrics import nemo_rl_name

    plottable = sorted({k for series in runs.values() for k, pts in series.items() if finite_points(pts)[0]})
    if patterns is None:
        panels = [(title, [k for k in keys if k in plottable]) for title, keys in DEFAULT_PANELS]
    else:
        panels = []
        for item in patterns:
            keys = []
            for pattern in item.split("+"):
                found = fnmatch.filter(plottable, pattern) or fnmatch.filter(plottable, nemo_rl_name(pattern))
                keys += [k for k in found if k not in keys]
            if not keys:
                print(f"warning: --metrics {item!r} matches no plottable metric; skipped", file=sys.stderr)
            panels.append((item, keys))
    return [(title, keys) for title, keys in panels if keys]


def line_color(run: int, key: int, several_runs: bool) -> str:
    """Several runs: one colour per run (keys differ by line style); one run: one colour per key."""
    return f"C{(run if several_runs else key) % 10}"


def line_style(key: int, several_runs: bool):
    return LINE_STYLES[key % len(LINE_STYLES)] if several_runs else "-"


def plot_runs(runs: dict[str, dict[str, dict[int, float]]], panels: list[tuple[str, list[str]]],
              out: str | Path) -> Path:
    """Draw ``panels`` (title, keys) for every run (label -> ``read_run`` output) into the PNG ``out``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.4 * nrows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    several = len(runs) > 1
    for ax, (title, keys) in zip(axes, panels):
        for i, series in enumerate(runs.values()):
            for j, key in enumerate(keys):
                steps, values = finite_points(series.get(key, {}))
                ax.plot(steps, values, color=line_color(i, j, several), linestyle=line_style(j, several),
                        marker="." if len(steps) < 30 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)  # 1.0000003, not 3e-7 + 1
        ax.grid(alpha=0.3)
        if len(keys) > 1 or keys[0] != title:
            handles = [Line2D([], [], color="black" if several else line_color(0, j, False),
                              linestyle=line_style(j, several)) for j in range(len(keys))]
            ax.legend(handles, keys, fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if several:
        fig.legend([Line2D([], [], color=line_color(i, 0, True)) for i in range(len(runs))], list(runs),
                   loc="outside upper center", ncols=min(len(runs), 6), fontsize=9)
    else:
        fig.suptitle(next(iter(runs)), fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m grpo.tools.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="runs' logger.log_dir (holding metrics.jsonl)")
    p.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
    p.add_argument("--labels", default=None, help="comma-separated run labels (default: the directory names)")
    p.add_argument("--metrics", default=None,
                   help="comma-separated panels, each a metric key or glob; '+' joins several into one panel")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        labels = args.labels.split(",") if args.labels else [Path(d).resolve().name for d in args.log_dirs]
        if len(labels) != len(args.log_dirs):
            raise PlotError(f"--labels has {len(labels)} labels for {len(args.log_dirs)} LOG_DIRs")
        if len(set(labels)) != len(labels):
            raise PlotError(f"two runs share a label in {labels}: pass --labels")
        runs = {label: read_run(d) for label, d in zip(labels, args.log_dirs)}
        patterns = [m for m in args.metrics.split(",") if m] if args.metrics else None
        panels = choose_panels(patterns, runs)
        if not panels:
            wanted = f"--metrics {args.metrics!r}" if patterns else "the default panels (reward, KL, entropy, ...)"
            raise PlotError(f"nothing to plot: no finite value of {wanted} in {', '.join(map(str, args.log_dirs))}")
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = plot_runs(runs, panels, args.out)
    print(f"wrote {out} ({len(panels)} panels, {len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
