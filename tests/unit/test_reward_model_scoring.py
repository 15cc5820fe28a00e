"""The reward models' scoring point (grpo.wings.reward_model.scorer.RewardModels.score_pending): the run's scorers are
deferred, the environment leaves pending scores, combined environments weight and name them, the point adds them
(equal to scoring in the step); the ZeRO-3 config and the offload plan; the async loop's hand-over to the trainer
thread (grpo.run.producer.TrainerDesk). Two ranks on gloo: tests/integration/test_reward_model_zero3.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from grpo.config import PolicyConfig, RewardModelConfig

pytest.importorskip("tiktoken")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, the colour of the sky."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
]


@pytest.fixture(scope="module")
def rm_cfg(tmp_path_factory):
    from tests.helpers.reward_models import save_tiny_reward_model

    path = save_tiny_reward_model(str(tmp_path_factory.mktemp("rm")))
    return RewardModelConfig(model_name=path, precision="float32", batch_size=2)


def _trajectories(ret, rewards=None):
    """Trajectories folded from one environment return, as the rollout folds them."""
    from grpo.system.rollout import _apply_step
    from grpo.trajectory import Message, Trajectory

    out = []
    for j in range(len(ret.observations)):
        t = Trajectory(0, j, "rm", "q", "", [Message("user", "q", [1])], {"answer": ""})
        _apply_step(t, ret, j)
        out.append(t)
    return out


def test_the_run_s_scorers_defer_and_the_point_adds_what_the_step_would_have(rm_cfg):
    from grpo.wings.reward_model.scorer import RewardModels, RewardModelScorer
    from grpo.tasks.pending import PENDING
    from grpo.wings.reward_model.environment import RewardModelEnvironment
    from grpo.trajectory import Failure

    models = RewardModels(torch.device("cpu"))
    deferred = RewardModelEnvironment(models(rm_cfg), rm_cfg.batch_size)
    models.place()
    ret = deferred.step(CONVERSATIONS, [{"answer": ""}] * 3)
    assert ret.rewards.tolist() == [0.0] * 3 and all(len(md[PENDING]) == 1 for md in ret.metadata)
    trajs = _trajectories(ret)
    trajs[2].fail(Failure.of("env_error"))  # a failed sample is not scored
    assert models.score_pending(trajs) >= 0 and all(PENDING not in t.metadata for t in trajs)
    immediate = RewardModelEnvironment(RewardModelScorer(rm_cfg, torch.device("cpu")), rm_cfg.batch_size)
    want = immediate.step(CONVERSATIONS, [{}] * 3).rewards
    torch.testing.assert_close(torch.tensor([t.reward for t in trajs[:2]]), want[:2], atol=1e-6, rtol=0)
    assert trajs[2].reward is None and want.std() > 0.01
    assert models.score_pending(trajs) >= 0 and trajs[0].reward == pytest.approx(float(want[0]))  # nothing left: no-op
    models.close()


class Constant:
    """A one-turn environment rewarding every sample ``value``."""

    def __init__(self, value: float):
        self.value = value

    def step(self, logs, metadata):
        from grpo.tasks.interface import EnvironmentReturn

        n = len(logs)
        return EnvironmentReturn([{"role": "user", "content": ""}] * n, [None] * n, [None] * n,
                                 torch.full((n,), self.value), torch.ones(n, dtype=torch.bool), [None] * n, [None] * n)


@pytest.mark.parametrize("mode", ["weighted_sum", "components"])
def test_a_combined_environment_weights_and_names_the_pending_score(rm_cfg, mode):
    from grpo.wings.reward_model.scorer import RewardModels
    from grpo.tasks.combined import OWN_REWARDS, CombinedEnvironment, combine
    from grpo.wings.reward_model.environment import RewardModelEnvironment

    models = RewardModels(torch.device("cpu"))
    scorer = models(rm_cfg)
    env = CombinedEnvironment({"rm": RewardModelEnvironment(scorer, rm_cfg.batch_size), "math": Constant(1.0)}, mode,
                              {"rm": 2.0, "math": 0.5})
    models.place()
    trajs = _trajectories(env.step(CONVERSATIONS, [{"answer": ""}] * 3))
    models.score_pending(trajs)
    scores = scorer.score([RewardModelEnvironment(scorer, 1).render([c])[0] for c in CONVERSATIONS]).tolist()
    want = combine({"rm": scores, "math": [1.0] * 3}, mode, {"rm": 2.0, "math": 0.5})
    # abs=1e-5: the pending batch and this one may pad differently; the head logit moves by ~1e-6 (as vs HF's)
    for i, t in enumerate(trajs):
        assert t.metadata[OWN_REWARDS] == pytest.approx({"rm": scores[i], "math": 1.0}, abs=1e-5)
        if mode == "components":
            assert t.reward_components == pytest.approx({"rm": want["rm"][i], "math": 1.0}, abs=1e-5)
            assert t.reward == pytest.approx(scores[i] + 1.0, abs=1e-5)
        else:
            assert t.reward_components is None and t.reward == pytest.approx(want[i], abs=1e-5)
    models.close()


def test_the_zero3_config_is_the_reference_s_filled_for_the_reward_model():
    from grpo.wings.reward_model.scorer import offload_plan, reward_model_ds_config

    rm = RewardModelConfig(model_name="m", precision="bfloat16", batch_size=3)
    ds = reward_model_ds_config(rm, PolicyConfig(precision="float32", logprob_batch_size=8), 2, 64, param_offload=False)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["train_batch_size"] == 6
    assert "offload_param" not in ds["zero_optimization"] and "optimizer" not in ds
    ds = reward_model_ds_config(rm, PolicyConfig(), 2, 64, param_offload=True)
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    # offload only where there is an accelerator to free: the CPU path never moves anything
    assert [offload_plan(o, d, p) for o in (False, True) for d in ("cpu", "cuda") for p in ("plain", "zero3")] == \
        ["none"] * 4 + ["none", "none", "move", "offload_param"]


def test_offload_on_the_cpu_never_touches_cuda(rm_cfg, monkeypatch):
    from grpo.wings.reward_model.scorer import RewardModels
    from grpo.wings.reward_model.environment import RewardModelEnvironment

    def no_cuda(*args, **kwargs):
        raise AssertionError("the CPU path touched CUDA")

    for name in ("empty_cache", "synchronize", "current_device", "mem_get_info", "set_device"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    models = RewardModels(torch.device("cpu"))
    scorer = models(rm_cfg.model_copy(update={"offload": True}))
    models.place()
    assert scorer.plan == "none"
    trajs = _trajectories(RewardModelEnvironment(scorer, 2).step(CONVERSATIONS, [{"answer": ""}] * 3))
    models.score_pending(trajs)
    assert all(t.reward != 0.0 for t in trajs)
    assert {p.device.type for p in scorer.engine.module.parameters()} == {"cpu"}
    models.close()


def test_offload_auto_follows_the_memory_a_rank_has_left_and_never_weighs_on_the_cpu(rm_cfg, monkeypatch):
    import grpo.wings.reward_model.scorer as rm_mod

    # the rule: the weights this rank holds (whole copy, or its ZeRO-3 shard) against a quarter of its free memory
    table = [(p, w, free) for p in ("plain", "zero3") for w in (1, 4) for free in (100, 400, None)]
    got = [rm_mod.needs_offload("auto", "cuda", p, 200, w, free) for p, w, free in table]
    assert got == [True, True, False, True, True, False, True, True, False, True, False, False]
    assert not any(rm_mod.needs_offload(o, "cpu", "plain", 10 ** 12, 1, 1) for o in ("auto", True))
    assert rm_mod.needs_offload(True, "cuda", "zero3", 0, 8, 10 ** 12) and not rm_mod.needs_offload(False, "cuda", "plain", 10 ** 12, 1, 1)
    # on the CPU, auto resolves without loading the model's config to weigh it
    monkeypatch.setattr(rm_mod, "num_params", lambda cfg: (_ for _ in ()).throw(AssertionError("weighed on the CPU")))
    models = rm_mod.RewardModels(torch.device("cpu"))
    assert rm_cfg.offload == "auto" and models.offload(rm_cfg, "plain", None) is False
    # on an accelerator, auto weighs the model and asks its free memory (here: 4 bytes free -> offload)
    monkeypatch.setattr(rm_mod, "num_params", lambda cfg: 1000)
    monkeypatch.setattr(rm_mod, "free_device_bytes", lambda device: 4)
    assert rm_mod.resolve_offload(rm_cfg, torch.device("cuda"), "plain", 1) is True


def test_placement_auto_is_plain_on_one_rank_and_forced_values_stand(rm_cfg):
    from grpo.wings.reward_model.scorer import RewardModels

    models = RewardModels(torch.device("cpu"))
    assert models.placement(rm_cfg, None) == "plain"
    assert models.placement(rm_cfg.model_copy(update={"placement": "zero3"}), None) == "zero3"


# ---- the async loop's hand-over (grpo.run.producer.TrainerDesk) -------------------------------------------------
def _submit(desk, target, fn, out):
    def go():
        try:
            out.append(("ok", desk.run(target, fn)))
        except Exception as err:  # noqa: BLE001 - recorded for the test
            out.append(("error", err))

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_the_trainer_runs_handed_over_work_of_its_step_or_earlier_only():
    from grpo.run.producer import TrainerDesk

    desk, out, ran_in = TrainerDesk(), [], []
    thread = _submit(desk, 2, lambda: ran_in.append(threading.current_thread().name) or 7, out)
    time.sleep(0.1)
    desk.serve(1)  # work for step 2 waits for step 2, whatever the timing: every rank runs it at the same point
    assert not ran_in and not out
    desk.serve(2)
    thread.join(5)
    assert out == [("ok", 7)] and ran_in == [threading.current_thread().name]


def test_an_error_of_handed_over_work_reaches_the_producer_and_close_releases_it():
    from grpo.run.producer import TrainerDesk

    desk, out = TrainerDesk(), []

    def broken():
        raise ValueError("rm forward broke")

    thread = _submit(desk, 1, broken, out)
    time.sleep(0.1)
    desk.serve(1)
    thread.join(5)
    assert out[0][0] == "error" and "rm forward broke" in str(out[0][1])
    thread = _submit(desk, 5, lambda: 1, out)  # never served: the trainer stops
    time.sleep(0.1)
    desk.close()
    thread.join(5)
    assert out[1][0] == "error" and "stopped" in str(out[1][1]) and not thread.is_alive()
    with pytest.raises(RuntimeError):
        desk.run(1, lambda: 1)


def test_own_reward_model_ranks_are_refused_in_a_native_config_and_translated_from_nemo_rl():
    """``resources`` (NeMo-RL's GPUs of the reward model's own) has no grpo-ds meaning in a native config: refused at
    load with where the reward model runs instead; a NeMo-RL recipe's is translated (its GPUs train, the reward model
    shares the training ranks)."""
    from pydantic import ValidationError

    from grpo.config.nemo_rl.recipe import load_recipe

    with pytest.raises(ValidationError, match=r"env.reward_model.resources=.*runs on the training ranks.*placement"):
        RewardModelConfig(model_name="m", resources={"gpus_per_node": 1, "num_nodes": 1})
    cfg, rows = load_recipe("tests/fixtures/nemo_rl/grpo_rm.yaml", ["+env.reward_model.placement=zero3"])
    assert cfg.env.reward_model.placement == "zero3"
    why = {key: note for _, key, note in rows}["env.reward_model.resources"]
    assert "runs it on the training ranks" in why and "cluster.gpus_per_node=1 it shares the one rank" in why


@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_a_plain_reward_model_runs_the_policy_s_cpu_linear_kernel_with_the_same_scores(rm_cfg, kernel):
    """policy.cpu_linear_kernel reaches the reward model (a plain one): its linear layers on oneDNN or not, its
    scores those of transformers' own layers up to rounding."""
    from grpo.system.cpu_linear import OneDNNLinear, onednn_available
    from grpo.wings.reward_model.scorer import RewardModelScorer

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    policy = PolicyConfig(model_name="unused", cpu_linear_kernel=kernel)
    scorer = RewardModelScorer(rm_cfg, torch.device("cpu"), policy=policy)
    plain = RewardModelScorer(rm_cfg, torch.device("cpu"), policy=PolicyConfig(model_name="unused",
                                                                                cpu_linear_kernel="torch"))
    swapped = [m for m in scorer.engine.module.modules() if type(m) is OneDNNLinear]
    assert bool(swapped) == (kernel == "onednn")
    ids = [list(range(3, 3 + n)) for n in (40, 64, 80, 100)] * 8  # enough tokens for oneDNN's calls
    a, b = scorer.score(ids), plain.score(ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
