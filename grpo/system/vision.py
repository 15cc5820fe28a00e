"""Vision-language models: which class loads a checkpoint, its processor, the ids it must never sample, its
vision tower, and the images of a data row as the model's tensors ("media").

A checkpoint whose config has a ``vision_config`` is an image-text-to-text model (``AutoModelForImageTextToText``:
LLaVA, Qwen2-VL, Gemma 3, ...); every other one loads as a causal LM, as before (`auto_model_class`).

Media: a sample's images as the processor makes them, one dict of tensors per sample (``{"pixel_values": [N, 3, H, W]}``
for LLaVA; Qwen2-VL adds ``image_grid_thw``), its images concatenated along dim 0 in the order their placeholders
appear in the sample's tokens. A batch's media is the rows' dicts concatenated in row order
(`grpo.system.media.collate_media`; that module holds a batch's media and their wire form): the
model fills its placeholder tokens with image features in that same row-major order, so left or right padding and any
row selection keep each sample's images with its tokens. The G samples of a prompt share one dict (stored once per
prompt group, `grpo.deduplicate_multimodal_data`); a forward still runs each row's images.

Token ids are the processor-expanded ones (LLaVA: one ``<image>`` in the text becomes ``(H / patch)²`` ids), expanded
once, when the row is read (`render_prompt`); the generator and the trainer get those ids as they are.

    >>> content_text([{"type": "image", "image": "a.png"}, {"type": "text", "text": "what colour?"}])
    '<image>what colour?'
"""

from __future__ import annotations

import base64
import io
import random
import re
from typing import Any

import torch

from grpo.system.media import any_media, collate_media, concat_media, picture_tensors
from grpo.tasks.rows import DataError

IMAGE_MARK = "<image>"  # how an image part shows in a message's text (logs, dumps, environments): never its bytes
# Config keys of ids that stand for vision input: the placeholder the processor expands and the markers around it.
VISION_TOKEN_KEYS = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id",
                     "vision_end_token_id", "vision_token_id", "boi_token_id", "eoi_token_id", "boi_token_index",
                     "eoi_token_index")
BANNED_LOGIT = -1e9  # finite: exp() of it is 0 in every float type, and 0 * it is 0 (entropy stays finite)
VISION_TOWER_NAMES = ("vision_tower", "visual", "vision_model")


# --------------------------------------------------------------------------------------------------
# The model: class, banned ids, vision tower
# --------------------------------------------------------------------------------------------------
def is_vision_config(config) -> bool:
    """Whether a transformers config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """The transformers auto class that loads ``config``: image-text-to-text for a VLM, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def vision_token_ids(config) -> list[int]:
    """The ids of ``config`` that stand for vision input (`VISION_TOKEN_KEYS`), sorted; [] for a text model.

        >>> from transformers import LlavaConfig
        >>> vision_token_ids(LlavaConfig(image_token_id=7))
        [7]
    """
    if not is_vision_config(config):
        return []
    ids = {getattr(config, k, None) for k in VISION_TOKEN_KEYS}
    return sorted(int(i) for i in ids if isinstance(i, int) and i >= 0)


def ban_token_ids(model, ids: list[int]) -> None:
    """Make ``ids`` impossible in every forward of ``model``: its output logits there are `BANNED_LOGIT`.

    The policy's distribution is then the one that never samples an image placeholder, in generation (any backend
    on this module or a copy built by `prepare_model`) and in the training and reference forwards alike, so the
    sampler's logprobs and the trainer's agree. No-op for no ids or a model that has it already."""
    if not ids or getattr(model, "_grpo_banned_ids", None) == list(ids):
        return
    head = model.get_output_embeddings()
    index = torch.tensor(ids, dtype=torch.long)

    def hook(module, args, logits):
        return logits.index_fill(-1, index.to(logits.device), BANNED_LOGIT)

    head.register_forward_hook(hook)
    model._grpo_banned_ids = list(ids)


def vision_tower(model) -> torch.nn.Module | None:
    """The vision encoder of a VLM (LLaVA's ``vision_tower``, Qwen-VL's ``visual``), None for a text model."""
    path = vision_tower_path(model)
    return None if path is None else model.get_submodule(path)


def vision_tower_path(model) -> str | None:
    """The dotted name of `vision_tower` in ``model`` (``"model.vision_tower"``), None for a text model."""
    return next((name for name, _ in model.named_modules() if name.split(".")[-1] in VISION_TOWER_NAMES), None)


