"""End to end, issue 43 item 5: SIGTERM while an agent blocks the event loop it runs on (``time.sleep`` inside
``async def``, for 10 minutes) ends the run with a checkpoint once env.agent.timeout_s has passed, not when the agent
gives control back (before: the run waited for the agent, past the timeout and past a second SIGTERM)."""

from __future__ import annotations

import json
import subprocess
import sys

from grpo.tasks.calculator import AGENT_CHAT_TEMPLATE
from tests.e2e.test_agent_e2e import CONFIG
from tests.helpers.e2e import REPO, child_env, paths, train_rows

TINY_AGENT_RUN = ["grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                  "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4",
                  "policy.generation_batch_size=4", "grpo.val_period=0", "grpo.val_at_start=false",
                  "grpo.val_at_end=false", "checkpointing.save_period=100", "logger.progress_bar=false",
                  "data.num_train_samples=16", "data.num_val_samples=4"]


def tiny_agent_config(tmp_path) -> str:
    """The agent demo over ``toy:tiny`` (untrained, built in a moment; toy:calc_agent's build takes minutes): the
    endpoint renders with the demo's template, the agent plays whatever the model writes."""
    path = tmp_path / "tiny_agent.yaml"
    path.write_text(f"defaults: {CONFIG}\npolicy:\n  model_name: toy:tiny\n  generation:\n    vllm_cfg:\n"
                    f"      http_server_serving_chat_kwargs:\n        chat_template: {json.dumps(AGENT_CHAT_TEMPLATE)}\n")
    return str(path)


def test_sigterm_while_an_agent_blocks_its_loop_stops_the_run_with_a_checkpoint_at_the_agents_timeout(tmp_path):
    # The first agent answered by the weights of step 1 (version 1: step 2's rollout) sends SIGTERM to the trainer,
    # then blocks for 600 s. A slow answer in step 1 (a loaded machine) is retried, as an infra failure.
    env = {**child_env(), "GRPO_TEST_FLAG": str(tmp_path / "signalled"), "GRPO_TEST_SIGNAL_AT_VERSION": "1"}
    args = [sys.executable, "train_grpo.py", "--config", tiny_agent_config(tmp_path),
            *paths(tmp_path, *TINY_AGENT_RUN, "env.agent.fn=tests.helpers.agent_fns:signal_then_block",
                   "env.agent.timeout_s=3")]
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # < the agent's 600 s
    out = p.stdout + p.stderr
    assert p.returncode == 143, out[-4000:]
    assert "SIGTERM received during step 2: the step was abandoned before training" in out, out[-4000:]
    assert sorted(train_rows(tmp_path)) == [1]
    assert json.loads((tmp_path / "ckpt" / "latest_checkpoint_status.json").read_text())["step"] == 1
    assert "Event loop is closed" not in out and "Traceback" not in out, out[-4000:]
