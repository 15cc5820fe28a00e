"""Prompt data: rows from a built-in task, reasoning-gym, local files or the hub; prompt formatting; a
resumable data loader.

A row is a plain, picklable dict::

    {"question": "3+4=", "answer": "7", "source": "arithmetic/train:0", "meta": {}}

``source`` says where the row came from: ``"<file>:<n>"`` (n = 1-based line of a .jsonl file, 0-based
row index of any other file), ``"<hub name>/<split>:<i>"``, ``"arithmetic/<split>:<i>"`` or
``"reasoning_gym:<task>/<split>:<i>"``. ``meta`` holds what a scorer needs besides the answer: the
reasoning-gym entry, or the other columns of a file row. `PromptDataset` formats and tokenises rows into
`grpo.tasks.rows.PromptRow`s, what the loader batches and the rollout reads.

`load_rows` returns a list that also carries a `LoadReport` (``rows.report.num_skipped``: malformed
rows skipped under ``data.on_bad_row=skip``).

Resuming the data order: iterate the loader of `build_dataloader` the way a training loop does,
``for epoch in range(start_epoch, n): for batch in loader: ...`` (or ``it = iter(loader)`` and
``next(it)``, starting a new epoch with a new ``iter(loader)`` on StopIteration), and save ``(epoch,
loader.state_dict())`` between batches, never after the StopIteration. On resume,
``loader.load_state_dict(state)`` and restart at the saved epoch: the first ``iter(loader)`` finishes
the interrupted epoch (it is empty when the state was saved right after the epoch's last batch) and
the next epochs follow in the same order as an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from grpo.config import DataConfig
from grpo.tasks.catalogue import dataset_task, load
from grpo.tasks.nemo_gym import GYM_INPUT_KEY, check_gym_record, gym_record_to_row
from grpo.tasks.rows import ROW_KEYS, DataError, PromptRow, Row, content_problem
from grpo.system.vision import (
    ANSWER_KEY, PROMPT_KEY, content_text, format_record, has_images, render_prompt,
)

logger = logging.getLogger(__name__)
FILE_EXTENSIONS = (".jsonl", ".json", ".parquet", ".arrow")
DEFAULT_SPLIT_FILES = {"train": ("train",), "val": ("val", "validation", "test")}
DEFAULT_HUB_SPLITS = {"train": "train", "val": "test"}


@dataclass
class LoadReport:
    """What `load_rows` read: where from, how many rows, and the malformed rows it skipped."""

    source: str
    num_rows: int = 0
    num_skipped: int = 0
    skipped: list[str] = field(default_factory=list)  # the first few "where: problem" messages

    MAX_MESSAGES = 10


class Rows(list):
    """The list of rows `load_rows` returns; ``rows.report`` is its `LoadReport` (a plain list otherwise)."""

    def __init__(self, rows: list[Row], report: LoadReport, spans: list[tuple[int, int, DataConfig]] | None = None):
        super().__init__(rows)
        self.report = report
        self.spans = spans or []  # (start, stop, cfg): rows[start:stop] take cfg's prompt template and system prompt


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------
_MISSING = object()


def field_value(record: dict, key: str) -> Any:
    """``record[key]``, or for a dotted key absent as such the value at that path (dict keys, list indices);
    a missing value is `_MISSING`.

    >>> field_value({"reward_model": {"ground_truth": "7"}}, "reward_model.ground_truth")
    '7'
    >>> field_value({"prompt": [{"role": "user", "content": "1+1?"}]}, "prompt.0.content")
    '1+1?'
    """
    if key in record or "." not in key:
        return record.get(key, _MISSING)
    value: Any = record
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def check_record(record: Any, input_key: str, output_key: str) -> str | None:
    """The problem with a file record as text, or None when it makes a valid row.

    >>> check_record({"input": "1+1=", "output": 2}, "input", "output") is None
    True
    >>> check_record({"input": " ", "output": "1"}, "input", "output")
    "empty prompt in 'input'"
    """
    if not isinstance(record, dict):
        return f"expected an object with keys {input_key!r} and {output_key!r}, got {type(record).__name__}"
    question, answer = field_value(record, input_key), field_value(record, output_key)
    if question is _MISSING:
        return f"missing input key {input_key!r} (keys: {sorted(record)})"
    if answer is _MISSING:
        return f"missing output key {output_key!r} (keys: {sorted(record)})"
    if isinstance(question, list):  # a conversation so far
        bad = next((m for m in question if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                                and isinstance(m.get("content"), (str, list)))), None)
        if bad is not None or not question:
            return f"prompt {input_key!r}: expected a string or a non-empty list of {{role, content}} messages"
        for i, m in enumerate(question):  # content: text, or NeMo-RL's parts (text and images: grpo.system.vision)
            if (problem := content_problem(m["content"])) is not None:
                return f"prompt {input_key!r}: message {i}: {problem}"
        if question[-1]["role"] != "user":
            return f"prompt {input_key!r}: a conversation must end with a user message (got {question[-1]['role']!r})"
    elif not isinstance(question, str):
        return f"prompt {input_key!r} is {type(question).__name__}, expected a string or a list of messages"
    elif not question.strip():
        return f"empty prompt in {input_key!r}"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"answer {output_key!r} is {type(answer).__name__}, expected a string or a number"
    return None


def record_to_row(record: dict, input_key: str, output_key: str, source: str) -> Row:
    """A checked record as a row; the other columns go into meta."""
    used = (input_key.split(".")[0] if input_key not in record else input_key,
            output_key.split(".")[0] if output_key not in record else output_key)
    meta = {k: v for k, v in record.items() if k not in used}
    return {"question": field_value(record, input_key), "answer": str(field_value(record, output_key)),
            "source": source, "meta": meta}


@dataclass
class _BadJson:
    """A .jsonl line that is not JSON: reported like any other malformed row."""

    problem: str


def _not_utf8(data: bytes, err: UnicodeDecodeError) -> str:
    """Where a bad byte is, as text: ``byte 0xff at line 3, column 7 is not UTF-8`` (``data`` one or more lines).

    >>> _not_utf8(b"ab\\ncd\\xff", UnicodeDecodeError("utf-8", b"ab\\ncd\\xff", 5, 6, "invalid start byte"))
    'byte 0xff at line 2, column 3 is not UTF-8'
    """
    line = data.count(b"\n", 0, err.start) + 1
    column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return f"byte 0x{data[err.start]:02x} at line {line}, column {column} is not UTF-8"


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line, record) for each non-blank line; a line that is not JSON, or not UTF-8, yields a `_BadJson`
    (a bad row: reported or skipped like any other, per ``data.on_bad_row``)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield lineno, _BadJson(_not_utf8(raw, err).replace("at line 1, ", "at "))
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                yield lineno, _BadJson(f"invalid JSON ({err.msg} at column {err.colno})")


def _read_json(path: Path) -> list[Any] | None:
    """Records of a .json file holding a list of objects (or ``{"data": [...]}``); None if it is JSON lines.

    A byte that is not UTF-8 in a JSON document is an error naming its line (a document has no rows to skip);
    in a file of JSON lines it makes a bad row, like any other malformed line."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        try:
            json.loads(data.decode("utf-8", errors="replace"))
        except json.JSONDecodeError:
            return None  # JSON lines: `_read_jsonl` reports the bad line as a row
        raise DataError(f"{path}: {_not_utf8(data, err)}; save the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of objects, got {type(data).__name__}")
    return data


