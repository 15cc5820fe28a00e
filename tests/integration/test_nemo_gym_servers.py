"""The NeMo-Gym path (grpo/tasks/nemo_gym.py, grpo/wings/gym/rollout.py, grpo/wings/gym/servers.py) over
real processes on loopback: the example Gym servers (examples/gym/) and a misbehaving agent server
(tests/helpers/gym/fault_agent.py), started by the stand-in launcher (examples/gym/launch.py) as grpo-ds starts
Gym's, against a real endpoint whose backend writes scripted texts with a real tokenizer."""

from __future__ import annotations

import json
import sys
import time

import pytest

from grpo.config import MasterConfig
from grpo.wings.agents.endpoint import Endpoint
from grpo.wings.gym.rollout import GymLedger, play_gym
from grpo.wings.gym.servers import LAUNCH_KEY, GymServerError, GymServers, read_global_config, start_gym_servers
from grpo.system.rollout import new_trajectories
from grpo.tasks.calculator import AGENT_CHAT_TEMPLATE
from grpo.tasks.failures import RetryPolicy
from grpo.tasks.nemo_gym import GymResultError, NemoGymEnvironment, gym_record_to_row
from grpo.tasks.rows import PromptRow
from grpo.tasks.toy import build_char_tokenizer
from tests.helpers.e2e import REPO
from tests.helpers.gym.decoy import Decoys
from tests.helpers.scripted_backend import ScriptedBackend

CALC_TOOL = {"type": "function", "name": "calc", "description": "Evaluate an arithmetic expression.",
             "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                            "required": ["expression"]}}
LAUNCHER = [sys.executable, "examples/gym/launch.py", "+config_paths=[{config_paths}]"]
CONFIGS = ["examples/gym/configs/calculator.yaml", "tests/helpers/gym/faults.yaml"]
RETRY = RetryPolicy(max_infra_attempts=2, max_data_attempts=1, backoff_base_s=0.05, max_backoff_s=0.05)


def _cfg(nemo_gym: dict, data: dict | None = None) -> MasterConfig:
    return MasterConfig.model_validate({**({"data": data} if data else {}),
        "policy": {"model_name": "toy:tiny", "max_total_sequence_length": 96, "generation": {
            "max_new_tokens": 24, "port_range_low": 25000, "port_range_high": 25999,
            "vllm_cfg": {"http_server_serving_chat_kwargs": {"tool_parser": "compact"}}}},
        "env": {"should_use_nemo_gym": True, "nemo_gym": nemo_gym}})


def _model_writes(prompt: str) -> str:
    """The scripted policy: a product is worked out with the tool, then the tool's result is the answer; a sum is
    answered at once."""
    if "*" not in prompt:
        a, b = prompt.removeprefix("<bos>").split("=")[0].split("+")
        return str(int(a) + int(b))
    return prompt.rsplit("<r>", 1)[1].split("</r>")[0] if "<r>" in prompt else "<calc>37*58</calc>"


@pytest.fixture(scope="module")
def gym(tmp_path_factory):
    """(endpoint, environment, servers): the endpoint over the scripted backend, the launched Gym servers calling it
    with the key of the environment's ledger."""
    tok = build_char_tokenizer(AGENT_CHAT_TEMPLATE)
    cfg = _cfg({"config_paths": CONFIGS, "launcher": LAUNCHER, "launcher_cwd": str(REPO),
                "port_range_low": 26000, "port_range_high": 26999, "startup_timeout_s": 120})
    endpoint = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, _model_writes), tok)
    endpoint.start()
    servers = GymServers(cfg.env.nemo_gym, str(tmp_path_factory.mktemp("gym_logs")))
    try:
        env = NemoGymEnvironment(cfg.env.nemo_gym)
        env.ledger = GymLedger.of(endpoint, seed=0)
        urls = servers.start(endpoint.base_url, env.ledger.key, endpoint.model_name)
        env.agent_urls.update(urls)
        yield endpoint, env, servers
    finally:
        servers.close()
        endpoint.close()


def _row(question: str, answer: str, agent: str = "calc_simple_agent", tools: bool = True, **extra) -> dict:
    params = {"input": [{"role": "user", "content": question}], **({"tools": [CALC_TOOL]} if tools else {})}
    return {"responses_create_params": params, "agent_ref": {"type": "responses_api_agents", "name": agent},
            "expected_answer": answer, **extra}