def lora_without_tower(model, lora):
    """``policy.lora`` for ``model`` with its vision tower excluded (peft's all-linear would adapt the tower's linear
    layers too); unchanged for a text model."""
    path = vision_tower_path(model)
    if path is None:
        return lora
    return lora.model_copy(update={"exclude_modules": [*lora.exclude_modules, f"*{path}.*"]})


def prepare_model(model, train_vision_tower: bool = True, linear_kernel: str = "auto"):
    """A loaded policy (or a copy of it) made ready for GRPO: its linear layers on oneDNN on the CPU per
    ``linear_kernel`` (``policy.cpu_linear_kernel``: `grpo.system.cpu_linear`); for a vision-language model, vision
    ids banned (`ban_token_ids`) and the vision tower frozen unless ``train_vision_tower``
    (``policy.vision.train_vision_tower``)."""
    from grpo.system.cpu_linear import use_onednn_linears

    use_onednn_linears(model, linear_kernel)
    config = model.config
    if not is_vision_config(config):
        return model
    ban_token_ids(model, vision_token_ids(config))
    tower = vision_tower(model)
    if tower is not None and not train_vision_tower:
        tower.requires_grad_(False)
    return model


def vision_model_impl(vllm_kwargs: dict, on_cpu: bool) -> str:
    """The ``model_impl`` vLLM runs a vision-language model with: ``vllm_kwargs``' own, else on the CPU transformers'
    modelling (`grpo.system.generation.vllm_params.CPU_VISION_LLM_KWARGS`), else vLLM's default ("auto": its own
    modelling where it has the architecture)."""
    return vllm_kwargs.get("model_impl") or ("transformers" if on_cpu else "auto")


def check_generation_backend(model_config, generation_cfg, on_cpu: bool | None = None) -> None:
    """Where a vision-language model generates: hf (on the training ranks or on generation ranks of its own), or
    vLLM on generation ranks of its own (``colocated.enabled=false``), or vLLM colocated where it runs its own
    modelling. Colocated vLLM running transformers' modelling (``vllm_kwargs.model_impl: transformers``, the CPU's
    default: `vision_model_impl`) is refused: that backend patches transformers'
    decoder classes in place, and the trainer's own model in the same process then fails. ``on_cpu`` None: no CUDA
    device here. A ValueError naming the key; nothing for a text model."""
    if not is_vision_config(model_config) or generation_cfg.backend == "hf":
        return
    if generation_cfg.backend != "vllm":
        raise ValueError(f"policy.generation.backend={generation_cfg.backend!r}: a vision-language model "
                         f"({model_config.model_type}) generates with 'hf' or 'vllm'")
    on_cpu = not torch.cuda.is_available() if on_cpu is None else on_cpu
    impl = vision_model_impl(generation_cfg.vllm_cfg.vllm_kwargs, on_cpu)
    if generation_cfg.colocated.enabled and impl == "transformers":
        raise ValueError(
            f"policy.generation.backend=vllm with policy.generation.colocated.enabled=true: vLLM runs this "
            f"vision-language model ({model_config.model_type}) with transformers' modelling (model_impl="
            f"transformers{', the CPU default' if on_cpu else ''}), which patches transformers' classes in the "
            "trainer's process and breaks its model; generate on ranks of their own "
            "(policy.generation.colocated.enabled=false), or set policy.generation.vllm_cfg.vllm_kwargs.model_impl=vllm "
            "(vLLM's own modelling; on a GPU install with torchvision)")


# Model types whose multimodal (M-RoPE) positions grpo-ds computes (`multimodal_positions`), tested on a tiny one each
# (tests/unit/test_mrope.py). Qwen3-VL's get_rope_index is another (timestamps, interleaved sections): not yet.
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# What the processor returns that is not media: the ids, their mask and the per-token modality (recomputed from the
# ids of whole rows, `mm_token_type_ids`).
NOT_MEDIA = ("input_ids", "attention_mask", "mm_token_type_ids")


def rope_index_module(model) -> torch.nn.Module | None:
    """The submodule of ``model`` with ``get_rope_index`` (Qwen-VL's ``model.model``, also under peft or DeepSpeed),
    None for a model with 1-D positions."""
    return next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)


