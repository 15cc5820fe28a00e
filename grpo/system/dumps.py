"""Rollout dumps: what the policy generated, one JSON line per sample (``logger.dump_rollouts``).

Every ``logger.dump_rollouts_every`` steps, rank 0 writes ``<log_dir>/rollouts/train_step_<N>.jsonl``
(and ``val_step_<N>.jsonl`` when validation runs on a dump step), at most
``logger.dump_rollouts_max_samples`` lines each. ``python -m grpo.tools.inspect LOG_DIR`` prints them for a
person; ``wandb_table`` turns them into a wandb table.

Record schema (the loop builds each record with exactly these keys; ``write`` checks them):

    step               int    the training step (0: validation before training)
    split              str    "train" | "val"
    task_name          str    the environment / task of the sample
    group_id           int    the sample's group (all generations of one prompt share it)
    prompt_index       int    the prompt's index in its dataset
    messages           list   the conversation, each {"role": str, "content": str, "trained": bool
                              (its tokens are trained: generated assistant tokens), "flags": [str]
                              (message-level penalty flags raised on it), "num_tokens": int}
    question           str    the prompt's question (None if the task has none)
    answer             any    the reference answer (None if the task has none)
    reward             float  the environment's reward: what train/mean_total_reward averages (reward
                              penalties, which validation/accuracy applies, scaling and shaping show in the advantage);
                              None for a failed sample (dumps written before held 0.0 there)
    reward_components  dict   {name: float} as the environment returned them, or None
    advantage          float  mean advantage over the sample's trained tokens; None for validation
    masked             bool   the sample is excluded from the loss
    mask_reason        str    None | "failed" | "mask_sample" | "dropped_group" | "overlong" | "logprob_error"
                              (None iff not masked; failed, flagged and dropped-group samples are out of their
                              group's baseline too)
    finish_reason      str    "stop" | "length"
    truncated          bool   the sample hit a length cap
    turns              int    assistant turns in the conversation
    response_length    int    generated tokens
    logprob_error      float  mean over trained tokens of exp|generation - previous-policy logprob|
                              (``grpo.logprobs.seq_logprob_error``); None when unknown
    error              str    None, or why the sample failed (``Failure.reason``, a key of
                              ``grpo.trajectory.REASONS``): it has no reward (it was masked, never trained on)
    failure_kind       str    None | "infra" | "data" (the failure's class)
    error_detail       str    None, or the failure's traceback / message
    retries            int    environment or reward calls retried for the sample (also when a retry succeeded)

Tensors and numpy scalars are written as plain numbers; NaN and ±inf as the strings "nan", "inf",
"-inf" (JSON has no such numbers); ``read_dump`` turns them back into floats in the float fields.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path

RECORD_KEYS = ("step", "split", "task_name", "group_id", "prompt_index", "messages", "question", "answer",
               "reward", "reward_components", "advantage", "masked", "mask_reason", "finish_reason",
               "truncated", "turns", "response_length", "logprob_error", "error", "failure_kind", "error_detail",
               "retries")
MESSAGE_KEYS = ("role", "content", "trained", "flags", "num_tokens")
SPLITS = ("train", "val")
MASK_REASONS = (None, "failed", "mask_sample", "dropped_group", "overlong", "logprob_error")
FINISH_REASONS = ("stop", "length")
_FLOAT_FIELDS = ("reward", "advantage", "logprob_error")
_DUMP_NAME = re.compile(r"^(train|val)_step_(\d+)\.jsonl$")


def to_plain(value):
    """Tensors / numpy values -> Python numbers and lists, tuples -> lists, recursively.

        >>> import torch
        >>> to_plain({"r": torch.tensor(0.5), "ids": (torch.tensor([1, 2]),)})
        {'r': 0.5, 'ids': [[1, 2]]}
    """
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # torch / numpy, 0-d included
        return value.tolist()
    return value


def encode_nonfinite(value):
    """NaN / ±inf floats -> "nan" / "inf" / "-inf", recursively (JSON has no such numbers).

        >>> encode_nonfinite({"a": [float("nan"), 1.5], "b": float("-inf")})
        {'a': ['nan', 1.5], 'b': '-inf'}
    """
    if isinstance(value, dict):
        return {k: encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode_nonfinite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def decode_float(value):
    """The inverse of ``encode_nonfinite`` for one number: "nan" / "inf" / "-inf" -> float.

        >>> decode_float("-inf"), decode_float(2), decode_float(None)
        (-inf, 2, None)
    """
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_record(record: dict, split: str | None = None, step: int | None = None) -> None:
    """Raise ValueError naming the first field of ``record`` (plain Python values) that breaks the schema
    of the module docstring, or that differs from the ``split`` / ``step`` being written."""
    keys = tuple(record)
    if set(keys) != set(RECORD_KEYS):
        missing = [k for k in RECORD_KEYS if k not in record]
        extra = [k for k in keys if k not in RECORD_KEYS]
        raise ValueError(f"rollout record: missing keys {missing}, unknown keys {extra} "
                         "(the schema is grpo.system.dumps.RECORD_KEYS)")

    def bad(key: str, want: str):
        return ValueError(f"rollout record (step {record['step']!r}, group {record['group_id']!r}): "
                          f"{key}={record[key]!r}, expected {want}")

    checks = {
        "step": (_is_int, "an int"), "group_id": (_is_int, "an int"), "prompt_index": (_is_int, "an int"),
        "turns": (_is_int, "an int"), "response_length": (_is_int, "an int"),
        "split": (lambda v: v in SPLITS, f"one of {SPLITS}"),
        "task_name": (lambda v: isinstance(v, str), "a str"),
        "question": (lambda v: v is None or isinstance(v, str), "a str or None"),
        "reward": (lambda v: v is None or _is_number(v), "a number, or None for a failed sample"),
        "reward_components": (lambda v: v is None or (isinstance(v, dict) and all(_is_number(x) for x in v.values())),
                              "None or a dict of numbers"),
        "advantage": (lambda v: v is None or _is_number(v), "a number or None"),
        "logprob_error": (lambda v: v is None or _is_number(v), "a number or None"),
        "masked": (lambda v: isinstance(v, bool), "a bool"),
        "truncated": (lambda v: isinstance(v, bool), "a bool"),
        "mask_reason": (lambda v: v in MASK_REASONS, f"one of {MASK_REASONS} (grpo.system.dumps.MASK_REASONS)"),
        "finish_reason": (lambda v: v in FINISH_REASONS, f"one of {FINISH_REASONS}"),
        "messages": (lambda v: isinstance(v, list), "a list of messages"),
        "error": (lambda v: v is None or isinstance(v, str), "None or a failure reason"),
        "failure_kind": (lambda v: v in (None, "infra", "data"), "None, 'infra' or 'data'"),
        "error_detail": (lambda v: v is None or isinstance(v, str), "None or a str"),
        "retries": (_is_int, "an int"),
    }
    for key, (ok, want) in checks.items():
        if not ok(record[key]):
            raise bad(key, want)
    if record["masked"] != (record["mask_reason"] is not None):
        raise bad("mask_reason", f"a reason exactly when masked (masked={record['masked']})")
    if record["split"] == "val" and record["advantage"] is not None:
        raise bad("advantage", "None for a validation sample")
    if split is not None and record["split"] != split:
        raise bad("split", f"{split!r}, the split being written")
    if step is not None and record["step"] != step:
        raise bad("step", f"{step}, the step being written")
    for i, m in enumerate(record["messages"]):
        if not isinstance(m, dict) or set(m) != set(MESSAGE_KEYS):
            raise bad("messages", f"message {i} with exactly the keys {MESSAGE_KEYS}")
        if not (isinstance(m["role"], str) and isinstance(m["content"], str) and isinstance(m["trained"], bool)
                and isinstance(m["flags"], list) and all(isinstance(f, str) for f in m["flags"])
                and _is_int(m["num_tokens"])):
            raise bad("messages", f"message {i}: role/content str, trained bool, flags [str], num_tokens int")


def _rank_key(reward) -> float:
    """Sort key of a reward: NaN (and non-numbers) rank lowest."""
    r = decode_float(reward)
    return r if _is_number(r) and not math.isnan(r) else -math.inf


def representative_indices(rewards: list[float], k: int) -> list[int]:
    """Indices of at most ``k`` samples spread evenly over the reward ranking, in their original order.

    The samples are ranked by (reward, index), NaN lowest; the pick is ranks round(i·(n-1)/(k-1)) for
    i = 0..k-1: always the worst and the best, the rest evenly spaced between them (k = 1: the best).
    Deterministic: ties go by index.

        >>> representative_indices([0.3, 0.9, 0.1, 0.5, 0.7], 3)   # worst 0.1, median 0.5, best 0.9
        [1, 2, 3]
        >>> representative_indices([1.0, 0.0], 5)
        [0, 1]
    """
    n = len(rewards)
    if k >= n:
        return list(range(n))
    ranked = sorted(range(n), key=lambda i: (_rank_key(rewards[i]), i))
    if k == 1:
        return [ranked[-1]]
    picks = {ranked[int(math.floor(i * (n - 1) / (k - 1) + 0.5))] for i in range(k)}
    return sorted(picks)


def dump_path(log_dir: str | os.PathLike, split: str, step: int) -> Path:
    """``<log_dir>/rollouts/<split>_step_<step>.jsonl``."""
    return Path(log_dir) / "rollouts" / f"{split}_step_{step}.jsonl"


def list_dumps(log_dir: str | os.PathLike, split: str) -> dict[int, Path]:
    """The dumps of ``split`` under ``<log_dir>/rollouts``, by step (ascending); {} if there are none."""
    found = {}
    rollouts = Path(log_dir) / "rollouts"
    if rollouts.is_dir():
        for p in rollouts.iterdir():
            m = _DUMP_NAME.match(p.name)
            if m and m.group(1) == split:
                found[int(m.group(2))] = p
    return dict(sorted(found.items()))


def read_dump(path: str | os.PathLike) -> list[dict]:
    """The records of one dump file, with "nan" / "inf" / "-inf" turned back into floats in the float
    fields (reward, advantage, logprob_error, reward_components values)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            for key in _FLOAT_FIELDS:
                if key in r:
                    r[key] = decode_float(r[key])
            if isinstance(r.get("reward_components"), dict):
                r["reward_components"] = {k: decode_float(v) for k, v in r["reward_components"].items()}
            records.append(r)
    return records