def _play(gym, records: list[dict], n: int = 1, stream: str = "train"):
    endpoint, env, _ = gym
    rows = []
    for i, record in enumerate(records):
        row = gym_record_to_row(record, f"test:{i}")
        ids = endpoint.tokenizer(row["question"])["input_ids"]
        rows.append(PromptRow(i, row["question"], row["answer"], "nemo_gym",
                              [{"role": "user", "content": row["question"], "token_ids": ids}], ids, meta=row["meta"]))
    trajs = new_trajectories(rows, n)
    play_gym(env, trajs, [(1, 0, i, stream) for i in range(len(trajs))], endpoint, RETRY)
    return trajs


def test_the_launcher_reports_the_servers_and_the_policy_keys(gym):
    _, env, servers = gym
    assert set(env.agent_urls) == {"calculator", "calc_simple_agent", "fault_agent"}
    assert servers.agents == ["calc_simple_agent", "fault_agent"] and servers.foreign_ports == []
    written = (servers.log_path.rsplit("/", 1)[0]) + "/global_config.yaml"
    import yaml

    config = yaml.safe_load(open(written))
    # the servers call with a key of their own (the ledger's session), never the run's
    assert config["policy_base_url"] == [gym[0].base_url] and config["policy_api_key"] == env.ledger.key
    assert env.ledger.key != gym[0].api_key
    assert read_global_config(servers.head_url)[LAUNCH_KEY] == config[LAUNCH_KEY]  # the head server is this launch's
    assert config["policy_model_name"] == gym[0].model_name and config["head_server"]["port"] >= 26000


def test_a_trajectory_is_exactly_the_tokens_of_the_model_calls(gym):
    endpoint, _, _ = gym
    before = len(endpoint.backend.calls)
    [t] = _play(gym, [_row("37*58=", "2146")])
    tok = endpoint.tokenizer
    assert (t.failure, t.reward, t.reward_components, t.mask_sample, t.turns) == (None, 1.0, {"correct": 1.0}, False, 2)
    assert [(m.role, m.trained) for m in t.messages] == [("user", False), ("assistant", True), ("user", False),
                                                         ("assistant", True)]
    assert tok.decode(t.token_ids()) == "<bos>37*58=<calc>37*58</calc><eos><r>2146</r>2146<eos>"
    assert tok.decode(t.completion_ids()) == "<calc>37*58</calc><eos>2146<eos>"
    assert all(m.generation_logprobs == [-0.5] * len(m.token_ids) for m in t.messages if m.trained)
    # the prompts the backend generated from are the trajectory's prefixes, token for token
    prompts = [p for call in endpoint.backend.calls[before:] for p in call]
    ids = t.token_ids()
    assert prompts == [ids[:len(t.messages[0].token_ids)],
                       ids[:sum(len(m.token_ids) for m in t.messages[:3])]]
    assert t.metadata["agent_name"] == "calc_simple_agent" and t.metadata["nemo_gym_numbers"]["reward"] == 1.0
    assert "prompt_token_ids" not in json.dumps(t.metadata["nemo_gym_result"])


def test_answers_that_come_back_out_of_order_are_regrouped_by_row(gym):
    # products take two model calls and a tool call, sums one: the sums' answers arrive first
    records = [_row("37*58=", "2146"), _row("3+4=", "7", tools=False), _row("37*58=", "2146"),
               _row("5+2=", "7", tools=False), _row("9+9=", "18", tools=False, fault="slow_0.5",
                                                   agent="fault_agent")]
    trajs = _play(gym, records)
    tok = gym[0].tokenizer
    assert [t.failure for t in trajs] == [None] * 5
    assert [tok.decode(t.messages[0].token_ids) for t in trajs[:4]] == ["<bos>37*58=", "<bos>3+4=", "<bos>37*58=",
                                                                       "<bos>5+2="]
    assert [t.turns for t in trajs] == [2, 1, 2, 1, 1]
    assert [t.reward for t in trajs] == [1.0] * 5


