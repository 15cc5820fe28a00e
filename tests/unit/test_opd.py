"""On-policy distillation as NeMo-RL shapes it (issue 48): the ``opd`` estimator against NeMo-RL's formula, the
teacher of each row (NeMo-RL's ``resolve_reference_aliases``), shared checkpoints, the config's errors and the
translation of NeMo-RL's MOPD keys. With a NeMo-RL checkout (NEMO_RL_CHECKOUT, 7ea279a) its own
``OPDAdvantageEstimator`` and ``resolve_reference_aliases`` run beside ours."""

from __future__ import annotations

import ast
import os
import random
from pathlib import Path

import pytest
import torch

from grpo.advantages import compute_advantages, opd_metrics
from grpo.batch import build_batch
from grpo.config import AdvEstimatorConfig, OnPolicyDistillationConfig
from grpo.config.load import ConfigError, build_config
from grpo.distillation import resolve_teacher_aliases, rows_by_teacher, shared_teachers, trajectory_teacher_key
from grpo.step import compose_advantages
from grpo.trajectory import Message, Trajectory

REPO = Path(__file__).resolve().parents[2]
CHECKOUT = Path(os.environ["NEMO_RL_CHECKOUT"]) if os.environ.get("NEMO_RL_CHECKOUT") else None


def nemo_rl_opd(teacher_bt, prev_bt, token_mask_bt, sample_mask_b):
    """NeMo-RL 7ea279a, written out: the mask of async_grpo_train (nemo_rl/algorithms/grpo.py:4833-4836) and
    OPDAdvantageEstimator.compute_advantage (nemo_rl/algorithms/advantage_estimator.py:602-606)."""
    mask = token_mask_bt * sample_mask_b.unsqueeze(-1)
    distill_advantages = (teacher_bt - prev_bt).detach()
    return distill_advantages * mask


def random_case(g: torch.Generator):
    B, T = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 24, (1,), generator=g))
    teacher = -5 * torch.rand(B, T, generator=g)
    prev = -5 * torch.rand(B, T, generator=g)
    token_mask = (torch.rand(B, T, generator=g) < 0.6).float()
    sample_mask = (torch.rand(B, generator=g) < 0.7).float()
    return teacher, prev, token_mask, sample_mask


def opd(teacher, prev, token_mask, sample_mask):
    B = len(sample_mask)
    return compute_advantages("opd", group_ids=torch.arange(B), rewards=torch.randn(B), valid_mask=torch.ones(B),
                              token_mask=token_mask, cfg=AdvEstimatorConfig(name="opd"), sample_mask=sample_mask,
                              teacher_logprobs=teacher, prev_logprobs=prev)


def test_opd_advantages_equal_nemo_rl_formula_exactly_in_float32():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        teacher, prev, token_mask, sample_mask = random_case(g)
        got = opd(teacher, prev, token_mask, sample_mask)
        assert got.dtype == torch.float32
        assert torch.equal(got, nemo_rl_opd(teacher, prev, token_mask, sample_mask))


def test_opd_takes_no_reward_and_no_gradient():
    teacher = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    prev = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    a = opd(teacher, prev, torch.ones(1, 2), torch.ones(1))
    b = compute_advantages("opd", group_ids=torch.arange(1), rewards=torch.tensor([100.0]), valid_mask=torch.ones(1),
                           token_mask=torch.ones(1, 2), cfg=AdvEstimatorConfig(name="opd"), sample_mask=torch.ones(1),
                           teacher_logprobs=teacher, prev_logprobs=prev)
    assert torch.equal(a, b) and not a.requires_grad and a.tolist() == [[0.5, 0.0]]


def sample(group: int, reward: float, gen_lp: list[float], task: str = "arithmetic", metadata=None) -> Trajectory:
    return Trajectory(group, group, task, "q", "a", [Message("user", "q", [1, 5]),
                                                    Message("assistant", "x", [7 + i for i in range(len(gen_lp))],
                                                            list(gen_lp))], metadata or {}, reward=reward)


