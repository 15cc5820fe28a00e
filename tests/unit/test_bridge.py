"""Generation on ranks of its own (policy.generation.colocated.enabled=false): the rank layout, the config's rules
and the bridge between trainer rank 0 and a generation rank (two real gloo processes: objects, a weight broadcast,
a peer that dies, a peer that hangs)."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from grpo.config import GenerationConfig, MasterConfig, generation_ranks, generation_split_problem
from grpo.system.bridge import Bridge, BridgeError, from_bytes_tensor, to_bytes_tensor
from grpo.system.dist import Layout, split_ranks
from grpo.system.generation.base import GenerationOutput
from grpo.system.generation.remote import bucket_specs, engine_shares
from tests.helpers.e2e import REPO, child_env, free_port


def non_colocated(**resources) -> dict:
    return {"policy": {"generation": {"colocated": {"enabled": False, "resources": resources}}}}


# ---------------------------------------------------------------- layout and config arithmetic
def test_the_last_ranks_generate_and_each_side_counts_from_zero():
    layout = [split_ranks(r, 8, 3) for r in range(8)]
    assert layout[:5] == [("train", r, 5) for r in range(5)]
    assert layout[5:] == [("generate", r, 3) for r in range(3)]
    assert Layout("train", 0, 5, 0, 8, 3).bridge_rank == 0
    assert Layout("train", 2, 5, 2, 8, 3).bridge_rank is None
    assert Layout("generate", 1, 3, 6, 8, 3).bridge_rank == 2
    with pytest.raises(ValueError, match="leave none to train"):
        split_ranks(0, 2, 2)


def test_generation_ranks_follow_nemo_rl_resources():
    assert generation_ranks(GenerationConfig()) == 0
    assert generation_ranks(GenerationConfig(colocated={"enabled": False, "resources": {"gpus_per_node": 4}})) == 4
    two_nodes = GenerationConfig(colocated={"enabled": False, "resources": {"gpus_per_node": 8, "num_nodes": 2}})
    assert generation_ranks(two_nodes) == 16
    assert generation_split_problem(two_nodes, 24) is None
    assert "leave none to train" in generation_split_problem(two_nodes, 16)


def test_requests_split_over_engines_and_only_group_leaders_receive():
    assert engine_shares(6, 2, 1) == [slice(0, 3), slice(3, 6)]
    shares = engine_shares(5, 4, 2)
    assert [s.stop - s.start for s in shares] == [3, 0, 2, 0]
    assert engine_shares(0, 1, 1) == [slice(0, 0)]


@pytest.mark.parametrize("overrides, expected", [
    (non_colocated(), "resources.gpus_per_node=None"),
    ({**non_colocated(gpus_per_node=8), "cluster": {"gpus_per_node": 8, "num_nodes": 1}},
     "expected < cluster.gpus_per_node=8"),
    ({**non_colocated(gpus_per_node=4), "cluster": {"gpus_per_node": 8, "num_nodes": 2}},
     "resources.num_nodes=None with cluster.num_nodes=2"),
    ({**non_colocated(gpus_per_node=4, num_nodes=1), "cluster": {"gpus_per_node": 8, "num_nodes": 2}},
     "expected cluster.gpus_per_node=8"),
    ({**non_colocated(gpus_per_node=8, num_nodes=2), "cluster": {"gpus_per_node": 8, "num_nodes": 2}},
     "at least one node must train"),
])
def test_non_colocated_resources_that_cannot_work_fail_at_load(overrides, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        MasterConfig.model_validate(overrides)


def test_tensor_parallel_size_must_divide_the_generation_ranks():
    cfg = non_colocated(gpus_per_node=3)
    cfg["policy"]["generation"].update(backend="vllm", vllm_cfg={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size=2: expected a divisor of the 3 generation ranks"):
        MasterConfig.model_validate(cfg)


def test_async_vllm_is_allowed_exactly_when_not_colocated():
    base = {"grpo": {"async_grpo": {"enabled": True}}, "loss_fn": {"use_importance_sampling_correction": True}}
    colocated = {**base, "policy": {"generation": {"backend": "vllm"}}}
    with pytest.raises(ValueError, match="needs policy.generation.colocated.enabled=false"):
        MasterConfig.model_validate(colocated)
    ok = {**base, "policy": {"generation": {"backend": "vllm", "colocated": {
        "enabled": False, "resources": {"gpus_per_node": 1}}}}}
    assert not MasterConfig.model_validate(ok).policy.generation.colocated.enabled


def test_lora_is_refused_on_generation_ranks():
    cfg = non_colocated(gpus_per_node=1)
    cfg["policy"]["lora"] = {"enabled": True}
    with pytest.raises(ValueError, match="policy.lora.enabled=true with policy.generation.colocated.enabled=false"):
        MasterConfig.model_validate(cfg)


# ---------------------------------------------------------------- the bridge, two real processes
def test_objects_round_trip_through_uint8_tensors():
    obj = {"prompts": [[1, 2, 3]], "seeds": [2**62], "text": "é"}
    assert from_bytes_tensor(to_bytes_tensor(obj)) == obj
    assert bucket_specs([("a.weight", torch.zeros(2, 5, dtype=torch.bfloat16))]) == [("a.weight", (2, 5), "bfloat16")]


def _peer(mode: str):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.bridge_peer", str(port), mode], cwd=REPO,
                            env=child_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return store, proc


def test_objects_and_a_weight_broadcast_reach_the_generation_rank():
    store, proc = _peer("echo")
    try:
        bridge = Bridge(store, 0, 2, timeout_s=60)
        bridge.send(("generate", [[5, 6]]), 1)
        assert bridge.recv(1) == {"echo": ("generate", [[5, 6]])}
        weights = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        bridge.broadcast(weights)
        assert bridge.recv(1) == float(weights.sum())
        bridge.send("bye", 1)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        proc.kill()


def test_a_generation_rank_that_dies_is_named_and_the_bridge_stays_failed():
    store, proc = _peer("die")
    try:
        bridge = Bridge(store, 0, 2, timeout_s=60)
        bridge.send("hello", 1)
        with pytest.raises(BridgeError, match="generation rank 0 is gone"):
            bridge.recv(1)
        with pytest.raises(BridgeError, match="generation rank 0 is gone"):  # every later transfer, at once
            bridge.send("more", 1)
    finally:
        proc.kill()


def test_a_generation_rank_that_hangs_times_out_naming_it():
    store, proc = _peer("hang")
    try:
        bridge = Bridge(store, 0, 2, timeout_s=60)
        bridge.send("hello", 1)
        with pytest.raises(BridgeError, match="no answer from generation rank 0 within 2 s"):
            bridge.recv(1, timeout_s=2)
    finally:
        proc.kill()


def _loader(bridge: Bridge):
    """Trainer 0's side of a weight load (`RemoteGeneration.load_weights`) over ``bridge``, one generation rank."""
    from grpo.system.generation.remote import RemoteGeneration

    gen = RemoteGeneration.__new__(RemoteGeneration)
    gen.bridge, gen.num_ranks, gen.version, gen.stats = bridge, 1, 0, {"weight_loads": 0}
    return gen