class RolloutDumper:
    """Writes a step's rollout records as ``<log_dir>/rollouts/{split}_step_{step}.jsonl`` (rank 0).

    ``every``: ``logger.dump_rollouts_every``; ``max_samples``: ``logger.dump_rollouts_max_samples``
    (None: no bound); ``enabled``: ``logger.dump_rollouts`` (False: ``due`` is always False).
    """

    def __init__(self, log_dir: str | os.PathLike, every: int, max_samples: int | None, rank: int,
                 enabled: bool = True):
        if not _is_int(every) or every < 1:
            raise ValueError(f"logger.dump_rollouts_every={every!r}: must be an integer >= 1")
        if max_samples is not None and (not _is_int(max_samples) or max_samples < 1):
            raise ValueError(f"logger.dump_rollouts_max_samples={max_samples!r}: must be an integer >= 1 "
                             "(or null for no bound)")
        self.log_dir = Path(log_dir)
        self.every = every
        self.max_samples = max_samples
        self.rank = rank
        self.enabled = enabled
        self.failed: str | None = None  # why writing stopped (a failed write turns the dumps off)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a dump step: enabled and step % every == 0 (step 0, validation before
        training, included). The same on every rank, so building records may use collectives."""
        return self.enabled and step % self.every == 0

    def select(self, records: list[dict]) -> list[dict]:
        """The records a dump keeps: all of them, or ``max_samples``: the failed samples first, then the others
        chosen by ``representative_indices`` of their rewards (worst, best, evenly spaced between). ``write`` applies it; the loop applies it
        too when it logs the same records elsewhere (a wandb table)."""
        if self.max_samples is None:
            return list(records)
        failed = [r for r in records if r.get("error") is not None][:self.max_samples]  # kept first: what broke
        scored = [r for r in records if r.get("error") is None]
        room = self.max_samples - len(failed)
        picked = representative_indices([r["reward"] for r in scored], room) if room > 0 else []
        return failed + [scored[i] for i in picked]

    def write(self, split: str, step: int, records: list[dict]) -> Path | None:
        """Write ``select(records)`` atomically (a temporary file renamed into place); returns the path,
        or None on ranks other than 0, when disabled, and after a failed write. Every record is checked
        against the schema first (ValueError naming the field). A write the file system refuses (OSError:
        a full disk, a file-size limit, a read-only directory) leaves no partial file, sets ``failed``
        (no later dump is tried: ``due`` stays the same on every rank) and is raised for the caller to
        count and warn about; the training goes on."""
        if split not in SPLITS:
            raise ValueError(f"RolloutDumper.write: split={split!r}, expected one of {SPLITS}")
        if not self.enabled or self.rank != 0 or self.failed is not None:
            return None
        plain = [to_plain(r) for r in records]
        for r in plain:
            check_record(r, split=split, step=step)
        plain = self.select(plain)
        path = dump_path(self.log_dir, split, step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as err:
            self.failed = f"{type(err).__name__}: {err}"
            raise
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in plain:
                    f.write(json.dumps(encode_nonfinite(r), ensure_ascii=False, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(err, OSError):
                self.failed = f"{type(err).__name__}: {err}"
            raise
        return path


def render_messages(messages: list[dict]) -> str:
    """A conversation as text: a header per message (role, token count, ``TRAINED`` on trained messages,
    flags), then its content, each line of a trained message prefixed with "> ".

        >>> print(render_messages([{"role": "user", "content": "2+2=", "trained": False, "flags": [], "num_tokens": 4},
        ...                        {"role": "assistant", "content": "4", "trained": True, "flags": ["overlong"],
        ...                         "num_tokens": 2}]))
        [user, 4 tokens]
          2+2=
        [assistant, 2 tokens, TRAINED, flags: overlong]
        > 4
    """
    lines = []
    for m in messages:
        head = [m.get("role", "?"), f"{m.get('num_tokens', '?')} tokens"]
        if m.get("trained"):
            head.append("TRAINED")
        if m.get("flags"):
            head.append("flags: " + ", ".join(m["flags"]))
        lines.append("[" + ", ".join(head) + "]")
        prefix = "> " if m.get("trained") else "  "
        lines += [prefix + line for line in str(m.get("content", "")).split("\n")]
    return "\n".join(lines)


def wandb_table(records: list[dict]):
    """A ``wandb.Table`` with the columns of ``RECORD_KEYS``: messages rendered by ``render_messages``,
    reward_components as JSON text. The loop logs it, e.g. ``run.log({"train/rollouts": table}, step=step)``."""
    import wandb

    rows = []
    for r in records:
        r = to_plain(r)
        row = []
        for key in RECORD_KEYS:
            v = r[key]
            if key == "messages":
                v = render_messages(v)
            elif key == "reward_components" and v is not None:
                v = json.dumps(encode_nonfinite(v))
            elif key in _FLOAT_FIELDS:
                v = decode_float(v)
            row.append(v)
        rows.append(row)
    return wandb.Table(columns=list(RECORD_KEYS), data=rows)


def failure_fields(failure) -> dict:
    """A `grpo.trajectory.Failure` (or None) as a record's flat ``error`` / ``failure_kind`` / ``error_detail``.

        >>> from grpo.trajectory import Failure
        >>> failure_fields(Failure.of("http_5xx", "503")), failure_fields(None)["error"]
        ({'error': 'http_5xx', 'failure_kind': 'infra', 'error_detail': '503'}, None)
    """
    if failure is None:
        return {"error": None, "failure_kind": None, "error_detail": None}
    return {"error": failure.reason, "failure_kind": failure.kind, "error_detail": failure.detail}


def rollout_records(trajectories: list, split: str, step: int, batch=None, overlong_filtering: bool = False
                    ) -> list[dict]:
    """Dump records (the schema above) of a rollout's trajectories (`grpo.trajectory.Trajectory`). ``batch``: the
    step's `grpo.batch.TrainBatch` after the advantages phase, for advantages, masks and logprob errors (None for
    validation). A masked sample's reason: a failure (its environment or reward call failed: masked in
    validation too), else the environment's ``mask_sample``, else its group dropped (too few valid members),
    else overlong filtering of a truncated sample, else the sequence logprob-error threshold."""
    from grpo.logprobs import seq_logprob_error
    from grpo.rollout_metrics import sample_token_means

    adv_b = err_b = mask_b = valid_b = None
    if batch is not None:  # a record per sample: its first row (a branch row's sample has its reward and advantage)
        if not bool(batch.first_rows().all()):
            batch = batch.select(batch.first_rows())
            trajectories = batch.trajectories
        if batch.advantages_bt is not None:  # None in a step skipped for failures (grpo.run.step_end.skip_step)
            adv_b = sample_token_means(batch.advantages_bt, batch.token_mask_bt).tolist()
        mask_b = batch.sample_mask_b.tolist()
        valid_b = batch.valid_b.tolist()
        if batch.prev_logprobs_bt is not None:
            err_b = seq_logprob_error(batch.generation_logprobs_bt, batch.prev_logprobs_bt,
                                      batch.token_mask_bt).tolist()
    records = []
    for i, t in enumerate(trajectories):
        masked = (mask_b is not None and mask_b[i] == 0) or not t.scored
        reason = None
        if masked:
            reason = ("failed" if not t.scored else
                      "mask_sample" if t.mask_sample and not valid_b[i] else
                      "dropped_group" if not valid_b[i] else
                      "overlong" if overlong_filtering and t.truncated else "logprob_error")
        records.append({
            "step": step, "split": split, "task_name": t.task_name, "group_id": t.group_id,
            "prompt_index": t.prompt_index,
            "messages": [{"role": m.role, "content": m.content, "trained": m.trained, "flags": list(m.flags),
                          "num_tokens": len(m.token_ids)} for m in t.messages],
            "question": t.question, "answer": t.answer, "reward": t.reward, "reward_components": t.reward_components,
            "advantage": None if adv_b is None else adv_b[i], "masked": masked, "mask_reason": reason,
            "finish_reason": t.finish_reason, "truncated": t.truncated, "turns": t.turns,
            "response_length": t.num_generated_tokens, "logprob_error": None if err_b is None else err_b[i],
            **failure_fields(t.failure),
            "retries": int(t.retries),
        })
    return records