def test_the_advantages_phase_with_opd_is_nemo_rl_s_over_the_masked_samples():
    """The whole phase (sequence logprob-error masking first, as NeMo-RL's loop): equal to NeMo-RL's formula over the
    sample mask the phase returns, no distillation added twice, NeMo-RL's metrics."""
    cfg = build_config({"grpo": {"adv_estimator": {"name": "opd"}, "seq_logprob_error_threshold": 1.5},
                        "on_policy_distillation": {"enabled": True, "teacher_model_by_agent_name": {"arithmetic": "t"}}})
    b = build_batch([sample(0, 1.0, [-0.1, -0.2]), sample(0, 0.0, [-0.3]), sample(1, 1.0, [-0.4, -0.5, -0.6])],
                    pad_id=0)
    g = torch.Generator().manual_seed(1)
    teacher = torch.where(b.token_mask_bt > 0, -2 * torch.rand(b.token_mask_bt.shape, generator=g), 0.0)
    prev = b.generation_logprobs_bt.clone()
    prev[1, 2] = -3.0  # exp|gen - prev| = e^2.7 > 1.5: sample 1 masked by the logprob error
    adv, mask, metrics = compose_advantages(cfg, b.replace(prev_logprobs_bt=prev, teacher_logprobs_bt=teacher))
    assert mask.tolist() == [1.0, 0.0, 1.0]
    assert torch.equal(adv, nemo_rl_opd(teacher, prev, b.token_mask_bt, mask))
    expected = opd_metrics(teacher, prev, adv, b.token_mask_bt * mask[:, None])
    assert {k: metrics[k] for k in expected} == expected


# --------------------------------------------------------------------------------------------------
# NeMo-RL's own functions beside ours (a NeMo-RL checkout)
# --------------------------------------------------------------------------------------------------
def nemo_rl_definitions(rel: str, names: tuple[str, ...]) -> dict:
    """NeMo-RL's definitions ``names`` cut out of ``rel`` with ast and run (its modules import Ray)."""
    from typing import Any, Optional

    path = CHECKOUT / rel
    if not path.exists():
        pytest.skip(f"{path} is missing (NEMO_RL_CHECKOUT needs NeMo-RL's sources)")
    ns = {"torch": torch, "Any": Any, "Optional": Optional, "__name__": __name__}
    for node in ast.parse(path.read_text()).body:
        if getattr(node, "name", None) in names:
            exec(compile(ast.Module([node], []), rel, "exec"), ns)
    return ns


@pytest.mark.skipif(CHECKOUT is None, reason="needs NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a)")
def test_opd_equals_nemo_rl_s_own_estimator_and_metrics():
    estimator = nemo_rl_definitions("nemo_rl/algorithms/advantage_estimator.py",
                                    ("OPDAdvantageEstimator",))["OPDAdvantageEstimator"]({"name": "opd"}, {})
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        teacher, prev, token_mask, sample_mask = random_case(g)
        theirs = estimator.compute_advantage(prompt_ids=None, rewards=None, mask=token_mask * sample_mask.unsqueeze(-1),
                                             teacher_logprobs=teacher, prev_logprobs=prev)
        ours = opd(teacher, prev, token_mask, sample_mask)
        assert torch.equal(ours, theirs)
        assert opd_metrics(teacher, prev, ours, token_mask * sample_mask[:, None]) == estimator.last_metrics


@pytest.mark.skipif(CHECKOUT is None, reason="needs NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a)")
def test_teacher_aliases_equal_nemo_rl_s_resolve_reference_aliases():
    theirs = nemo_rl_definitions("nemo_rl/algorithms/opd.py", ("resolve_reference_aliases",))["resolve_reference_aliases"]
    rng = random.Random(3)
    for _ in range(300):
        mapped = {k: rng.choice(["m1", "m2"]) for k in rng.sample("abcd", rng.randint(1, 3))}
        default = rng.choice([None, "", *mapped])
        strict = rng.random() < 0.3
        keys = [rng.choice("abcde") for _ in range(rng.randint(0, 6))]
        try:
            expected = theirs([{"name": k} for k in keys], mapped, default, strict)
        except ValueError:
            with pytest.raises(ValueError):
                resolve_teacher_aliases(keys, mapped, default, strict)
            continue
        assert resolve_teacher_aliases(keys, mapped, default, strict) == expected


