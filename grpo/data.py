"""Prompt data: rows from a built-in task, reasoning-gym, local files or the hub; prompt formatting; a
resumable data loader.

A row is a plain, picklable dict::

    {"question": "3+4=", "answer": "7", "source": "arithmetic/train:0", "meta": {}}

``source`` says where the row came from: ``"<file>:<n>"`` (n = 1-based line of a .jsonl file, 0-based
row index of any other file), ``"<hub name>/<split>:<i>"``, ``"arithmetic/<split>:<i>"`` or
``"reasoning_gym:<task>/<split>:<i>"``. ``meta`` holds what a scorer needs besides the answer: the
reasoning-gym entry, or the other columns of a file row.

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
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from grpo.config import DataConfig

Row = dict[str, Any]
logger = logging.getLogger(__name__)
FILE_EXTENSIONS = (".jsonl", ".json", ".parquet", ".arrow")
DEFAULT_SPLIT_FILES = {"train": ("train",), "val": ("val", "validation", "test")}
DEFAULT_HUB_SPLITS = {"train": "train", "val": "test"}


class DataError(ValueError):
    """Data that cannot be used; the message names the file (and row) and the problem."""


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

    def __init__(self, rows: list[Row], report: LoadReport):
        super().__init__(rows)
        self.report = report


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------
def split_seed(seed: int, split: str) -> int:
    """Seed of a procedural split, so train and val never share a stream: 2*seed (train), 2*seed+1 (val)."""
    return 2 * seed + (0 if split == "train" else 1)


def arithmetic_rows(n: int, max_operand: int, seed: int, split: str) -> list[Row]:
    """``n`` rows ``"a+b="`` -> ``"a+b"`` with a, b uniform in [0, max_operand], deterministic in seed."""
    rng = random.Random(split_seed(seed, split))
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b), "source": f"arithmetic/{split}:{i}", "meta": {}})
    return rows


def reasoning_gym_rows(task: str, n: int, seed: int, split: str) -> list[Row]:
    """``n`` entries of reasoning-gym's ``task``; the entry rides along in meta for the task's scorer."""
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(task, size=n, seed=split_seed(seed, split))
    except Exception as err:  # reasoning-gym raises a bare error for unknown task names
        raise DataError(f"data.dataset_name='reasoning_gym:{task}': {type(err).__name__}: {err}") from err
    return [
        {
            "question": entry["question"],
            "answer": str(entry["answer"]),
            "source": f"reasoning_gym:{task}/{split}:{i}",
            "meta": {"entry": entry, "task": task},
        }
        for i, entry in enumerate(ds)
    ]


def check_record(record: Any, input_key: str, output_key: str) -> str | None:
    """The problem with a file record as text, or None when it makes a valid row.

    >>> check_record({"input": "1+1=", "output": 2}, "input", "output") is None
    True
    >>> check_record({"input": " ", "output": "1"}, "input", "output")
    "empty prompt in 'input'"
    """
    if not isinstance(record, dict):
        return f"expected an object with keys {input_key!r} and {output_key!r}, got {type(record).__name__}"
    if input_key not in record:
        return f"missing input key {input_key!r} (keys: {sorted(record)})"
    if output_key not in record:
        return f"missing output key {output_key!r} (keys: {sorted(record)})"
    question, answer = record[input_key], record[output_key]
    if not isinstance(question, str):
        return f"prompt {input_key!r} is {type(question).__name__}, expected a string"
    if not question.strip():
        return f"empty prompt in {input_key!r}"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"answer {output_key!r} is {type(answer).__name__}, expected a string or a number"
    return None


def record_to_row(record: dict, input_key: str, output_key: str, source: str) -> Row:
    """A checked record as a row; the other columns go into meta."""
    meta = {k: v for k, v in record.items() if k not in (input_key, output_key)}
    return {"question": record[input_key], "answer": str(record[output_key]), "source": source, "meta": meta}


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
    for n, record in records:
        problem = record.problem if isinstance(record, _BadJson) else check_record(
            record, cfg.input_key, cfg.output_key
        )
        if problem is None:
            rows.append(record_to_row(record, cfg.input_key, cfg.output_key, f"{where}:{n}"))
            continue
        message = f"{where} {'line' if line_numbers else 'row'} {n}: {problem}"
        if cfg.on_bad_row == "error":
            raise DataError(message + " (set data.on_bad_row=skip to skip malformed rows)")
        report.num_skipped += 1
        if len(report.skipped) < LoadReport.MAX_MESSAGES:
            report.skipped.append(message)
    return rows


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
    return _rows_from_records(enumerate(ds), f"{name}/{hub_split}", cfg, report, line_numbers=False)


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

    The source is ``data.train_data_path`` / ``val_data_path`` when set, else ``data.dataset_name``:
    "arithmetic", "reasoning_gym:<task>", a local file or directory (``train.jsonl`` / ``val.jsonl``...),
    a `save_to_disk` directory, or a hub name. Procedural sources draw train and val from different seeds.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: expected 'train' or 'val'")
    explicit_path = cfg.train_data_path if split == "train" else cfg.val_data_path
    name = explicit_path or cfg.dataset_name
    report = LoadReport(source=name)
    n = cfg.num_train_samples if split == "train" else cfg.num_val_samples
    if explicit_path is None and name == "arithmetic":
        rows = arithmetic_rows(n, cfg.arithmetic_max_operand, seed, split)
    elif explicit_path is None and name.startswith("reasoning_gym:"):
        rows = reasoning_gym_rows(name.split(":", 1)[1], n, seed, split)
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
    """Question -> (prompt text, token ids): template, system prompt, then the chat template if any.

    ``chat_template``: None (plain text: ``system + "\\n" + prompt``, tokenised with the tokenizer's
    special tokens), ``"default"`` (the tokenizer's own chat template) or a Jinja string. Chat-formatted
    text is tokenised without adding special tokens: the template writes them.
    """

    def __init__(self, tokenizer, cfg: DataConfig, chat_template: str | None = None):
        if cfg.prompt_file and cfg.prompt_template:
            raise DataError("data.prompt_file and data.prompt_template are both set: keep one")
        if cfg.system_prompt_file and cfg.system_prompt:
            raise DataError("data.system_prompt_file and data.system_prompt are both set: keep one")
        self.tokenizer = tokenizer
        self.template = _read_text(cfg.prompt_file, "prompt_file") if cfg.prompt_file else cfg.prompt_template
        self.system_prompt = (
            _read_text(cfg.system_prompt_file, "system_prompt_file") if cfg.system_prompt_file else cfg.system_prompt
        )
        self.chat_template = chat_template
        if chat_template == "default" and not getattr(tokenizer, "chat_template", None):
            raise DataError("policy.tokenizer.chat_template='default' but the tokenizer has no chat template")
        self._check_template()

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

    def text(self, question: str) -> str:
        """The prompt text the model sees."""
        prompt = fill_template(self.template, question)
        if self.chat_template is None:
            return prompt if self.system_prompt is None else f"{self.system_prompt}\n{prompt}"
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []) + [
            {"role": "user", "content": prompt}
        ]
        kwargs = {} if self.chat_template == "default" else {"chat_template": self.chat_template}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def format(self, question: str) -> tuple[str, list[int]]:
        text = self.text(question)
        ids = self.tokenizer(text, add_special_tokens=self.chat_template is None)["input_ids"]
        return text, list(ids)


class PromptDataset(Dataset):
    """Formatted prompts; items are ``{"index", "question", "answer", "prompt_text", "prompt_ids",
    "source", "meta"}`` with ``index`` the row's position in ``rows``. Prompts longer than
    ``max_input_seq_length`` tokens are dropped at construction and counted in ``num_filtered``."""

    def __init__(self, rows: list[Row], formatter: PromptFormatter, max_input_seq_length: int | None = None):
        self.items: list[dict] = []
        self.num_filtered = 0
        for index, row in enumerate(rows):
            text, ids = formatter.format(row["question"])
            if max_input_seq_length is not None and len(ids) > max_input_seq_length:
                self.num_filtered += 1
                continue
            self.items.append({"index": index, **row, "prompt_text": text, "prompt_ids": ids})
        if not self.items:
            raise DataError(
                f"all {len(rows)} prompts are longer than data.max_input_seq_length={max_input_seq_length} tokens"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


# --------------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------------
def collate_rows(batch: list[dict]) -> list[dict]:
    """Batches are plain lists of item dicts (the loop pads what it needs itself)."""
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
