"""Tests of grpo/system/data.py: row sources, malformed rows, prompt formatting, resumable loader order."""

from __future__ import annotations

import doctest
import io
import json
import pickle
import re

import pytest
import torch

import grpo.system.data
from grpo.config import DataConfig
from grpo.system.data import (
    check_record,
    PromptDataset,
    PromptFormatter,
    build_dataloader,
    load_rows,
)
from grpo.tasks.rows import DataError, PromptRow, split_seed
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer

RECORDS = [
    {"input": "1+2=", "output": "3", "level": 1},
    {"input": "2+2=", "output": 4, "level": 2},
    {"input": "9+0=", "output": "9", "level": 1},
]


def write_jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def expected_rows(source, first=0):
    return [
        {"question": r["input"], "answer": str(r["output"]), "source": f"{source}:{i + first}",
         "meta": {"level": r["level"]}}
        for i, r in enumerate(RECORDS)
    ]


def test_doctests():
    assert doctest.testmod(grpo.system.data).failed == 0


# --------------------------------------------------------------------------------------------------
# Procedural sources
# --------------------------------------------------------------------------------------------------
def test_arithmetic_rows_are_sums_in_range_and_deterministic():
    cfg = DataConfig(num_train_samples=200, num_val_samples=50, arithmetic_max_operand=12)
    rows = load_rows(cfg, "train", seed=3)
    report = rows.report
    assert len(rows) == 200 and report.num_rows == 200 and report.num_skipped == 0
    operands = set()
    for i, row in enumerate(rows):
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["question"]).groups())
        assert row["answer"] == str(a + b)
        assert row["source"] == f"arithmetic/train:{i}"
        operands |= {a, b}
    assert operands == set(range(13))  # uniform over [0, 12]: 400 draws hit every value
    assert load_rows(cfg, "train", seed=3) == rows
    assert load_rows(cfg, "train", seed=4) != rows
    val = load_rows(cfg, "val", seed=3)
    assert len(val) == 50 and [r["question"] for r in val] != [r["question"] for r in rows[:50]]


def test_split_seed_never_collides():
    seeds = {split_seed(s, sp) for s in range(100) for sp in ("train", "val")}
    assert len(seeds) == 200


def test_reasoning_gym_rows_match_the_library():
    import reasoning_gym

    cfg = DataConfig(dataset_name="reasoning_gym:basic_arithmetic", num_train_samples=4, num_val_samples=3)
    rows = load_rows(cfg, "train", seed=7)
    ref = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=split_seed(7, "train")))
    assert [r["question"] for r in rows] == [e["question"] for e in ref]
    assert [r["answer"] for r in rows] == [e["answer"] for e in ref]
    assert rows[2]["meta"] == {"entry": ref[2], "task": "basic_arithmetic"}
    assert rows[2]["source"] == "reasoning_gym:basic_arithmetic/train:2"
    assert pickle.loads(pickle.dumps(rows)) == rows
    val = load_rows(cfg, "val", seed=7)
    assert len(val) == 3 and [r["question"] for r in val] != [r["question"] for r in rows[:3]]


def test_unknown_reasoning_gym_task_is_a_data_error():
    with pytest.raises(DataError, match="reasoning_gym:no_such_task"):
        load_rows(DataConfig(dataset_name="reasoning_gym:no_such_task"), "train", seed=0)


# --------------------------------------------------------------------------------------------------
# Local files
# --------------------------------------------------------------------------------------------------
def test_jsonl_rows_with_line_numbers_and_meta(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [RECORDS[0], "", RECORDS[1], RECORDS[2]])  # a blank line 2 is not a row
    rows = load_rows(DataConfig(dataset_name=str(path)), "train", seed=0)
    report = rows.report
    want = expected_rows(str(path), first=1)
    want[1]["source"], want[2]["source"] = f"{path}:3", f"{path}:4"
    assert rows == want
    assert report.num_rows == 3 and report.source == str(path)