# --------------------------------------------------------------------------------------------------
# Routing: which teacher scores which row
# --------------------------------------------------------------------------------------------------
MOPD = {"enabled": True, "teacher_model_by_agent_name": {"math": "ckpt/a", "code": "ckpt/b", "chat": "ckpt/a"},
        "default_teacher_alias": "code"}


def test_rows_go_to_their_task_or_agent_s_teacher_and_shared_checkpoints_to_one():
    opd_cfg = OnPolicyDistillationConfig(**MOPD)
    gym = {"agent_name": "chat", "meta": {"agent_ref": {"name": "chat"}}}
    before = {"meta": {"agent_ref": {"name": "math"}}}  # a Gym row before its rollout stamped the agent
    trajectories = [sample(0, 1.0, [-1.0], "math"), sample(1, 1.0, [-1.0], "nemo_gym", gym),
                    sample(2, 1.0, [-1.0], "other"), sample(3, 1.0, [-1.0], "nemo_gym", before)]
    keys = [trajectory_teacher_key(t) for t in trajectories]
    assert keys == ["math", "chat", "other", "math"]
    assert rows_by_teacher(keys, opd_cfg) == {"math": [0, 1, 3], "code": [2]}  # chat shares math's checkpoint
    no_dedup = opd_cfg.model_copy(update={"deduplicate_shared_teacher_checkpoints": False})
    assert rows_by_teacher(keys, no_dedup) == {"math": [0, 3], "chat": [1], "code": [2]}
    assert shared_teachers(MOPD["teacher_model_by_agent_name"]) == {"math": "math", "code": "code", "chat": "math"}
    strict = opd_cfg.model_copy(update={"strict_agent_name_match": True})
    with pytest.raises(ValueError, match="strict_agent_name_match=true: no teacher for agent or task 'other'"):
        rows_by_teacher(keys, strict)
    single = OnPolicyDistillationConfig(enabled=True, teacher_model_name="ckpt/t")
    assert rows_by_teacher(keys, single) == {"teacher": [0, 1, 2, 3]}


def test_teacher_logprobs_put_each_teacher_s_numbers_on_its_rows_and_score_the_whole_batch_for_one():
    from grpo.system.training import teacher_logprobs

    cfg = build_config({"on_policy_distillation": MOPD})
    b = build_batch([sample(0, 1.0, [-1.0, -1.0], "math"), sample(1, 1.0, [-1.0], "other"),
                     sample(2, 1.0, [-1.0, -1.0, -1.0], "chat")], pad_id=0)
    offset = {"engine-a": 100.0, "engine-b": 200.0}
    calls = []

    def score(engine, rows):  # each teacher's "logprobs": its offset plus the rows' tokens
        calls.append((engine, len(rows)))
        return offset[engine] + rows.input_ids_bt.float()

    out = teacher_logprobs(cfg, b, {"math": "engine-a", "code": "engine-b"}, score)
    expected = b.input_ids_bt.float() + torch.tensor([100.0, 200.0, 100.0])[:, None]
    assert torch.equal(out, expected) and calls == [("engine-a", 2), ("engine-b", 1)]
    single = build_config({"on_policy_distillation": {"enabled": True, "teacher_model_name": "ckpt/t"}})
    seen = []
    out = teacher_logprobs(single, b, {"teacher": "engine-a"}, lambda engine, rows: seen.append(rows) or rows.input_ids_bt.float())
    assert seen == [b] and seen[0] is b and torch.equal(out, b.input_ids_bt.float())
    assert teacher_logprobs(build_config({}), b, {}, score) is None


def test_identical_checkpoints_load_once_and_each_alias_otherwise():
    from grpo.system.teacher import build_teachers

    built = []
    for dedup, expected in ((True, ["ckpt/a", "ckpt/b"]), (False, ["ckpt/a", "ckpt/b", "ckpt/a"])):
        built.clear()
        cfg = build_config({"on_policy_distillation": {**MOPD, "deduplicate_shared_teacher_checkpoints": dedup}})
        teachers = build_teachers(cfg, 0, 1, lambda policy, world_size: built.append(policy.model_name) or policy)
        assert built == expected
        assert list(teachers) == (["math", "code"] if dedup else ["math", "code", "chat"])
        assert teachers["code"].model_name == "ckpt/b" and teachers["code"].hf_config_overrides == {}


