"""Print a step's best, median and worst samples from the rollout dumps, for reading in a terminal.

    python -m grpo.tools.inspect LOG_DIR [--step N] [--split train|val] [--n K]
    python -m grpo.tools.inspect LOG_DIR --failed [--step N]     # the samples whose environment or reward failed

Reads ``LOG_DIR/rollouts/<split>_step_<N>.jsonl`` (written with ``logger.dump_rollouts=true``);
without ``--step``, the last dumped step. Per sample: reward (and its components), advantage, mask
reason, finish reason, lengths, logprob error, then the conversation, trained messages marked
``TRAINED`` with each line prefixed "> ". ``--failed`` lists every failed sample of the step instead (its reason,
class, retries and the last lines of its error; `grpo.tasks.failures`), or of every dumped step without ``--step``.

The module is ``grpo.tools.inspect``: run with ``-m`` (or imported as ``grpo.tools.inspect``) it does not shadow
the standard library's ``inspect``, which absolute imports (``import inspect``) still find.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from grpo.system.dumps import SPLITS, list_dumps, read_dump, render_messages


class InspectError(Exception):
    """A problem with the inputs: printed as ``error: ...`` with exit status 2."""


def _reward_key(record: dict) -> float:
    r = record.get("reward")
    return r if isinstance(r, (int, float)) and not isinstance(r, bool) and not math.isnan(r) else -math.inf


def pick_samples(records: list[dict], n: int) -> list[tuple[str, int]]:
    """(label, index) of the ``n`` best, ``n`` median and ``n`` worst records by reward (NaN lowest, ties
    by index), each record once (the first label that takes it).

        >>> pick_samples([{"reward": r} for r in (0.5, 1.0, 0.0, 0.2, 0.7)], 1)
        [('best', 1), ('median', 0), ('worst', 2)]
        >>> pick_samples([{"reward": 1.0}, {"reward": 0.0}], 2)
        [('best', 0), ('best', 1)]
    """
    ranked = sorted(range(len(records)), key=lambda i: (_reward_key(records[i]), i))
    start = max((len(ranked) - n) // 2, 0)
    groups = (("best", ranked[::-1][:n]), ("median", ranked[start:start + n]), ("worst", ranked[:n]))
    out, seen = [], set()
    for label, indices in groups:
        for i in indices:
            if i not in seen:
                seen.add(i)
                out.append((label, i))
    return out


def _num(v, digits: int = 4) -> str:
    """``None`` -> "-"; floats to ``digits`` significant digits."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def format_sample(label: str, record: dict) -> str:
    """One sample as text: a header line, its numbers, the conversation and the reference answer."""
    comps = record.get("reward_components")
    lines = [
        f"==== {label}: reward {_num(record['reward'])} | task {record['task_name']} | group {record['group_id']} "
        f"| prompt {record['prompt_index']} ====",
        f"advantage {_num(record['advantage'])} | masked: {record['mask_reason'] or 'no'} | finish "
        f"{record['finish_reason']}{' (truncated)' if record['truncated'] else ''} | {record['turns']} turn(s) | "
        f"{record['response_length']} generated tokens | logprob error {_num(record['logprob_error'], 6)}",
    ]
    if record.get("error") is not None:
        lines.append(f"FAILED: {record['error']} ({record.get('failure_kind') or '?'}), {record.get('retries', 0)} "
                     "retries; its reward is no score")
    if comps:
        lines.append("reward components: " + ", ".join(f"{k} {_num(v)}" for k, v in comps.items()))
    lines.append(render_messages(record["messages"]))
    if record.get("answer") is not None:
        lines.append(f"reference answer: {record['answer']!r}")
    return "\n".join(lines)