@pytest.mark.parametrize("fmt", ["json", "json_lines_in_json", "parquet", "arrow"])
def test_table_formats_give_the_same_rows(tmp_path, fmt):
    import datasets

    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(RECORDS))
    elif fmt == "json_lines_in_json":
        path = write_jsonl(tmp_path / "d.json", RECORDS)
    else:
        ds = datasets.Dataset.from_list([{**r, "output": str(r["output"])} for r in RECORDS])
        path = tmp_path / f"d.{fmt}"
        if fmt == "parquet":
            ds.to_parquet(str(path))
        else:
            ds.save_to_disk(str(tmp_path / "saved"))
            (tmp_path / "saved" / "data-00000-of-00001.arrow").rename(path)
    rows = load_rows(DataConfig(train_data_path=str(path)), "train", seed=0)
    first = 1 if fmt == "json_lines_in_json" else 0
    assert rows == expected_rows(str(path), first=first)


def test_save_to_disk_directory(tmp_path):
    import datasets

    ds = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"input": "1+1=", "output": "2"}]),
        "test": datasets.Dataset.from_list([{"input": "3+3=", "output": "6"}]),
    })
    ds.save_to_disk(str(tmp_path / "dd"))
    cfg = DataConfig(dataset_name=str(tmp_path / "dd"))
    assert load_rows(cfg, "train", 0)[0]["question"] == "1+1="
    assert load_rows(cfg, "val", 0)[0]["question"] == "3+3="


def test_directory_with_one_file_per_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", RECORDS)
    write_jsonl(tmp_path / "validation.jsonl", RECORDS[:1])
    write_jsonl(tmp_path / "dev.jsonl", RECORDS[1:])
    cfg = DataConfig(dataset_name=str(tmp_path))
    assert load_rows(cfg, "train", 0) == expected_rows(str(tmp_path / "train.jsonl"), first=1)
    assert [r["question"] for r in load_rows(cfg, "val", 0)] == ["1+2="]
    cfg = DataConfig(dataset_name=str(tmp_path), val_split="dev")
    assert [r["question"] for r in load_rows(cfg, "val", 0)] == ["2+2=", "9+0="]
    with pytest.raises(DataError, match=r"no train file.*'nope\{"):
        load_rows(DataConfig(dataset_name=str(tmp_path), train_split="nope"), "train", 0)


def test_explicit_paths_override_dataset_name(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", RECORDS[:1])
    write_jsonl(tmp_path / "b.jsonl", RECORDS[1:])
    cfg = DataConfig(train_data_path=str(tmp_path / "a.jsonl"), val_data_path=str(tmp_path / "b.jsonl"))
    assert [r["question"] for r in load_rows(cfg, "train", 0)] == ["1+2="]
    assert [r["question"] for r in load_rows(cfg, "val", 0)] == ["2+2=", "9+0="]


def test_single_file_has_no_val_split(tmp_path):
    path = write_jsonl(tmp_path / "all.jsonl", RECORDS)
    with pytest.raises(DataError, match="single file: set data.val_data_path"):
        load_rows(DataConfig(dataset_name=str(path)), "val", 0)


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(DataError, match=r"missing\.jsonl: file not found \(data\.train_data_path\)"):
        load_rows(DataConfig(train_data_path=str(tmp_path / "missing.jsonl")), "train", 0)
    (tmp_path / "x.csv").write_text("input,output\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_rows(DataConfig(train_data_path=str(tmp_path / "x.csv")), "train", 0)


BAD_LINES = [
    ({"output": "1"}, "missing input key 'input'"),
    ({"input": "1+1="}, "missing output key 'output'"),
    ({"input": "   ", "output": "1"}, "empty prompt in 'input'"),
    ({"input": 12, "output": "1"}, "prompt 'input' is int, expected a string"),
    ({"input": "q", "output": None}, "answer 'output' is NoneType"),
    ("{not json", "invalid JSON"),
    ('["a list"]', "expected an object"),
]


@pytest.mark.parametrize("bad,problem", BAD_LINES)
def test_bad_jsonl_row_names_file_line_and_problem(tmp_path, bad, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [RECORDS[0], RECORDS[1], bad, RECORDS[2]])
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(dataset_name=str(path)), "train", 0)
    assert f"{path} line 3: {problem}" in str(err.value)


def test_bad_rows_are_skipped_and_counted(tmp_path, caplog):
    lines = [RECORDS[0]] + [bad for bad, _ in BAD_LINES] + [RECORDS[1], RECORDS[2]]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    rows = load_rows(DataConfig(dataset_name=str(path), on_bad_row="skip"), "train", 0)
    report = rows.report
    assert [r["question"] for r in rows] == ["1+2=", "2+2=", "9+0="]
    assert [r["source"] for r in rows] == [f"{path}:1", f"{path}:{len(BAD_LINES) + 2}", f"{path}:{len(BAD_LINES) + 3}"]
    assert report.num_skipped == len(BAD_LINES) and report.num_rows == 3
    assert f"skipped {len(BAD_LINES)} malformed train rows" in caplog.text
    assert report.skipped[0].startswith(f"{path} line 2: missing input key")
    assert pickle.loads(pickle.dumps(rows)).report == report  # the report survives a pickle round trip


def test_bad_parquet_row_names_the_row_index(tmp_path):
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"input": "a", "output": "1"}, {"input": "", "output": "2"}]).to_parquet(str(path))
    with pytest.raises(DataError, match=re.escape(f"{path} row 1: empty prompt")):
        load_rows(DataConfig(train_data_path=str(path)), "train", 0)