def test_a_training_row_without_a_teacher_stops_the_run_at_startup_naming_the_row():
    from types import SimpleNamespace

    from grpo.run.run import RunError
    from grpo.run.run_setup import check_teacher_routing
    from grpo.tasks.rows import PromptRow

    rows = [PromptRow(0, "q", "a", "math", [], [], "d.jsonl:1"),
            PromptRow(1, "q", "a", "nemo_gym", [], [], "d.jsonl:2", meta={"agent_ref": {"name": "search"}})]
    strict = build_config({"on_policy_distillation": {**MOPD, "strict_agent_name_match": True}})
    with pytest.raises(RunError, match=r"^d\.jsonl:2: on_policy_distillation\.strict_agent_name_match=true: no teacher "
                                       r"for agent or task 'search'"):
        check_teacher_routing(strict, SimpleNamespace(items=rows))
    check_teacher_routing(build_config({"on_policy_distillation": MOPD}), SimpleNamespace(items=rows))  # default
    check_teacher_routing(build_config({}), SimpleNamespace(items=rows))  # no distillation


# --------------------------------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, message", [
    ({"grpo": {"adv_estimator": {"name": "opd"}}},
     "grpo.adv_estimator.name='opd' needs teacher logprobs: set on_policy_distillation.enabled=true"),
    ({"grpo": {"adv_estimator": {"name": "opd"}}, "on_policy_distillation": {**MOPD, "kl_coef": 0.5}},
     "on_policy_distillation.kl_coef=0.5 with grpo.adv_estimator.name='opd': expected 1.0"),
    ({"on_policy_distillation": {**MOPD, "teacher_model_name": "t"}},
     "on_policy_distillation.teacher_model_name='t' with on_policy_distillation.teacher_model_by_agent_name="),
    ({"on_policy_distillation": {**MOPD, "default_teacher_alias": "cod"}},
     "on_policy_distillation.default_teacher_alias='cod': expected a key of "
     "on_policy_distillation.teacher_model_by_agent_name (available: ['chat', 'code', 'math'])"),
    ({"on_policy_distillation": {"enabled": True, "teacher_model_by_agent_name": {"math": "toy:nope"}}},
     "on_policy_distillation.teacher_model_by_agent_name.math='toy:nope': no such toy model"),
    ({"on_policy_distillation": {"enabled": True, "teacher_model_by_agent_name": {"math": ""}}},
     "on_policy_distillation.teacher_model_by_agent_name.math='': expected a model"),
    ({"on_policy_distillation": {"enabled": True}}, "on_policy_distillation.teacher_model_name=None: expected a model"),
    ({"on_policy_distillation": {**MOPD, "teacher_by_agent": {}}}, "on_policy_distillation.teacher_by_agent"),
])
def test_bad_distillation_configs_fail_at_load_naming_key_and_value(raw, message):
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert message in str(err.value)


def test_opd_needs_no_group_and_keeps_the_previous_policy_logprobs():
    from grpo.config import resolve_skip_flags

    cfg = build_config({"grpo": {"adv_estimator": {"name": "opd"}, "num_generations_per_prompt": 1,
                                 "num_prompts_per_step": 8},
                        "loss_fn": {"force_on_policy_ratio": True}, "policy": {"train_global_batch_size": 8},
                        "on_policy_distillation": MOPD})
    assert resolve_skip_flags(cfg)[0] is False  # the student's logprobs are computed: opd reads them