BUCKETS = [[("a", torch.ones(2, 3)), ("b", torch.full((4,), 2.0))], [("c", torch.full((5,), 3.0))],
           [("d", torch.ones(1))]]


def test_a_weight_load_is_acknowledged_bucket_by_bucket_and_arrives_whole():
    store, proc = _peer("load")
    try:
        gen = _loader(Bridge(store, 0, 2, timeout_s=60))
        assert gen.load_weights(BUCKETS, ["a", "b", "c", "d"], version=1) is None
        assert gen.bridge.recv(1) == {"a": 6.0, "b": 8.0, "c": 15.0, "d": 1.0}
        assert gen.version == 1 and proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        proc.kill()


@pytest.mark.parametrize("mode, expected", [
    ("load-die-2", "generation rank 0 is gone"),  # killed in the middle of bucket 1's broadcast
    ("load-hang-1", "no answer from generation rank 0 within 3 s"),  # hangs in the middle of bucket 0's
])
def test_a_generation_rank_lost_mid_broadcast_fails_the_load_within_the_bridge_timeout(mode, expected):
    """Each bucket is acknowledged over gloo, so trainer 0 names the rank within its timeout instead of waiting on a
    broadcast (on GPUs NCCL's, which would leave it to the watchdog to kill the trainer without a checkpoint)."""
    import time

    store, proc = _peer(mode)
    try:
        store.wait(["peer_up"])  # the peer's imports are not part of the bound
        gen = _loader(Bridge(store, 0, 2, timeout_s=3))
        t0 = time.monotonic()
        error = gen.load_weights(BUCKETS, ["a", "b", "c", "d"], version=1)
        assert expected in error, error
        assert time.monotonic() - t0 < 15 and gen.version == 0
        assert gen.bridge.broken is not None  # every later transfer fails at once
    finally:
        proc.kill()


class _NcclLike:
    """The weight group as ProcessGroupNCCL behaves on the host: a broadcast returns before any peer received it
    (``wait`` only orders the device stream), and ``abort`` ends what is pending. Over the gloo group underneath."""

    def __init__(self, gloo):
        self.gloo, self.aborted = gloo, False

    def broadcast(self, tensors, opts):
        self.gloo.broadcast(tensors, opts)
        return type("Work", (), {"wait": lambda self, *a: True})()

    def abort(self):
        self.aborted = True