def test_validation_rows_get_the_validation_sampling(gym):
    endpoint, env, _ = gym
    # the endpoint answers 400 to sampling that is neither profile; a row stamped with validation's is answered
    trajs = _play(gym, [_row("3+4=", "7", tools=False)], stream="val")
    assert trajs[0].scored and trajs[0].reward == 1.0


def test_the_endpoint_answers_gyms_model_server_as_nemo_rls_vllm_server_does(gym):
    """Gym's model server (responses_api_models/vllm_model, return_token_id_information: true) sends logprobs=true,
    top_logprobs=0, return_tokens_as_token_ids=true and reads the token bundle on the message first."""
    import httpx

    endpoint = gym[0]
    body = {"model": endpoint.model_name, "messages": [{"role": "user", "content": "3+4="}], "temperature": 1.0,
            "top_p": 1.0, "max_tokens": 8, "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True}
    with endpoint.serving():  # the endpoint generates during rollouts only
        r = httpx.post(endpoint.base_url + "/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {endpoint.api_key}"})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    tok = endpoint.tokenizer
    assert tok.decode(message["prompt_token_ids"]) == "<bos>3+4="
    assert tok.decode(message["generation_token_ids"]) == "7<eos>"
    assert len(message["generation_log_probs"]) == len(message["generation_token_ids"])


def test_mask_sample_and_reward_components_are_honoured(gym):
    [t] = _play(gym, [_row("3+4=", "8", tools=False, instance_config={"mask_sample": True})])
    assert (t.failure, t.reward, t.reward_components, t.mask_sample) == (None, 0.0, {"correct": 0.0}, True)


def test_a_non_contiguous_result_raises(gym):
    with pytest.raises(GymResultError, match="non-contiguous"):
        _play(gym, [_row("1+1=", "2", agent="fault_agent", fault="noncontiguous")])


def test_components_that_do_not_sum_to_the_reward_raise(gym):
    with pytest.raises(GymResultError, match="sum to 0.25"):
        _play(gym, [_row("1+1=", "2", agent="fault_agent", fault="bad_sum")])


def test_server_errors_are_retried_then_masked_never_scored(gym):
    trajs = _play(gym, [_row("1+1=", "2", agent="fault_agent", fault="status_503"),
                        _row("1+1=", "2", agent="fault_agent", fault="status_422"), _row("3+4=", "7", tools=False)])
    assert [(t.failure and (t.failure.reason, t.failure.kind), t.retries) for t in trajs] == [
        (("http_5xx", "infra"), 1), (("http_4xx", "data"), 0), (None, 0)]
    assert trajs[2].reward == 1.0