def _read_table(path: Path) -> list[Any]:
    """Records of a .parquet or .arrow file; a file that is not one is a `DataError` naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = "Parquet" if path.suffix == ".parquet" else "Arrow"
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path).to_pylist()
        try:  # `datasets` writes the streaming format; plain Arrow IPC files use the file format
            with pa.memory_map(str(path)) as src:
                return pa.ipc.open_stream(src).read_all().to_pylist()
        except pa.ArrowInvalid:
            with pa.memory_map(str(path)) as src:
                return pa.ipc.open_file(src).read_all().to_pylist()
    except (pa.ArrowException, OSError) as err:
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise DataError(f"{path}: not a readable {kind} file ({reason}); check the file, or give it the extension "
                        f"of what it holds ({', '.join(FILE_EXTENSIONS)})") from None


def _rows_from_records(records, where: str, cfg: DataConfig, report: LoadReport, line_numbers: bool) -> list[Row]:
    """Check each (n, record); a bad one raises `DataError` or is skipped and counted (``on_bad_row``)."""
    rows = []
    gym = cfg.input_key == GYM_INPUT_KEY  # NeMo-Gym rows (env.should_use_nemo_gym): NemoGymDataset's, kept whole
    keys = (PROMPT_KEY, ANSWER_KEY) if cfg.row_format else (cfg.input_key, cfg.output_key)
    check = (lambda r: check_gym_record(r)) if gym else (lambda r: check_record(r, *keys))
    fill = _row_format_fill(cfg)
    for n, record in records:
        if cfg.row_format and not isinstance(record, _BadJson):  # NeMo-RL's image dataset columns (data.row_format)
            try:
                record = format_record(cfg.row_format, record, fill, n, f"{where}:{n}")
            except (ValueError, TypeError, KeyError, DataError) as err:
                record = _BadJson(str(err))
        problem = record.problem if isinstance(record, _BadJson) else check(record)
        if problem is None:
            rows.append(gym_record_to_row(record, f"{where}:{n}") if gym else
                        record_to_row(record, *keys, f"{where}:{n}"))
            continue
        message = f"{where} {'line' if line_numbers else 'row'} {n}: {problem}"
        if cfg.on_bad_row == "error":
            raise DataError(message + " (set data.on_bad_row=skip to skip malformed rows)")
        report.num_skipped += 1
        if len(report.skipped) < LoadReport.MAX_MESSAGES:
            report.skipped.append(message)
    return rows


def _row_format_fill(cfg: DataConfig):
    """The prompt template applied to a ``data.row_format`` row's problem (NeMo-RL's vlm_hf_data_processor fills each
    text part), None without a template."""
    if not cfg.row_format or (cfg.prompt_template is None and cfg.prompt_file is None):
        return None
    template = cfg.prompt_template if cfg.prompt_template is not None else _read_text(cfg.prompt_file, "prompt_file")
    return lambda text: fill_template(template, text)


def read_file_rows(path: Path, cfg: DataConfig, report: LoadReport) -> list[Row]:
    """Rows of one local .jsonl / .json / .parquet / .arrow file (a .json file may hold JSON lines)."""
    records = _read_json(path) if path.suffix == ".json" else None
    if path.suffix == ".jsonl" or (path.suffix == ".json" and records is None):
        return _rows_from_records(_read_jsonl(path), str(path), cfg, report, line_numbers=True)
    if records is None:
        records = _read_table(path)
    return _rows_from_records(enumerate(records), str(path), cfg, report, line_numbers=False)


def _split_file(directory: Path, split: str, cfg: DataConfig) -> Path:
    """The file of ``split`` in a directory: ``<name>.<ext>`` for the configured or default split names."""
    explicit = cfg.train_split if split == "train" else cfg.val_split
    names = (explicit,) if explicit else DEFAULT_SPLIT_FILES[split]
    for name in names:
        for ext in FILE_EXTENSIONS:
            if (directory / f"{name}{ext}").is_file():
                return directory / f"{name}{ext}"
    wanted = [f"{n}{{{','.join(FILE_EXTENSIONS)}}}" for n in names]
    raise DataError(f"{directory}: no {split} file; expected one of {wanted} (or set data.{split}_split)")


def _hub_rows(name: str, split: str, cfg: DataConfig, report: LoadReport, key: str) -> list[Row]:
    """Rows of a `datasets.load_dataset` name (or a `save_to_disk` directory); needs the network for hub names."""
    import datasets

    explicit = cfg.train_split if split == "train" else cfg.val_split
    hub_split = explicit or DEFAULT_HUB_SPLITS[split]
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
            ds = ds[hub_split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(name, cfg.dataset_config, split=hub_split)
    except Exception as err:
        raise DataError(
            f"{key}={name!r}: could not load split {hub_split!r} with datasets.load_dataset "
            f"({type(err).__name__}: {err}). Hub names need network access; for local data give a "
            f".jsonl/.json/.parquet/.arrow file or directory, 'arithmetic' or 'reasoning_gym:<task>'"
        ) from err
    return _rows_from_records(enumerate(undecoded(ds)), f"{name}/{hub_split}", cfg, report, line_numbers=False)


def undecoded(ds):
    """A `datasets.Dataset` whose image columns give their stored bytes (``{"bytes", "path"}``, what
    `grpo.system.vision.load_image` reads) instead of decoded PIL pictures: the rows of an image dataset are kept for
    the run, and a decoded picture costs its pixels (CLEVR's 480x320: 460 KB, against some 30 KB of PNG)."""
    import dataclasses as dc

    import datasets

    def plain(feature):
        if isinstance(feature, datasets.Image):
            return datasets.Image(decode=False)
        if isinstance(feature, dict):
            return type(feature)({k: plain(v) for k, v in feature.items()})
        if isinstance(feature, list):
            return [plain(f) for f in feature]
        if dc.is_dataclass(feature) and hasattr(feature, "feature"):  # List, LargeList, Sequence
            return dc.replace(feature, feature=plain(feature.feature))
        return feature

    features = getattr(ds, "features", None)
    if not features:
        return ds
    changed = plain(features)
    return ds if changed == features else ds.cast(changed)


def _looks_local(name: str) -> bool:
    return name.endswith(FILE_EXTENSIONS) or name.startswith((".", "/", "~")) or os.path.exists(name)


def _local_rows(path: Path, split: str, cfg: DataConfig, report: LoadReport, explicit: bool) -> list[Row]:
    """Rows of a local file, a directory with one file per split, or a `save_to_disk` directory."""
    key = f"data.{split}_data_path" if explicit else "data.dataset_name"
    if not path.exists():
        raise DataError(f"{path}: file not found ({key})")
    if path.is_file() and not explicit and split == "val":
        raise DataError(
            f"data.dataset_name={str(path)!r} is a single file: set data.val_data_path for validation "
            "(or give a directory holding train and val files)"
        )
    if path.is_dir():
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return _hub_rows(str(path), split, cfg, report, key)
        path = _split_file(path, split, cfg)
    if path.suffix not in FILE_EXTENSIONS:
        raise DataError(f"{path}: unsupported file type ({key}); expected one of {list(FILE_EXTENSIONS)}")
    return read_file_rows(path, cfg, report)


def load_rows(cfg: DataConfig, split: str, seed: int) -> Rows:
    """Rows of ``split`` ("train" | "val"): a list, with ``rows.report.num_skipped`` counting skipped bad rows.

    A source is ``data.train_data_path`` / ``val_data_path`` when set, else ``data.dataset_name``:
    "arithmetic", "reasoning_gym:<task>", a local file or directory (``train.jsonl`` / ``val.jsonl``...),
    a `save_to_disk` directory, or a hub name. Procedural sources draw train and val from different seeds.
    ``data.train_sources`` / ``val_sources`` give several, concatenated in order (`Source`). A training
    source's ``split_validation_size`` > 0 holds rows out of its training rows; the validation rows are the
    held-out rows (each repeated ``data.val_repeat`` times), then the validation sources' (``val_data_path``
    or ``val_sources``), as NeMo-RL's setup_response_data joins them; with neither, each training source's
    own validation split.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: expected 'train' or 'val'")
    train = training_sources(cfg)
    parts: list[tuple[Source, list[Row], int, str]] = []  # (source, rows, repeat, the split they come from)
    if split == "train":
        for src in train:
            rows = _read(src, "train", seed)
            parts.append((src, _hold_out(src, rows, seed)[0] if src.split_size else rows, src.repeat, "train"))
        return _concat(parts, cfg.task_key)
    for src in train:
        if src.split_size:
            parts.append((src, _hold_out(src, _read(src, "train", seed), seed)[1], cfg.val_repeat, "train"))
    parts += [(src, _read(src, "val", seed), src.repeat, "val") for src in validation_sources(cfg)]
    if not parts:  # no validation source, nothing held out: each training source's own validation split
        parts = [(src, _read(src, "val", seed), cfg.val_repeat, "val") for src in train]
    return _concat(parts, cfg.task_key)


@dataclass
class Source:
    """One dataset as `load_rows` reads it: ``cfg`` is a `DataConfig` whose single-source fields (dataset_name,
    val_data_path, splits, keys, sizes, prompts) name it; ``key`` is where its errors point."""

    key: str
    cfg: DataConfig
    task_name: str | None = None  # tags its rows' meta[data.task_key] (None: the rows' own column, else env's)
    repeat: int = 1
    split_size: float = 0
    split_seed: int | None = None
    own_prompts: bool = False  # its prompt template / system prompt are not data.*'s


PROMPT_KEYS = (("prompt_file", "prompt_template"), ("system_prompt_file", "system_prompt"))
SOURCE_KEYS = ("dataset_name", "dataset_config", "input_key", "output_key", "row_format") + tuple(
    k for p in PROMPT_KEYS for k in p)


def _source(cfg: DataConfig, src, side: str, key: str) -> Source:
    """A `grpo.config.DataSource` of ``side`` as a `Source`: its non-null fields over ``cfg``'s."""
    update: dict[str, Any] = {k: getattr(src, k) for k in SOURCE_KEYS if getattr(src, k) is not None}
    for pair in PROMPT_KEYS:  # a source's prompt_file replaces data.prompt_template too (one template)
        for k, other in (pair, pair[::-1]):
            if k in update and other not in update:
                update[other] = None
    if src.split is not None:
        update[f"{side}_split"] = src.split
    if src.num_samples is not None:
        update["num_train_samples" if side == "train" else "num_val_samples"] = src.num_samples
    update.update(train_data_path=None, val_data_path=None, train_sources=[], val_sources=[])
    name = update.get("dataset_name", cfg.dataset_name)
    if side == "val" and dataset_task(name) is None:  # a file or hub name read as it is, not as a dataset's val split
        update["val_data_path"] = name
    split_size = cfg.split_validation_size if src.split_validation_size is None else src.split_validation_size
    split_seed = cfg.split_validation_seed if src.split_validation_seed is None else src.split_validation_seed
    repeat = src.repeat or (cfg.val_repeat if side == "val" else 1)
    return Source(key, cfg.model_copy(update=update), src.task_name, repeat, split_size, split_seed,
                  own_prompts=any(getattr(src, k) is not None for pair in PROMPT_KEYS for k in pair))


def training_sources(cfg: DataConfig) -> list[Source]:
    """``data.train_sources``, or the one source of data.dataset_name / train_data_path."""
    if not cfg.train_sources:
        return [Source("data", cfg, split_size=cfg.split_validation_size, split_seed=cfg.split_validation_seed)]
    return [_source(cfg, s, "train", f"data.train_sources.{i}") for i, s in enumerate(cfg.train_sources)]


def validation_sources(cfg: DataConfig) -> list[Source]:
    """``data.val_sources``, or data.val_data_path as one source, or none."""
    if cfg.val_sources:
        return [_source(cfg, s, "val", f"data.val_sources.{i}") for i, s in enumerate(cfg.val_sources)]
    return [Source("data", cfg, repeat=cfg.val_repeat)] if cfg.val_data_path else []


def _read(src: Source, split: str, seed: int) -> Rows:
    if src.key == "data":
        return _load_rows(src.cfg, split, seed)
    try:
        return _load_rows(src.cfg, split, seed)
    except DataError as err:
        raise DataError(f"{src.key}: {err}") from None


def _hold_out(src: Source, rows: Rows, seed: int) -> tuple[list[Row], list[Row]]:
    """(training rows, held-out rows): ``split_size`` of ``rows`` (a share < 1, rounded up, or a count), drawn
    with the source's split seed (else ``seed``); both in their order in ``rows``."""
    size = src.split_size
    n_val = int(size) if size >= 1 else math.ceil(size * len(rows))
    if not 0 < n_val < len(rows):
        raise DataError(f"{src.key}.split_validation_size={size}: {n_val} of the {len(rows)} training rows would be "
                        "held out for validation; expected at least one row on each side")
    order = list(range(len(rows)))
    random.Random(seed if src.split_seed is None else src.split_seed).shuffle(order)
    held_out = set(order[:n_val])
    return [r for i, r in enumerate(rows) if i not in held_out], [rows[i] for i in sorted(held_out)]


def _concat(parts: list[tuple[Source, list[Row], int, str]], task_key: str) -> Rows:
    """The parts' rows in order, each row ``repeat`` times in a row, tagged with its source's task; ``spans``
    say which rows take a source's own prompts."""
    out: list[Row] = []
    spans: list[tuple[int, int, DataConfig]] = []
    report = LoadReport(source=", ".join(dict.fromkeys(_name(src, split) for src, _, _, split in parts)))
    for src, rows, repeat, split in parts:
        start = len(out)
        task = src.task_name
        for row in rows:
            if task is not None:
                row = {**row, "meta": {**(row.get("meta") or {}), task_key: task}}
            out.extend([row] * repeat)
        if src.own_prompts:
            spans.append((start, len(out), src.cfg))
        if isinstance(rows, Rows):
            report.num_skipped += rows.report.num_skipped
            report.skipped += rows.report.skipped[:LoadReport.MAX_MESSAGES - len(report.skipped)]
        if len(parts) > 1:
            logger.info("%s: %d %s rows from %s%s", src.key, len(out) - start, split, _name(src, split),
                        f" (task {task})" if task else "")
    report.num_rows = len(out)
    return Rows(out, report, spans)


def _name(src: Source, split: str) -> str:
    return (src.cfg.train_data_path if split == "train" else src.cfg.val_data_path) or src.cfg.dataset_name


def _load_rows(cfg: DataConfig, split: str, seed: int) -> Rows:
    explicit_path = cfg.train_data_path if split == "train" else cfg.val_data_path
    name = explicit_path or cfg.dataset_name
    report = LoadReport(source=name)
    n = cfg.num_train_samples if split == "train" else cfg.num_val_samples
    task = dataset_task(name) if explicit_path is None else None
    if task is not None:  # a built-in task's rows (grpo.tasks.catalogue)
        rows = load(task.rows)(name, cfg, n, seed, split)
    elif _looks_local(name):
        rows = _local_rows(Path(name).expanduser(), split, cfg, report, explicit=explicit_path is not None)
    else:
        key = f"data.{split}_data_path" if explicit_path else "data.dataset_name"
        rows = _hub_rows(name, split, cfg, report, key)
    if not rows:
        raise DataError(f"{name}: no usable {split} rows ({report.num_skipped} malformed rows skipped)")
    report.num_rows = len(rows)
    if report.num_skipped:
        logger.warning("%s: skipped %d malformed %s rows (data.on_bad_row=skip), first: %s",
                       name, report.num_skipped, split, report.skipped[0])
    return Rows(rows, report)


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------
def _read_text(path: str, key: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise DataError(f"data.{key}={path!r}: {err.strerror}") from err


def fill_template(template: str | None, question: str) -> str:
    """Put the question where the template has ``{}`` or ``{input}`` (str.format: write ``{{`` for a brace).

    >>> fill_template("Q: {}\\nA:", "1+1=")
    'Q: 1+1=\\nA:'
    >>> fill_template(r"Put it in \\boxed{{}}. {input}", "x")
    'Put it in \\\\boxed{}. x'
    """
    return question if template is None else template.format(question, input=question)


class PromptFormatter:
    """Question -> prompt messages -> (prompt text, token ids): template, system prompt, chat template.

    ``chat_template``: None (plain text: one user message ``system + "\n" + prompt``, tokenised with the
    tokenizer's special tokens), ``"default"`` (the tokenizer's own chat template) or a Jinja string;
    tokens come from `grpo.system.chat.ChatFormat` (one run of ids per message; ``chat_template_kwargs``: the
    template's extra variables). A question may also be a list of
    ``{"role", "content"}`` messages (a conversation so far; its assistant messages are context, never
    trained): it needs a chat template, and the prompt template is not applied to it.
    """

    def __init__(self, tokenizer, cfg: DataConfig, chat_template: str | None = None, tools: list[dict] | None = None,
                 chat_template_kwargs: dict | None = None, processor=None):
        from grpo.system.chat import ChatFormat, ChatFormatError

        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's (grpo.system.vision.load_processor), else None
        self.chat_template = chat_template
        try:
            self.chat = ChatFormat(tokenizer, chat_template, tools, chat_template_kwargs, processor)
        except ChatFormatError as err:
            raise DataError(str(err)) from err
        self._set_prompts(cfg)

    def _set_prompts(self, cfg: DataConfig) -> None:
        if cfg.prompt_file and cfg.prompt_template:
            raise DataError("data.prompt_file and data.prompt_template are both set: keep one")
        if cfg.system_prompt_file and cfg.system_prompt:
            raise DataError("data.system_prompt_file and data.system_prompt are both set: keep one")
        self.template = _read_text(cfg.prompt_file, "prompt_file") if cfg.prompt_file else cfg.prompt_template
        self.system_prompt = (
            _read_text(cfg.system_prompt_file, "system_prompt_file") if cfg.system_prompt_file else cfg.system_prompt
        )
        self._check_template()

    def with_prompts(self, cfg: DataConfig) -> "PromptFormatter":
        """This formatter (same tokenizer and chat template) with ``cfg``'s prompt template and system prompt: a
        source of ``data.train_sources`` / ``val_sources`` with prompts of its own."""
        import copy

        other = copy.copy(self)
        other._set_prompts(cfg)
        return other

    def _check_template(self) -> None:
        marker = "\x00QUESTION\x00"
        try:
            filled = fill_template(self.template, marker)
        except (KeyError, IndexError, ValueError) as err:
            raise DataError(
                f"prompt template {self.template!r}: {type(err).__name__}: {err}; use {{}} or {{input}} for the "
                "question and {{ }} for literal braces"
            ) from err
        if marker not in filled:
            raise DataError(f"prompt template {self.template!r} has no {{}} or {{input}} for the question")

    def messages(self, question: str | list[dict]) -> list[dict]:
        """The prompt as ``{"role", "content"}`` messages."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        if isinstance(question, list):
            if self.chat_template is None:
                raise DataError("a prompt given as a list of messages needs a chat template "
                                "(set policy.tokenizer.chat_template)")
            has_system = bool(question) and question[0].get("role") == "system"
            return ([] if has_system else system) + [{"role": m["role"], "content": m["content"]} for m in question]
        prompt = fill_template(self.template, question)
        if self.chat_template is None:
            content = prompt if self.system_prompt is None else f"{self.system_prompt}\n{prompt}"
            return [{"role": "user", "content": content}]
        return system + [{"role": "user", "content": prompt}]

    def text(self, question: str | list[dict]) -> str:
        """The prompt text the model sees."""
        messages = self.messages(question)
        return messages[0]["content"] if self.chat_template is None else self.chat.render(messages, True)

    def format(self, question: str | list[dict]) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids)."""
        return self.text(question), [t for ids in self.chat.prompt_token_ids(self.messages(question)) for t in ids]

    def prompt_messages(self, question: str | list[dict]) -> list[dict]:
        """The prompt messages with their token ids: ``{"role", "content", "token_ids"}``."""
        messages = self.messages(question)
        return [{**m, "token_ids": ids} for m, ids in zip(messages, self.chat.prompt_token_ids(messages))]

    def prompt_messages_and_media(self, question: str | list[dict], where: str) -> tuple[list[dict], dict | None]:
        """`prompt_messages` and the prompt's media (None without images). Messages with image parts are rendered
        by ``processor`` (`grpo.system.vision.render_prompt`: the processor-expanded ids); a row with images for a
        text model, or an image that cannot be read, is a `DataError` naming ``where``."""
        messages = self.messages(question)
        if not has_images(messages):
            return self.prompt_messages(question), None
        if self.processor is None:
            raise DataError(f"{where}: the row has images but policy.model_name is a text model (no vision_config)")
        if self.chat.plain:
            raise DataError(f"{where}: a row with images needs a chat template (set policy.tokenizer.chat_template)")
        return render_prompt(self.processor, self.chat, messages, where)


def question_text(question: str | list[dict]) -> str:
    """A question for logs: the text, or the last user message of a conversation."""
    if isinstance(question, str):
        return question
    return next((content_text(m["content"]) for m in reversed(question) if m.get("role") == "user"), "")


class PromptDataset(Dataset):
    """Formatted prompts; items are `grpo.tasks.rows.PromptRow`s, with ``index`` the row's position in ``rows``,
    ``prompt_messages`` as `PromptFormatter.prompt_messages` gives them, and a row's keys other than
    ``question``, ``answer``, ``source`` and ``meta`` in ``extra``.

    A row's task (its environment) is ``meta[task_key]`` when the row has it, else ``default_task``;
    ``tasks`` (when given) are the known ones, and a row naming another fails with its source. Prompts
    longer than ``max_input_seq_length`` tokens are dropped at construction and counted in ``num_filtered``.
    A prompt that leaves no room for one generated token under ``max_total_sequence_length`` cannot be
    trained on: with ``on_bad_row="error"`` it fails naming the row, with "skip" it is dropped and counted
    in ``num_too_long``. A row whose image is missing or cannot be decoded fails naming the row ("error") or is
    dropped and counted in ``num_bad_images`` ("skip").

    A row with images is rendered once here (its ids decide the filters above), but its media (the processor's
    tensors: a few MB a picture for Qwen-VL) are not kept for the run: `__getitem__` renders them again when the row is
    drawn (the same processor on the same pictures: the same tensors), so a dataset of 70K pictures holds its rows'
    image values (a hub dataset's undecoded bytes, `undecoded`) rather than every picture's pixels.
    """

    def __init__(self, rows: list[Row], formatter: PromptFormatter, max_input_seq_length: int | None = None,
                 default_task: str = "default", task_key: str = "task_name", tasks: list[str] | None = None,
                 max_total_sequence_length: int | None = None, on_bad_row: str = "error"):
        self.items: list[PromptRow] = []
        self.num_filtered = self.num_too_long = self.num_bad_images = 0
        self._render: dict[int, tuple[PromptFormatter, Any, str]] = {}  # an image row's item -> how to render its media
        formatters = [formatter] * len(rows)  # a source with prompts of its own (`Rows.spans`) formats its rows
        for start, stop, cfg in getattr(rows, "spans", []):
            formatters[start:stop] = [formatter.with_prompts(cfg)] * (stop - start)
        for index, row in enumerate(rows):
            task = str((row.get("meta") or {}).get(task_key, default_task))
            if tasks is not None and task not in tasks:
                raise DataError(f"{row.get('source', f'row {index}')}: {task_key}={task!r} has no environment "
                                f"(known tasks: {sorted(tasks)}; add it to env.tasks)")
            try:
                messages, media = formatters[index].prompt_messages_and_media(row["question"],
                                                                              row.get("source", f"row {index}"))
            except DataError:  # an image missing or undecodable: the row, named, fails or is skipped and counted
                if on_bad_row == "error":
                    raise
                self.num_bad_images += 1
                continue
            ids = [t for m in messages for t in m["token_ids"]]
            if max_input_seq_length is not None and len(ids) > max_input_seq_length:
                self.num_filtered += 1
                continue
            if max_total_sequence_length is not None and len(ids) >= max_total_sequence_length:
                if on_bad_row == "error":
                    where = row.get("source", f"row {index}")
                    raise DataError(f"{where}: the prompt has {len(ids)} tokens, leaving no "
                                    f"room to generate under policy.max_total_sequence_length="
                                    f"{max_total_sequence_length}; raise it, lower data.max_input_seq_length to "
                                    "filter such prompts, or set data.on_bad_row=skip to skip and count them")
                self.num_too_long += 1
                continue
            parts = None if media is None else [m["content"] for m in formatters[index].messages(row["question"])]
            if media is not None:  # rendered again when drawn (`__getitem__`)
                self._render[len(self.items)] = (formatters[index], row["question"], row.get("source", f"row {index}"))
                media = None
            self.items.append(PromptRow(
                index=index, question=question_text(row["question"]), answer=row["answer"], task_name=task,
                prompt_messages=messages, prompt_ids=ids, source=row.get("source", ""), meta=row.get("meta") or {},
                extra={k: v for k, v in row.items() if k not in ROW_KEYS}, media=media, prompt_parts=parts))
        if not self.items:
            raise DataError(
                f"all {len(rows)} prompts are longer than data.max_input_seq_length={max_input_seq_length} tokens "
                f"or leave no room under policy.max_total_sequence_length={max_total_sequence_length}"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptRow:
        """Item ``i``; an image row with its media rendered now (a `DataError` naming the row when its picture can no
        longer be read)."""
        item = self.items[i]
        if i not in self._render:
            return item
        formatter, question, where = self._render[i]
        _, media = formatter.prompt_messages_and_media(question, where)
        return dataclasses.replace(item, media=media)


# --------------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------------
def collate_rows(batch: list[PromptRow]) -> list[PromptRow]:
    """Batches are plain lists of items (the loop pads what it needs itself)."""
    return list(batch)


def build_dataloader(dataset: Dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool = True,
                     num_workers: int = 0):
    """A `StatefulDataLoader` of lists of items, in the same order on every rank (shard batches yourself).

    The shuffle uses its own `torch.Generator` seeded with ``seed`` (the global torch RNG is not read);
    epoch e+1's order follows from epoch e's generator state, so ``state_dict()`` saved between
    batches resumes exactly, across epoch boundaries (see the module docstring for the loop shape).
    """
    from torch.utils.data import SequentialSampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    if len(dataset) < batch_size and drop_last:
        raise DataError(f"{len(dataset)} prompts cannot fill one batch of {batch_size} (drop_last=True)")
    if shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = SequentialSampler(dataset)
    # A separate generator for the loader's own per-iterator seed draw: sharing the sampler's would shift
    # the shuffle stream on resume, and None would consume the global torch RNG.
    return StatefulDataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=num_workers,
        collate_fn=collate_rows, generator=torch.Generator().manual_seed(seed + 1),
    )


def _samples_yielded(loader_state: dict) -> str:
    """How far into its epoch a saved `StatefulDataLoader` state is, in prompts ("?" when it does not say)."""
    sampler = loader_state.get("_sampler_iter_state") if isinstance(loader_state, dict) else None
    yielded = sampler.get("samples_yielded") if isinstance(sampler, dict) else None
    return str(yielded) if isinstance(yielded, int) else "?"


@dataclass(frozen=True)
class LoaderMark:
    """A data position: where the next prompt batch comes from, in ``epoch`` with the loader in state ``loader``
    (a `StatefulDataLoader` state saved between batches, see the module docstring; None: the loader's start).
    Checkpoints hold it as the plain dict of `to_dict` (``{"epoch", "loader"}``, the form they always had), which
    loads with ``torch.load(weights_only=True)``.

        >>> LoaderMark.from_dict(LoaderMark(2, {"n": 3}).to_dict())
        LoaderMark(epoch=2, loader={'n': 3})
    """

    epoch: int
    loader: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loader": self.loader}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoaderMark:
        return cls(int(d["epoch"]), d["loader"])


class PromptStream:
    """Prompt batches across epochs, resumable: ``next()`` gives the next batch (a list of items), starting a
    new epoch when the loader runs out, and None after ``max_epochs``. ``epoch`` is the current epoch.

    ``loader_state`` (a `StatefulDataLoader` state saved between batches, see the module docstring) and
    ``epoch`` restore a position; `mark` returns the current one (a `LoaderMark`, a copy, safe to keep).
    """

    def __init__(self, loader, max_epochs: int, epoch: int = 0, loader_state: dict | None = None):
        self.loader, self.max_epochs, self.epoch = loader, max_epochs, epoch
        if loader_state is None:
            self._it = iter(loader)
            return
        try:  # the loader applies a saved position on the next iter()
            loader.load_state_dict(loader_state)
            self._it = iter(loader)
        except (StopIteration, IndexError, KeyError, ValueError, TypeError, RuntimeError) as err:
            raise DataError(
                f"the checkpoint's data position (epoch {epoch}, "
                f"{_samples_yielded(loader_state)} prompts into it) does not fit the data now "
                f"({len(loader.dataset)} prompts, {len(loader)} batches per epoch): the training data changed since "
                f"the checkpoint ({type(err).__name__}{': ' + str(err)[:200] if str(err) else ''}). Restore the "
                "data it trained on, or start a new run (another checkpointing.checkpoint_dir)") from None

    def next(self) -> list[PromptRow] | None:
        for _ in range(2):
            try:
                return next(self._it)
            except StopIteration:
                self.epoch += 1
                if self.epoch >= self.max_epochs:
                    return None
                self._it = iter(self.loader)
        return None

    def mark(self) -> LoaderMark:
        """Where the next batch comes from."""
        import copy

        return LoaderMark(self.epoch, copy.deepcopy(self.loader.state_dict()))
