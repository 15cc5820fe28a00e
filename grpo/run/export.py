"""``--export-hf`` / ``--export-adapter``: claim the checkpoint directory, load its newest checkpoint into the
built policy, write the weights (consolidated HF safetensors, or the LoRA adapter) and end the run there."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from grpo.run.cli import export_flag
from grpo.config import MasterConfig
from grpo.run.run import RunError, RunLocks, claim_on_rank0

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from grpo.system.checkpoint import CheckpointManager
    from grpo.system.rundir import RunLock


def claim_export(cfg: MasterConfig, rank: int, args: argparse.Namespace) -> tuple[list[RunLock], str | None]:
    """``--export-hf`` / ``--export-adapter``: rank 0 locks the checkpoint directory (refused while its run is live)
    and checks the command's weight settings against the run's fingerprint (`grpo.system.rundir.claim_for_export`),
    before any model is built; ``(locks, run_id)`` on every rank, or every rank raises `RunError`. A collective."""
    from grpo.system.rundir import claim_for_export

    return claim_on_rank0(rank, lambda: claim_for_export(
        cfg.checkpointing.checkpoint_dir, cfg.model_dump(mode="json"), export_flag(args),
        allow_change=args.export_allow_config_change))


def export_checkpoint(cfg: MasterConfig, args: argparse.Namespace, ckpt: CheckpointManager, policy: DeepSpeedEngine,
                      tokenizer: PreTrainedTokenizerBase, locks: list[RunLock], run_id: str | None) -> None:
    """Load the newest checkpoint of ``checkpointing.checkpoint_dir`` into ``policy`` and write what the command
    asks for: ``--export-hf`` the consolidated HF weights (a LoRA run: the merged model), ``--export-adapter`` the
    adapter in peft's layout; the directory's locks are released once written. Deletes nothing (the ``.tmp`` of a
    dead run's save is the next run's to clean). A checkpoint that cannot be read or an export that cannot be
    written raises `RunError`."""
    from grpo.system import weights
    from grpo.system.checkpoint import CheckpointError
    from grpo.system.weights import ExportError

    flag = export_flag(args)
    try:
        latest = ckpt.latest() if cfg.checkpointing.enabled and cfg.checkpointing.resume else None
        if latest is None:
            raise RunError(f"{flag}: no checkpoint in {cfg.checkpointing.checkpoint_dir}")
        ckpt.load(latest, policy, export_flag=flag)
        try:
            overwrite = args.export_hf_overwrite
            if args.export_hf is not None:  # with LoRA: the merged model
                weights.export_hf(policy, args.export_hf, tokenizer, overwrite=overwrite, run_id=run_id)
            if args.export_adapter is not None:
                weights.export_adapter(policy, args.export_adapter, overwrite=overwrite, run_id=run_id)
        finally:
            RunLocks(locks).close()
    except (CheckpointError, ExportError) as err:
        raise RunError(str(err)) from err
