"""grpo.system.rundir: one run per directory (a lock another process cannot take, released when its holder dies), the
run fingerprint a resume must match, and no fresh start into a directory holding checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from grpo.config import MasterConfig
from grpo.system.rundir import (
    FINGERPRINT_FILE, LOCK_FILE, RESUME_MUTABLE, RunDirError, RunLock, check_fingerprint, check_fresh_start,
    claim_run_dirs, distinct_dirs, record_run_dirs, recorded_run_id, run_fingerprint, write_fingerprint,
)
from tests.helpers.e2e import REPO, child_env


def _lock_in_child(directory, hold: bool = False) -> subprocess.Popen:
    code = ("import sys, time\nfrom grpo.system.rundir import RunLock, RunDirError\n"
            "try:\n    lock = RunLock(sys.argv[1])\n"
            "except RunDirError as e:\n    print(e, file=sys.stderr); sys.exit(3)\n"
            "print('locked', flush=True)\n"
            "time.sleep(600 if sys.argv[2] == '1' else 0)\n")
    return subprocess.Popen([sys.executable, "-c", code, str(directory), "1" if hold else "0"], cwd=REPO,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_process_fails_at_once_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] and holder["started"]
        child = _lock_in_child(tmp_path / "run")
        out, err = child.communicate(timeout=60)
        assert child.returncode == 3, out + err
        assert f"{tmp_path / 'run'} is in use by another run (PID {os.getpid()} on " in err
    child = _lock_in_child(tmp_path / "run")  # released: the next run may go
    assert child.communicate(timeout=60)[0] == "locked\n" and child.returncode == 0


def test_the_lock_dies_with_its_holder_even_under_kill_9(tmp_path):
    child = _lock_in_child(tmp_path, hold=True)
    try:
        assert child.stdout.readline() == "locked\n"
        with pytest.raises(RunDirError, match=rf"PID {child.pid} on "):
            RunLock(tmp_path)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    with RunLock(tmp_path):  # no stale lock
        pass
    assert (tmp_path / LOCK_FILE).exists()


def test_the_same_directory_twice_in_one_process_is_refused_and_distinct_dirs_dedups(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunDirError, match=f"PID {os.getpid()}"):
            RunLock(tmp_path)
    assert distinct_dirs(tmp_path, f"{tmp_path}/", tmp_path / "logs" / "..", tmp_path / "logs") == \
        [tmp_path.resolve(), (tmp_path / "logs").resolve()]


def _cfg(*overrides: tuple[str, object]) -> dict:
    raw = MasterConfig().model_dump(mode="json")
    for key, value in overrides:
        *parents, leaf = key.split(".")
        node = raw
        for p in parents:
            node = node[p]
        node[leaf] = value
    return MasterConfig.model_validate(raw).model_dump(mode="json")


def test_fingerprint_holds_model_data_seed_and_ignores_only_the_resume_mutable_fields():
    fp = run_fingerprint(_cfg())
    assert fp["model"] == "Qwen/Qwen2.5-1.5B" and fp["seed"] == 42 and fp["data"]["dataset_name"] == "arithmetic"
    same = run_fingerprint(_cfg(("grpo.max_num_steps", 7), ("grpo.val_period", 3), ("logger.log_dir", "x"),
                                ("logger.wandb.project", "p"), ("checkpointing.keep_top_k", 1),
                                ("checkpointing.checkpoint_must_save_by", "00:01:00:00"),
                                ("checkpointing.resume", False), ("cluster.num_nodes", 2)))
    assert same["config_sha256"] == fp["config_sha256"]
    for key, value in [("grpo.seed", 1), ("policy.optimizer.lr", 1e-3), ("data.dataset_name", "x.jsonl"),
                       ("loss_fn.ratio_clip_max", 0.3), ("policy.model_name", "other")]:
        assert run_fingerprint(_cfg((key, value)))["config_sha256"] != fp["config_sha256"], key
    assert not any(k.startswith(("logger.", "cluster.")) for k in fp["config"])
    assert "checkpointing.save_period" in RESUME_MUTABLE and "policy.optimizer.lr" in fp["config"]


def test_check_fingerprint_names_the_differing_field_and_can_be_overridden(tmp_path):
    fp = run_fingerprint(_cfg())
    check_fingerprint(tmp_path, fp)  # nothing recorded yet
    assert recorded_run_id(tmp_path) is None
    run_id = write_fingerprint(tmp_path, fp)
    assert recorded_run_id(tmp_path) == run_id and len(run_id) == 32
    check_fingerprint(tmp_path, run_fingerprint(_cfg(("grpo.max_num_steps", 99))))  # a resume that trains longer
    other = run_fingerprint(_cfg(("policy.optimizer.lr", 1e-3), ("grpo.seed", 7)))
    check_fingerprint(tmp_path, other)  # the recorded run wrote nothing yet (stopped at startup): no conflict
    (tmp_path / "step_000002").mkdir()  # now it has a checkpoint
    with pytest.raises(RunDirError) as err:
        check_fingerprint(tmp_path, other)
    message = str(err.value)
    assert f"{tmp_path} belongs to a run with another config (grpo.seed: 42 -> 7; policy.optimizer.lr: 5e-06 -> " \
           "0.001)" in message and "checkpointing.allow_config_change=true" in message
    check_fingerprint(tmp_path, other, allow_change=True)
    assert write_fingerprint(tmp_path, other) == run_id  # the run keeps its id
    assert json.loads((tmp_path / FINGERPRINT_FILE).read_text())["config_sha256"] == other["config_sha256"]


def test_an_unreadable_fingerprint_is_named(tmp_path):
    (tmp_path / FINGERPRINT_FILE).write_text("{")
    with pytest.raises(RunDirError, match=f"{FINGERPRINT_FILE}: unreadable"):
        check_fingerprint(tmp_path, run_fingerprint(_cfg()))


def test_resume_false_refuses_a_directory_with_checkpoints(tmp_path):
    check_fresh_start(tmp_path / "missing")
    (tmp_path / "step_000010.tmp").mkdir()
    (tmp_path / "hf_final").mkdir()
    check_fresh_start(tmp_path)  # no checkpoint yet
    (tmp_path / "step_000010").mkdir()
    with pytest.raises(RunDirError, match=rf"checkpointing.resume=false but {tmp_path} holds checkpoints "
                                          r"\(step_000010\)"):
        check_fresh_start(tmp_path)


def test_claim_run_dirs_locks_checks_and_records(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    locks, run_id = claim_run_dirs(ckpt, logs, _cfg(), resume=True)
    assert not (ckpt / FINGERPRINT_FILE).exists()  # checked, not yet recorded: the run has not started
    record_run_dirs(ckpt, logs, _cfg(), run_id)
    with pytest.raises(RunDirError, match="is in use by another run"):
        claim_run_dirs(ckpt, tmp_path / "other_logs", _cfg(), resume=True)
    assert not (tmp_path / "other_logs" / FINGERPRINT_FILE).exists()  # nothing recorded by the refused claim
    for lock in locks:
        lock.release()
    (ckpt / "step_000002").mkdir()
    locks, again = claim_run_dirs(ckpt, logs, _cfg(("grpo.max_num_steps", 50)), resume=True)  # resume, train longer
    assert again == run_id and json.loads((logs / FINGERPRINT_FILE).read_text())["run_id"] == run_id and [lk.directory for lk in locks] == [ckpt.resolve(), logs.resolve()]
    for lock in locks:
        lock.release()
    with pytest.raises(RunDirError, match="checkpointing.resume=false"):
        claim_run_dirs(ckpt, logs, _cfg(), resume=False)
    with pytest.raises(RunDirError, match=r"policy.optimizer.lr: 5e-06 -> 0.1"):
        claim_run_dirs(ckpt, logs, _cfg(("policy.optimizer.lr", 0.1)), resume=True)
    locks, _ = claim_run_dirs(ckpt, logs, _cfg(("policy.optimizer.lr", 0.1)), resume=True, allow_change=True)
    for lock in locks:  # the refusals above released what they had locked
        lock.release()
    locks, log_run = claim_run_dirs(None, tmp_path / "only_logs", _cfg(), resume=False)  # checkpointing off
    assert len(locks) == 1 and log_run != run_id
    locks[0].release()


def _data_cfg(path):
    return _cfg(("data.dataset_name", str(path)), ("data.val_data_path", str(path)))


@pytest.mark.parametrize("change", ["other rows", "fewer rows", "same size"])
def test_other_data_under_the_same_path_is_refused_unless_allowed(tmp_path, change):
    data = tmp_path / "data.jsonl"
    rows = [json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) for i in range(8)]
    data.write_text("\n".join(rows) + "\n")
    run = tmp_path / "run"
    write_fingerprint(run, run_fingerprint(_data_cfg(data)))
    (run / "step_000002").mkdir()
    check_fingerprint(run, run_fingerprint(_data_cfg(data)))  # the same data: resumes
    if change == "other rows":
        data.write_text("\n".join(rows[::-1]) + "\n")
    elif change == "fewer rows":
        data.write_text("\n".join(rows[:3]) + "\n")
    else:
        data.write_text(data.read_text().replace("0+1", "9+1"))
    with pytest.raises(RunDirError) as err:
        check_fingerprint(run, run_fingerprint(_data_cfg(data)))
    message = str(err.value)
    assert message.startswith(f"{run} belongs to a run that trained on other data under the same path "
                              f"(data.dataset_name {data}: ")
    assert "other content" in message and "checkpointing.allow_config_change=true" in message
    check_fingerprint(run, run_fingerprint(_data_cfg(data)), allow_change=True)


def test_a_data_directory_and_large_files_are_fingerprinted_by_content(tmp_path, monkeypatch):
    import grpo.system.rundir as rundir

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (tmp_path / "d" / "val.jsonl").write_text('{"question": "1+2=", "answer": "3"}\n')
    fp = run_fingerprint(_cfg(("data.dataset_name", str(tmp_path / "d"))))["data_files"]
    assert set(fp["data.dataset_name"]["files"]) == {"train.jsonl", "val.jsonl"}
    monkeypatch.setattr(rundir, "FULL_HASH_BYTES", 16)
    monkeypatch.setattr(rundir, "HEAD_TAIL_BYTES", 8)
    big = rundir.file_fingerprint(tmp_path / "d" / "train.jsonl")
    assert big["hashed"] == "head+tail" and big["size"] == 36
    assert run_fingerprint(_cfg())["data_files"] == {}  # built-in tasks and hub names have no file


def test_a_fingerprint_recorded_before_data_fingerprints_still_resumes(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n')
    old = run_fingerprint(_data_cfg(data))
    del old["data_files"]
    write_fingerprint(tmp_path / "run", old)
    (tmp_path / "run" / "step_000002").mkdir()
    check_fingerprint(tmp_path / "run", run_fingerprint(_data_cfg(data)))


def test_a_differing_long_value_is_named_briefly():
    from grpo.system.rundir import fingerprint_diff

    diff = fingerprint_diff({"config": {"env.x": list(range(10_000))}}, {"config": {"env.x": list(range(10_001))}})
    assert diff == ["env.x: [0, 1, 2, 3, ...] -> [0, 1, 2, 3, ...]"]


def _fp_dir(tmp_path, cfg_dict) -> str:
    from grpo.system.rundir import run_fingerprint

    d = tmp_path / "ckpt"
    write_fingerprint(d, run_fingerprint(cfg_dict))
    return str(d)


def test_an_export_names_each_weight_setting_that_differs_and_only_those(tmp_path):
    """--export-hf's check (issue 37): the keys that shape the exported weights (model, precision, tokenizer,
    hf_config_overrides, the LoRA settings) against the run's fingerprint; everything else may differ."""
    from grpo.system.rundir import EXPORT_KEYS, claim_for_export, export_config_diff

    run = MasterConfig.model_validate({"policy": {"lora": {"enabled": True}}}).model_dump(mode="json")
    d = _fp_dir(tmp_path, run)
    same_weights = MasterConfig.model_validate({"policy": {"lora": {"enabled": True, "dropout": 0.1}},
                                                "grpo": {"seed": 3}}).model_dump(mode="json")
    assert export_config_diff(d, same_weights) == []
    other = MasterConfig.model_validate({"policy": {"model_name": "other", "precision": "float32",
                                                    "lora": {"enabled": True, "alpha": 64}}}).model_dump(mode="json")
    assert export_config_diff(d, other) == ["policy.lora.alpha: 32.0 -> 64.0", "policy.model_name: 'Qwen/Qwen2.5-1.5B' "
                                            "-> 'other'", "policy.precision: 'bfloat16' -> 'float32'"]
    assert all(k.startswith("policy.") for k in EXPORT_KEYS)
    with pytest.raises(RunDirError, match="policy.lora.alpha: 32.0 -> 64.0.*cannot be overridden"):
        claim_for_export(d, other, "--export-hf", allow_change=True)
    model_only = MasterConfig.model_validate({"policy": {"model_name": "other", "lora": {"enabled": True}}})
    with pytest.raises(RunDirError, match="policy.model_name.*--export-allow-config-change"):
        claim_for_export(d, model_only.model_dump(mode="json"), "--export-hf")
    locks, run_id = claim_for_export(d, model_only.model_dump(mode="json"), "--export-hf", allow_change=True)
    assert run_id == recorded_run_id(d)
    for lock in locks:
        lock.release()