def test_custom_keys_and_all_rows_bad(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "solution": "s"}])
    rows = load_rows(DataConfig(dataset_name=str(path), input_key="problem", output_key="solution"), "train", 0)
    assert rows[0]["question"] == "p" and rows[0]["answer"] == "s"
    with pytest.raises(DataError, match="no usable train rows \\(1 malformed"):
        load_rows(DataConfig(dataset_name=str(path), on_bad_row="skip"), "train", 0)


def test_unreachable_hub_name_is_a_clear_error(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying DNS
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(dataset_name="no-such-org/no-such-dataset"), "train", 0)
    msg = str(err.value)
    assert "data.dataset_name='no-such-org/no-such-dataset'" in msg and "split 'train'" in msg
    assert "need network access" in msg


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def char_ids(tok, text):
    """Expected ids of the char tokenizer, computed independently: one id per character."""
    vocab = tok.get_vocab()
    return [vocab[c] for c in text]


def test_plain_prompt_is_the_question_with_bos(tok):
    text, ids = PromptFormatter(tok, DataConfig()).format("1+2=")
    assert text == "1+2="
    assert ids == [tok.bos_token_id] + char_ids(tok, "1+2=")


@pytest.mark.parametrize("template,want", [
    ("Q: {}\nA:", "Q: 1+2=\nA:"),
    ("Q: {input} A:", "Q: 1+2= A:"),
    ("Box {{}}: {}", "Box {}: 1+2="),  # literal braces are doubled, as in str.format
])
def test_prompt_template(tok, template, want):
    text, ids = PromptFormatter(tok, DataConfig(prompt_template=template)).format("1+2=")
    assert text == want and ids == [tok.bos_token_id] + char_ids(tok, want)


def test_system_prompt_and_files_plain(tok, tmp_path):
    (tmp_path / "p.txt").write_text("Solve: {}")
    (tmp_path / "s.txt").write_text("Be brief.")
    cfg = DataConfig(prompt_file=str(tmp_path / "p.txt"), system_prompt_file=str(tmp_path / "s.txt"))
    assert PromptFormatter(tok, cfg).format("2+2=")[0] == "Be brief.\nSolve: 2+2="
    assert PromptFormatter(tok, DataConfig(system_prompt="Hi.")).format("q")[0] == "Hi.\nq"


