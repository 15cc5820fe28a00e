"""A tiny vision-language model built locally, and the visual CPU demo's task (configs/cpu_demo_vlm.yaml).

The task (``data.dataset_name=visual:images``, ``env.name=visual``): a 16x16 picture drawn with PIL (four 8x8
cells, one patch each), and one of three questions about it: ``colour?`` (a square in red, green,
blue or yellow), ``count?`` (1 to 3 white squares) and ``shape?`` (a filled ``box`` or a hollow ``ring``); the answer
is one word. ``visual:blank`` asks the same questions over black pictures: the text-only baseline, whose best policy
answers each question's likeliest answer (1/4, 1/3 and 1/2 right: 0.36 on average). Which side a shape is on was
the third question first: the tiny model did not learn positions within its warm start (its answers stayed 50/50),
while colours, counts and shapes (what a patch holds) it learns in a few hundred steps.

The model (``toy:tiny_vlm``) is transformers' `LlavaForConditionalGeneration`: a one-layer CLIP vision tower over
16x16 images in 8x8 patches (4 image tokens, the CLS token dropped), a two-layer projector and a Llama text model over
the char tokenizer (`grpo.tasks.toy`) plus one special token, ``<image>``. Its processor is a `LlavaProcessor` with
transformers' PIL image processor (``CLIPImageProcessorPil``: no torchvision), saved beside the model, so
``AutoProcessor`` and ``AutoModelForImageTextToText`` load both from the directory.

    >>> tok = build_vlm_tokenizer()
    >>> tok("a<image>b")["input_ids"][1:] == [tok.convert_tokens_to_ids(c) for c in ("a", IMAGE_TOKEN, "b")]
    True
"""

from __future__ import annotations

import io
import random
import re

from grpo.tasks.rows import Row, split_seed
from grpo.tasks.toy import MODEL_SIZES, build_char_tokenizer, save_char_tokenizer, supervise

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 16, 8
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
    """`LlavaProcessor` over ``tok`` with the PIL image processor: images resized to 16x16 (no crop), CLIP's
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
    CLIP vision tower of ``vision_layers`` layers of width ``vision_hidden`` over 16x16 images in 8x8 patches."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       **MODEL_SIZES[size])
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=2, image_size=IMAGE_SIZE,
                              patch_size=PATCH_SIZE, projection_dim=vision_hidden)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                      vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=False)
    return _random_init(LlavaForConditionalGeneration, cfg, tok, seed)


def _random_init(model_class, cfg, tok, seed: int):
    """``model_class(cfg)`` in fp32 from ``seed``, its config's and generation config's special ids the tokenizer's."""
    import torch

    cfg.dtype = torch.float32
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, key, getattr(tok, key))
    torch.manual_seed(seed)
    model = model_class(cfg).to(torch.float32)
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


# --------------------------------------------------------------------------------------------------
# A tiny Qwen2-VL (multimodal M-RoPE positions)
# --------------------------------------------------------------------------------------------------
QWEN_IMAGE_TOKEN, QWEN_VISION_START, QWEN_VISION_END, QWEN_VIDEO_TOKEN = (
    "<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
QWEN_PATCH, QWEN_MERGE = 4, 2   # a 16x16 picture: a 4x4 grid of patches, merged 2x2 into 4 image tokens


def build_qwen_vl_tokenizer():
    """The char tokenizer with Qwen-VL's vision tokens as special tokens; its chat template writes an image as
    ``<|vision_start|><|image_pad|><|vision_end|>`` (Qwen2-VL's)."""
    template = VLM_CHAT_TEMPLATE.replace(IMAGE_TOKEN, QWEN_VISION_START + QWEN_IMAGE_TOKEN + QWEN_VISION_END)
    tok = build_char_tokenizer(template)
    tok.add_special_tokens({"additional_special_tokens": [QWEN_VISION_START, QWEN_VISION_END, QWEN_IMAGE_TOKEN,
                                                         QWEN_VIDEO_TOKEN]})
    return tok


def build_qwen_vl_processor(tok):
    """A Qwen2-VL processor over ``tok`` with transformers' PIL image processor (``Qwen2VLImageProcessorPil``: no
    torchvision) and no video processor (transformers' needs torchvision): pictures resized to between one merged
    patch (8x8) and 16x16 pixels, keeping their aspect, in 4x4 patches, two frames per temporal patch, merged 2x2;
    one ``<|image_pad|>`` expands to (height / 8) x (width / 8) placeholders (4 for the task's 16x16 pictures)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """`Qwen2VLProcessor` without its video processor (images only)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = QWEN_IMAGE_TOKEN, QWEN_VIDEO_TOKEN
            self.image_token_id = tokenizer.convert_tokens_to_ids(QWEN_IMAGE_TOKEN)
            self.video_token_id = tokenizer.convert_tokens_to_ids(QWEN_VIDEO_TOKEN)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    images = Qwen2VLImageProcessorPil(min_pixels=(QWEN_PATCH * QWEN_MERGE) ** 2, max_pixels=IMAGE_SIZE ** 2,
                                      patch_size=QWEN_PATCH,
                                      merge_size=QWEN_MERGE, temporal_patch_size=2)
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template)


