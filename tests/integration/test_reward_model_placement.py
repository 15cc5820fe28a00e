"""When the reward model is placed (issue 52, finding 2): setup builds the environments before the engines (the data
needs them), and the reward model with them, so ``placement: auto`` / ``offload: auto`` weighed a GPU still empty of
the policy and of vLLM's ``gpu_memory_utilization``. Now `grpo.wings.reward_model.scorer.RewardModels.place` runs once the
policy and the generation backend are built. `grpo.run.run_setup.setup` in this process, on the CPU, with the device's
free memory injected: a GPU of 80 GiB that the policy takes 30 of and the generation backend 40."""

from __future__ import annotations

import pytest
import torch

from grpo.config import RewardModelConfig

pytest.importorskip("tiktoken")
GiB = 2**30


def test_the_reward_model_is_placed_by_the_memory_the_engines_left(tmp_path, monkeypatch, capsys):
    from grpo.run import run_setup
    from grpo.system import engines
    from grpo.wings.reward_model import scorer as reward_model
    from tests.helpers.e2e import TINY
    from tests.helpers.reward_models import save_tiny_reward_model

    rm_dir = save_tiny_reward_model(str(tmp_path / "rm"))
    events, gpu = [], {"free": 80 * GiB}

    def read_free(device):
        events.append(("free memory read", gpu["free"] // GiB))
        return gpu["free"]

    def taking(name: str, gib: int, build):
        def wrapped(*args, **kwargs):
            out = build(*args, **kwargs)
            gpu["free"] -= gib * GiB
            events.append(name)
            return out
        return wrapped

    class Recorded(reward_model.RewardModelScorer):
        def __init__(self, *args, **kwargs):
            events.append("reward model built")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(reward_model, "free_device_bytes", read_free)
    monkeypatch.setattr(reward_model, "RewardModelScorer", Recorded)
    monkeypatch.setattr(engines, "build_policy_engine", taking("policy built", 30, engines.build_policy_engine))
    monkeypatch.setattr(run_setup, "build_generation_backend", taking("generation backend built", 40,
                                                                      run_setup.build_generation_backend))
    run = run_setup.setup(["--config", TINY, "env.name=reward_model", f"env.reward_model.model_name={rm_dir}",
                           "env.reward_model.precision=float32", f"logger.log_dir={tmp_path}/logs",
                           f"checkpointing.checkpoint_dir={tmp_path}/ckpt"], TINY, asynchronous=False)
    try:
        assert events == ["policy built", "generation backend built", ("free memory read", 10), "reward model built"]
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("reward models: "))
        assert "(a frozen copy on each rank, batches of 8; placed with 10.00 GiB free on cpu)" in line, line
    finally:
        for closable in run.closables:
            closable.close()


def test_offload_auto_decides_on_the_memory_left_once_the_engines_are_built(monkeypatch):
    """The decision itself on an accelerator, with the readings above: a reward model of 4 GiB stays resident next to
    an empty 80 GiB GPU, and is offloaded next to the 10 GiB the engines leave (more than a quarter of it)."""
    from grpo.wings.reward_model import scorer as reward_model

    monkeypatch.setattr(reward_model, "num_params", lambda cfg: 2 * GiB)  # bf16: 4 GiB of weights
    models = reward_model.RewardModels(torch.device("cuda", 1))
    rm = RewardModelConfig(model_name="m", precision="bfloat16")
    assert models.offload(rm, "plain", 80 * GiB) is False
    assert models.offload(rm, "plain", 10 * GiB) is True


def test_the_async_producer_places_the_reward_model_and_hands_its_moves_to_the_trainer_thread(tmp_path, monkeypatch):
    """Issue 52, finding 5: only a ZeRO-3 reward model scored through the trainer thread; a plain copy that offloads by
    moving (``offload`` on a GPU) went onto the device from the producer thread while the trainer trained, and emptied
    the allocator's cache from there. Now its scoring is handed over too. The producer also places the reward models
    (the async loop's weight copy exists by then). On the CPU the move is forced (what offload gives on a GPU)."""
    import threading
    import types

    from grpo.config import MasterConfig
    from grpo.run.producer import RolloutProducer
    from grpo.wings.reward_model import scorer as reward_model
    from grpo.system.generation.base import GenerationBackend
    from grpo.system.rollout import _apply_step
    from grpo.wings.reward_model.environment import RewardModelEnvironment
    from grpo.trajectory import Message, Trajectory
    from tests.helpers.reward_models import save_tiny_reward_model

    rm_cfg = RewardModelConfig(model_name=save_tiny_reward_model(str(tmp_path / "rm")), precision="float32",
                               batch_size=2)
    models = reward_model.RewardModels(torch.device("cpu"))
    env = RewardModelEnvironment(models(rm_cfg), rm_cfg.batch_size)
    monkeypatch.setattr(reward_model, "offload_plan", lambda offload, device_type, placement: "move")
    lines: list[str] = []
    run = types.SimpleNamespace(deferred=models, cfg=MasterConfig(), logger=types.SimpleNamespace(write=lines.append))
    producer = RolloutProducer(run, None, None, GenerationBackend(), None, None, first_target=1)
    assert producer.desk is not None  # a moving copy scores in the trainer thread
    assert lines and "in host memory between scorings" in lines[0]  # placed by the producer, said once
    moved_back_in: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: moved_back_in.append(threading.current_thread().name))
    ret = env.step([[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]] * 2,
                   [{"answer": ""}] * 2)
    trajs = []
    for j in range(2):
        t = Trajectory(0, j, "rm", "q", "", [Message("user", "q", [1])], {"answer": ""})
        _apply_step(t, ret, j)
        trajs.append(t)
    generation = threading.Thread(target=producer._score_in_trainer(1), args=(trajs,), name="grpo-generation")
    generation.start()
    while generation.is_alive():  # the trainer, waiting for step 1's groups (RolloutProducer.take)
        producer.desk.serve(1)
    assert moved_back_in == [threading.current_thread().name] and all(t.reward != 0.0 for t in trajs)
    models.close()
