"""NeMo-Gym rows with images (issue 47): a row whose Responses-API input holds an ``input_image`` part goes to the
example Gym agent server (examples/gym/, started by the stand-in launcher as grpo-ds starts Gym's), which calls the
run's endpoint with it as a chat ``image_url`` part; the sample's trajectory carries the picture the endpoint rendered
and trains on it token-exact (grpo/wings/gym/rollout.py, examples/gym/agent_server.py)."""

from __future__ import annotations

import json
import sys

import pytest

from grpo.config import MasterConfig
from grpo.system.rollout import new_trajectories
from grpo.tasks.failures import RetryPolicy
from grpo.tasks.nemo_gym import NemoGymEnvironment, gym_record_to_row
from grpo.tasks.rows import PromptRow
from grpo.tasks.visual import IMAGE_TOKENS
from grpo.wings.gym.rollout import MEDIA_KEY, GymLedger, play_gym
from grpo.wings.gym.servers import GymServers
from tests.helpers.e2e import REPO
from tests.helpers.image_agents import MODEL, TEMPLATE, data_url, mult_prob_error, vlm_endpoint

LAUNCHER = [sys.executable, "examples/gym/launch.py", "+config_paths=[{config_paths}]"]
RETRY = RetryPolicy(max_infra_attempts=1, max_data_attempts=1, backoff_base_s=0.05, max_backoff_s=0.05)


@pytest.fixture(scope="module")
def gym(tmp_path_factory):
    cfg = MasterConfig.model_validate({
        "policy": {"model_name": MODEL, "precision": "float32", "max_total_sequence_length": 96,
                   "tokenizer": {"chat_template": TEMPLATE},
                   "generation": {"max_new_tokens": 6, "port_range_low": 27000, "port_range_high": 27999}},
        "env": {"should_use_nemo_gym": True, "nemo_gym": {
            "config_paths": ["examples/gym/configs/calculator.yaml"], "launcher": LAUNCHER,
            "launcher_cwd": str(REPO), "port_range_low": 28000, "port_range_high": 28999, "startup_timeout_s": 120}}})
    endpoint = vlm_endpoint(cfg)
    servers = GymServers(cfg.env.nemo_gym, str(tmp_path_factory.mktemp("gym_logs")))
    try:
        env = NemoGymEnvironment(cfg.env.nemo_gym)
        env.ledger = GymLedger.of(endpoint, seed=0)
        env.agent_urls.update(servers.start(endpoint.base_url, env.ledger.key, endpoint.model_name))
        yield endpoint, env
    finally:
        servers.close()
        endpoint.close()


def _image_row(url: str) -> dict:
    content = [{"type": "input_image", "image_url": url, "detail": "auto"}, {"type": "input_text", "text": "1+2="}]
    return {"responses_create_params": {"input": [{"role": "user", "content": content}]},
            "agent_ref": {"type": "responses_api_agents", "name": "calc_simple_agent"}, "expected_answer": "3"}


def test_a_gym_row_with_an_image_trains_on_its_picture_token_exact(gym):
    endpoint, env = gym
    records = [_image_row(data_url((255, 0, 0))), _image_row(data_url((0, 0, 255)))]
    rows = []
    for i, record in enumerate(records):
        row = gym_record_to_row(record, f"test:{i}")
        assert "base64" not in row["question"]  # the row's text for logs holds no blob
        ids = endpoint.tokenizer(row["question"])["input_ids"]
        rows.append(PromptRow(i, row["question"], row["answer"], "nemo_gym",
                              [{"role": "user", "content": row["question"], "token_ids": ids}], ids, meta=row["meta"]))
    trajs = new_trajectories(rows, 2)
    play_gym(env, trajs, [(1, 0, i, "train") for i in range(len(trajs))], endpoint, RETRY)
    image_id = endpoint.tokenizer.convert_tokens_to_ids("<image>")
    for t in trajs:
        assert t.failure is None, t.failure
        assert t.media["pixel_values"].shape[0] == 1 and t.token_ids().count(image_id) == IMAGE_TOKENS
        assert MEDIA_KEY not in json.dumps(t.metadata["nemo_gym_result"], default=str)
    # each sample carries its own row's picture: red rows and blue rows differ
    assert not trajs[0].media["pixel_values"].equal(trajs[2].media["pixel_values"])
    assert abs(mult_prob_error(endpoint.model, trajs, endpoint.tokenizer.pad_token_id) - 1.0) < 1e-3