def test_a_launcher_that_exits_is_one_clear_error(tmp_path):
    cfg = _cfg({"config_paths": ["nowhere.yaml"], "launcher": [sys.executable, "-c", "import sys; print('boom');"
                                                                                      " sys.exit(4)"],
                "startup_timeout_s": 30})
    servers = GymServers(cfg.env.nemo_gym, str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(GymServerError, match=r"exited with status 4 .*boom"):
        servers.start("http://127.0.0.1:1/v1", "k", "m")
    assert time.monotonic() - t0 < 20


def test_a_launcher_that_is_not_installed_says_what_to_do(tmp_path):
    cfg = _cfg({"config_paths": ["x.yaml"]})  # the default launcher: ng_run, not installed here
    with pytest.raises(GymServerError, match="Python >= 3.13"):
        GymServers(cfg.env.nemo_gym, str(tmp_path)).start("http://127.0.0.1:1/v1", "k", "m")


def test_servers_you_started_are_found_through_the_head_server(gym, tmp_path):
    endpoint, env, servers = gym
    cfg = _cfg({"head_server_url": servers.head_url, "startup_timeout_s": 10})
    mine = GymServers(cfg.env.nemo_gym, str(tmp_path))
    urls = mine.start(endpoint.base_url, env.ledger.key, endpoint.model_name)
    assert urls["calc_simple_agent"] == env.agent_urls["calc_simple_agent"] and mine.proc is None
    import yaml

    assert yaml.safe_load((tmp_path / "nemo_gym_env.yaml").read_text())["policy_api_key"] == env.ledger.key
    # servers started with another run's key (an earlier run's, another user's) are not this run's
    cfg = _cfg({"head_server_url": servers.head_url, "startup_timeout_s": 1})
    with pytest.raises(GymServerError, match="another policy_api_key than this run's.*start the servers with"):
        GymServers(cfg.env.nemo_gym, str(tmp_path)).start(endpoint.base_url, "sk-grpo-s-another", "m")
    cfg = _cfg({"agent_urls": {"a": "http://127.0.0.1:9"}, "startup_timeout_s": 1})
    with pytest.raises(GymServerError, match="did not answer"):
        GymServers(cfg.env.nemo_gym, str(tmp_path)).start(endpoint.base_url, "k", "m")


def _refused(t, *words: str) -> None:
    """Sample ``t`` failed as env_malformed (never trained), its detail naming the fault agent's server and row."""
    assert (t.failure.reason, t.failure.kind, t.reward) == ("env_malformed", "data", None), t.failure
    assert "'fault_agent' (http://127.0.0.1:" in t.failure.detail
    assert f"train data row {t.prompt_index}:" in t.failure.detail
    for word in words:
        assert word in t.failure.detail, t.failure.detail


def test_a_result_of_tokens_the_endpoint_never_generated_is_refused(gym):
    trajs = _play(gym, [_row("1+1=", "2", agent="fault_agent", fault="forged"), _row("3+4=", "7", tools=False)])
    _refused(trajs[0], "no generation the run's endpoint made")
    assert (trajs[1].failure, trajs[1].reward) == (None, 1.0)


def test_a_generation_backs_one_sample_only(gym):
    """The fault agent answers a second row with the first row's result (a replay): one of the two is refused, in
    the same rollout or a later one."""
    trajs = _play(gym, [_row("1+1=", "2", agent="fault_agent", tag="same"),
                        _row("1+1=", "2", agent="fault_agent", fault="replay", tag="same")])
    assert sorted(t.scored for t in trajs) == [False, True]
    _refused(next(t for t in trajs if not t.scored), "another sample claimed")
    [first] = _play(gym, [_row("5+2=", "7", agent="fault_agent", tag="later")])
    [replayed] = _play(gym, [_row("5+2=", "7", agent="fault_agent", fault="replay", tag="later")])
    assert first.scored
    _refused(replayed, "no generation the run's endpoint made")


@pytest.mark.parametrize("fault", ["token_generation_100000", "token_generation_-1", "token_prompt_-5",
                                   "token_prompt_89"])
def test_token_ids_outside_the_vocabulary_fail_their_sample_only(gym, fault):
    field, token = fault.split("_")[1:]
    trajs = _play(gym, [_row("1+1=", "2", agent="fault_agent", fault=fault), _row("3+4=", "7", tools=False)])
    _refused(trajs[0], f"{field}_token_ids[0]={token} is not a token id of the policy's tokenizer (ints in [0, 89))")
    assert (trajs[1].failure, trajs[1].reward) == (None, 1.0)


@pytest.mark.parametrize("value", ["inf", "nan", "0.5", "-inf"])
def test_a_logprob_must_be_finite_and_not_above_zero(gym, value):
    trajs = _play(gym, [_row("1+1=", "2", agent="fault_agent", fault=f"logprob_{value}"), _row("3+4=", "7",
                                                                                              tools=False)])
    _refused(trajs[0], f"generation_log_probs[0]={float(value)} is not a log-probability (finite and <= 0)")
    assert (trajs[1].failure, trajs[1].reward) == (None, 1.0)


def _gated_cfg(low: int, data: dict | None = None):
    launcher = [sys.executable, "tests/helpers/gym/gated_launch.py", "{config_file}", "examples/gym/launch.py",
                "+config_paths=[{config_paths}]"]
    return _cfg({"config_paths": ["examples/gym/configs/calculator.yaml"], "launcher": launcher,
                 "launcher_cwd": str(REPO), "port_range_low": low, "port_range_high": low + 99,
                 "startup_timeout_s": 120}, data)


def test_a_server_bound_on_the_head_servers_port_first_is_not_trusted(gym, tmp_path):
    """A decoy takes the port picked for the head server before the launcher binds it: its agent is never used (no
    row reaches it), the launcher starts again on another port, and the run's own servers play the samples."""
    endpoint, _, _ = gym
    cfg = _gated_cfg(28000)
    servers = GymServers(cfg.env.nemo_gym, str(tmp_path))
    decoys = Decoys(str(tmp_path / "nemo_gym" / "global_config.yaml"), strikes=1)
    try:
        env = NemoGymEnvironment(cfg.env.nemo_gym)
        env.ledger = GymLedger.of(endpoint, seed=0)
        env.agent_urls.update(servers.start(endpoint.base_url, env.ledger.key, endpoint.model_name))
        [decoy] = decoys.decoys
        assert servers.foreign_ports == [int(decoy.url.rsplit(":", 1)[1])]
        assert servers.head_url != decoy.url and env.agent_urls["calc_simple_agent"] != decoy.url
        trajs = _play((endpoint, env, servers), [_row("3+4=", "7", tools=False)])
        assert (trajs[0].failure, trajs[0].reward) == (None, 1.0) and decoy.runs == 0
    finally:
        servers.close()
        decoys.close()


def test_a_decoy_on_every_port_picked_stops_the_start_with_one_line(gym, tmp_path):
    endpoint, _, _ = gym
    servers = GymServers(_gated_cfg(28100).env.nemo_gym, str(tmp_path))
    decoys = Decoys(str(tmp_path / "nemo_gym" / "global_config.yaml"), strikes=99)
    try:
        with pytest.raises(GymServerError) as err:
            servers.start(endpoint.base_url, "k", endpoint.model_name)
        ports = [int(d.url.rsplit(":", 1)[1]) for d in decoys.decoys]
        assert len(ports) == 3 and f"ports {ports}" in str(err.value) and "\n" not in str(err.value)
        assert "a server this run did not launch answered first" in str(err.value)
        assert sum(d.runs for d in decoys.decoys) == 0 and servers.proc.poll() is not None
    finally:
        servers.close()
        decoys.close()


def test_a_launch_of_files_that_are_not_gym_server_configs_stops_the_start(gym, tmp_path):
    endpoint, _, _ = gym
    cfg = _cfg({"config_paths": ["configs/cpu_demo.yaml"], "launcher": LAUNCHER, "launcher_cwd": str(REPO),
                "port_range_low": 28200, "port_range_high": 28299, "startup_timeout_s": 120})
    servers = GymServers(cfg.env.nemo_gym, str(tmp_path))
    with pytest.raises(GymServerError, match=r"config_paths=\['configs/cpu_demo.yaml'\] include no agent server"):
        servers.start(endpoint.base_url, "k", endpoint.model_name)
    assert servers.proc.poll() is not None  # the launcher is stopped


def _gym_data(tmp_path, agents: list[str]) -> dict:
    for split, names in (("train", agents), ("val", agents[:1])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(_row("3+4=", "7", agent=a, tools=False)) + "\n"
                                                         for a in names))
    return {"train_data_path": str(tmp_path / "train.jsonl"), "val_data_path": str(tmp_path / "val.jsonl")}