def test_an_export_without_lora_ignores_the_lora_settings_and_a_missing_directory_is_named(tmp_path):
    from grpo.system.rundir import claim_for_export, export_config_diff

    d = _fp_dir(tmp_path, MasterConfig().model_dump(mode="json"))
    assert export_config_diff(d, MasterConfig.model_validate({"policy": {"lora": {"alpha": 1}}}).model_dump(
        mode="json")) == []
    assert export_config_diff(tmp_path / "nothing", {}) is None
    with pytest.raises(RunDirError, match="--export-adapter: no checkpoint in .*nothing"):
        claim_for_export(tmp_path / "nothing", {}, "--export-adapter")
    assert not (tmp_path / "nothing").exists()


def test_an_export_checks_the_checkpoint_s_own_record_before_the_fingerprint(tmp_path):
    """A resume refused at startup (another policy.lora.dim with allow_config_change) has already rewritten the
    run fingerprint; the checkpoints' weight_config.json still says what their weights were trained with."""
    from grpo.system.rundir import WEIGHT_CONFIG_FILE, export_config_diff, weight_config

    def dumped(dim: int) -> dict:
        return MasterConfig.model_validate({"policy": {"lora": {"enabled": True, "dim": dim}}}).model_dump(mode="json")

    d = _fp_dir(tmp_path, dumped(8))  # the refused run's fingerprint
    (tmp_path / "ckpt" / "step_000001").mkdir()
    (tmp_path / "ckpt" / "step_000001" / WEIGHT_CONFIG_FILE).write_text(json.dumps(weight_config(dumped(4))))
    assert export_config_diff(d, dumped(4)) == []
    assert export_config_diff(d, dumped(8)) == ["policy.lora.dim: 4 -> 8"]


def test_setup_reads_each_data_file_once_and_a_changed_file_again(tmp_path, monkeypatch):
    """The claim and the record of one setup fingerprint the same data: the file is read once, not twice; a file
    rewritten since (other size or mtime) is read again, so a changed dataset is never taken for the old one."""
    import builtins

    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "1+1=", "output": "2"}\n')
    reads, real_open = [], builtins.open

    def counting_open(file, *args, **kwargs):
        if os.fspath(file) == str(data.resolve()):
            reads.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    cfg = _cfg(("data.train_data_path", str(data)))
    locks, run_id = claim_run_dirs(tmp_path / "ckpt", tmp_path / "logs", cfg, resume=True)
    record_run_dirs(tmp_path / "ckpt", tmp_path / "logs", cfg, run_id)
    assert len(reads) == 1
    data.write_text('{"input": "2+2=", "output": "4"}\n{"input": "1+1=", "output": "2"}\n')
    assert run_fingerprint(cfg)["data_files"] != json.loads((tmp_path / "logs" / FINGERPRINT_FILE).read_text())["data_files"]
    assert len(reads) == 2
    for lock in locks:
        lock.release()
