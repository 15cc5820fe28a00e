"""env.name=agent (grpo/wings/agents/environment.py, grpo/wings/agents/player.py): agents written with the openai client play
samples over a real endpoint on loopback; the trajectories come from the recorded tokens (a row per branch where an
agent rewrote its history), and every failure is a masked failure, never a 0."""

from __future__ import annotations

import sys

import pytest

from grpo.config import MasterConfig
from grpo.wings.agents.player import AgentPlayer
from grpo.wings.agents.endpoint import Endpoint
from grpo.system.rollout import TurnSettings, generate_rollout, new_trajectories
from grpo.tasks.calculator import AGENT_CHAT_TEMPLATE
from grpo.tasks.factory import build_environments
from grpo.tasks.function import EnvError
from grpo.tasks.rows import PromptRow
from grpo.tasks.toy import build_char_tokenizer
from tests.helpers.scripted_backend import ScriptedBackend

FNS = "tests.helpers.agent_fns"


def _cfg(agent: dict) -> MasterConfig:
    return MasterConfig.model_validate({
        "policy": {"model_name": "toy:tiny", "max_total_sequence_length": 96, "generation": {
            "max_new_tokens": 24, "port_range_low": 24000, "port_range_high": 24999,
            "vllm_cfg": {"http_server_serving_chat_kwargs": {"tool_parser": "compact"}}}},
        "env": {"name": "agent", "agent": agent}})


def _model_writes(prompt: str) -> str:
    """The scripted policy: calls the tool first, answers with the tool's result after it."""
    return "2146" if "<r>" in prompt else "<calc>37*58</calc>"


@pytest.fixture(scope="module")
def endpoint():
    tok = build_char_tokenizer(AGENT_CHAT_TEMPLATE)
    cfg = _cfg({"fn": f"{FNS}:calc_agent"})
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, _model_writes), tok)
    ep.start()
    yield ep
    ep.close()


def _play(endpoint, agent: dict, n: int = 2, question: str = "37*58=", player: AgentPlayer | None = None,
          rollout_failure=None):
    """``n`` samples of ``question`` played by ``agent`` (an env.agent section) over ``endpoint``; ``rollout_failure``:
    the retry budgets (None: one attempt)."""
    envs = build_environments(_cfg(agent).env, rollout_failure=rollout_failure)
    tok = endpoint.tokenizer
    ids = tok(question)["input_ids"]
    rows = [PromptRow(0, question, "2146", "agent", [{"role": "user", "content": question, "token_ids": ids}], ids)]
    trajs = new_trajectories(rows, n)
    (player or AgentPlayer(endpoint)).play(trajs, [(1, 0, i, "train") for i in range(n)], envs)
    return trajs, envs


def test_an_agents_trajectory_is_the_tokens_it_generated(endpoint):
    trajs, envs = _play(endpoint, {"fn": f"{FNS}:calc_agent"})
    tok = endpoint.tokenizer
    for t in trajs:
        assert (t.reward, t.reward_components, t.failure, t.mask_sample, t.turns) == (1.0, {"answered": 1.0}, None,
                                                                                       False, 2)
        assert [(m.role, m.trained) for m in t.messages] == [("user", False), ("assistant", True), ("user", False),
                                                             ("assistant", True)]
        assert tok.decode(t.token_ids()) == "<bos>37*58=<calc>37*58</calc><eos><r>2146</r>2146<eos>"
        assert tok.decode(t.completion_ids()) == "<calc>37*58</calc><eos>2146<eos>"
        assert all(m.generation_logprobs == [-0.5] * len(m.token_ids) for m in t.messages if m.trained)
    _, metrics = envs.post_process(trajs)
    assert metrics == {"env/agent/failed_samples": 0.0, "env/agent/noncontiguous_samples": 0.0,
                       "env/agent/calls_per_sample": 2.0, "env/agent/branches_per_sample": 1.0,
                       "env/agent/trained_tokens_per_sample": 24.0, "env/agent/row_tokens_per_sample": 42.0,
                       "env/agent/realigned_tokens_per_sample": 0.0}


def test_an_agent_program(endpoint):
    trajs, _ = _play(endpoint, {"command": [sys.executable, "-m", FNS]})
    assert [(t.reward, t.failure, t.turns) for t in trajs] == [(1.0, None, 2)] * 2
    trajs, _ = _play(endpoint, {"command": [sys.executable, "-m", FNS]}, question="crash")
    assert trajs[0].failure.reason == "env_error" and "fell over" in trajs[0].failure.detail


