"""grpo.system.weights.export_hf never deletes what the run did not write: a non-empty directory that is not an earlier
export of the same run is refused unless asked, and even then only same-named files are replaced.

The engine here is a stand-in without ZeRO (a plain HF model; export_hf's ZeRO-3 gather is tested in
test_engines.py): what is tested is the directory handling."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from grpo.tasks.toy import build_char_tokenizer
from grpo.system.weights import EXPORT_MARKER, ExportError, export_hf


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return SimpleNamespace(zero_optimization_stage=lambda: 0, module=model)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _files(d) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}


def test_a_fresh_export_records_what_it_wrote_and_loads(engine, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    export_hf(engine, str(tmp_path / "out"), tok, run_id="run-a")
    marker = json.loads((tmp_path / "out" / EXPORT_MARKER).read_text())
    assert marker["run_id"] == "run-a" and set(marker["files"]) == _files(tmp_path / "out") - {EXPORT_MARKER}
    assert "model.safetensors" in marker["files"] and "config.json" in marker["files"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for (n, p), (_, q) in zip(reloaded.named_parameters(), engine.module.named_parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=n)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left
    (tmp_path / "empty").mkdir()
    export_hf(engine, str(tmp_path / "empty"), tok)  # an empty directory is fine too
    assert "model.safetensors" in _files(tmp_path / "empty")


def test_a_directory_with_other_files_is_refused_and_left_alone(engine, tok, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(ExportError, match=rf"{out} is not empty and is not an export of this run"):
        export_hf(engine, str(out), tok, run_id="run-a")
    assert _files(out) == {"thesis.tex"} and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file, not a directory"):
        export_hf(engine, str(tmp_path / "file"), tok, run_id="run-a")


def test_the_same_run_replaces_its_export_and_keeps_files_added_later(engine, tok, tmp_path):
    out = tmp_path / "out"
    export_hf(engine, str(out), tok, run_id="run-a")
    first = _files(out)
    export_hf(engine, str(out), tok, run_id="run-a")  # only our files there: replaced in one rename
    assert _files(out) == first
    # An earlier export of this run wrote a shard the new one does not; the user added a README.
    (out / "model-00002-of-00002.safetensors").write_text("stale")
    marker = json.loads((out / EXPORT_MARKER).read_text())
    stale = marker["files"] + ["model-00002-of-00002.safetensors"]
    (out / EXPORT_MARKER).write_text(json.dumps({**marker, "files": stale}))
    (out / "README.md").write_text("notes")
    export_hf(engine, str(out), tok, run_id="run-a")
    assert _files(out) == first | {"README.md"} and (out / "README.md").read_text() == "notes"
    assert json.loads((out / EXPORT_MARKER).read_text())["run_id"] == "run-a"


def test_another_runs_export_is_refused_unless_overwrite_and_then_nothing_is_deleted(engine, tok, tmp_path):
    out = tmp_path / "out"
    export_hf(engine, str(out), tok, run_id="run-a")
    (out / "extra_from_run_a.bin").write_text("a")
    marker = json.loads((out / EXPORT_MARKER).read_text())
    (out / EXPORT_MARKER).write_text(json.dumps({**marker, "files": marker["files"] + ["extra_from_run_a.bin"]}))
    for other in ("run-b", None):  # another run, or a run without an id
        with pytest.raises(ExportError, match="is an export of another run"):
            export_hf(engine, str(out), tok, run_id=other)
    (out / "config.json").write_text("{}")  # will be replaced: same name
    export_hf(engine, str(out), tok, run_id="run-b", overwrite=True)
    assert (out / "extra_from_run_a.bin").read_text() == "a"  # not ours to delete
    assert json.loads((out / "config.json").read_text()).get("model_type") == "llama"
    assert json.loads((out / EXPORT_MARKER).read_text())["run_id"] == "run-b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_into_a_foreign_directory_replaces_only_same_named_files(engine, tok, tmp_path):
    out = tmp_path / "theirs"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "data.txt").write_text("keep")
    (out / "model.safetensors").write_text("old weights")
    export_hf(engine, str(out), tok, run_id="run-a", overwrite=True)
    assert (out / "sub" / "data.txt").read_text() == "keep"
    assert (out / "model.safetensors").stat().st_size > 100
    export_hf(engine, str(out), tok, run_id="run-a")  # now an export of run-a (with foreign files beside it)
    assert (out / "sub" / "data.txt").read_text() == "keep"
