"""Several data sources per side (data.train_sources / val_sources, grpo.system.data.load_rows): concatenated in
order, each with its own keys, prompts and task (its environment); absent fields take data.*; held-out rows join
the validation sources (NeMo-RL's setup_response_data); the loader over them shuffles by seed and resumes exactly."""

from __future__ import annotations

import io
import json

import pytest
import torch
from pydantic import ValidationError

from grpo.config import DataConfig
from grpo.system.data import LoaderMark, PromptDataset, PromptFormatter, PromptStream, build_dataloader, load_rows
from grpo.tasks.rows import DataError
from grpo.tasks.toy import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def files(tmp_path):
    """Two training files keyed differently, and a validation file."""
    a = write(tmp_path / "a.jsonl", [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(6)])
    b = write(tmp_path / "b.jsonl", [{"problem": f"{i}*2=", "solution": str(2 * i)} for i in range(4)])
    v = write(tmp_path / "v.jsonl", [{"q": f"{i}-1=", "a": str(i - 1)} for i in range(1, 4)])
    return a, b, v


def two_sources(a, b, **data):
    return DataConfig(input_key="q", output_key="a", **data, train_sources=[
        {"dataset_name": a, "task_name": "arith"},
        {"dataset_name": b, "input_key": "problem", "output_key": "solution", "task_name": "times",
         "prompt_template": "Double: {}"}])


def test_sources_concatenate_in_order_with_their_keys_tasks_and_prompts(tok, files):
    a, b, v = files
    cfg = two_sources(a, b, prompt_template="Add: {}", val_data_path=v)
    rows = load_rows(cfg, "train", seed=0)
    assert [r["question"] for r in rows] == [f"{i}+1=" for i in range(6)] + [f"{i}*2=" for i in range(4)]
    assert [r["answer"] for r in rows][6:] == ["0", "2", "4", "6"]
    assert [r["meta"]["task_name"] for r in rows] == ["arith"] * 6 + ["times"] * 4
    ds = PromptDataset(rows, PromptFormatter(tok, cfg), default_task="arith", tasks=["arith", "times"])
    texts = [m["content"] for item in ds for m in item.prompt_messages]
    assert texts[0] == "Add: 0+1=" and texts[6] == "Double: 0*2="  # data.prompt_template, then the source's own
    assert [item.task_name for item in ds] == ["arith"] * 6 + ["times"] * 4
    assert [item.index for item in ds] == list(range(10))
    val = load_rows(cfg, "val", seed=0)  # data.val_data_path is the validation side
    assert [r["question"] for r in val] == ["1-1=", "2-1=", "3-1="] and "task_name" not in val[0]["meta"]
    with pytest.raises(DataError, match=r"times.*has no environment"):
        PromptDataset(rows, PromptFormatter(tok, cfg), default_task="arith", tasks=["arith"])


def test_a_null_field_takes_data_s_and_a_prompt_file_replaces_data_s_template(tok, files):
    a, b, _ = files
    cfg = DataConfig(input_key="q", output_key="a", prompt_template="Add: {}", system_prompt="sys",
                     train_sources=[{"dataset_name": a, "prompt_template": None}, {"dataset_name": a,
                                                                                  "prompt_template": "{}"}])
    ds = PromptDataset(load_rows(cfg, "train", seed=0), PromptFormatter(tok, cfg))
    assert ds[0].prompt_messages[0]["content"] == "sys\nAdd: 0+1=" and ds[6].prompt_messages[0]["content"] == "sys\n0+1="
    # the config as dumped (every field, nulls included) reads the same
    assert load_rows(DataConfig(**cfg.model_dump()), "train", 0) == load_rows(cfg, "train", 0)
    cfg = DataConfig(input_key="q", output_key="a", prompt_template="Add: {}",
                     train_sources=[{"dataset_name": a, "prompt_file": write_prompt(a)}])
    ds = PromptDataset(load_rows(cfg, "train", seed=0), PromptFormatter(tok, cfg))
    assert ds[0].prompt_messages[0]["content"] == "From file: 0+1="


def write_prompt(near: str) -> str:
    path = near + ".prompt.txt"
    with open(path, "w") as f:
        f.write("From file: {}")
    return path


