"""End to end: NeMo-RL's GDPO NeMo-Gym recipe (examples/configs/recipes/llm/gdpo-qwen2.5-1.5b-1n8g-gym-multireward.yaml
and its defaults, copied verbatim under tests/fixtures/nemo_rl/examples/) trains 2 steps on the CPU with a tiny Qwen2
(the real Qwen2.5 tokenizer and chat template) against the example Gym servers: Gym's example_tool_call_multireward
environment (examples/gym/tool_call_multireward_server.py) started by the stand-in launcher, GDPO over its three
reward components with the recipe's reward_weights. Only NeMo-RL's key names; the overrides make it tiny and local."""

from __future__ import annotations

import re
import sys

import httpx
import pytest
import yaml

from tests.helpers.e2e import REPO, paths, run, train_rows

RECIPE = REPO / "tests/fixtures/nemo_rl/examples/configs/recipes/llm/gdpo-qwen2.5-1.5b-1n8g-gym-multireward.yaml"
DATA = "examples/gym/data/tool_call_multireward.jsonl"  # Gym's data/example.jsonl with each row's agent_ref
COMPONENTS = ("correctness", "format", "schema_valid")


@pytest.mark.slow  # ~3.5 minutes on the loaded 2-core machine
def test_the_gdpo_gym_recipe_trains_two_steps_over_the_components_and_stops_its_servers(tmp_path):
    try:
        from tests.helpers.reward_models import save_tiny_qwen2_lm

        model = save_tiny_qwen2_lm(str(tmp_path / "qwen2"))
    except (ImportError, OSError) as err:
        pytest.skip(f"no offline Qwen2.5 tokenizer: {err}")
    p = run([sys.executable, "train_grpo.py", "--config", str(RECIPE), *paths(
        tmp_path,
        # the model, tiny and local; fp32 and HF generation on the CPU (the recipe's vLLM is the GPU path)
        f"policy.model_name={model}", "policy.precision=float32", "policy.generation.backend=hf",
        # sizes: 2 prompts x 4 generations a step, so Gym's 5 rows give 2 steps
        "policy.max_total_sequence_length=256", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=4", "policy.generation_batch_size=8", "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2", "grpo.val_batch_size=5",
        "cluster.gpus_per_node=1",
        # the data and the servers: the example servers through the stand-in of ng_run
        f"data.train.data_path={DATA}", f"data.validation.data_path={DATA}",
        "env.nemo_gym.config_paths=[examples/gym/configs/tool_call_multireward.yaml]",
        '+env.nemo_gym.launcher=["{python}",examples/gym/launch.py,"+config_paths=[{config_paths}]"]')],
        timeout=1500)
    assert "done: 2 steps" in p.stdout, p.stdout[-3000:]
    config = yaml.safe_load((tmp_path / "logs" / "config.json").read_text())
    assert config["grpo"]["adv_estimator"]["name"] == "gdpo"
    assert config["grpo"]["adv_estimator"]["reward_weights"] == [1.0, 0.5, 0.25]  # GDPO checks one per component
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    agent = "train/env/nemo_gym/example_tool_call_multireward_simple_agent"
    for r in rows.values():
        assert r["train/num_valid_samples"] == 8 and r["train/env/nemo_gym/failed_samples"] == 0
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3
        for name in COMPONENTS:  # GDPO's per-component means, and the agent's
            assert f"train/reward/{name}/mean" in r and f"{agent}/{name}/mean" in r
        assert r["train/reward"] == pytest.approx(sum(r[f"train/reward/{name}/mean"] for name in COMPONENTS))
    launched = re.search(r"nemo_gym: servers launched \(.*?\): (\{.*\})", p.stdout)
    urls = list(yaml.safe_load(launched.group(1)).values())
    head = yaml.safe_load((tmp_path / "logs" / "nemo_gym" / "global_config.yaml").read_text())["head_server"]
    urls.append(f"http://{head['host']}:{head['port']}")
    for url in urls:  # the launcher and its servers stopped with the run
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{url}/verify", json={}, timeout=5)
