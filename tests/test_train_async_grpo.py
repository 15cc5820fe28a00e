"""End-to-end tests of train_async_grpo.py on the CPU: real DeepSpeed ZeRO-3 engines (gloo), tiny
models, a real generation thread. Each run is a subprocess of tests/configs/tiny.yaml + async."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "tests" / "configs" / "tiny.yaml")
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
PROMPTS_PER_STEP = 4  # tiny.yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int = 2) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
               OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    return env


def run(cmd: list[str], timeout: int = 300, threads: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=REPO, env=child_env(threads), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nSTDOUT:\n{p.stdout[-4000:]}\n"
                             f"STDERR:\n{p.stderr[-6000:]}")
    return p


def paths(tmp: Path) -> list[str]:
    return [f"logger.log_dir={tmp}/logs", f"checkpointing.checkpoint_dir={tmp}/ckpt"]


def async_train(tmp: Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "train_async_grpo.py", "--config", TINY, *ASYNC, *paths(tmp), *extra], **kw)


def train_rows(tmp: Path) -> dict[int, dict]:
    with open(tmp / "logs" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r for r in rows if "train/loss" in r}


def trained_prompts(tmp: Path) -> list[list[int]]:
    rows = train_rows(tmp)
    return [rows[s]["train/prompt_indices"] for s in sorted(rows)]


def loader_batches(n_prompts: int, steps: int, seed: int = 42) -> list[list[int]]:
    """The prompt batches the StatefulDataLoader yields (no prompt filtered: position == row index)."""
    from grpo.data import build_dataloader

    loader = build_dataloader([{"index": i} for i in range(n_prompts)], PROMPTS_PER_STEP, shuffle=True, seed=seed)
    it = iter(loader)
    return [[row["index"] for row in next(it)] for _ in range(steps)]


# ---------------------------------------------------------------------------------------------
# Configs this script cannot run fail before torch is imported
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    ([], "grpo.async_grpo.enabled=true"),                                                   # sync config
    (ASYNC + ["policy.generation.backend=vllm"], "not supported by train_async_grpo.py"),  # vLLM
    (["grpo.async_grpo.enabled=true"], "use_importance_sampling_correction=true"),         # the config's check
])
def test_unsupported_configs_exit_2_before_torch_loads(tmp_path, overrides, expected):
    code = ("import sys, train_async_grpo\n"
            "try:\n    train_async_grpo.load_run_config(sys.argv[1:])\n"
            "except SystemExit as e:\n"
            "    print('EXIT', e.code, 'torch' in sys.modules)\n")
    p = run([sys.executable, "-c", code, "--config", TINY, *overrides], timeout=60)
    assert "EXIT 2 False" in p.stdout, p.stdout + p.stderr
    assert expected in p.stderr


# ---------------------------------------------------------------------------------------------
# One rank: metrics, sync parity, checkpoint contents
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    async_train(tmp, "grpo.max_num_steps=3", "grpo.val_at_end=true")
    return tmp


def test_async_run_logs_async_metrics(one_rank):
    rows = train_rows(one_rank)
    assert sorted(rows) == [1, 2, 3]
    for key in ("train/loss", "train/reward_mean", "train/kl", "train/token_mult_prob_error", "train/tokens_per_s",
                "timing/step_s", "timing/generate_s", "timing/train_s", "timing/refit_s", "async/trajectory_age_max",
                "async/buffer_size", "async/trainer_wait_s", "async/generation_busy_frac", "async/evicted_groups",
                "async/generation_failures", "train/prompt_indices"):
        assert key in rows[3], (key, sorted(rows[3]))
    for r in rows.values():
        assert isinstance(r["async/trajectory_age_hist"], list) and len(r["async/trajectory_age_hist"]) == 4
        assert r["async/trajectory_age_max"] == max(r["async/trajectory_age_hist"]) <= 1
        assert 0.0 <= r["async/generation_busy_frac"] <= 1.0
    assert rows[1]["async/trajectory_age_hist"] == [0, 0, 0, 0]  # step 1: generated by the initial weights
    # step 1 is on-policy: generation and training logprobs agree (fp32, same weights)
    assert abs(rows[1]["train/token_mult_prob_error"] - 1.0) < 1e-3
    assert trained_prompts(one_rank) == loader_batches(64, 3)
    with open(one_rank / "logs" / "metrics.jsonl") as f:
        val = [json.loads(line) for line in f if '"val/reward_mean"' in line]
    assert val and val[-1]["step"] == 3


def test_step_one_equals_the_synchronous_step_one(one_rank, tmp_path):
    """Same prompts, same per-sample seeds, same (initial) weights: the first step is the sync one."""
    run([sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp_path), "grpo.max_num_steps=1",
         "checkpointing.enabled=false", "loss_fn.use_importance_sampling_correction=true"])
    a, s = train_rows(one_rank)[1], train_rows(tmp_path)[1]
    assert a["train/reward_mean"] == s["train/reward_mean"]
    assert a["train/num_completion_tokens"] == s["train/num_completion_tokens"]
    assert abs(a["train/loss"] - s["train/loss"]) < 1e-5, (a["train/loss"], s["train/loss"])


def test_checkpoint_holds_the_replay_buffer_loadable_weights_only(one_rank):
    ckpt = one_rank / "ckpt" / "step_000002"
    state = torch.load(ckpt / "extra_replay_buffer.pt", weights_only=True)
    assert set(state) >= {"entries", "num_evicted"}
    for e in state["entries"]:  # whatever the thread had buffered past step 2
        assert e["target_version"] >= 3 and len(e["group"]["outputs"]) == 4
    assert (ckpt / "dataloader.pt").exists()


# ---------------------------------------------------------------------------------------------
# Bounded staleness and overlap, with random rollout times
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def delayed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("delayed")
    async_train(tmp, "grpo.max_num_steps=10", "grpo.async_grpo.max_trajectory_age_steps=2", "env.name=function",
                "env.reward_fn=tests.async_reward_fns:random_delay_arithmetic", "checkpointing.enabled=false",
                timeout=400)
    return train_rows(tmp)


def test_no_trained_group_is_older_than_the_bound_nor_trained_twice(delayed_run):
    rows = delayed_run
    assert sorted(rows) == list(range(1, 11))
    ages = [a for s in rows for a in rows[s]["async/trajectory_age_hist"]]
    assert max(ages) <= 2 and rows[10]["async/evicted_groups"] == 0
    assert max(ages) == 2  # the thread ran ahead of the trainer up to the bound
    prompts = [rows[s]["train/prompt_indices"] for s in sorted(rows)]
    flat = [i for batch in prompts for i in batch]
    assert len(flat) == len(set(flat)) == 40  # each prompt group trained once
    assert prompts == loader_batches(64, 10)  # in the data loader's order


def test_generation_for_the_next_step_overlaps_training(delayed_run):
    rows = delayed_run
    overlap = [s for s in range(1, 10) if rows[s + 1]["async/gen_start_time"] < rows[s]["async/train_end_time"]]
    # prompt batch 2 starts as soon as batch 1 is in the deque, while step 1 trains
    assert 1 in overlap, [(rows[s]["async/gen_start_time"], rows[s]["async/train_end_time"]) for s in rows]
    assert len(overlap) >= 5, overlap


# ---------------------------------------------------------------------------------------------
# Resume: the same prompts in the same order, with the deque restored or regenerated
# ---------------------------------------------------------------------------------------------
RESUME = ["grpo.max_num_steps=4", "checkpointing.save_period=2", "grpo.val_period=2",
          "grpo.async_grpo.max_trajectory_age_steps=2"]
STOP_AT_2 = ["grpo.stop_at_validation_metric=reward_mean", "grpo.stop_at_validation_threshold=-1"]


@pytest.fixture(scope="module")
def stopped_at_step_2(tmp_path_factory):
    """A run of 4 steps stopped after step 2 (an early stop that always fires), checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("stopped")
    p = async_train(tmp, *RESUME, *STOP_AT_2)
    assert "stopping" in p.stdout and sorted(train_rows(tmp)) == [1, 2]
    return tmp


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    async_train(tmp, *RESUME)
    return trained_prompts(tmp)