def test_held_out_rows_join_the_validation_sources_first(files):
    a, b, v = files
    cfg = DataConfig(input_key="q", output_key="a", val_repeat=2, train_sources=[
        {"dataset_name": a, "split_validation_size": 2, "split_validation_seed": 3, "task_name": "arith"},
        {"dataset_name": b, "input_key": "problem", "output_key": "solution"}],
        val_sources=[{"dataset_name": v, "repeat": 3, "task_name": "minus"}])
    train, val = load_rows(cfg, "train", seed=0), load_rows(cfg, "val", seed=0)
    held = [r["question"] for r in val[:4]]
    assert len(train) == 4 + 4 and held[0::2] == held[1::2]  # data.val_repeat repeats the held-out rows
    assert set(held) | {r["question"] for r in train[:4]} == {f"{i}+1=" for i in range(6)}
    assert [r["question"] for r in val[4:]] == ["1-1="] * 3 + ["2-1="] * 3 + ["3-1="] * 3  # the source's repeat
    assert [r["meta"].get("task_name") for r in val] == ["arith"] * 4 + ["minus"] * 9
    assert [r["question"] for r in load_rows(cfg, "val", seed=0)] == [r["question"] for r in val]  # seeded


def test_single_source_split_and_val_data_path_both_validate(files):
    """NeMo-RL's setup_response_data: a training dataset's split_validation_size part joins the validation dataset."""
    a, _, v = files
    cfg = DataConfig(train_data_path=a, val_data_path=v, input_key="q", output_key="a", split_validation_size=2)
    train, val = load_rows(cfg, "train", seed=0), load_rows(cfg, "val", seed=0)
    assert len(train) == 4 and len(val) == 2 + 3 and [r["question"] for r in val[2:]] == ["1-1=", "2-1=", "3-1="]
    assert {r["question"] for r in train}.isdisjoint(r["question"] for r in val[:2])


def test_without_validation_sources_each_training_source_validates_on_its_own_split(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    write(d / "train.jsonl", [{"input": "x", "output": "1"}] * 3)
    write(d / "val.jsonl", [{"input": "y", "output": "2"}])
    cfg = DataConfig(num_val_samples=5, train_sources=[
        {"dataset_name": "arithmetic", "num_samples": 7, "task_name": "arithmetic"}, {"dataset_name": str(d)}])
    train, val = load_rows(cfg, "train", seed=1), load_rows(cfg, "val", seed=1)
    assert len(train) == 7 + 3 and len(val) == 5 + 1 and val[-1]["question"] == "y"
    assert [r["question"] for r in val[:5]] == [r["question"] for r in load_rows(DataConfig(num_val_samples=5), "val", 1)]
    single = write(tmp_path / "one.jsonl", [{"input": "x", "output": "1"}] * 3)
    with pytest.raises(DataError, match=r"data.train_sources.1: .*single file"):
        load_rows(DataConfig(train_sources=[{"dataset_name": "arithmetic"}, {"dataset_name": single}]), "val", 1)
    with pytest.raises(DataError, match=r"data.val_sources.0: .*nope.jsonl: file not found"):
        load_rows(DataConfig(val_sources=[{"dataset_name": str(tmp_path / "nope.jsonl")}]), "val", 1)


def test_config_errors_name_the_keys(files):
    a, _, _ = files
    with pytest.raises(ValidationError, match="data.train_sources and data.train_data_path are both set"):
        DataConfig(train_data_path=a, train_sources=[{"dataset_name": a}])
    with pytest.raises(ValidationError, match="data.val_sources.0.split_validation_size: only training sources"):
        DataConfig(val_sources=[{"dataset_name": a, "split_validation_size": 0.1}])
    with pytest.raises(ValidationError, match="extra"):
        DataConfig(train_sources=[{"dataset_name": a, "env_name": "math"}])
    with pytest.raises(DataError, match=r"data.train_sources.0.split_validation_size=6.0: 6 of the 6"):
        load_rows(DataConfig(input_key="q", output_key="a", train_sources=[
            {"dataset_name": a, "split_validation_size": 6}]), "train", 0)


def _indices(stream, n):
    return [[item.index for item in stream.next()] for _ in range(n)]


def test_the_loader_over_several_sources_shuffles_by_seed_and_resumes_exactly(tok, files):
    a, b, _ = files
    cfg = two_sources(a, b)
    ds = PromptDataset(load_rows(cfg, "train", seed=0), PromptFormatter(tok, cfg), default_task="arith")

    def stream(state=None, epoch=0):
        return PromptStream(build_dataloader(ds, batch_size=3, shuffle=True, seed=4), 3, epoch, state)

    full = _indices(stream(), 9)  # 3 batches per epoch, 3 epochs
    assert {i for b in full[:3] for i in b} & set(range(6, 10))  # the sources are mixed by the shuffle
    first = stream()
    head = _indices(first, 4)
    buf = io.BytesIO()
    torch.save(first.mark().to_dict(), buf)  # as a checkpoint holds it
    buf.seek(0)
    mark = LoaderMark.from_dict(torch.load(buf, weights_only=True))
    tail = _indices(stream(mark.loader, mark.epoch), 5)
    assert head + tail == full
    assert _indices(PromptStream(build_dataloader(ds, 3, shuffle=True, seed=5), 3), 9) != full