def check_positions(model) -> None:
    """Refuse a model with multimodal positions (``get_rope_index``) that `multimodal_positions` does not compute:
    one whose ``model_type`` is not in `MROPE_MODEL_TYPES` (Qwen3-VL's)."""
    if rope_index_module(model) is not None and model.config.model_type not in MROPE_MODEL_TYPES:
        raise ValueError(f"{type(model).__name__} ({model.config.model_type}) places image tokens with multimodal "
                         f"(M-RoPE) positions that grpo-ds does not compute yet (it does for {list(MROPE_MODEL_TYPES)} "
                         "and for LLaVA-style models, whose positions are 1-D)")


def mm_token_type_ids(config, ids_bt: torch.Tensor) -> torch.Tensor:
    """Each token's modality as Qwen-VL's ``get_rope_index`` reads it: 1 an image placeholder, 2 a video one, 0 text
    (what the processor returns beside a prompt's ids, here for whole rows, completions and padding included)."""
    types_bt = torch.zeros_like(ids_bt)
    for kind, key in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, key, None)
        if token is not None:
            types_bt = types_bt.masked_fill(ids_bt == token, kind)
    return types_bt


def generate_keywords(model, ids_bt: torch.Tensor, images: dict) -> dict:
    """What transformers' ``generate`` needs beside the images to place a prompt's tokens: an M-RoPE model's
    ``mm_token_type_ids`` (it computes ``get_rope_index`` from them, then rope deltas per row); {} otherwise."""
    owner = rope_index_module(model)
    return {"mm_token_type_ids": mm_token_type_ids(owner.config, ids_bt)} if owner is not None and images else {}


def multimodal_positions(model, ids_bt: torch.Tensor, mask_bt: torch.Tensor, images: dict) -> dict:
    """The ``position_ids`` keyword of a forward over padded rows: {} for a model with 1-D positions (the model counts
    them itself); for M-RoPE (`MROPE_MODEL_TYPES`) the model's own ``get_rope_index`` over the rows' unpadded tokens,
    ``[3, B, T]`` (time, height, width; 0 on padding), with ``images``' ``image_grid_thw`` (`collate_media`). Each
    row's positions are then those of the row alone, whatever its padding (left or right) or its batch."""
    owner = rope_index_module(model)
    if owner is None:
        return {}
    positions_3bt, _ = owner.get_rope_index(ids_bt, mm_token_type_ids(owner.config, ids_bt),
                                            image_grid_thw=images.get("image_grid_thw"), attention_mask=mask_bt)
    return {"position_ids": positions_3bt}