# --------------------------------------------------------------------------------------------------
# NeMo-RL's MOPD keys in its recipes
# --------------------------------------------------------------------------------------------------
def mopd_recipe(tmp_path, estimator: str = "opd", non_colocated: bool = False, orm: bool = False) -> Path:
    """NeMo-RL's MOPD keys as its recipes write them (examples/nemo_gym/nemotron-3-ultra/mopd.yaml: a ``_teachers``
    holder the map interpolates, the ORM keys no NeMo-RL code reads)."""
    path = tmp_path / "mopd.yaml"
    path.write_text(f"""defaults: {REPO / 'tests' / 'fixtures' / 'nemo_rl' / 'base_math.yaml'}
grpo:
  adv_estimator:
    name: {estimator}
_teachers:
  general: Qwen/Qwen3-1.7B
  reasoning: ${{_teachers.general}}
on_policy_distillation:
  enabled: true
  use_orm_advantage: {str(orm).lower()}
  orm_advantage_weight: 0.0
  teacher_model_by_agent_name:
    default_teacher: ${{_teachers.general}}
    math: ${{_teachers.reasoning}}
  default_teacher_alias: default_teacher
  strict_agent_name_match: false
  deduplicate_shared_teacher_checkpoints: true
  non_colocated_teachers:
    enabled: {str(non_colocated).lower()}
    default_teacher_cfg:
      tensor_model_parallel_size: 2
      gpus_per_node: 4
""")
    return path


def test_nemo_rl_mopd_keys_translate_with_the_teachers_on_ranks_of_their_own(tmp_path):
    from grpo.config import teacher_ranks
    from grpo.config.nemo_rl.recipe import load_recipe

    cfg, table = load_recipe(mopd_recipe(tmp_path))
    opd_cfg = cfg.on_policy_distillation
    assert cfg.grpo.adv_estimator.name == "opd" and opd_cfg.enabled and opd_cfg.kl_coef == 1.0
    assert opd_cfg.teacher_model_by_agent_name == {"default_teacher": "Qwen/Qwen3-1.7B", "math": "Qwen/Qwen3-1.7B"}
    assert opd_cfg.default_teacher_alias == "default_teacher" and opd_cfg.deduplicate_shared_teacher_checkpoints
    ignored = {key for kind, key, _ in table if kind == "ignored"}
    assert {"on_policy_distillation.non_colocated_teachers", "_teachers", "on_policy_distillation.use_orm_advantage",
            "on_policy_distillation.orm_advantage_weight"} <= ignored
    # NeMo-RL's other estimators ignore the teachers' logprobs: so does the translation (kl_coef 0)
    cfg, table = load_recipe(mopd_recipe(tmp_path, estimator="grpo"))
    assert cfg.on_policy_distillation.enabled and cfg.on_policy_distillation.kl_coef == 0.0
    # teachers by agent on GPUs of their own: NeMo-RL's worker group per loaded teacher, a block of ranks here
    cfg, table = load_recipe(mopd_recipe(tmp_path, non_colocated=True))
    nct = cfg.on_policy_distillation.non_colocated_teachers
    assert nct.enabled and nct.default_teacher_cfg.gpus_per_node == 4
    assert teacher_ranks(cfg.on_policy_distillation) == 4  # one checkpoint (deduplicated): one block of 4
    assert "Megatron parallel sizes" in {key: why for _, key, why in table}[
        "on_policy_distillation.non_colocated_teachers.default_teacher_cfg"]
    with pytest.raises(ConfigError, match=r"non_colocated_teachers\.teacher_overrides="
                                          r"\{'math': \{'gpus_per_node': 4\}\}: per-teacher sizes"):
        load_recipe(mopd_recipe(tmp_path, non_colocated=True), [
            "+on_policy_distillation.non_colocated_teachers.teacher_overrides.math.gpus_per_node=4"])
    with pytest.raises(ConfigError, match=r"on_policy_distillation\.use_orm_advantage=True: NeMo-RL 7ea279a reads"):
        load_recipe(mopd_recipe(tmp_path, orm=True))


def test_teachers_by_agent_load_on_teacher_ranks_of_their_own():
    """Teachers by agent or task on ranks of their own: a block of default_teacher_cfg's ranks per loaded teacher."""
    from grpo.config import teacher_ranks

    cfg = build_config({"on_policy_distillation": {**MOPD, "non_colocated_teachers": {"enabled": True}}})
    n = len(dict.fromkeys(MOPD["teacher_model_by_agent_name"].values()))
    assert teacher_ranks(cfg.on_policy_distillation) == 8 * n
