"""grpo.system.checkpoint: manifests and verification, fallback to the newest intact checkpoint, missing state files,
a full disk, pruning, ``.tmp`` cleanup, the status file, and no code run from any file a resume reads.

Most tests use `FakeEngine` (DeepSpeed's save/load surface over one tensor, loading through
``checkpoint_engine.load`` with ``weights_only=False`` as DeepSpeed's own engine does); the planted-pickle
test runs a real one-rank ZeRO-3 engine on a tiny model.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo.system.checkpoint import (
    MANIFEST, CheckpointError, CheckpointManager, GRPOSaveState, build_manifest, safe_load, use_safe_loading,
)
from grpo.config import CheckpointingConfig
from tests.helpers.batches import train_batch


class FakeEngine:
    """A DeepSpeed engine's checkpoint surface over one weight tensor."""

    def __init__(self, value: float = 0.0, rank: int = 0):
        self.weight = torch.full((4,), value)
        self.file = "model_states.pt" if rank == 0 else f"model_states_rank{rank}.pt"
        # DeepSpeed's TorchCheckpointEngine.load: torch.load(weights_only=False)
        self.checkpoint_engine = SimpleNamespace(
            load=lambda path, map_location=None: torch.load(path, map_location=map_location, weights_only=False))

    def load_universal_checkpoint(self) -> bool:
        return False

    def save_checkpoint(self, save_dir, tag, save_latest=False):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        torch.save({"module": self.weight}, os.path.join(save_dir, tag, self.file))

    def load_checkpoint(self, load_dir, tag, load_module_strict=True):
        self.weight = self.checkpoint_engine.load(os.path.join(load_dir, tag, self.file))["module"]
        return load_dir, {}


def manager(tmp_path, **cfg) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **cfg))


def save(ckpt: CheckpointManager, step: int, val_reward: float = -99999999.0, engine=None) -> Path:
    state = GRPOSaveState(current_step=step, consumed_samples=8 * step, val_reward=val_reward)
    return ckpt.save(step, engine or FakeEngine(step), state, {"position": step}, extra={"buffer": {"n": step}})


def rewrite_manifest(path: Path) -> None:
    """What an attacker who edits files would also do: make the manifest match them."""
    (path / MANIFEST).write_text(json.dumps(build_manifest(path)))


# --------------------------------------------------------------------------------------------------
# round trip, manifest, status file
# --------------------------------------------------------------------------------------------------
def test_save_and_load_round_trip_with_manifest_and_status(tmp_path):
    ckpt = manager(tmp_path)
    random.seed(5)
    torch.manual_seed(5)
    path = save(ckpt, 3)
    expected = (random.random(), torch.rand(2))
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    assert set(manifest) == {"ds/ds/model_states.pt", "rng_rank0.pt", "dataloader.pt", "extra_buffer.pt",
                             "train_state.json", "lora.json"}  # lora.json: {"enabled": false}, checked on resume
    assert manifest["dataloader.pt"]["size"] == (path / "dataloader.pt").stat().st_size
    status = json.loads((tmp_path / "ckpt" / "latest_checkpoint_status.json").read_text())
    assert (status["step"], status["path"]) == (3, str(path))

    engine = FakeEngine()
    state, loader_state, extra = ckpt.load(path, engine)
    assert (state.current_step, state.consumed_samples, loader_state, extra) == (3, 24, {"position": 3},
                                                                                {"buffer": {"n": 3}})
    assert torch.equal(engine.weight, torch.full((4,), 3.0))
    assert (random.random(), *torch.rand(2).tolist()) == (expected[0], *expected[1].tolist())  # RNG restored
    assert ckpt.verify(path) is None and ckpt.latest() == path and ckpt.latest_step() == 3