def test_a_failed_weight_load_aborts_an_nccl_weight_group(monkeypatch):
    """A dead peer left an NCCL broadcast pending on trainer 0's stream, where the checkpoint's copies would queue
    behind it until the watchdog killed the process: the bridge aborts the weight group when it fails."""
    import grpo.system.bridge as bridge_module

    groups = []
    monkeypatch.setattr(bridge_module, "weights_group",
                        lambda store, rank, size, timeout, device, objects, prefix: groups.append(_NcclLike(objects))
                        or groups[-1])
    store, proc = _peer("load-die-2")
    try:
        gen = _loader(Bridge(store, 0, 2, timeout_s=60))
        assert "generation rank 0 is gone" in gen.load_weights(BUCKETS, ["a", "b", "c", "d"], version=1)
        assert groups[0].aborted
    finally:
        proc.kill()


# ---------------------------------------------------------------- in-flight weight updates (token rounds)
class _Tok:
    """Token t decodes to chr(t)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(t) for t in ids)


def _remote(chunk_tokens: int, stop_ids=(0,)):
    from grpo.system.generation.remote import RemoteGeneration

    gen = RemoteGeneration.__new__(RemoteGeneration)
    gen.tokenizer, gen.stop_ids, gen.chunk_tokens = _Tok(), list(stop_ids), chunk_tokens
    gen.version, gen._stale_cache = 0, False
    gen.stats = {"multi_version_samples": 0}
    return gen


def test_a_generation_rank_that_never_joins_is_named_with_the_setting_within_the_timeout():
    """Issue 37: a generation rank stalled before the bridge formed stopped the trainer after ~55 s with
    ``DistStoreError: wait timeout ... /bridge/objects/0/1``; now one BridgeError names it, bridge_timeout_s and what
    to check, after bridge_timeout_s, and every trainer stops with it (RemoteGeneration's start)."""
    import time

    from grpo.system.generation.remote import RemoteGeneration
    from grpo.system.rollout import RolloutError

    store, proc = _peer("stall")
    try:
        t0 = time.monotonic()
        with pytest.raises(BridgeError) as err:
            Bridge(store, 0, 2, timeout_s=3)
        assert 3 <= time.monotonic() - t0 < 30
    finally:
        proc.kill()
        proc.wait(timeout=60)
    message = str(err.value)
    assert message.startswith("generation rank 0 did not join the bridge within 3 s "
                              "(policy.generation.colocated.bridge_timeout_s): check its log") and "\n" not in message
    cfg = MasterConfig.model_validate(non_colocated(gpus_per_node=1))
    with pytest.raises(RolloutError, match="starting the generation ranks: generation rank 0 did not join"):
        RemoteGeneration(cfg, Layout("train", 0, 1, 0, 2, 1), None, "unused", torch.device("cpu"),
                         bridge_error=message)


def test_in_flight_rounds_continue_from_the_partial_output_with_newer_weights():
    """A fake engine whose token at position p of a completion is ord('a') + p (its 'weights' = the version is in
    the logprob): requests go 3 tokens a round, get the newest version between rounds, and continue from their
    prompt + the tokens so far; a stop string split over two rounds ends the sample where it completes."""
    gen = _remote(chunk_tokens=3)
    seen = []

    def fake_round(prompts, seeds, caps, stops, *, greedy, sampling, media=None):
        seen.append([(len(p), c) for p, c in zip(prompts, caps)])
        outs = []
        for p, c in zip(prompts, caps):
            done = len(p) - 2  # the prompts have 2 tokens
            ids = [ord("a") + done + j for j in range(c)]
            outs.append(GenerationOutput(p, ids, [-float(gen.version)] * c, "length", ""))
        return outs

    def load_newer():
        gen.version += 1

    gen._round, gen.in_flight = fake_round, load_newer
    out = gen._generate_in_flight([[1, 2], [1, 2]], [5, 6], [8, 8], [None, ["de"]], greedy=False, sampling=None)
    assert out[0].completion_ids == [ord(c) for c in "abcdefgh"] and out[0].finish_reason == "length"
    assert out[1].text == "abcde" and out[1].finish_reason == "stop"  # "d" in round 1, "e" in round 2
    assert out[0].logprobs == [0.0] * 3 + [-1.0] * 3 + [-2.0] * 2  # each round with the weights of its time
    assert seen == [[(2, 3), (2, 3)], [(5, 3), (5, 3)], [(8, 2)]]
    assert gen.stats["multi_version_samples"] == 2


def test_in_flight_rounds_end_at_a_stop_token_and_seed_each_round_apart():
    from grpo.system.generation.remote import round_seed

    gen = _remote(chunk_tokens=2)
    seeds_seen = []

    def fake_round(prompts, seeds, caps, stops, *, greedy, sampling, media=None):
        seeds_seen.append(seeds)
        return [GenerationOutput(p, [ord("x"), 0][:c], [0.0, 0.0][:c], "stop", "") for p, c in zip(prompts, caps)]

    gen._round, gen.in_flight = fake_round, lambda: None
    out = gen._generate_in_flight([[1]], [9], [10], [None], greedy=False, sampling=None)
    assert out[0].completion_ids == [ord("x"), 0] and out[0].finish_reason == "stop"
    assert seeds_seen == [[9]] and round_seed(9, 1) != 9
