"""grpo's collectives under NCCL's rules (tests/helpers/device_rules.py), on two gloo ranks: the harness itself, then the
code paths that run collectives on GPUs (the vLLM tensor-parallel lockstep and gather, the step's counts and
flags, the run's object gathers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch


def _probe(fn) -> str:
    """'ok', or the error's type and message."""
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001  (recorded for the parent to assert)
        return f"{type(e).__name__}: {e}"


def _in_thread(fn, set_device: bool, rules) -> str:
    out: list[str] = []

    def body():
        if set_device:
            torch.cuda.set_device(0)  # recorded by the harness (no CUDA here)
        out.append(_probe(fn))

    t = threading.Thread(target=body, name="producer")
    t.start()
    t.join()
    return out[0]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    from grpo import metrics
    from grpo.system.dist import all_gather_objects, any_rank
    from grpo.system.generation.vllm import VllmGeneration
    from tests.helpers.device_rules import nccl_rules
    from tests.integration.test_generation_vllm_group import fake_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    r: dict[str, object] = {}
    with nccl_rules() as rules:
        gloo = dist.new_group([0, 1], backend="gloo")
        r["backend"] = [dist.get_backend(), dist.get_backend(gloo)]
        r["host_all_reduce"] = _probe(lambda: dist.all_reduce(torch.ones(2)))
        dev = torch.ones(2, device=rules.device)
        r["device_all_reduce"] = _probe(lambda: dist.all_reduce(dev))
        r["device_sum"] = dev.tolist()
        r["derived_all_reduce"] = _probe(lambda: dist.all_reduce(torch.stack([dev[0] * 2, dev[1]])))
        r["cuda_copy_all_gather"] = _probe(lambda: dist.all_gather_into_tensor(
            torch.empty(2, device=rules.device), torch.tensor([float(rank)]).cuda()))
        r["cpu_copy_broadcast"] = _probe(lambda: dist.broadcast(dev.cpu(), src=0))
        r["host_all_reduce_over_gloo"] = _probe(lambda: dist.all_reduce(torch.ones(2), group=gloo))
        r["object_main_thread"] = _probe(lambda: dist.all_gather_object([None, None], rank))
        r["object_thread_no_device"] = _in_thread(lambda: dist.all_gather_object([None, None], rank), False, rules)
        r["object_thread_device_set"] = _in_thread(lambda: dist.all_gather_object([None, None], rank), True, rules)
        r["object_thread_gloo"] = _in_thread(lambda: dist.all_gather_object([None, None], rank, group=gloo),
                                             False, rules)
        # grpo's own collectives
        r["any_rank"] = _probe(lambda: any_rank(rank == 1))
        r["valid_counts"] = _probe(lambda: metrics.global_valid_counts(torch.ones(2, 3), torch.ones(2)))
        r["gather_objects"] = _probe(lambda: all_gather_objects([rank]))
        # the vLLM backend with tensor_parallel_size=2: its group as the backend makes it, then the lockstep
        gen = VllmGeneration.__new__(VllmGeneration)
        gen.tp, gen.world_size = 2, 2
        tp_group = gen._make_tp_group(dist)
        gen._tp_group = tp_group
        r["lockstep_max"] = _probe(lambda: r.setdefault("lockstep_value", gen.lockstep_max(3 if rank == 0 else 1)))
        calls: list = []
        backend = fake_backend(tp_group, calls)
        r["tp_generate"] = _probe(lambda: r.setdefault("tp_outputs", backend.generate([[rank]], [10 + rank])))
        r["violations"] = len(rules.violations)
    import torch.distributed.distributed_c10d as c10d

    r["restored"] = dist.get_backend() == "gloo" and dist.all_reduce is c10d.all_reduce
    dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(r))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.helpers.e2e import free_port

    out = tmp_path_factory.mktemp("device_rules")
    torch.multiprocessing.spawn(_rank_main, args=(free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in (0, 1)]


def test_the_harness_rejects_host_tensors_on_device_groups_and_takes_device_ones(ranks):
    for r in ranks:
        assert r["backend"] == ["nccl", "gloo"]
        assert r["host_all_reduce"].startswith("DeviceRuleError: all_reduce over a group that is NCCL"), r
        assert r["device_all_reduce"] == "ok" and r["device_sum"] == [2.0, 2.0]
        assert r["derived_all_reduce"] == "ok" and r["cuda_copy_all_gather"] == "ok"
        assert r["cpu_copy_broadcast"].startswith("DeviceRuleError: broadcast"), r
        assert r["host_all_reduce_over_gloo"] == "ok"
        assert r["restored"]


def test_the_harness_checks_object_collectives_per_thread(ranks):
    for r in ranks:
        assert r["object_main_thread"] == "ok"
        assert r["object_thread_no_device"].startswith("DeviceRuleError: all_gather_object"), r
        assert "'producer', which never set its CUDA device" in r["object_thread_no_device"]
        assert r["object_thread_device_set"] == "ok" and r["object_thread_gloo"] == "ok"


def test_the_step_and_run_collectives_follow_nccl_rules(ranks):
    for r in ranks:
        assert (r["any_rank"], r["valid_counts"], r["gather_objects"]) == ("ok", "ok", "ok")


def test_vllm_tensor_parallel_lockstep_and_gather_follow_nccl_rules(ranks):
    """Bug 1 of issue 21: lockstep_max all-reduced a host tensor over a subgroup of the (NCCL) default group."""
    for rank, r in enumerate(ranks):
        assert r["lockstep_max"] == "ok", r["lockstep_max"]
        assert r["lockstep_value"] == 3
        assert r["tp_generate"] == "ok", r["tp_generate"]
        assert r["tp_outputs"] == [f"{[rank]}/{10 + rank}"]


def test_a_thread_that_calls_a_backend_without_its_device_breaks_the_rule_and_the_endpoint_batcher_keeps_it():
    """Issue 52, finding 1: the endpoint's batcher thread called the backend (colocated vLLM) without ever setting the
    CUDA device, so on local rank k >= 1 its kernels went to cuda:0. Under the rules such a call raises; the batcher
    now enters the backend's device context, and a request over the wire is answered."""
    import openai

    from grpo.config import MasterConfig
    from grpo.wings.agents.endpoint import Endpoint
    from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer
    from tests.helpers.device_rules import nccl_rules
    from tests.helpers.scripted_backend import ScriptedBackend

    cfg = MasterConfig.model_validate({"policy": {
        "model_name": "toy:tiny", "max_total_sequence_length": 64,
        "generation": {"max_new_tokens": 6, "port_range_low": 28000, "port_range_high": 28999,
                       "http_server": {"batch_window_s": 0.01, "max_wait_s": 10.0}}}})
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    with nccl_rules() as rules:
        backend = ScriptedBackend(tok, cfg.policy.generation, ["ok"])
        bare = _in_thread(lambda: backend.generate([[5]], [0]), False, rules)
        assert bare.startswith("DeviceRuleError: ScriptedBackend.generate from thread 'producer', which never set its "
                               "CUDA device"), bare
        assert _in_thread(lambda: backend.generate([[5]], [0]), True, rules) == "ok"  # torch.cuda.set_device

        def in_context():
            with backend.device_context():
                backend.generate([[5]], [0])

        assert _in_thread(in_context, False, rules) == "ok"
        ep = Endpoint(cfg, backend, tok)
        ep.start()
        try:
            client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=30)
            with ep.serving():
                answer = client.chat.completions.create(model="toy:tiny", messages=[{"role": "user", "content": "hi"}],
                                                        top_p=1.0)
        finally:
            ep.close()
        assert answer.choices[0].message.content == "ok"
        assert len(rules.violations) == 1  # the bare thread's only