@pytest.mark.parametrize("cfg,match", [
    (DataConfig(prompt_template="no placeholder"), "has no {} or {input}"),
    (DataConfig(prompt_template=r"\boxed{} {}"), "literal braces"),
    (DataConfig(prompt_template="{question}"), "KeyError"),
    (DataConfig(prompt_template="{}", prompt_file="x.txt"), "both set"),
    (DataConfig(system_prompt_file="/no/such/file.txt"), "system_prompt_file='/no/such/file.txt'"),
])
def test_bad_prompt_config(tok, cfg, match):
    with pytest.raises(DataError, match=re.escape(match)):
        PromptFormatter(tok, cfg)


def test_jinja_chat_template(tok):
    cfg = DataConfig(system_prompt="Be brief.", prompt_template="Q {}")
    text, ids = PromptFormatter(tok, cfg, chat_template=SIMPLE_CHAT_TEMPLATE).format("1+2=")
    want = "system: Be brief.\nuser: Q 1+2=\nassistant: "
    assert text == want
    assert ids == char_ids(tok, want)  # the template owns special tokens: no <bos> added
    text, _ = PromptFormatter(tok, DataConfig(), chat_template=SIMPLE_CHAT_TEMPLATE).format("x")
    assert text == "user: x\nassistant: "


def test_default_chat_template_uses_the_tokenizers_own():
    chat_tok = build_char_tokenizer(chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert PromptFormatter(chat_tok, DataConfig(), chat_template="default").format("q")[0] == "<q>"
    with pytest.raises(DataError, match="has no chat template"):
        PromptFormatter(build_char_tokenizer(), DataConfig(), chat_template="default")


def test_prompt_dataset_filters_long_prompts(tok):
    rows = [{"question": q, "answer": "a", "source": f"s:{i}", "meta": {"k": i}, "level": i}
            for i, q in enumerate(["1+2=", "10+20=", "3+4=", "100+200="])]
    ds = PromptDataset(rows, PromptFormatter(tok, DataConfig()), max_input_seq_length=5)  # <bos> + 4 chars
    assert ds.num_filtered == 2 and len(ds) == 2
    ids = [tok.bos_token_id] + char_ids(tok, "3+4=")
    assert ds[1] == PromptRow(index=2, question="3+4=", answer="a", task_name="default",
                              prompt_messages=[{"role": "user", "content": "3+4=", "token_ids": ids}], prompt_ids=ids,
                              source="s:2", meta={"k": 2}, extra={"level": 2})  # a row's other keys survive
    assert len(PromptDataset(rows, PromptFormatter(tok, DataConfig()), None)) == 4
    with pytest.raises(DataError, match="all 4 prompts are longer"):
        PromptDataset(rows, PromptFormatter(tok, DataConfig()), max_input_seq_length=2)


# --------------------------------------------------------------------------------------------------
# Loader: order and exact resume
# --------------------------------------------------------------------------------------------------
class Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"index": i}


def run(loader, num_epochs, start_epoch=0, stop_after=None):
    """The training loop's shape: returns [(epoch, indices)] and, when stopped, (epoch, loader state)."""
    seen = []
    for epoch in range(start_epoch, num_epochs):
        for batch in loader:
            seen.append((epoch, [item["index"] for item in batch]))
            if len(seen) == stop_after:
                buf = io.BytesIO()  # a checkpoint round trip
                torch.save({"epoch": epoch, "loader": loader.state_dict()}, buf)
                buf.seek(0)
                return seen, torch.load(buf, weights_only=False)
    return seen, None


def test_batches_are_lists_covering_each_epoch():
    seen, _ = run(build_dataloader(Items(10), batch_size=3, shuffle=True, seed=0), num_epochs=2)
    assert len(seen) == 6  # drop_last: 3 full batches per epoch
    for epoch in (0, 1):
        idx = [i for e, b in seen if e == epoch for i in b]
        assert len(idx) == 9 and len(set(idx)) == 9 and set(idx) <= set(range(10))
    assert [b for e, b in seen if e == 0] != [b for e, b in seen if e == 1]  # reshuffled per epoch
    batch = next(iter(build_dataloader(Items(4), batch_size=2, shuffle=False, seed=0)))
    assert batch == [{"index": 0}, {"index": 1}]


