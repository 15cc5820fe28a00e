"""``--export-hf`` / ``--export-adapter`` from a run's checkpoints (issue 37), through `grpo.run.run_setup.setup` in this process:
the export command's weight settings must be the run's (a changed ``policy.lora.alpha`` would merge the adapters
with another scale and exit 0), a live run's directory is refused at once and left as it is, and an export deletes
nothing (a ``step_N.tmp`` is a save in progress or the next run's to clean). The same with a real trainer paused
mid-save: tests/e2e/test_lora_e2e.py (slow)."""

from __future__ import annotations

import shutil

import pytest

from grpo.run.run import RunError
from grpo.run.run_setup import setup
from tests.helpers.e2e import TINY
from tests.unit.test_rundir import _lock_in_child


def _overrides(tmp, model_dir, *extra) -> list[str]:
    return [f"policy.model_name={model_dir}", f"logger.log_dir={tmp}/logs", f"checkpointing.checkpoint_dir={tmp}/ckpt",
            "policy.lora.enabled=true", "policy.lora.dim=4", *extra]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A LoRA run's directory as the trainer leaves it: fingerprint, one checkpoint (alpha 32, the default)."""
    from grpo.config.load import load_config
    from grpo.system.checkpoint import CheckpointManager, GRPOSaveState
    from grpo.system.dist import init_distributed
    from grpo.system.engines import build_policy_engine
    from grpo.system.rundir import claim_run_dirs, record_run_dirs

    init_distributed()
    tmp = tmp_path_factory.mktemp("run")
    cfg = load_config(TINY, _overrides(tmp, tiny_model_dir))
    given = cfg.model_dump(mode="json")
    locks, run_id = claim_run_dirs(cfg.checkpointing.checkpoint_dir, cfg.logger.log_dir, given, resume=True)
    record_run_dirs(cfg.checkpointing.checkpoint_dir, cfg.logger.log_dir, given, run_id)
    engine = build_policy_engine(cfg, 1, total_optimizer_steps=4)
    CheckpointManager(cfg.checkpointing).save(1, engine, GRPOSaveState(current_step=1), dataloader_state={"x": 1})
    for lock in locks:
        lock.release()
    return tmp


@pytest.fixture
def run_dir(trained, tmp_path):
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _export(tmp, model_dir, *extra):
    return setup(["--config", TINY, *_overrides(tmp, model_dir, *extra)], TINY, asynchronous=False)


def test_an_export_with_another_lora_alpha_is_refused_naming_the_key(run_dir, tiny_model_dir):
    out = run_dir / "merged"
    for extra in ([], ["--export-allow-config-change"]):  # the adapters' settings are never overridden
        with pytest.raises(RunError, match=r"policy\.lora\.alpha: 32\.0 -> 64\.0") as err:
            _export(run_dir, tiny_model_dir, "policy.lora.alpha=64", "--export-hf", str(out), *extra)
        assert "\n" not in str(err.value) and not out.exists()


def test_an_export_while_the_run_holds_its_directory_is_refused_and_touches_nothing(run_dir, tiny_model_dir):
    saving = run_dir / "ckpt" / "step_000002.tmp"  # the live run's save in progress
    (saving / "ds").mkdir(parents=True)
    (saving / "ds" / "part.pt").write_bytes(b"x" * 10)
    holder = _lock_in_child(run_dir / "ckpt", hold=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunError, match=rf"--export-adapter: .* is in use by a running run \(PID {holder.pid} "):
            _export(run_dir, tiny_model_dir, "--export-adapter", str(run_dir / "adapter"))
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert (saving / "ds" / "part.pt").read_bytes() == b"x" * 10 and not (run_dir / "adapter").exists()


def test_an_export_deletes_no_partial_save_and_releases_the_lock(run_dir, tiny_model_dir):
    from grpo.system.rundir import RunLock

    left = run_dir / "ckpt" / "step_000002.tmp"  # a killed run's save: the next run cleans it, not an export
    left.mkdir()
    assert _export(run_dir, tiny_model_dir, "--export-adapter", str(run_dir / "adapter")) is None
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists() and left.is_dir()
    RunLock(run_dir / "ckpt").release()  # the export let go of the directory


def test_a_resume_refused_after_the_claim_leaves_the_run_fingerprint_as_it_was(run_dir, tiny_model_dir):
    """``allow_config_change`` lets the claim pass, then the checkpoint refuses other LoRA settings: the fingerprint
    must still be the run's (else the run's own config would be refused next time, as 'another config')."""
    from grpo.system.rundir import FINGERPRINT_FILE

    before = {d: (run_dir / d / FINGERPRINT_FILE).read_bytes() for d in ("ckpt", "logs")}
    with pytest.raises(RunError, match=r"other LoRA settings"):
        _export(run_dir, tiny_model_dir, "policy.lora.dim=8", "checkpointing.allow_config_change=true")
    assert {d: (run_dir / d / FINGERPRINT_FILE).read_bytes() for d in ("ckpt", "logs")} == before
