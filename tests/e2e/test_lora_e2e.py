"""End to end with LoRA (policy.lora, issue 22): a NeMo-RL-format recipe with ``lora_cfg.enabled: true`` trains with
the hf backend, its checkpoint holds the adapters, and both exports work from it (the merged model loads without
peft, the adapter with ``PeftModel.from_pretrained``); slow: kill -9 and resume give the uninterrupted run's losses,
and two ranks under ZeRO-3 train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.e2e import (REPO, TINY, addition_jsonl, child_env, free_port, kill_at_random_points, launcher,
                               metrics, paths, run, train_rows)

FIX = REPO / "tests" / "fixtures" / "nemo_rl"


def _recipe_cmd(tmp: Path, *extra: str) -> list[str]:
    small = [  # the model, the data and the sizes, in NeMo-RL's key names; LoRA as a NeMo-RL user turns it on
        "policy.model_name=toy:demo", "+policy.tokenizer.chat_template=null", "policy.precision=float32",
        "policy.generation.backend=hf", "policy.max_total_sequence_length=16", "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8", "policy.generation_batch_size=16", "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", "grpo.max_val_samples=4", "grpo.val_batch_size=4",
        "cluster.gpus_per_node=1", "env.math.num_workers=1", "data.default.prompt_file=null",
        "data.train.dataset_name=ResponseDataset", f"+data.train.data_path={addition_jsonl(tmp)}",
        "policy.dtensor_cfg.lora_cfg.enabled=true", "++policy.dtensor_cfg.lora_cfg.alpha=16",
        "++policy.dtensor_cfg.lora_cfg.use_triton=true", "checkpointing.save_period=2",
        f"logger.log_dir={tmp}/logs", f"checkpointing.checkpoint_dir={tmp}/ckpt",
    ]
    return [sys.executable, "train_grpo.py", "--config", str(FIX / "base_math.yaml"), *small, *extra]


def test_nemo_rl_recipe_with_lora_trains_with_the_base_as_reference_and_checkpoints_the_adapters(tmp_path):
    p = run(_recipe_cmd(tmp_path), timeout=300)
    assert "translated: policy.dtensor_cfg.lora_cfg" in p.stdout and "reference AdaptersOff" in p.stdout, p.stdout[-3000:]
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    # B starts at zero: at step 1 the policy IS the base (the reference), KL 0; after a step it has moved off it
    assert abs(rows[1]["train/kl_penalty"]) < 1e-6 and rows[2]["train/kl_penalty"] > 0, rows
    ds = tmp_path / "ckpt" / "step_000002" / "ds"
    assert sum(f.stat().st_size for f in ds.rglob("*.pt")) < 2_000_000  # adapters (toy:demo itself is ~ 10 MB)
    hf_final = tmp_path / "ckpt" / "hf_final"  # the run's own export: the merged model
    assert (hf_final / "model.safetensors").exists() and not (hf_final / "adapter_config.json").exists()


@pytest.mark.slow
def test_export_adapter_from_the_command_line_loads_with_peft_and_matches_the_merged_export(tmp_path):
    """The fast twins: tests/unit/test_lora.py's export tests (the same functions, without the command line)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run(_recipe_cmd(tmp_path), timeout=300)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    run(_recipe_cmd(tmp_path, "--export-adapter", str(adapter), "--export-hf", str(merged)), timeout=300)
    base = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)  # a plain model, no peft
    assert not any("lora" in n for n, _ in base.named_parameters())
    config = json.loads((adapter / "adapter_config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(plain, str(adapter)).eval()
    ids = torch.tensor([[1, 5, 9, 12, 4, 7]])
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5, rtol=0)


def _tiny_lora(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "train_grpo.py", "--config", TINY,
            *paths(tmp, "policy.lora.enabled=true", "policy.lora.dim=4", *extra)]


@pytest.mark.slow
def test_lora_kill_9_then_rerun_ends_like_an_uninterrupted_run(tmp_path):
    """kill -9 at random moments (steps, saves), rerun each time: the last steps' losses equal an uninterrupted LoRA
    run's within 1e-5 (the fast twin: tests/unit/test_lora.py's checkpoint round trip)."""
    extra = ("grpo.max_num_steps=6", "checkpointing.save_period=1")
    full = tmp_path / "full"
    run(_tiny_lora(full, *extra))
    killed = tmp_path / "killed"
    kill_at_random_points(_tiny_lora(killed, *extra), int(os.environ.get("KILL_POINTS", "3")), 20.0,
                          int(os.environ.get("KILL_SEED", "0")))
    run(_tiny_lora(killed, *extra), timeout=600)
    a, b = train_rows(full), train_rows(killed)
    assert [r["step"] for r in metrics(killed) if "train/loss" in r] == list(range(1, 7))
    for step in (5, 6):
        assert abs(a[step]["train/loss"] - b[step]["train/loss"]) < 1e-5, (step, a[step], b[step])


@pytest.mark.slow
def test_lora_on_two_ranks_under_zero3_trains_and_resumes(tmp_path):
    """Two ranks (ZeRO-3, the several-rank default; the hf copy refitted with the adapters only), then a resume."""
    def cmd(steps: int) -> list[str]:
        return [*launcher("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "train_grpo.py",
                "--config", TINY, *paths(tmp_path, "policy.lora.enabled=true", f"grpo.max_num_steps={steps}",
                                         "checkpointing.save_period=1")]

    run(cmd(2), timeout=600, threads=1)
    run(cmd(3), timeout=600, threads=1)
    assert sorted(train_rows(tmp_path)) == [1, 2, 3]


@pytest.mark.slow
def test_lora_trains_in_the_async_loop(tmp_path):
    """train_async_grpo.py: the generation thread's copy is a peft model fed the adapters each step (fast twin: the
    hf copy's adapter-only refit in tests/unit/test_lora.py)."""
    run([sys.executable, "train_async_grpo.py", "--config", str(REPO / "configs" / "cpu_demo_async.yaml"),
         *paths(tmp_path, "policy.lora.enabled=true", "grpo.max_num_steps=3", "grpo.val_period=0",
                "grpo.val_at_start=false", "grpo.val_at_end=false", "logger.progress_bar=false")], timeout=600)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3] and abs(rows[1]["train/token_mult_prob_error"] - 1.0) < 1e-4


@pytest.mark.slow
def test_an_export_during_a_save_leaves_the_run_training_and_its_checkpoint_intact(tmp_path):
    """The trainer's save of step 2 is paused halfway (tests/helpers/paused_save.py, a file event, not a sleep): an
    export then is refused in one line (the live run holds the directory) and deletes nothing; the run goes on to
    the end with every checkpoint intact. After it, an export with another policy.lora.alpha is refused naming the
    key. (The fast twins: tests/integration/test_export_guard.py.)"""
    from grpo.config import CheckpointingConfig
    from grpo.system.checkpoint import CheckpointManager

    env = {**child_env(), "PAUSE_DIR": str(tmp_path), "PAUSE_STEP": "2"}
    trainer = subprocess.Popen([sys.executable, "tests/helpers/paused_save.py",
                                *_tiny_lora(tmp_path, "grpo.max_num_steps=3", "checkpointing.save_period=1",
                                           "checkpointing.keep_top_k=3")[1:]],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "save_paused").exists():
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[0][-3000:]
            time.sleep(0.2)
        saving = Path((tmp_path / "save_paused").read_text())
        p = run(_tiny_lora(tmp_path, "--export-hf", str(tmp_path / "merged")), check=False)
        error = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert p.returncode == 1 and len(error) == 1 and "is in use by a running run" in error[0], p.stderr[-3000:]
        assert saving.is_dir() and (saving / "rng_rank0.pt").exists() and not (tmp_path / "merged").exists()
    finally:
        (tmp_path / "save_go").touch()
        out = trainer.communicate(timeout=600)[0]
    assert trainer.returncode == 0, out[-3000:]
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    assert [c.name for c in ckpt.checkpoints()] == ["step_000001", "step_000002", "step_000003"]
    assert all(ckpt.verify(c) is None for c in ckpt.checkpoints())

    p = run(_tiny_lora(tmp_path, "policy.lora.alpha=64", "--export-hf", str(tmp_path / "merged")), check=False)
    assert p.returncode == 1 and "policy.lora.alpha: 32.0 -> 64.0" in p.stderr and not (tmp_path / "merged").exists()


@pytest.mark.slow
def test_a_zero3_resume_with_another_lora_rank_is_one_line_naming_policy_lora(tmp_path):
    """Two ranks under ZeRO-3 (issue 37: "The size of tensor a (16384) must match..."): a resume with another
    policy.lora.dim, even with checkpointing.allow_config_change=true, stops before DeepSpeed loads, with one error
    line naming the key and both values (the fast one-rank twins: tests/unit/test_lora.py)."""
    def cmd(*extra: str) -> list[str]:
        return [*launcher("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "train_grpo.py",
                "--config", TINY, *paths(tmp_path, "policy.lora.enabled=true", "checkpointing.save_period=1", *extra)]

    run(cmd("grpo.max_num_steps=1", "policy.lora.dim=4"), timeout=600, threads=1)
    p = run(cmd("grpo.max_num_steps=2", "policy.lora.dim=8", "checkpointing.allow_config_change=true"), timeout=600,
            threads=1, check=False)
    errors = sorted({line for line in p.stderr.splitlines() if line.startswith("error:")})
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-4000:]
    assert "policy.lora.dim=4 in the checkpoint, 8 in this run" in errors[0], errors
    assert "size mismatch" not in p.stderr and "must match" not in p.stderr  # (torchrun prints its own traceback)

    # --export-adapter of that two-rank ZeRO-3 checkpoint from one process: the advice names the launch that works
    export = ["train_grpo.py", "--config", TINY, *paths(tmp_path, "policy.lora.enabled=true", "policy.lora.dim=4"),
              "--export-adapter", str(tmp_path / "adapter")]
    p = run([sys.executable, *export], check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and len(errors) == 1 and "torchrun --nproc_per_node 2" in errors[0], p.stderr[-3000:]
    assert "--export-hf, then" not in errors[0]
    run([*launcher("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), *export], timeout=600,
        threads=1)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