class _Lines:
    def __init__(self):
        self.lines = []

    def write(self, line: str) -> None:
        self.lines.append(line)


def test_data_naming_an_unknown_agent_stops_the_start_with_one_line(gym, tmp_path):
    from types import SimpleNamespace

    endpoint, _, _ = gym
    cfg = _gated_cfg(28300, _gym_data(tmp_path, ["calc_simple_agent", "calc_simple_agnet"]))
    envs = SimpleNamespace(envs={"nemo_gym": NemoGymEnvironment(cfg.env.nemo_gym)})
    decoys = Decoys(str(tmp_path / "logs" / "nemo_gym" / "global_config.yaml"), strikes=0)  # the go-ahead only
    closables = []
    try:
        with pytest.raises(GymServerError) as err:
            start_gym_servers(cfg, [envs], endpoint, str(tmp_path / "logs"), closables, _Lines())
    finally:
        decoys.close()
    assert str(err.value) == (
        f"the data's agent_ref.name ['calc_simple_agnet'] (first at {tmp_path}/train.jsonl:2) names no agent server "
        "of the NeMo-Gym servers (agents: ['calc_simple_agent']): fix the data, or give the servers of that agent "
        "(env.nemo_gym.config_paths, agent_urls or head_server_url)")
    assert not closables[0].alive()  # the launcher is stopped


