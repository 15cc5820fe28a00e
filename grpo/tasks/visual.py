"""A tiny vision-language model built locally, and the visual CPU demo's task (configs/cpu_demo_vlm.yaml).

The model (``toy:tiny_vlm``) is transformers' `LlavaForConditionalGeneration`: a one-layer CLIP vision tower over
32x32 images in 8x8 patches (16 image tokens, the CLS token dropped), a linear projector and a Llama text model over
the char tokenizer (`grpo.tasks.toy`) plus one special token, ``<image>``. Its processor is a `LlavaProcessor` with
transformers' PIL image processor (``CLIPImageProcessorPil``: no torchvision), saved beside the model, so
``AutoProcessor`` and ``AutoModelForImageTextToText`` load both from the directory.

    >>> tok = build_vlm_tokenizer()
    >>> tok("a<image>b")["input_ids"][1:] == [tok.convert_tokens_to_ids(c) for c in ("a", IMAGE_TOKEN, "b")]
    True
"""

from __future__ import annotations

from grpo.tasks.toy import MODEL_SIZES, build_char_tokenizer, save_char_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2   # placeholders one image expands to

# Roles as plain text (like grpo.tasks.toy.SIMPLE_CHAT_TEMPLATE); a content list renders its text parts as they are
# and an image part as the processor's placeholder. Newlines are written as expressions: transformers renders
# templates with trim_blocks, which would eat a newline right after a block tag.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_vlm_tokenizer():
    """The char tokenizer with `VLM_CHAT_TEMPLATE` and ``<image>`` as one special token (the last id)."""
    tok = build_char_tokenizer(VLM_CHAT_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tok


def build_vlm_processor(tok):
    """`LlavaProcessor` over ``tok`` with the PIL image processor: images resized to 32x32 (no crop), CLIP's
    normalisation; one ``<image>`` expands to `IMAGE_TOKENS` placeholders."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    images = CLIPImageProcessorPil(size=size, crop_size=size, do_center_crop=False)
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH_SIZE, image_token=IMAGE_TOKEN,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=VLM_CHAT_TEMPLATE)


def build_tiny_vlm(tok, size: str = "tiny", seed: int = 0, vision_hidden: int = 32, vision_layers: int = 1):
    """Random-init fp32 `LlavaForConditionalGeneration`: the text model of `grpo.tasks.toy.MODEL_SIZES[size]`, a
    CLIP vision tower of ``vision_layers`` layers of width ``vision_hidden`` over 32x32 images in 8x8 patches."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       **MODEL_SIZES[size])
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=2, image_size=IMAGE_SIZE,
                              patch_size=PATCH_SIZE, projection_dim=vision_hidden)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                      vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=False)
    cfg.dtype = torch.float32
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, key, getattr(tok, key))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(tok, key))
    return model


def save_vlm(model, tok, out_dir: str) -> str:
    """Model, processor and tokenizer into ``out_dir`` (``from_pretrained`` / ``AutoProcessor`` load them)."""
    model.save_pretrained(out_dir, safe_serialization=True)
    build_vlm_processor(tok).save_pretrained(out_dir)
    save_char_tokenizer(tok, out_dir)
    return out_dir


def save_tiny_vlm(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """``toy:tiny_vlm``: an untrained tiny VLM (tests)."""
    tok = build_vlm_tokenizer()
    return save_vlm(build_tiny_vlm(tok, size=size, seed=seed), tok, out_dir)