def test_a_rewritten_history_trains_as_two_branches_never_retemplated(endpoint):
    """An agent that keeps only the text and rewrites it: its second call's prompt does not continue the first call,
    so the sample is two rows (was: masked), each the tokens the endpoint saw and generated."""
    trajs, envs = _play(endpoint, {"fn": f"{FNS}:rewriting_agent"})
    t = trajs[0]
    assert t.reward == 0.5 and not t.mask_sample and t.turns == 2 and len(t.branches) == 1
    tok = endpoint.tokenizer
    assert tok.decode(t.token_ids()) == "<bos>37*58=<calc>37*58</calc><eos>"
    assert tok.decode([i for m in t.branches[0] for i in m.token_ids]).endswith("<r>2146</r>2146<eos>")
    metrics = envs.post_process(trajs)[1]
    assert metrics["env/agent/noncontiguous_samples"] == 0.0 and metrics["env/agent/branches_per_sample"] == 2.0


def test_a_compacting_agent_with_a_sub_agent_trains_as_branches_each_token_once_with_the_sample_s_advantage(
        endpoint):
    from grpo.batch import build_batch
    from grpo.step import compose_advantages, initial_sample_mask, mask_invalid_samples
    from tests.helpers import agent_fns

    agent_fns.ANSWERS.clear()
    trajs, envs = _play(endpoint, {"fn": f"{FNS}:compacting_agent"})
    answers = list(agent_fns.ANSWERS.values())
    assert len(answers) == 2 and answers[0] == answers[1] and len(answers[0]) == 5
    generated = sorted((tuple(p), tuple(g)) for p, g in answers[0])
    for t in trajs:
        assert (t.reward, t.turns, t.mask_sample, t.failure, len(t.branches)) == (1.0, 5, False, None, 2)
        trained = []  # (the row's tokens before it, the tokens) of every trained message of every row
        for row in [t.messages, *t.branches]:
            ids = []
            for m in row:
                if m.trained:
                    trained.append((tuple(ids), tuple(m.token_ids)))
                    assert m.generation_logprobs == [-0.5] * len(m.token_ids)
                ids += m.token_ids
        assert sorted(trained) == generated  # what the endpoint generated, after what it was given, each once
    metrics = envs.post_process(trajs)[1]
    assert metrics["env/agent/branches_per_sample"] == 3.0
    assert metrics["env/agent/trained_tokens_per_sample"] == sum(len(g) for _, g in generated)
    trajs[1].reward = 0.0  # one sample right, one wrong: advantages +1 and -1 (a group of 2, leave-one-out)
    cfg = _cfg({"fn": f"{FNS}:compacting_agent"})
    b, counts = mask_invalid_samples(build_batch(trajs, endpoint.tokenizer.pad_token_id))
    adv_bt, _, _ = compose_advantages(cfg, b.replace(sample_mask_b=initial_sample_mask(cfg, b)))
    assert b.branch_b.tolist() == [0, 1, 2] * 2 and counts["rollout/masked_samples"] == 0
    trained_bt = b.token_mask_bt.bool()
    assert int(trained_bt.sum()) == 2 * sum(len(g) for _, g in generated)
    for row, want in zip(range(6), [1.0] * 3 + [-1.0] * 3):
        assert adv_bt[row][trained_bt[row]].tolist() == [want] * int(trained_bt[row].sum())


@pytest.mark.parametrize("agent, reason, kind, words", [
    ({"fn": f"{FNS}:broken_agent"}, "env_error", "data", "the agent's own bug"),
    ({"fn": f"{FNS}:slow_agent", "timeout_s": 0.5}, "env_timeout", "infra", "timeout_s=0.5"),
    ({"fn": f"{FNS}:malformed_agent"}, "env_malformed", "data", "finite 'reward'"),
    ({"fn": f"{FNS}:silent_agent"}, "env_malformed", "data", "no call"),
])
def test_failed_agents_fail_their_samples(endpoint, agent, reason, kind, words):
    trajs, envs = _play(endpoint, agent)
    for t in trajs:
        assert (t.failure.reason, t.failure.kind, t.reward) == (reason, kind, None) and words in t.failure.detail
    assert envs.post_process(trajs)[1]["env/agent/failed_samples"] == 2.0


def test_agent_config_errors_name_the_key():
    with pytest.raises(EnvError, match=r"env.agent.fn=.*not_async.*async function"):
        build_environments(_cfg({"fn": f"{FNS}:not_async"}).env)
    with pytest.raises(ValueError, match="exactly one of fn"):
        _cfg({})


def test_generate_rollout_hands_agent_samples_to_the_agents(endpoint):
    envs = build_environments(_cfg({"fn": f"{FNS}:calc_agent"}).env)
    ids = endpoint.tokenizer("37*58=")["input_ids"]
    rows = [PromptRow(i, "37*58=", "2146", "agent", [{"role": "user", "content": "37*58=", "token_ids": ids}], ids)
            for i in range(2)]
    r = generate_rollout(rows, 2, endpoint.backend, envs, None, TurnSettings(3, 96, 8), base_seed=0, step=0,
                         gen_batch=0, stream="train", rank=0, world_size=1, player=AgentPlayer(endpoint))
    assert [t.reward for t in r.trajectories] == [1.0] * 4 and r.timing["agent_s"] > 0
    assert r.metrics["env/agent/calls_per_sample"] == 2.0