def build_tiny_qwen_vl(tok, model_type: str = "qwen2_vl", size: str = "tiny", seed: int = 0, vision_hidden: int = 32):
    """Random-init fp32 Qwen2-VL (``model_type="qwen2_vl"``) or Qwen2.5-VL (``"qwen2_5_vl"``: its windowed vision
    blocks, SwiGLU and RMSNorm): the text model of `grpo.tasks.toy.MODEL_SIZES[size]` with M-RoPE (sections
    [2, 3, 3] of its 16-wide heads' 8 frequencies: time, height, width), a one-block vision transformer of width
    ``vision_hidden`` over 4x4 patches, merged 2x2 into the text model's width."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    text_size = MODEL_SIZES[size]
    head_dim = text_size["hidden_size"] // text_size["num_attention_heads"]
    unit = head_dim // 16  # the 8ths of a head's head_dim / 2 frequencies
    text = dict(vocab_size=len(tok), max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2 * unit, 3 * unit, 3 * unit]},
                **text_size)
    vision = dict(depth=1, num_heads=2, patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=2,
                  in_channels=3)
    if model_type == "qwen2_vl":
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision.update(embed_dim=vision_hidden, hidden_size=text_size["hidden_size"], mlp_ratio=2)
    elif model_type == "qwen2_5_vl":  # 8x8-pixel windows (one merged patch) in its block, as Qwen2.5-VL's 112
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision.update(hidden_size=vision_hidden, out_hidden_size=text_size["hidden_size"],
                      intermediate_size=2 * vision_hidden, window_size=QWEN_PATCH * QWEN_MERGE,
                      fullatt_block_indexes=[])
    else:
        raise ValueError(f"tiny Qwen-VL model_type {model_type!r}: expected 'qwen2_vl' or 'qwen2_5_vl'")
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", QWEN_IMAGE_TOKEN),
                                                        ("video_token_id", QWEN_VIDEO_TOKEN),
                                                        ("vision_start_token_id", QWEN_VISION_START),
                                                        ("vision_end_token_id", QWEN_VISION_END))}
    cfg = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return _random_init(model_class, cfg, tok, seed)


# --------------------------------------------------------------------------------------------------
# The visual task
# --------------------------------------------------------------------------------------------------
COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (40, 70, 235), "yellow": (235, 215, 40)}
KINDS = ("colour", "count", "shape")
MAX_COUNT = 3
FIRST_WORD = re.compile(r"[a-z0-9]+")


def draw(kind: str, rng: random.Random):
    """(a 16x16 RGB picture, its answer) for one question ``kind``; a count's or a shape's square fills one 8x8 cell
    (a patch) but its border, a colour's the whole picture but its border."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
    pen = ImageDraw.Draw(img)
    cells = [(x, y) for x in range(0, IMAGE_SIZE, PATCH_SIZE) for y in range(0, IMAGE_SIZE, PATCH_SIZE)]
    if kind == "colour":  # a square over the whole picture but its border
        name = rng.choice(sorted(COLOURS))
        pen.rectangle([1, 1, IMAGE_SIZE - 2, IMAGE_SIZE - 2], fill=COLOURS[name])
        return img, name
    if kind == "count":
        n = rng.randint(1, MAX_COUNT)
        for x, y in rng.sample(cells, n):
            pen.rectangle([x + 1, y + 1, x + PATCH_SIZE - 2, y + PATCH_SIZE - 2], fill=(255, 255, 255))
        return img, str(n)
    if kind == "shape":
        x, y = rng.choice(cells)
        name = rng.choice(["box", "ring"])
        box = [x + 1, y + 1, x + PATCH_SIZE - 2, y + PATCH_SIZE - 2]
        pen.rectangle(box, fill=(255, 255, 255) if name == "box" else None, outline=(255, 255, 255))
        return img, name
    raise ValueError(f"visual question kind {kind!r}: expected one of {list(KINDS)}")


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def visual_rows(n: int, seed: int, split: str, blank: bool = False) -> list[Row]:
    """``n`` rows in NeMo-RL's format (a user message of an image part, as a datasets ``Image`` value, and a text
    part ``"<kind>?"``), the kinds in turn; ``blank``: every picture black (the answers stay the drawn ones)."""
    from PIL import Image

    rng = random.Random(split_seed(seed, split))
    rows = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        img, answer = draw(kind, rng)
        if blank:
            img = Image.new("RGB", img.size, (0, 0, 0))
        content = [{"type": "image", "image": {"bytes": png_bytes(img), "path": None}},
                   {"type": "text", "text": f"{kind}?"}]
        rows.append({"question": [{"role": "user", "content": content}], "answer": answer,
                     "source": f"visual/{split}:{i}", "meta": {"kind": kind}})
    return rows


