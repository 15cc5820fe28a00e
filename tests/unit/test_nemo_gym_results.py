"""NeMo-Gym's pure half (grpo/tasks/nemo_gym.py) and its config (grpo/config/ NemoGymConfig): NeMo-RL's checks
on hand-made results, Gym rows as data, and the config errors a user meets. The HTTP path is
tests/integration/test_nemo_gym_servers.py."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from grpo.config import MasterConfig
from grpo.system.data import LoadReport, read_file_rows
from grpo.wings.agents.endpoint import CallRecord
from grpo.wings.gym.rollout import GymLedger
from grpo.wings.gym.servers import agent_names, launched_by
from grpo.tasks.nemo_gym import (GymResultError, check_data_agents, check_result, check_token_fields, data_agents,
                                 gym_metrics, prepare_row, regroup, reward_of, trajectory_messages)
from grpo.trajectory import Failure, Trajectory

GYM = {"should_use_nemo_gym": True, "nemo_gym": {"agent_urls": {"a": "http://127.0.0.1:5001"}}}


def _item(prompt, generated, logprobs=None):
    return {"type": "message", "prompt_token_ids": prompt, "generation_token_ids": generated,
            "generation_log_probs": logprobs if logprobs is not None else [-0.5] * len(generated)}


def test_the_config_keeps_nemo_rls_keys_typed_and_gyms_free():
    cfg = MasterConfig.model_validate({"env": {**GYM, "nemo_gym": {
        **GYM["nemo_gym"], "thinking_tags": ["<t>", "</t>"], "effort_levels": {"low_weight": 0.5},
        "policy_model": {"responses_api_models": {"vllm_model": {"uses_reasoning_parser": False}}},
        "is_trajectory_collection": False}}})
    g = cfg.env.nemo_gym
    assert cfg.env.name == "nemo_gym" and cfg.data.input_key == "responses_create_params"
    assert g.thinking_tags == ["<t>", "</t>"] and g.effort_levels.low_weight == 0.5
    assert g.gym_keys() == {"policy_model": {"responses_api_models": {"vllm_model": {"uses_reasoning_parser": False}}}}


@pytest.mark.parametrize("env, message", [
    ({"should_use_nemo_gym": True, "nemo_gym": {}}, "say where the Gym servers are"),
    ({"should_use_nemo_gym": True}, "needs env.nemo_gym"),
    ({"nemo_gym": GYM["nemo_gym"]}, "env.should_use_nemo_gym is false"),
    ({**GYM, "nemo_gym": {"agent_urls": {"a": "http://x:1"}, "config_paths": ["c.yaml"]}}, "keep one"),
    ({**GYM, "nemo_gym": {"agent_urls": {"a": "x:1"}}}, "expected an http"),
    ({**GYM, "name": "arithmetic"}, "exactly when"),
    ({**GYM, "nemo_gym": {**GYM["nemo_gym"], "effort_levels": {"low": {}}}}, "effort_levels.low"),
])
def test_config_errors_name_the_key(env, message):
    with pytest.raises(ValidationError, match=message):
        MasterConfig.model_validate({"env": env})


def test_top_k_is_refused_as_nemo_rl_asserts():
    with pytest.raises(ValidationError, match="top_k"):
        MasterConfig.model_validate({"env": GYM, "policy": {"generation": {"top_k": 5}}})


def test_gym_rows_are_read_whole(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"responses_create_params": {"input": [{"role": "user", "content": "2+2="}]},
             "agent_ref": {"name": "a"}, "expected_answer": 4, "extra_field": [1]},
            {"responses_create_params": {"input": "hi"}}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = MasterConfig.model_validate({"env": GYM, "data": {"on_bad_row": "skip"}})
    report = LoadReport(str(path))
    [row] = read_file_rows(path, cfg.data, report)
    assert row["question"] == "2+2=" and row["answer"] == "4" and row["meta"] == rows[0]
    assert report.num_skipped == 1 and "agent_ref" in report.skipped[0]


def test_rows_get_the_sampling_profile_and_their_index():
    row = {"responses_create_params": {"input": "x"}, "agent_ref": {"name": "a"}}
    out = prepare_row(row, 5, 0.7, 0.95, 128)
    assert out["responses_create_params"] == {"input": "x", "temperature": 0.7, "top_p": 0.95, "max_output_tokens": 128}
    assert out["_rowidx"] == 5 and "temperature" not in row["responses_create_params"]  # the data row is untouched


@pytest.mark.parametrize("pairs, message", [
    ([(0, "a")], "missing row indices \\[1\\]"),
    ([(0, "a"), (0, "b")], "duplicate row index 0"),
    ([(0, "a"), (2, "b")], "outside the expected range"),
    ([(0, "a"), ("1", "b")], "must be an int"),
])
def test_a_short_or_broken_stream_raises(pairs, message):
    with pytest.raises(GymResultError, match=message):
        regroup(pairs, 2)


def test_results_nemo_rl_refuses_raise():
    with pytest.raises(GymResultError, match="no generation data"):
        trajectory_messages({"response": {"output": [{"type": "message", "generation_token_ids": []}]}}, str)
    with pytest.raises(GymResultError, match="non-contiguous"):
        trajectory_messages({"response": {"output": [_item([1, 2], [3]), _item([1, 2], [4])]}}, str)
    with pytest.raises(GymResultError, match="reward_components sum"):
        reward_of({"reward": 1.0, "reward_components": {"a": 0.6, "b": 0.6}})
    assert reward_of({"reward": 1.2, "reward_components": {"a": 0.6, "b": 0.6}}) == (1.2, {"a": 0.6, "b": 0.6})


def test_answers_that_are_not_results_are_failures_not_errors():
    assert "finite 'reward'" in check_result({"response": {"output": []}, "reward": math.nan})
    assert "finite 'reward'" in check_result(["not", "a", "dict"])
    assert "reward_components" in check_result({"response": {"output": []}, "reward": 1, "reward_components": [1]})


def _result(*items) -> dict:
    return {"response": {"output": list(items)}, "reward": 1.0}


@pytest.mark.parametrize("item, problem", [
    (_item([1, 2], [3]), None),
    (_item(None, [3]), None),  # no prompt tokens: nothing to check (the ledger refuses what the endpoint never saw)
    (_item([1, 2], [10]), "generation_token_ids[0]=10 is not a token id of the policy's tokenizer (ints in [0, 10))"),
    (_item([1, -1], [3]), "prompt_token_ids[1]=-1 is not a token id"),
    (_item([1, 2], [3.0]), "generation_token_ids[0]=3.0 is not a token id"),
    (_item([1, 2], [True]), "generation_token_ids[0]=True is not a token id"),
    (_item("12", [3]), "prompt_token_ids must be a list of token ids"),
    (_item([1], [3], [math.inf]), "generation_log_probs[0]=inf is not a log-probability (finite and <= 0)"),
    (_item([1], [3], [-math.inf]), "generation_log_probs[0]=-inf is not a log-probability"),
    (_item([1], [3], [math.nan]), "generation_log_probs[0]=nan is not a log-probability"),
    (_item([1], [3], [1e-9]), "generation_log_probs[0]=1e-09 is not a log-probability"),
    (_item([1], [3], ["-0.5"]), "generation_log_probs[0]=-0.5 is not a log-probability"),
    (_item([1], [3, 4], [-0.5]), "2 generation_token_ids but generation_log_probs 1"),
    (_item([1], [3], None) | {"generation_log_probs": None}, "1 generation_token_ids but generation_log_probs None"),
])
def test_token_fields_must_be_token_ids_and_log_probabilities(item, problem):
    """A result's token fields are checked before anything reads them (a bad id fails its sample, never the run:
    IndexError / OverflowError / a device-side assert before); a logprob is finite and <= 0, with no tolerance."""
    got = check_token_fields(_result(_item([1], [2]), item), vocab_size=10)
    assert got is None if problem is None else got.startswith("model call 2: " + problem), got
    assert check_token_fields(_result(_item([1], [3], [0.0])), vocab_size=10) is None  # a certain token: log 1 = 0


def _records(*calls) -> list:
    return [CallRecord(list(p), list(g), [-0.5] * len(g) if lp is None else lp, "stop", 0) for p, g, lp in calls]


def _pending():
    """(take, add): the records a ledger takes, as the endpoint would hand them over."""
    waiting: list = []

    def take():
        out = list(waiting)
        waiting.clear()
        return out

    return take, lambda *calls: waiting.extend(_records(*calls))


def test_a_result_is_claimed_only_from_generations_no_other_sample_claimed():
    take, generated = _pending()
    ledger = GymLedger(take)
    with ledger.opened():
        generated(([1, 2], [3], None), ([1, 2, 3, 4], [5], None), ([1, 2], [3], None))
        two_calls = _result(_item([1, 2], [3]), {"type": "function_call_output"}, _item([1, 2, 3, 4], [5]))
        assert ledger.claim(two_calls) is None
        assert "model call 2" in ledger.claim(two_calls)  # its second call is claimed already
        assert ledger.claim(_result(_item([1, 2], [3]))) is None  # ...but nothing of a refused claim was taken
        assert "another sample claimed" in ledger.claim(_result(_item([1, 2], [3])))
        assert "no generation" in ledger.claim(_result(_item([9, 2], [3])))  # another prompt
        generated(([7], [8], [-0.25]))
        assert "generation_log_probs are not the ones" in ledger.claim(_result(_item([7], [8], [-0.5])))
        assert ledger.claim(_result(_item([7], [8], [-0.25 * (1 + 1e-8)]))) is None  # a float32 round trip


def test_generations_no_open_rollout_can_claim_are_forgotten():
    take, generated = _pending()
    ledger = GymLedger(take)
    generated(([1], [2], None))  # before any rollout (a straggler of an earlier run of the servers)
    with ledger.opened():
        assert "no generation" in ledger.claim(_result(_item([1], [2])))
        generated(([3], [4], None), ([5], [6], None))
        assert ledger.claim(_result(_item([3], [4]))) is None
    with ledger.opened():  # the unclaimed generation of the rollout before
        assert "no generation" in ledger.claim(_result(_item([5], [6])))


def test_overlapping_rollouts_keep_each_others_generations():
    """The async loop's validation may play while the producer does: one rollout ending forgets nothing the other
    may still claim."""
    take, generated = _pending()
    ledger = GymLedger(take)
    training = ledger.opened()
    training.__enter__()
    generated(([1], [2], None))
    with ledger.opened():
        generated(([3], [4], None))
    assert ledger.claim(_result(_item([1], [2]))) is None and ledger.claim(_result(_item([3], [4]))) is None
    training.__exit__(None, None, None)


def test_a_play_that_opens_alone_restarts_the_seeds_counts_and_one_beside_another_does_not():
    """The servers' calls are seeded by prompt and count (`Endpoint.call_seeds`): a play opening alone restarts the
    count, so a validation before it at the same weight version cannot move its seeds (a resume runs no such
    validation: the gym demo's step after a resume drew other seeds for one group). Beside an open play the count
    runs on, or the two plays would draw the same seeds."""
    restarts = []
    ledger = GymLedger(lambda: [], restart=lambda: restarts.append(1))
    with ledger.opened():
        assert len(restarts) == 1
        with ledger.opened():
            assert len(restarts) == 1
    with ledger.opened():
        assert len(restarts) == 2


def test_the_launched_head_server_is_known_by_its_key_and_its_agents_by_their_kind():
    assert launched_by({"grpo_ds_launch_key": "k1"}, "k1") and not launched_by({"grpo_ds_launch_key": "k2"}, "k1")
    assert not launched_by("grpo_ds_launch_key: k1", "k1") and not launched_by(None, "k1")
    config = {"calc": {"responses_api_agents": {"simple_agent": {"host": "h", "port": 1}}},
              "calculator": {"resources_servers": {"calc": {"host": "h", "port": 2}}}, "head_server": {"port": 3}}
    assert agent_names(config) == ["calc"] and agent_names({"policy": {"x": 1}}) == [] and agent_names("x") == []


def test_the_datas_agents_are_checked_against_the_servers():
    rows = [{"source": f"d.jsonl:{n}", "meta": {"agent_ref": {"name": a}}}
            for n, a in enumerate(["calc", "calk", "calc", "mathh"], 1)]
    assert data_agents(rows) == {"calc": "d.jsonl:1", "calk": "d.jsonl:2", "mathh": "d.jsonl:4"}
    assert check_data_agents(data_agents(rows), ["calc", "calk", "mathh", "other"]) is None
    problem = check_data_agents(data_agents(rows), ["calc"])
    assert problem.startswith("the data's agent_ref.name ['calk', 'mathh'] (first at d.jsonl:2, d.jsonl:4) names no "
                              "agent server of the NeMo-Gym servers (agents: ['calc'])") and "\n" not in problem
    assert "(agents: [])" in check_data_agents({"calc": "d.jsonl:1"}, [])


def test_metrics_are_nemo_rls_over_the_scored_samples():
    def traj(reward, error=None, agent="a", turns=1, truncated=False):
        msgs, stripped = trajectory_messages({"response": {"output": [_item(list(range(2 * k + 1)), [9]) if k == 0
                                                                      else _item([0, 9] + [5] * (k - 1) * 2 + [5], [9])
                                                                      for k in range(turns)]}}, str)
        return Trajectory(0, 0, "nemo_gym", "", "", msgs, {"agent_name": agent, "nemo_gym_numbers": {"reward": reward}},
                          reward=None if error else reward, failure=error and Failure.of(error), truncated=truncated)
    trajs = [traj(1.0, turns=2), traj(0.0, truncated=True), traj(0.0, error="connection")]
    m = gym_metrics(trajs)
    assert m["turns_per_sample/mean"] == 1.5 and m["turns_per_sample/max"] == 2.0
    assert (m["natural_termination_rate"], m["truncation_rate"]) == (0.5, 0.5)
    assert m["a/reward/mean"] == 0.5 and m["total_reward/mean"] == 0.5 and m["gen_tokens_per_sample/mean"] == 1.5


def test_each_model_calls_message_carries_nemo_rls_flags_for_the_penalties():
    """fill_gym_trajectory flags an assistant message whose text holds an unexecuted tool call or broken thinking
    (`grpo.wings.gym.rewards.annotate_gym_items`), and keeps the decoded text in the stored result (penalty 4c reads it)."""
    from types import SimpleNamespace

    from grpo.wings.gym.rollout import fill_gym_trajectory

    def call(prompt, gen, text):
        return {**_item(prompt, gen), "content": [{"type": "output_text", "text": text}]}

    result = {"response": {"output": [call([1, 2], [3], "<tool_call>{}"), {"type": "function_call_output"},
                                      call([1, 2, 3, 4], [5], "<think>no end")]}, "reward": 1.0}
    env = SimpleNamespace(invalid_tool_call_patterns=None, thinking_tags=None)
    t = Trajectory(messages=[], group_id=0, prompt_index=0, task_name="nemo_gym", question="", answer="", metadata={})
    fill_gym_trajectory(t, {"agent_ref": {"name": "a"}}, (result, None, 0), decode=lambda ids: f"<{ids}>",
                        max_total_len=100, weight_version=0, env=env)
    assert [m.flags for m in t.messages if m.role == "assistant"] == [["invalid_tool_call"], ["malformed_thinking"]]
    assert [m.flags for m in t.messages if m.role != "assistant"] == [[], []]
    assert t.metadata["nemo_gym_result"]["response"]["output"][0]["generation_str"] == "<[3]>"