def test_order_depends_on_seed_only_not_on_global_rng():
    torch.manual_seed(0)
    a, _ = run(build_dataloader(Items(20), 4, shuffle=True, seed=5), 2)
    rng_before = torch.get_rng_state()
    b, _ = run(build_dataloader(Items(20), 4, shuffle=True, seed=5), 2)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the loader never touches the global RNG
    torch.manual_seed(123)
    c, _ = run(build_dataloader(Items(20), 4, shuffle=True, seed=5), 2)
    d, _ = run(build_dataloader(Items(20), 4, shuffle=True, seed=6), 2)
    assert a == b == c and a != d


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("stop_after", [1, 4, 3, 6])  # mid-epoch 0, mid-epoch 1, exactly at an epoch end
def test_resume_continues_exactly(shuffle, stop_after):
    num_epochs = 3
    full, _ = run(build_dataloader(Items(10), 3, shuffle=shuffle, seed=1), num_epochs)
    assert len(full) == 9
    head, state = run(build_dataloader(Items(10), 3, shuffle=shuffle, seed=1), num_epochs, stop_after=stop_after)
    assert head == full[:stop_after]
    fresh = build_dataloader(Items(10), 3, shuffle=shuffle, seed=1)
    fresh.load_state_dict(state["loader"])
    tail, _ = run(fresh, num_epochs, start_epoch=state["epoch"])
    assert head + tail == full


def test_too_small_dataset_for_one_batch():
    with pytest.raises(DataError, match="3 prompts cannot fill one batch of 4"):
        build_dataloader(Items(3), 4, shuffle=True, seed=0)


def test_resume_with_worker_processes():
    full, _ = run(build_dataloader(Items(12), 2, shuffle=True, seed=2, num_workers=2), 2)
    head, state = run(build_dataloader(Items(12), 2, shuffle=True, seed=2, num_workers=2), 2, stop_after=4)
    fresh = build_dataloader(Items(12), 2, shuffle=True, seed=2, num_workers=2)
    fresh.load_state_dict(state["loader"])
    tail, _ = run(fresh, 2, start_epoch=state["epoch"])
    assert head + tail == full


def test_prompt_dataset_reads_the_task_column_and_rejects_tasks_without_an_environment(tok):
    rows = [{"question": "1+2=", "answer": "3", "source": "f.jsonl:1", "meta": {"task_name": "math"}},
            {"question": "1+3=", "answer": "4", "source": "f.jsonl:2", "meta": {}}]
    ds = PromptDataset(rows, PromptFormatter(tok, DataConfig()), default_task="arithmetic",
                       tasks=["arithmetic", "math"])
    assert [item.task_name for item in ds] == ["math", "arithmetic"]
    with pytest.raises(DataError, match=r"f.jsonl:1: task_name='math' has no environment"):
        PromptDataset(rows, PromptFormatter(tok, DataConfig()), default_task="arithmetic", tasks=["arithmetic"])


def test_a_conversation_prompt_keeps_its_history_and_needs_a_chat_template(tok):
    from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE

    history = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
               {"role": "user", "content": "and 1+3="}]
    fmt = PromptFormatter(tok, DataConfig(system_prompt="be brief"), chat_template=SIMPLE_CHAT_TEMPLATE)
    messages = fmt.prompt_messages(history)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    text, ids = fmt.format(history)
    assert text == "system: be brief\nuser: 1+2=\nassistant: 3\nuser: and 1+3=\nassistant: "
    assert ids == [t for m in messages for t in m["token_ids"]] == tok(text, add_special_tokens=False)["input_ids"]
    assert check_record({"input": history, "output": "4"}, "input", "output") is None
    assert "must end with a user message" in check_record({"input": history[:2], "output": "4"}, "input", "output")
    with pytest.raises(DataError, match="needs a chat template"):
        PromptFormatter(tok, DataConfig()).prompt_messages(history)
