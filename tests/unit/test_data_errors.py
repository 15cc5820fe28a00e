"""Data files that cannot be read give a message naming the file (and line), never a traceback: bytes that are
not UTF-8 (a bad row in a .jsonl, skipped with data.on_bad_row=skip), a .parquet or .arrow that is not one."""

from __future__ import annotations

import json

import pytest

from grpo.config import DataConfig
from grpo.system.data import load_rows
from grpo.tasks.rows import DataError

GOOD = [{"input": f"{i}+1=", "output": str(i + 1)} for i in range(4)]


def _jsonl_with_bad_byte(path):
    lines = [json.dumps(r).encode() for r in GOOD]
    lines[2] = b'{"input": "caf\xe9+1=", "output": "2"}'  # Latin-1, not UTF-8
    path.write_bytes(b"\n".join(lines) + b"\n")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])  # a .json file may hold JSON lines
def test_a_non_utf8_line_is_a_bad_row_named_by_file_and_line(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    _jsonl_with_bad_byte(path)
    with pytest.raises(DataError, match=rf"{path} line 3: byte 0xe9 at column 15 is not UTF-8 \(set "
                                        r"data.on_bad_row=skip"):
        load_rows(DataConfig(train_data_path=str(path)), "train", 0)
    rows = load_rows(DataConfig(train_data_path=str(path), on_bad_row="skip"), "train", 0)
    assert [r["source"] for r in rows] == [f"{path}:1", f"{path}:2", f"{path}:4"]
    assert rows.report.num_skipped == 1 and "line 3: byte 0xe9" in rows.report.skipped[0]


def test_a_non_utf8_byte_in_a_json_document_names_its_line(tmp_path):
    path = tmp_path / "train.json"
    path.write_bytes(b'[\n  {"input": "1+1=", "output": "2"},\n  {"input": "caf\xe9", "output": "1"}\n]\n')
    for on_bad_row in ("error", "skip"):  # one document: no row to skip
        with pytest.raises(DataError, match=rf"{path}: byte 0xe9 at line 3, column 17 is not UTF-8; save the file"):
            load_rows(DataConfig(train_data_path=str(path), on_bad_row=on_bad_row), "train", 0)


@pytest.mark.parametrize("name, content, kind", [
    ("train.parquet", b"input,output\n1+1=,2\n", "Parquet"),  # a CSV with the wrong extension
    ("train.parquet", b"", "Parquet"),
    ("train.arrow", json.dumps(GOOD).encode(), "Arrow"),
    ("train.arrow", b"", "Arrow"),
])
def test_a_table_file_that_is_not_one_is_named(tmp_path, name, content, kind):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"{path}: not a readable {kind} file \(.+\); check the file"):
        load_rows(DataConfig(train_data_path=str(path), on_bad_row="skip"), "train", 0)


def test_windows_line_endings_still_read(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\r\n".join(json.dumps(r).encode() for r in GOOD) + b"\r\n")
    assert [r["answer"] for r in load_rows(DataConfig(train_data_path=str(path)), "train", 0)] == ["1", "2", "3", "4"]


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_saved_position_past_the_end_of_shorter_data_is_a_data_error(shuffle):
    from grpo.system.data import PromptStream, build_dataloader

    stream = PromptStream(build_dataloader(list(range(40)), 4, shuffle=shuffle, seed=0), max_epochs=2)
    for _ in range(5):
        stream.next()
    mark = stream.mark()  # 20 prompts into epoch 0
    shorter = build_dataloader(list(range(8)), 4, shuffle=shuffle, seed=0)
    with pytest.raises(DataError, match=r"the checkpoint's data position \(epoch 0, 20 prompts into it\) does not "
                                        r"fit the data now \(8 prompts, 2 batches per epoch\)"):
        PromptStream(shorter, 2, mark.epoch, mark.loader)