# --------------------------------------------------------------------------------------------------
# Images in data rows
# --------------------------------------------------------------------------------------------------
def content_text(content, image_mark: str = IMAGE_MARK) -> str:
    """A message's content as text: a string as is; content parts joined, an image part as ``image_mark``."""
    if isinstance(content, str):
        return content
    return "".join(image_mark if p.get("type") == "image" else str(p.get("text", "")) for p in content)


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def load_image(value, where: str):
    """An image part's value as an RGB PIL image: a PIL image, a datasets ``Image`` value (``{"bytes", "path"}``),
    raw bytes, a ``data:`` URL, a ``file://`` URL or a local path. A value that is none of these, a file that is not
    there or bytes that are not an image raise `DataError` naming ``where`` (the row)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    try:
        if isinstance(value, dict) and (value.get("bytes") or value.get("path")):  # datasets' Image feature
            data = value.get("bytes")
            return _open(io.BytesIO(data) if data else value["path"])
        if isinstance(value, (bytes, bytearray)):
            return _open(io.BytesIO(value))
        if isinstance(value, str) and value.startswith("data:"):
            header, _, encoded = value.partition(",")
            if ";base64" not in header:
                raise DataError(f"{where}: image {value[:40]!r}...: a data: URL must be base64 encoded")
            return _open(io.BytesIO(base64.b64decode(encoded, validate=True)))
        if isinstance(value, str) and value.startswith(("http://", "https://")):
            raise DataError(f"{where}: image {value!r}: URLs are not fetched; download the image and name the file")
        if isinstance(value, str):
            return _open(value.removeprefix("file://"))
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"{where}: image {str(value)[:200]!r}: no such file") from None
    except (UnidentifiedImageError, OSError, ValueError) as err:
        shown = str(value)[:60] + ("..." if len(str(value)) > 60 else "")
        raise DataError(f"{where}: image {shown!r} cannot be decoded ({type(err).__name__}: {err})") from None
    raise DataError(f"{where}: an image part holds {type(value).__name__}: expected a path, a data: URL, bytes or "
                    "a datasets Image")


def image_data_url(value, where: str) -> str:
    """An image part's value (what `load_image` reads) as the ``data:image/<format>;base64,...`` URL of an OpenAI
    ``image_url`` part: a data: URL of an image as it is, the bytes a value holds or names (bytes, a datasets
    ``Image``, a path) as they are, a PIL image PNG-encoded in RGB (`png_data_url`); so the endpoint decodes the
    very picture `load_image` decoded. Nothing is decoded here (a format is read from the file's header). A file
    that is gone, or bytes that are not an image, raise `DataError` naming ``where``.

        >>> image_data_url("data:image/png;base64,iVBO", "row 0")
        'data:image/png;base64,iVBO'
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return png_data_url(value.convert("RGB"))
    if isinstance(value, str) and value.startswith("data:image/") and value.partition(",")[0].endswith(";base64"):
        return value
    try:
        if isinstance(value, dict) and value.get("bytes"):
            data = value["bytes"]
        elif isinstance(value, (bytes, bytearray)):
            data = bytes(value)
        elif isinstance(value, str) and value.startswith("data:"):  # another header: the bytes are the image's
            data = base64.b64decode(value.partition(",")[2], validate=True)
        elif isinstance(value, (str, dict)) and not str(value).startswith(("http://", "https://")):
            with open((value["path"] if isinstance(value, dict) else value).removeprefix("file://"), "rb") as f:
                data = f.read()
        else:
            return png_data_url(load_image(value, where))  # load_image says what is wrong with it
        with Image.open(io.BytesIO(data)) as img:  # the header only
            mime = img.get_format_mimetype()
        if mime is None:  # a format with no MIME type: its picture as PNG
            return png_data_url(_open(io.BytesIO(data)))
    except FileNotFoundError:
        raise DataError(f"{where}: image {str(value)[:200]!r}: no such file") from None
    except (UnidentifiedImageError, OSError, ValueError, KeyError, TypeError) as err:
        shown = str(value)[:60] + ("..." if len(str(value)) > 60 else "")
        raise DataError(f"{where}: image {shown!r} cannot be read ({type(err).__name__}: {err})") from None
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def openai_content(content, where: str):
    """A message's content as OpenAI's chat form: a string as is; parts with each image part an ``image_url`` part
    carrying its picture (`image_data_url`), text parts as they are.

        >>> openai_content([{"type": "image", "image": "data:image/png;base64,iVBO"}, {"type": "text", "text": "?"}],
        ...                "row 0")[0]
        {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,iVBO'}}
    """
    if isinstance(content, str):
        return content
    return [{"type": "image_url", "image_url": {"url": image_data_url(p["image"], where)}}
            if p.get("type") == "image" else {"type": "text", "text": p["text"]} for p in content]


def _open(source):
    from PIL import Image

    with Image.open(source) as img:
        img.load()
        return img.convert("RGB")


def render_prompt(processor, chat, messages: list[dict], where: str) -> tuple[list[dict], dict | None]:
    """The prompt ``messages`` (content parts with images) as ``({"role", "content", "token_ids"}`` per message,
    media): each message's text is the chat template's (`grpo.system.chat.ChatFormat.prompt_texts`, an image part
    rendered as the template's placeholder), tokenised by ``processor`` with that message's images, so its ids are
    the processor-expanded ones; ``content`` is the text with an image as `IMAGE_MARK`. Media: every tensor the
    processor made besides the ids, the messages' images concatenated in order (None without images)."""
    images = [message_images(m, where) for m in messages]
    out, parts = [], []
    for m, text, imgs in zip(messages, chat.prompt_texts(template_messages(messages)), images):
        ids, media = encode_with_images(processor, text, imgs)
        out.append({"role": m["role"], "content": content_text(m["content"]), "token_ids": ids})
        if imgs:
            parts.append(media)
    return out, (concat_media(parts) if parts else None)


def encode_with_images(processor, text: str, images: list) -> tuple[list[int], dict]:
    """``(ids, media)`` of a rendered ``text`` and its ``images`` (PIL, in the order of their placeholders in the
    text): the processor's ids (each placeholder expanded) without special tokens added, and every tensor it made
    besides the ids ({} without images), with the pictures themselves where the processor keeps them
    (`keeps_pictures`: a vLLM policy)."""
    enc = processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
    media = {k: v for k, v in enc.items() if k not in NOT_MEDIA}
    if images and keeps_pictures(processor):
        media.update(picture_tensors(images))
    return enc["input_ids"][0].tolist(), media


def message_images(message: dict, where: str) -> list:
    """The images of a message's content parts, in order, as PIL images (`load_image`); [] for a text message."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [load_image(p["image"], where) for p in content if p.get("type") == "image"]


def placeholder_problem(text: str, image_token: str, n_images: int) -> str | None:
    """Why a rendered ``text`` and its ``n_images`` pictures do not pair up, or None: the processor's
    ``image_token`` must stand in the text exactly once per picture (one typed in a text part, or a template that
    writes none, would leave a placeholder without pixels or pixels without a place). The endpoint's requests and the
    environments' observations are checked by it.

        >>> placeholder_problem("user: <image>what?", "<image>", 1) is None
        True
        >>> placeholder_problem("look: <image>", "<image>", 0)
        "holds the image placeholder '<image>' 1 time(s) for 0 picture(s): a text part may not contain it (a picture is an image content part)"
    """
    found = text.count(image_token)
    if found == n_images:
        return None
    return (f"holds the image placeholder {image_token!r} {found} time(s) for {n_images} picture(s): a text part may "
            "not contain it (a picture is an image content part)")


def template_messages(messages: list[dict]) -> list[dict]:
    """``{"role", "content"}`` messages as a chat template reads them (an image part as ``{"type": "image"}``)."""
    return [{"role": m["role"], "content": _template_content(m["content"])} for m in messages]


# --------------------------------------------------------------------------------------------------
# Images in observations (multi-turn environments)
# --------------------------------------------------------------------------------------------------
def observation_raw_text(processor, messages: list[dict]) -> str:
    """An observation's content as raw text (``observation_format: raw``): text parts as they are, an image part
    as the processor's placeholder (``<image>``; the environment writes any markup around it, Qwen-VL's
    ``<|vision_start|>`` ... ``<|vision_end|>`` too)."""
    return "".join(content_text(m["content"], processor.image_token) for m in messages)


def encode_observation(processor, text: str, messages: list[dict], where: str) -> tuple[list[int], dict | None]:
    """``(ids, media)`` of an observation: ``text``, its rendering (chat template or raw) with each image part
    written as the processor's placeholder, tokenised by ``processor`` with the images of ``messages`` in order, so
    each placeholder is expanded once, as `render_prompt` does for a prompt message; media None without images.
    A text that holds the placeholder itself (`placeholder_problem`: the image would be missing its pixels) or an
    image that cannot be read is a `DataError` naming ``where``."""
    images = [img for m in messages for img in message_images(m, where)]
    problem = placeholder_problem(text, processor.image_token, len(images))
    if problem is not None:
        raise DataError(f"{where}: its rendering {problem}")
    try:
        ids, media = encode_with_images(processor, text, images)
    except ValueError as err:  # placeholders and images that do not pair up (a template that drops an image part)
        raise DataError(f"{where}: the processor refused it ({err})") from None
    return ids, (media if images else None)


def cut_observation(ids: list[int], room: int, image_token_id: int | None) -> list[int]:
    """The first ``room`` tokens of an observation that does not fit (its sample ends), ending before its first
    image placeholder (``image_token_id``; None: a text model) when there is one: a picture is whole or absent, and
    the cut observation keeps none (nothing is generated after it).

        >>> cut_observation([1, 2, 9, 9, 3], 4, 9), cut_observation([1, 2, 3], 2, None)
        ([1, 2], [1, 2])
    """
    keep = max(room, 0)
    if image_token_id is not None and image_token_id in ids:
        keep = min(keep, ids.index(image_token_id))
    return ids[:keep]


def _template_content(content):
    """Content as a chat template reads it: text parts as they are, an image part as ``{"type": "image"}``."""
    if isinstance(content, str):
        return content
    return [{"type": "image"} if p.get("type") == "image" else {"type": "text", "text": p["text"]} for p in content]


def load_processor(policy_cfg, model_config):
    """The policy's processor (``AutoProcessor`` from the tokenizer's directory, else the model's) for a VLM; None
    for a text model. For a policy generating with vLLM it keeps the raw pictures in the media it makes
    (`keeps_pictures`): vLLM runs its own processor on pictures, never on the trainer's ``pixel_values``."""
    if not is_vision_config(model_config):
        return None
    from transformers import AutoProcessor

    name = policy_cfg.tokenizer.name or policy_cfg.model_name
    processor = AutoProcessor.from_pretrained(name, trust_remote_code=policy_cfg.trust_remote_code)
    if policy_cfg.generation.backend == "vllm":
        processor.grpo_keep_pictures = True  # read by `keeps_pictures`
    return processor