def inspect_step(log_dir: str | Path, split: str, step: int | None, n: int) -> str:
    """The report ``main`` prints; InspectError when there is nothing to show."""
    dumps = list_dumps(log_dir, split)
    if not dumps:
        raise InspectError(f"no {split} rollout dumps in {Path(log_dir) / 'rollouts'}: run with "
                           "logger.dump_rollouts=true (and logger.dump_rollouts_every=N) to write them")
    if step is None:
        step = max(dumps)
    if step not in dumps:
        steps = list(dumps)
        shown = ", ".join(map(str, steps if len(steps) <= 12 else steps[:5] + ["..."] + steps[-5:]))
        raise InspectError(f"no {split} dump for step {step} in {Path(log_dir) / 'rollouts'}; dumped steps: {shown}")
    records = read_dump(dumps[step])
    if not records:
        return f"{dumps[step]}: no samples"
    rewards = [_reward_key(r) for r in records]
    finite = [r for r in rewards if math.isfinite(r)]
    mean = f"{sum(finite) / len(finite):.4g}" if finite else "-"
    masked = sum(bool(r.get("masked")) for r in records)
    head = (f"{dumps[step]}: {split} step {step}, {len(records)} samples dumped, reward mean {mean}, "
            f"{masked} masked")
    return "\n\n".join([head] + [format_sample(label, records[i]) for label, i in pick_samples(records, n)])


def format_failure(record: dict, detail_lines: int = 3) -> str:
    """One failed sample: step, task, group, reason, class, retries, then the last lines of its error text.

        >>> print(format_failure({"step": 3, "task_name": "judge", "group_id": 1, "prompt_index": 7, "retries": 4,
        ...                       "error": "http_5xx", "failure_kind": "infra", "error_detail": "a\\nHTTPError: 503"}))
        step 3 | task judge | group 1 | prompt 7 | http_5xx (infra) after 4 retries
            a
            HTTPError: 503
    """
    head = (f"step {record['step']} | task {record['task_name']} | group {record['group_id']} | prompt "
            f"{record['prompt_index']} | {record['error']} ({record.get('failure_kind') or '?'}) after "
            f"{record.get('retries', 0)} retries")
    tail = (record.get("error_detail") or "").rstrip().splitlines()[-detail_lines:]
    return "\n".join([head] + [f"    {line}" for line in tail])


def list_failures(log_dir: str | Path, split: str, step: int | None) -> str:
    """The report of ``--failed``: every failed sample of ``step``'s dump (None: of every dump), counted by
    reason; InspectError when there is no dump."""
    dumps = list_dumps(log_dir, split)
    if not dumps:
        raise InspectError(f"no {split} rollout dumps in {Path(log_dir) / 'rollouts'}: run with "
                           "logger.dump_rollouts=true to write them")
    if step is not None and step not in dumps:
        raise InspectError(f"no {split} dump for step {step} in {Path(log_dir) / 'rollouts'}")
    failed = [r for s in ([step] if step is not None else sorted(dumps)) for r in read_dump(dumps[s])
              if r.get("error") is not None]
    where = f"step {step}" if step is not None else f"{len(dumps)} dumped steps"
    if not failed:
        return f"no failed {split} samples in {where}"
    reasons: dict[str, int] = {}
    for r in failed:
        reasons[r["error"]] = reasons.get(r["error"], 0) + 1
    head = f"{len(failed)} failed {split} samples in {where}: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
    return "\n\n".join([head] + [format_failure(r) for r in failed])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo.tools.inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_dir", metavar="LOG_DIR", help="the run's logger.log_dir")
    p.add_argument("--step", type=int, default=None, help="the step to show (default: the last dumped)")
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--n", type=int, default=1, help="samples of each kind: best, median, worst (default 1)")
    p.add_argument("--failed", action="store_true",
                   help="list the failed samples (reason, class, retries, error) of --step, or of every dumped step")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n {args.n}: must be >= 1")
    try:
        text = (list_failures(args.log_dir, args.split, args.step) if args.failed
                else inspect_step(args.log_dir, args.split, args.step, args.n))
    except InspectError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `| head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