def test_train_state_is_strict_json_without_non_finite_metrics(tmp_path):
    ckpt = manager(tmp_path)
    state = GRPOSaveState(current_step=1, val_reward=float("nan"),
                          metrics={"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/kl": 0.5})
    path = ckpt.save(1, FakeEngine(), state, {})
    saved = json.loads((path / "train_state.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert saved["metrics"] == {"train/kl": 0.5} and saved["val_reward"] == -99999999.0
    assert ckpt.verify(path) is None


# --------------------------------------------------------------------------------------------------
# verification and fallback
# --------------------------------------------------------------------------------------------------
def _truncate(path: Path, rel: str) -> None:
    f = path / rel
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_byte(path: Path, rel: str) -> None:
    f = path / rel
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _edit_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, expected", [
    (lambda p: _truncate(p, "ds/ds/model_states.pt"), "ds/ds/model_states.pt has"),
    (lambda p: (p / "train_state.json").write_text(""), "train_state.json has 0 bytes"),
    (lambda p: _flip_byte(p, "extra_buffer.pt"), "extra_buffer.pt does not match its sha256"),
    (lambda p: (p / MANIFEST).unlink(), "no manifest.json"),
    (lambda p: (p / MANIFEST).write_text("{"), "manifest.json is unreadable"),
    (lambda p: _edit_manifest(p, lambda m: m["files"]["dataloader.pt"].pop("size")), "manifest.json is malformed"),
    (lambda p: _edit_manifest(p, lambda m: m.update(files=sorted(m["files"]))), "manifest.json is malformed"),
    (lambda p: _edit_manifest(p, lambda m: m["files"].update({"dataloader.pt": "x"})), "manifest.json is malformed"),
    (lambda p: _edit_manifest(p, lambda m: m["files"]["rng_rank0.pt"].update(size="12")), "manifest.json is malformed"),
    (lambda p: (p / MANIFEST).write_text("[]"), "manifest.json is malformed"),
    (lambda p: (p / MANIFEST).write_text('{"files": {"../../outside": {"size": 1, "sha256": ""}}}'),
     "manifest.json is malformed"),
    (lambda p: (p / "dataloader.pt").unlink(), "dataloader.pt is missing"),
    (lambda p: (p / "rng_rank0.pt").unlink(), "rng_rank0.pt is missing"),
])
def test_latest_skips_a_broken_newest_checkpoint_naming_the_problem(tmp_path, caplog, damage, expected):
    ckpt = manager(tmp_path, keep_top_k=None)
    good, bad = save(ckpt, 2), save(ckpt, 4)
    damage(bad)
    assert expected in ckpt.verify(bad)
    with caplog.at_level(logging.WARNING, logger="grpo.system.checkpoint"):
        assert ckpt.latest() == good and ckpt.latest_step() == 2
    assert str(bad) in caplog.text and expected in caplog.text
    with pytest.raises(CheckpointError, match=expected):  # and it never loads
        ckpt.load(bad, FakeEngine())


