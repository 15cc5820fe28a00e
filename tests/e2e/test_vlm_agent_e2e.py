"""End to end: a vision-language policy (``toy:tiny_vlm``) trained on agent samples that send pictures through the
run's endpoint (issue 47): the agent (tests/helpers/image_agents.py) sends a picture, then a tool result with another,
or forwards an image dataset's rows unchanged (their pictures as image_url parts); the trainer trains on the recorded
tokens with the recorded pictures, token-exact (token_mult_prob_error within 1e-3 of 1.0, hf backend, colocated)
(slow)."""

from __future__ import annotations

import sys

import pytest
import yaml

from tests.helpers.e2e import REPO, paths, run, train_rows
from tests.helpers.image_agents import TEMPLATE


@pytest.mark.slow
@pytest.mark.parametrize("agent, calls", [("picture_agent", 2), ("forwarding_agent", 1)])
def test_an_agent_that_sends_pictures_trains_on_them_token_exact(tmp_path, agent, calls):
    """``picture_agent`` sends pictures of its own; ``forwarding_agent`` forwards the image dataset's rows
    (visual:images) unchanged, their pictures as the row gives them to it (image_url parts)."""
    config = yaml.safe_load((REPO / "configs" / "cpu_demo_vlm.yaml").read_text())
    config["policy"].update(model_name="toy:tiny_vlm", max_total_sequence_length=128, train_global_batch_size=8,
                            train_micro_batch_size=8, logprob_batch_size=8, generation_batch_size=8)
    config["policy"]["tokenizer"]["chat_template"] = TEMPLATE  # an end-of-sequence token after assistant turns
    config["grpo"].update(max_num_steps=2, num_prompts_per_step=2, num_generations_per_prompt=4, val_period=0,
                          val_at_start=False, val_at_end=False)
    config["data"].update(num_train_samples=8, num_val_samples=4)
    config["env"] = {"name": "agent", "agent": {"fn": f"tests.helpers.image_agents:{agent}"}}
    config["checkpointing"]["enabled"] = False
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    run([sys.executable, "train_grpo.py", "--config", str(path), *paths(tmp_path, "logger.progress_bar=false")],
        timeout=1200)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["train/env/agent/failed_samples"] == 0 and r["train/env/agent/noncontiguous_samples"] == 0
        assert r["train/env/agent/calls_per_sample"] == calls
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3  # the trainer scores the tokens with the pictures