def test_an_agent_sample_whose_calls_span_weight_versions_is_aged_by_its_oldest_call():
    """The async loop's staleness bound for agent samples: weights that change between a sample's calls (an in-flight
    update on generation ranks lands during its first call) leave it the version of its OLDEST call, as its group
    in the replay deque; trained at a step where that call is over ``max_trajectory_age_steps`` old, the group is
    never trained (as any group of the async loop's own), though its newest call alone would pass."""
    from grpo.system.replay import ReplayBuffer, groups_from_trajectories

    class UpdatedMidCall(ScriptedBackend):  # its first generate ends on newer weights
        def generate(self, prompt_ids, seeds, **kw):
            outs = super().generate(prompt_ids, seeds, **kw)
            if len(self.calls) == 1:
                ep.weight_version += 1  # what RolloutProducer._load_mid_request does inside a generate call
            return outs

    tok = build_char_tokenizer(AGENT_CHAT_TEMPLATE)
    cfg = _cfg({"fn": f"{FNS}:calc_agent"})
    ep = Endpoint(cfg, UpdatedMidCall(tok, cfg.policy.generation, _model_writes), tok)
    ep.start()
    try:
        ids = tok("37*58=")["input_ids"]
        row = PromptRow(0, "37*58=", "2146", "agent", [{"role": "user", "content": "37*58=", "token_ids": ids}], ids)
        version_first = new_trajectories([row], 1)  # played over weights of version 5 (the thread's load)
        AgentPlayer(ep).play(version_first, [(1, 0, 0, "train")], build_environments(cfg.env), weight_version=5)
    finally:
        ep.close()
    t = version_first[0]
    assert t.turns == 2 and t.scored and ep.weight_version == 6  # its calls: versions 5, then 6
    assert t.generation_version == 5
    group = groups_from_trajectories([t])[0]
    assert group.version == 5
    buf = ReplayBuffer(max_age_steps=1)
    buf.put([group], [group.version], target_version=7)  # trained at step 7: age (7 - 1) - 5 = 1, within the bound
    assert buf.take(7, 1)[0][0].generation_version == 5
    buf.put([group], [group.version], target_version=8)  # at step 8 its first call is 2 steps old (its second, 1)
    with pytest.raises(RuntimeError, match="older than max_age_steps=1"):
        buf.take(8, 1)
    assert buf.num_evicted == 1 and len(buf) == 0


def test_the_synchronous_loop_labels_agent_samples_with_the_steps_trained(endpoint):
    """train_grpo.py's generator holds the weights of the steps trained so far (refit after each): its rollouts, and
    the endpoint's answers in them, record that version (not 0)."""
    from types import SimpleNamespace

    from grpo.run.run import run_rollout

    cfg = _cfg({"fn": f"{FNS}:calc_agent"})
    envs = build_environments(cfg.env)
    ids = endpoint.tokenizer("37*58=")["input_ids"]
    rows = [PromptRow(0, "37*58=", "2146", "agent", [{"role": "user", "content": "37*58=", "token_ids": ids}], ids)]
    run = SimpleNamespace(cfg=cfg, state=SimpleNamespace(current_step=4), chat=None, turn_stop=None, rank=0,
                          world_size=1, player=AgentPlayer(endpoint), deferred=None)
    r = run_rollout(run, endpoint.backend, envs, rows, 5, 0)
    assert [t.generation_version for t in r.trajectories] == [4] * cfg.grpo.num_generations_per_prompt
    assert endpoint.weight_version == 4


def test_the_demo_agent_ends_a_conversation_that_outgrows_the_context_unanswered_not_failed():
    """examples/calculator_agent.py: when its history leaves no room under policy.max_total_sequence_length (the
    endpoint's 400 context_length_exceeded) the episode ends with reward 0, trained on the calls it made; masking it
    as a failure would hide the policy's rambling from the gradient (and skipped the demo's steps)."""
    tok = build_char_tokenizer(AGENT_CHAT_TEMPLATE)
    agent = {"fn": "examples.calculator_agent:calculator_agent"}
    cfg = _cfg(agent).model_copy(deep=True)
    cfg.policy.max_total_sequence_length = 40
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, lambda prompt: "<calc>37*58</calc>"), tok)
    ep.start()
    try:
        trajs, envs = _play(ep, agent, n=1)
    finally:
        ep.close()
    t = trajs[0]
    assert (t.failure, t.reward, t.mask_sample) == (None, 0.0, False)
    # two calls fit (their tokens trained); the third (of MAX_TURNS=3), with both tool results, had no room
    assert [m.role for m in t.messages] == ["user", "assistant", "user", "assistant"]
    _, metrics = envs.post_process(trajs)
    assert metrics["env/agent/failed_samples"] == 0.0