def test_only_broken_checkpoints_refuse_to_start_over(tmp_path):
    ckpt = manager(tmp_path)
    path = save(ckpt, 2)
    _truncate(path, "ds/ds/model_states.pt")
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'ckpt'}: no intact checkpoint \(step_000002: ds/ds/"):
        ckpt.latest()
    assert manager(tmp_path / "empty").latest() is None  # nothing saved yet: a fresh start


@pytest.mark.parametrize("name, expected", [
    ("dataloader.pt", "dataloader.pt is missing: without it the data order would restart"),
    ("rng_rank0.pt", r"rng_rank0.pt is missing \(the checkpoint has \[\]\)"),
])
def test_a_checkpoint_saved_without_loader_or_rng_state_is_an_error_not_a_restart(tmp_path, name, expected):
    ckpt = manager(tmp_path)
    path = save(ckpt, 2)
    (path / name).unlink()
    rewrite_manifest(path)  # intact as far as the manifest goes: saved without it
    assert ckpt.verify(path) is None
    with pytest.raises(CheckpointError, match=expected):
        ckpt.load(path, FakeEngine())
    if name == "dataloader.pt":  # a loop without a data loader says so
        state, loader_state, _ = ckpt.load(path, FakeEngine(), need_dataloader=False)
        assert state.current_step == 2 and loader_state is None


def test_a_rank_without_its_rng_file_names_the_world_size(tmp_path):
    path = save(manager(tmp_path), 2)
    other_rank = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")), rank=1)
    with pytest.raises(CheckpointError, match=r"rng_rank1.pt is missing .*\['rng_rank0.pt'\].*saved by 1 rank"):
        other_rank.load(path, FakeEngine())


def test_extra_files_the_manifest_does_not_list_are_never_read(tmp_path):
    ckpt = manager(tmp_path)
    path = save(ckpt, 2)
    marker = tmp_path / "pwned"
    torch.save({"x": _Payload(marker)}, path / "extra_planted.pt")
    _, _, extra = ckpt.load(path, FakeEngine())
    assert set(extra) == {"buffer"} and not marker.exists()


# --------------------------------------------------------------------------------------------------
# a full disk
# --------------------------------------------------------------------------------------------------
def test_full_disk_during_save_names_the_directory_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
    ckpt = manager(tmp_path)
    earlier = save(ckpt, 2)
    real_save = torch.save

    def to_full_disk(obj, f, *args, **kwargs):  # torch's own error for a full device
        return real_save(obj, "/dev/full" if str(f).endswith("dataloader.pt") else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", to_full_disk)
    with pytest.raises(CheckpointError) as err:
        save(ckpt, 4)
    message = str(err.value)
    assert f"could not write checkpoint step 4 in {tmp_path / 'ckpt'}: " in message and "GiB free" in message
    assert "iostream error" in message or "unexpected pos" in message
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest_checkpoint_status.json",
                                                                     "step_000002"]
    assert ckpt.latest() == earlier and json.loads(
        (tmp_path / "ckpt" / "latest_checkpoint_status.json").read_text())["step"] == 2


def _two_rank_save(rank: int, tmp: str) -> None:
    """One of two gloo ranks: save step 1, then step 2 with rank 1's disk full; write what happened."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=f"{tmp}/ckpt"), rank=rank)
    engine = FakeEngine(1.0, rank)
    outcome = {"first": str(ckpt.save(1, engine, GRPOSaveState(current_step=1), {"p": 1}))}
    real_save = torch.save
    if rank == 1:
        torch.save = lambda obj, f, *a, **k: real_save(obj, "/dev/full" if "rng_rank" in str(f) else f, *a, **k)
    try:
        ckpt.save(2, engine, GRPOSaveState(current_step=2), {"p": 2})
        outcome["second"] = "saved"
    except CheckpointError as err:
        outcome["second"] = str(err)
    torch.save = real_save
    dist.barrier()
    outcome["latest"] = str(ckpt.latest())
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(outcome, f)
    dist.destroy_process_group()


def test_a_failure_on_one_rank_makes_every_rank_raise_and_keeps_the_earlier_checkpoint(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_two_rank_save, args=(r, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["first"] == r1["first"] == str(tmp_path / "ckpt" / "step_000001")
    assert "could not write checkpoint step 2" in r1["second"] and "GiB free" in r1["second"]
    assert r0["second"].startswith(f"saving checkpoint step 2 in {tmp_path / 'ckpt'} failed on another rank")
    assert r0["latest"] == r1["latest"] == r0["first"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest_checkpoint_status.json", "step_000001"]
    files = json.loads((tmp_path / "ckpt" / "step_000001" / MANIFEST).read_text())["files"]
    assert {"rng_rank0.pt", "rng_rank1.pt", "ds/ds/model_states.pt", "ds/ds/model_states_rank1.pt"} <= set(files)


class _LoadRecorder(FakeEngine):
    """A FakeEngine that records whether DeepSpeed's load was reached."""

    def load_checkpoint(self, load_dir, tag, load_module_strict=True):
        self.loaded = True
        return super().load_checkpoint(load_dir, tag, load_module_strict)


def _ranks_run(tmp: str, world_size: int, action: str) -> None:
    """Run ``action`` ("save" or "load") on ``world_size`` gloo ranks; each writes rank{r}_{action}.json."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_action, args=(r, world_size, tmp, action)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * world_size


def _rank_action(rank: int, world_size: int, tmp: str, action: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous_{action}_{world_size}", rank=rank,
                            world_size=world_size)
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=f"{tmp}/ckpt"), rank=rank)
    engine = _LoadRecorder(1.0, rank)
    engine.loaded = False
    if action == "save":
        outcome = {"saved": str(ckpt.save(1, engine, GRPOSaveState(current_step=1), {"p": 1}))}
    else:
        try:
            ckpt.load(ckpt.latest(), engine)
            outcome = {"error": None}
        except CheckpointError as err:
            outcome = {"error": str(err)}
        outcome["deepspeed_load_reached"] = engine.loaded
    dist.barrier()
    with open(f"{tmp}/rank{rank}_{action}.json", "w") as f:
        json.dump(outcome, f)
    dist.destroy_process_group()


def test_resuming_two_ranks_checkpoint_on_one_rank_names_the_world_size_before_deepspeed_loads(tmp_path):
    _ranks_run(str(tmp_path), 2, "save")
    path = tmp_path / "ckpt" / "step_000001"
    assert json.loads((path / MANIFEST).read_text())["world_size"] == 2
    engine = _LoadRecorder()
    engine.loaded = False
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    with pytest.raises(CheckpointError, match=r"was saved by 2 rank\(s\) and this run has 1: resume with the same "
                                              r"number of ranks \(2: e.g. torchrun --nproc_per_node 2\)"):
        ckpt.load(ckpt.latest(), engine)
    assert not engine.loaded


@pytest.mark.slow  # its default-suite twin: two ranks' checkpoint resumed on one rank
def test_resuming_one_ranks_checkpoint_on_two_ranks_fails_alike_on_every_rank_before_deepspeed_loads(tmp_path):
    path = save(manager(tmp_path), 1)
    assert json.loads((path / MANIFEST).read_text())["world_size"] == 1
    _ranks_run(str(tmp_path), 2, "load")
    r0, r1 = (json.loads((tmp_path / f"rank{r}_load.json").read_text()) for r in range(2))
    assert r0["error"] == r1["error"] and "was saved by 1 rank(s) and this run has 2" in r0["error"]
    assert not r0["deepspeed_load_reached"] and not r1["deepspeed_load_reached"]


def test_a_checkpoint_without_a_recorded_world_size_counts_its_rng_files(tmp_path):
    path = save(manager(tmp_path), 1)
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["world_size"]  # saved before the world size was recorded
    (path / MANIFEST).write_text(json.dumps(manifest))
    _ranks_run(str(tmp_path), 2, "load")
    r0, r1 = (json.loads((tmp_path / f"rank{r}_load.json").read_text()) for r in range(2))
    assert r0["error"] == r1["error"] and "was saved by 1 rank(s) and this run has 2" in r0["error"]


def test_other_save_errors_are_raised_as_they_are_and_leave_no_tmp(tmp_path):
    ckpt = manager(tmp_path)
    engine = FakeEngine()
    engine.save_checkpoint = lambda *a, **k: (_ for _ in ()).throw(ValueError("engine broke"))
    with pytest.raises(ValueError, match="engine broke"):
        ckpt.save(1, engine, GRPOSaveState(current_step=1), {})
    assert list((tmp_path / "ckpt").iterdir()) == []


# --------------------------------------------------------------------------------------------------
# pruning, .tmp cleanup, saving a step again
# --------------------------------------------------------------------------------------------------
def test_last_k_without_a_metric(tmp_path):
    ckpt = manager(tmp_path, metric_name=None, keep_top_k=2)
    for step in range(1, 6):
        save(ckpt, step)
    assert [p.name for p in ckpt.checkpoints()] == ["step_000004", "step_000005"]


def test_top_k_by_val_reward_keeps_the_best_and_the_newest(tmp_path):
    ckpt = manager(tmp_path, metric_name="val_reward", higher_is_better=True, keep_top_k=2)
    for step, reward in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7), (5, 0.2)]:
        save(ckpt, step, val_reward=reward)
    # best two: steps 2 and 4; step 5 is the newest (what a resume needs) and stays too
    assert [p.name for p in ckpt.checkpoints()] == ["step_000002", "step_000004", "step_000005"]
    low = manager(tmp_path / "low", metric_name="val_reward", higher_is_better=False, keep_top_k=1)
    for step, reward in [(1, 0.5), (2, 0.1), (3, 0.9)]:
        save(low, step, val_reward=reward)
    assert [p.name for p in low.checkpoints()] == ["step_000002", "step_000003"]


def test_tmp_directories_are_ignored_and_cleaned(tmp_path):
    ckpt = manager(tmp_path)
    save(ckpt, 2)
    half = tmp_path / "ckpt" / "step_000003.tmp"
    (half / "ds").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_notanumber").mkdir()
    assert [p.name for p in ckpt.checkpoints()] == ["step_000002"] and ckpt.latest_step() == 2
    ckpt.clean_partial()
    assert not half.exists()


def test_saving_a_step_again_replaces_it(tmp_path):
    ckpt = manager(tmp_path)
    save(ckpt, 2)
    path = save(ckpt, 2, engine=FakeEngine(7.0))
    engine = FakeEngine()
    ckpt.load(path, engine)
    assert torch.equal(engine.weight, torch.full((4,), 7.0))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest_checkpoint_status.json", "step_000002"]


# --------------------------------------------------------------------------------------------------
# no code from checkpoints
# --------------------------------------------------------------------------------------------------
class _Payload:
    """Unpickling it creates ``marker`` (what a planted pickle would do: run any code)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _plant(path: Path, marker: Path) -> None:
    """Put a payload inside the object a file holds, keeping the rest of it."""
    obj = safe_load(path)
    obj = {**obj, "planted": _Payload(marker)} if isinstance(obj, dict) else {"value": obj, "planted": _Payload(marker)}
    torch.save(obj, path)


def test_the_payload_is_live_and_safe_load_refuses_it(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "x": _Payload(marker)}, tmp_path / "f.pt")
    with pytest.raises(CheckpointError, match=r"f.pt: refused to load: it references Python code \(io.open\)"):
        safe_load(tmp_path / "f.pt")
    assert not marker.exists()
    torch.load(tmp_path / "f.pt", weights_only=False)  # what DeepSpeed's loader would do
    assert marker.exists()