def keeps_pictures(processor) -> bool:
    """Whether media made with ``processor`` hold their raw pictures (`grpo.system.media.picture_tensors`)."""
    return bool(getattr(processor, "grpo_keep_pictures", False))


# NeMo-RL's image datasets whose columns `format_record` reads (data.row_format), the keys of its records.
ROW_FORMATS = ("clevr-cogent", "geometry3k", "refcoco")
PROMPT_KEY, ANSWER_KEY = "messages", "ground_truth"
REFCOCO_SIZE = (256, 256)  # NeMo-RL resizes RefCOCO's pictures to this for batching


# --------------------------------------------------------------------------------------------------
# NeMo-RL's image datasets (nemo_rl/data/datasets/response_datasets/{clevr,geometry3k,refcoco}.py) as rows
# --------------------------------------------------------------------------------------------------
def png_data_url(img) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (NeMo-RL's ``pil_to_base64``)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _answer_from_tags(solution: str) -> str:
    """CLEVR's solution ``"<answer> 3 </answer>"`` -> ``"3"`` (the whole text, stripped, without tags)."""
    match = re.search(r"<answer>(.*?)</answer>", solution)
    return (match.group(1) if match else solution).strip()


def _need(record: dict, keys: tuple[str, ...], fmt: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"data.row_format={fmt}: missing {missing} (keys: {sorted(record)})")


def _refcoco(record: dict, index: int, where: str) -> tuple[Any, str, str]:
    """RefCOCO's (image, phrase, box): the picture resized to `REFCOCO_SIZE`, a caption (a random one seeded by
    the row's index for training, the longest for a ``val`` split, as NeMo-RL), the box scaled to 0..1000."""
    image = load_image(record["image_path"], where)
    width, height = image.size
    captions = record["captions"]
    if not isinstance(captions, list) or not captions:
        raise ValueError("data.row_format=refcoco: captions must be a non-empty list of strings")
    caption = (max(captions, key=len) if "val" in str(record.get("split", ""))
               else random.Random(index).choice(captions))
    x1, y1, x2, y2 = (float(v) for v in record["bbox"])
    box = [int(round(v)) for v in (x1 / width * 1000, y1 / height * 1000, x2 / width * 1000, y2 / height * 1000)]
    text = f"Please provide the bounding box coordinate of the region described by the following phrase: {caption}"
    return png_data_url(image.resize(REFCOCO_SIZE)), text, f"[{box[0]}, {box[1]}, {box[2]}, {box[3]}]"


def format_record(fmt: str, record: dict, fill=None, index: int = 0, where: str = "") -> dict:
    """A record in the columns of NeMo-RL's dataset ``fmt`` -> ``{"messages": [user message], "ground_truth"}``:
    the user message an image part then a text part, the text put through ``fill`` (the prompt file's template)
    as ``vlm_hf_data_processor`` does. Columns: clevr-cogent ``image, problem, solution``
    (the answer inside ``<answer>`` tags); geometry3k ``images`` (the first) or ``image, problem, answer``
    (``<image>`` dropped from the problem); refcoco ``image_path, captions, bbox`` (`_refcoco`). A missing column
    or a bad value raises ValueError."""
    if fmt == "clevr-cogent":
        _need(record, ("image", "problem", "solution"), fmt)
        image, text, truth = record["image"], str(record["problem"]), _answer_from_tags(str(record["solution"]))
    elif fmt == "geometry3k":
        _need(record, ("problem", "answer"), fmt)
        images = record.get("images")
        image = images[0] if isinstance(images, list) and images else record.get("image")
        if image is None:
            raise ValueError("data.row_format=geometry3k: no image (an images list or an image column)")
        text, truth = str(record["problem"]).replace("<image>", ""), str(record["answer"])
    elif fmt == "refcoco":
        _need(record, ("image_path", "captions", "bbox"), fmt)
        image, text, truth = _refcoco(record, index, where)
    else:
        raise ValueError(f"data.row_format={fmt!r}: expected one of {list(ROW_FORMATS)}")
    text = fill(text) if fill is not None else text
    user = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}
    return {PROMPT_KEY: [user], ANSWER_KEY: truth}


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def image_keywords(model, media: list | None, device) -> dict:
    """`collate_media` for ``model``'s parameter dtype."""
    return collate_media(media, device, model_dtype(model)) if any_media(media) else {}