def test_the_run_gives_its_gym_servers_their_own_key_and_its_environments_the_ledger(gym, tmp_path):
    from types import SimpleNamespace

    endpoint, _, _ = gym
    cfg = _gated_cfg(28400, _gym_data(tmp_path, ["calc_simple_agent"]))
    train, val = (NemoGymEnvironment(cfg.env.nemo_gym) for _ in range(2))
    decoys = Decoys(str(tmp_path / "logs" / "nemo_gym" / "global_config.yaml"), strikes=0)
    closables, logger = [], _Lines()
    try:
        start_gym_servers(cfg, [SimpleNamespace(envs={"nemo_gym": train}), SimpleNamespace(envs={"nemo_gym": val})],
                          endpoint, str(tmp_path / "logs"), closables, logger)
        assert train.ledger is val.ledger and train.ledger.key not in (None, endpoint.api_key)
        assert read_global_config(closables[0].head_url)["policy_api_key"] == train.ledger.key
        assert set(train.agent_urls) == {"calculator", "calc_simple_agent"} and "servers launched" in logger.lines[-1]
        trajs = _play((endpoint, train, closables[0]), [_row("3+4=", "7", tools=False)], stream="val")
        assert (trajs[0].failure, trajs[0].reward) == (None, 1.0)
    finally:
        for c in closables:
            c.close()
        decoys.close()


def test_a_server_killed_mid_rollout_costs_its_samples_only(gym):
    """Runs last in this module: the fault agent's process is gone after it."""
    _, env, servers = gym
    trajs = _play(gym, [_row("1+1=", "2", agent="fault_agent", fault="die"), _row("3+4=", "7", tools=False),
                        _row("1+1=", "2", agent="fault_agent")])
    assert [(t.failure and (t.failure.reason, t.failure.kind), t.retries) for t in trajs[:2]] == [
        (("connection", "infra"), 1), (None, 0)]
    assert trajs[1].reward == 1.0
    # the fault agent's other row was answered before the process died, or failed the same way: never scored 0
    assert (trajs[2].failure, trajs[2].reward) == (None, 1.0) or trajs[2].failure.reason == "connection"
    _, metrics = env.global_post_process_and_metrics({"trajectories": trajs})
    assert metrics["failed_samples"] >= 1 and metrics["turns_per_sample/mean"] == 1.0
    assert metrics["calc_simple_agent/reward/mean"] == 1.0
    assert servers.alive()  # the launcher and the other servers go on


def test_the_launched_servers_die_with_a_killed_trainer(tmp_path):
    """A trainer killed by SIGKILL runs no cleanup: the parent-death signal stops the launcher, and its servers."""
    import os
    import signal
    import subprocess

    import httpx

    script = (
        "import sys, time\n"
        "from grpo.config import MasterConfig\n"
        "from grpo.wings.gym.servers import GymServers\n"
        f"cfg = MasterConfig.model_validate({{'env': {{'should_use_nemo_gym': True, 'nemo_gym': {{"
        f"'config_paths': ['examples/gym/configs/calculator.yaml'], 'launcher': {LAUNCHER!r}, "
        f"'port_range_low': 27000, 'port_range_high': 27999, 'startup_timeout_s': 120}}}}}})\n"
        f"s = GymServers(cfg.env.nemo_gym, {str(tmp_path)!r})\n"
        "urls = s.start('http://127.0.0.1:9/v1', 'k', 'm')\n"
        "print(s.head_url, urls['calc_simple_agent'], flush=True)\n"
        "time.sleep(300)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        head, agent = trainer.stdout.readline().split()
        assert httpx.get(head + "/global_config_dict_yaml", timeout=5).status_code == 200
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
    def down(url: str) -> bool:
        try:
            httpx.get(url, timeout=2)
            return False
        except httpx.ConnectError:
            return True
        except httpx.TransportError:  # a server being torn down: the connection reset mid-request; ask again
            return False

    deadline = time.monotonic() + 30
    while not (down(head + "/global_config_dict_yaml") and down(agent)):
        assert time.monotonic() < deadline, "the Gym servers outlived the killed trainer by 30 s"
        time.sleep(0.5)