def test_use_safe_loading_refuses_universal_checkpoints():
    engine = FakeEngine()
    engine.load_universal_checkpoint = lambda: True
    with pytest.raises(CheckpointError, match="load_universal=true"):
        use_safe_loading(engine)


@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory):
    """A one-rank ZeRO-3 engine trained one step and saved with CheckpointManager; a fresh engine to load into."""
    from grpo.system import engines
    from grpo.system.dist import init_distributed
    from grpo.system.training import train_on_batch
    from grpo.config import MasterConfig
    from grpo.tasks.toy import save_tiny_model

    tmp = tmp_path_factory.mktemp("ds_ckpt")
    model_dir = save_tiny_model(str(tmp / "model"), seed=3)
    init_distributed()
    cfg = MasterConfig.model_validate({
        "policy": {"model_name": model_dir, "precision": "float32", "train_global_batch_size": 2,
                   "train_micro_batch_size": 2, "optimizer": {"lr": 1e-2},
                   "deepspeed_config": "ds_configs/zero3.json"},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 1}})
    trained = engines.build_policy_engine(cfg, 1, total_optimizer_steps=4)
    ids = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(4))
    train_on_batch(trained, [train_batch(input_ids_bt=ids, attention_mask_bt=torch.ones_like(ids))],
                           lambda lp, mb: (-lp.sum() / 12, {}))
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp / "ckpt")))
    path = ckpt.save(1, trained, GRPOSaveState(current_step=1), {"position": 1},
                     extra={"replay_buffer": {"entries": [], "num_evicted": 0}})
    weights = {n: t.clone() for n, t in _gathered(trained).items()}
    return ckpt, path, engines.build_policy_engine(cfg, 1, total_optimizer_steps=4), weights