# --------------------------------------------------------------------------------------------------
# Whole runs on two ranks under the rules: ZeRO-3, multi-turn rollouts, refits, checkpoints, the async producer
# --------------------------------------------------------------------------------------------------
MULTITURN = ["grpo.max_rollout_turns=3", "env.name=class", "env.env_class=tests.helpers.multiturn_envs:HintThenCheck",
             "policy.max_total_sequence_length=32", "grpo.max_num_steps=2"]


@pytest.mark.parametrize("script, extra", [
    ("train_grpo.py", ["checkpointing.save_period=1"]),
    pytest.param("train_async_grpo.py", ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"],
                 marks=pytest.mark.slow),  # the default suite runs the sync twin
], ids=["sync", "async"])
def test_two_rank_multiturn_runs_follow_nccl_rules(tmp_path, script, extra):
    """Every collective grpo calls in a 2-rank multi-turn run (ZeRO-3 engines, refits of the generation copy,
    checkpoints; in the async loop the producer thread on its gloo group) is legal on NCCL. DeepSpeed's own
    collectives are not checked (tests/helpers/device_rules.py)."""
    from tests.helpers.e2e import REPO, TINY, child_env, paths, train_rows

    log = tmp_path / "collectives.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "tests/helpers/device_rules.py", script, "--config", TINY, *MULTITURN, *extra, *paths(tmp_path)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**child_env(1), "DEVICE_RULES_LOG": str(log)})
    assert p.returncode == 0 and "DeviceRuleError" not in p.stdout + p.stderr, p.stdout[-3000:] + p.stderr[-5000:]
    assert sorted(train_rows(tmp_path)) == [1, 2]
    seen = set(log.read_text().splitlines())
    assert {"all_reduce grpo.system.dist device", "all_gather_object grpo.system.dist device"} <= seen, seen
    if "async" in script:
        assert "all_gather_object grpo.system.dist host" in seen  # the producer's own gloo group