def best_blind_accuracy(rows: list[Row]) -> float:
    """The most a policy that cannot see scores on ``rows`` in expectation: per question kind, its commonest answer's
    share (its answers depend on the kind alone). 0.36 over many rows; a finite set's draws can lift it.

        >>> best_blind_accuracy([{"meta": {"kind": "shape"}, "answer": a} for a in ("box", "box", "ring")])
        0.6666666666666666
    """
    from collections import Counter

    counts: dict[str, Counter] = {}
    for row in rows:
        counts.setdefault(row["meta"]["kind"], Counter())[row["answer"]] += 1
    return sum(max(c.values()) for c in counts.values()) / max(len(rows), 1)


def rows(name: str, data_cfg, n: int, seed: int, split: str) -> list[Row]:
    """``data.dataset_name=visual:images`` (pictures) or ``visual:blank`` (black pictures: the text-only baseline)."""
    variant = name.split(":", 1)[1]
    if variant not in ("images", "blank"):
        raise ValueError(f"data.dataset_name={name!r}: expected 'visual:images' or 'visual:blank'")
    return visual_rows(n, seed, split, blank=variant == "blank")


def visual_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    """1.0 if the completion's first word is the answer (case-insensitive), else 0.0.

    >>> visual_reward("colour?", "Red.", "red", {}), visual_reward("count?", " 2 or 3", "3", {})
    (1.0, 0.0)
    """
    word = FIRST_WORD.search(completion.lower())
    return float(word is not None and word.group() == answer)


def slip(kind: str, answer: str) -> str:
    """The demo model's systematic mistake: the next colour, one more (wrapping), the other shape.

    >>> slip("colour", "yellow"), slip("count", "3"), slip("shape", "box")
    ('blue', '1', 'ring')
    """
    if kind == "colour":
        names = sorted(COLOURS)
        return names[(names.index(answer) + 1) % len(names)]
    if kind == "count":
        return str(int(answer) % MAX_COUNT + 1)
    return "ring" if answer == "box" else "box"


def make_visual_demo_model(out_dir: str, p_correct: float = 0.2, steps: int = 400, pool: int = 1500, seed: int = 0,
                           log_every: int = 0) -> str:
    """The visual demo's starting policy (``toy:visual_demo``): the tiny VLM with the "small" text model, supervised on
    the task's pictures with one systematic slip (`slip`) in ``1 - p_correct`` of its targets. It learns the answer
    format and to look at the picture, but answers right only about ``p_correct`` of the time: GRPO has one habit to
    unlearn, which needs the picture to unlearn (the slip depends on what is drawn). Deterministic for a given seed
    and thread count."""
    import torch

    tok = build_vlm_tokenizer()
    processor = build_vlm_processor(tok)
    model = build_tiny_vlm(tok, size="small", seed=seed)
    rng = random.Random(seed)
    eos = tok.eos_token_id
    examples = []
    for i in range(pool):  # prompts as the trainer renders them: the chat template, then the processor
        kind = KINDS[i % len(KINDS)]
        img, answer = draw(kind, rng)
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": f"{kind}?"}]}],
                                             add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=[img], add_special_tokens=False, return_tensors="pt")
        examples.append((enc["input_ids"][0].tolist(), enc["pixel_values"], kind, answer))

    def sample_row():
        ids, pixels, kind, answer = rng.choice(examples)
        said = answer if rng.random() < p_correct else slip(kind, answer)
        target = tok(said, add_special_tokens=False)["input_ids"] + [eos]
        return ids + target, [-100] * len(ids) + target, pixels

    torch.manual_seed(seed)
    supervise(model, tok.pad_token_id, sample_row, steps, batch_size=32, log_every=log_every, name="visual demo model")
    return save_vlm(model, tok, out_dir)