def _gathered(engine) -> dict:
    from grpo.system.weights import iter_gathered_params

    return {n: t.clone() for bucket in iter_gathered_params(engine) for n, t in bucket}


FILE_KINDS = {
    "model states": "ds/ds/zero_pp_rank_0_mp_rank_00_model_states.pt",
    "optimizer states": "ds/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "dataloader": "dataloader.pt",
    "rng": "rng_rank0.pt",
    "extra": "extra_replay_buffer.pt",
}


def test_a_real_deepspeed_checkpoint_loads_weights_only(deepspeed_checkpoint):
    ckpt, path, fresh, weights = deepspeed_checkpoint
    assert set(FILE_KINDS.values()) <= set(json.loads((path / MANIFEST).read_text())["files"])
    state, loader_state, extra = ckpt.load(path, fresh)
    assert state.current_step == 1 and loader_state == {"position": 1} and set(extra) == {"replay_buffer"}
    for name, w in _gathered(fresh).items():
        torch.testing.assert_close(w, weights[name], atol=0, rtol=0)


@pytest.mark.parametrize("kind", list(FILE_KINDS))
def test_a_planted_pickle_in_any_file_a_resume_reads_does_not_run(deepspeed_checkpoint, tmp_path, kind):
    ckpt, path, fresh, _ = deepspeed_checkpoint
    planted = tmp_path / "ckpt" / path.name
    shutil.copytree(path, planted)
    marker = tmp_path / "pwned"
    _plant(planted / FILE_KINDS[kind], marker)
    rewrite_manifest(planted)  # the attacker fixes the manifest too
    assert CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"))).latest() == planted
    with pytest.raises(CheckpointError, match=rf"{FILE_KINDS[kind]}: refused to load: it references Python code"):
        ckpt.load(planted, fresh)
    assert not marker.exists()