@pytest.mark.parametrize("load_replay_buffer", [True, False])
def test_resume_trains_the_same_prompts_as_an_uninterrupted_run(stopped_at_step_2, uninterrupted, tmp_path,
                                                                  load_replay_buffer):
    part = tmp_path / "part"
    shutil.copytree(stopped_at_step_2, part)
    p = async_train(part, *RESUME, f"checkpointing.load_replay_buffer={str(load_replay_buffer).lower()}")
    out = p.stdout + p.stderr
    assert "resumed from" in out and "step 2" in out
    buffered = torch.load(part / "ckpt" / "step_000002" / "extra_replay_buffer.pt", weights_only=True)["entries"]
    if load_replay_buffer:
        assert f"{len(buffered)} replay groups restored" in out and len(buffered) >= PROMPTS_PER_STEP
        # step 3 trained the restored groups themselves, not a regeneration
        step3 = [e["group"] for e in buffered if e["target_version"] == 3]
        rewards = [r for grp in step3 for r in grp["rewards"]]
        assert train_rows(part)[3]["train/reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-7)
    else:
        assert "0 replay groups restored" in out
    assert trained_prompts(part) == uninterrupted == loader_batches(64, 4)


# ---------------------------------------------------------------------------------------------
# Generation failures: tolerated below the limit, a clean stop and a resumable checkpoint above it
# ---------------------------------------------------------------------------------------------
LONG = "1+1+1+1+1+1+1+1+1="  # 18 tokens > policy.max_total_sequence_length=16: generation raises


@pytest.fixture
def failing_data(tmp_path):
    """40 rows, unshuffled; prompt batches 1 and 3 (rows 5 and 13) hold a prompt too long to generate."""
    rows = [{"input": f"{i % 10}+{i // 10}=", "output": str(i % 10 + i // 10)} for i in range(40)]
    rows[5] = rows[13] = {"input": LONG, "output": "9"}
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    val.write_text("\n".join(json.dumps(r) for r in rows[:4]) + "\n")
    return [f"data.train_data_path={train}", f"data.val_data_path={val}", "data.shuffle=false",
            "grpo.max_num_steps=4", "checkpointing.save_period=2"]


GOOD_BATCHES = [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19], [20, 21, 22, 23]]  # batches 0, 2, 4, 5


def test_generation_failures_are_tolerated_up_to_the_limit_then_stop_cleanly_and_resume(tmp_path, failing_data):
    # Limit 1: batch 1 fails and is skipped (step 2 trains batch 2); batch 3 is the failure too many.
    p = async_train(tmp_path, *failing_data, "grpo.async_grpo.max_generation_failures=1", check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "generation failure 1 of 1 tolerated (step 2)" in p.stdout, p.stdout[-3000:]
    assert "2 generation failures > grpo.async_grpo.max_generation_failures=1" in p.stderr, p.stderr[-3000:]
    assert "tokens, leaving no room under policy.max_total_sequence_length=16" in p.stderr
    assert "rerun the same command to resume" in p.stderr
    assert trained_prompts(tmp_path) == GOOD_BATCHES[:2]
    assert train_rows(tmp_path)[2]["async/generation_failures"] in (1, 2)  # counted when they happen
    assert (tmp_path / "ckpt" / "step_000002" / "train_state.json").exists()
    # Resume with room for more failures: batch 3 fails again and is skipped; nothing else changes.
    p = async_train(tmp_path, *failing_data, "grpo.async_grpo.max_generation_failures=5")
    assert "resumed from" in p.stdout + p.stderr
    assert trained_prompts(tmp_path) == GOOD_BATCHES
    assert train_rows(tmp_path)[4]["async/generation_failures"] == 1


# ---------------------------------------------------------------------------------------------
# Two ranks: each rank's generation thread gathers over its own gloo group
# ---------------------------------------------------------------------------------------------
def test_two_ranks_train_the_same_groups_as_one(one_rank, tmp_path):
    """Also with in-flight weight updates between chunks of 4 samples (2 per rank and prompt batch)."""
    run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "train_async_grpo.py", "--config",
         TINY, *ASYNC, *paths(tmp_path), "grpo.max_num_steps=3", "checkpointing.enabled=false",
         "grpo.async_grpo.in_flight_weight_updates=true", "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true",
         "policy.generation_batch_size=4"], threads=1)
    one, two = train_rows(one_rank), train_rows(tmp_path)
    assert trained_prompts(tmp_path) == trained_prompts(one_rank)
    assert two[1]["train/reward_mean"] == one[1]["train/reward_mean"]  # step 1: same weights, same seeds
    assert abs(two[1]["train/loss"] - one[1]["train/loss"]) < 1e-5
    assert all(max(r["async/trajectory_age_hist"]) <= 1 for r in two.values())


# ---------------------------------------------------------------------------------------------
# Learning: the async CPU demo improves validation reward like the sync one
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_async_cpu_demo_raises_validation_reward(tmp_path):
    run([sys.executable, "train_async_grpo.py", "--config", str(REPO / "configs" / "cpu_demo_async.yaml"),
         *paths(tmp_path), "grpo.max_num_steps=60", "grpo.val_period=20", "checkpointing.enabled=false"],
        timeout=3600)
    with open(tmp_path / "logs" / "metrics.jsonl") as f:
        val = {r["step"]: r["val/reward_mean"] for r in map(json.loads, f) if "val/reward_mean" in r}
    print("validation reward by step:", val)
    assert val[60] > val[0] + 0.1, val