def check_policy(policy_cfg, model_config) -> None:
    """A policy's kind as ``policy.is_vlm`` asks, and what a vision-language policy cannot be run with yet, as one
    ValueError naming the key: a generation backend or placement that cannot take images
    (`check_generation_backend`), shared prompts asked for (``policy.shared_prompt_forward=true``). Nothing for a
    text model. ``policy.is_vlm`` (NeMo-RL's key), when set, must name the checkpoint's kind."""
    vision = is_vision_config(model_config)
    if policy_cfg.is_vlm is not None and policy_cfg.is_vlm != vision:
        kind = "a vision-language model (its config has a vision_config)" if vision else "a text model (no vision_config)"
        raise ValueError(f"policy.is_vlm={str(policy_cfg.is_vlm).lower()}: {policy_cfg.model_name} is {kind}; "
                         "set policy.is_vlm to match it, or leave it null to follow the checkpoint")
    if not vision:
        return
    check_generation_backend(model_config, policy_cfg.generation)
    if policy_cfg.shared_prompt_forward is True:
        raise ValueError("policy.shared_prompt_forward=true: a shared prompt's KV cache does not carry a "
                         "vision-language model's images yet; set it to auto or false")


def save_processor(model_config, out_dir) -> None:
    """Beside an export of a vision-language model: the processor it was loaded with (its image processor, chat
    template and placeholder settings), from the directory the model came from; nothing for a text model."""
    if not is_vision_config(model_config):
        return
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(model_config._name_or_path).save_pretrained(out_dir)


# --------------------------------------------------------------------------------------------------
# ZeRO-3: every rank runs the vision tower in every forward
# --------------------------------------------------------------------------------------------------
def dummy_image(processor) -> tuple[list[int], dict]:
    """One black picture as ``processor`` makes it: its placeholder ids (expanded) and its media."""
    from PIL import Image

    image = Image.new("RGB", (64, 64))
    enc = processor(text=[processor.image_token], images=[image], add_special_tokens=False, return_tensors="pt")
    return enc["input_ids"][0].tolist(), {k: v for k, v in enc.items() if k not in NOT_MEDIA}


def attach_dummy_image(model, processor) -> None:
    """Keep `dummy_image` on ``model`` for `with_dummy_image` (a ZeRO-3 engine's forwards without images)."""
    if processor is not None and is_vision_config(model.config):
        model._grpo_dummy_image = dummy_image(processor)


def with_dummy_image(module, ids_bt: torch.Tensor, mask_bt: torch.Tensor, pad_id: int = 0):
    """``(ids, mask, images)`` with one more row: the dummy picture's placeholders (`attach_dummy_image`), its
    columns right-padded to fit; None when ``module`` has no dummy picture.

    Under ZeRO-3 a module's forward gathers its parameters from every rank: a rank whose micro-batch has no
    image would skip the vision tower while another waits in its gather (DeepSpeed#7170). With the extra row every
    forward runs the tower, in the same module order as a micro-batch with images; the caller drops the row's
    outputs and adds 0 x their sum to what it keeps, so the tower's gradient (zero) is reduced on every rank too."""
    dummy = getattr(module, "_grpo_dummy_image", None)
    if dummy is None:
        return None
    ids, media = dummy
    B, T = ids_bt.shape
    width = max(T, len(ids))
    ids_out = torch.full((B + 1, width), pad_id, dtype=ids_bt.dtype, device=ids_bt.device)
    mask_out = torch.zeros((B + 1, width), dtype=mask_bt.dtype, device=mask_bt.device)
    ids_out[:B, :T], mask_out[:B, :T] = ids_bt, mask_bt
    ids_out[B, :len(ids)] = torch.tensor(ids, dtype=ids_bt.dtype, device=ids_bt.device)
    mask_out[B, :len(ids)] = 1
    return ids_out, mask_out, collate_media([media], ids_bt.device, model_dtype(module))
