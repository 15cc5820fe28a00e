"""Rows with images for the vision-language tests: PNG bytes, data: URLs, NeMo-RL-format rows, a `PromptDataset` over
the tiny VLM's processor."""

from __future__ import annotations

import base64
import io

from PIL import Image

from grpo.config import MasterConfig


def png(colour, size=(20, 12)) -> bytes:
    """A one-colour PNG."""
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def data_url(colour, size=(20, 12)) -> str:
    return "data:image/png;base64," + base64.b64encode(png(colour, size)).decode()


def image_row(source, *images, text="what colour?"):
    """A row in NeMo-RL's format: one user message of image parts, then a text part."""
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return {"question": [{"role": "user", "content": parts}], "answer": "red", "source": source, "meta": {}}


def text_row(source, text="text only"):
    return {"question": [{"role": "user", "content": text}], "answer": "x", "source": source, "meta": {}}


def dataset(vlm_dir, processor, rows, **kw):
    """A `PromptDataset` of ``rows`` for the VLM at ``vlm_dir`` (its own chat template)."""
    from grpo.system.chat import load_tokenizer
    from grpo.system.data import PromptDataset, PromptFormatter

    cfg = MasterConfig.model_validate({"policy": {"model_name": vlm_dir, "tokenizer": {"chat_template": "default"}}})
    formatter = PromptFormatter(load_tokenizer(cfg.policy), cfg.data, "default", processor=processor)
    return PromptDataset(rows, formatter, **kw)


def sample_prompts(vlm_dir, processor):
    """Five prompts (ids, media): three one-image rows of different colours and text lengths, a two-image row, a
    text-only row."""
    colours = [(255, 0, 0), (0, 0, 255), (0, 200, 0)]
    rows = [image_row(f"r:{i}", data_url(c), text="colour" + "?" * i) for i, c in enumerate(colours)]
    rows.append(image_row("r:3", data_url((255, 255, 0)), data_url((0, 0, 0)), text="two"))
    rows.append(text_row("r:4"))
    ds = dataset(vlm_dir, processor, rows)
    return [ds[i].prompt_ids for i in range(len(ds))], [ds[i].media for i in range(len(ds))]


def sample_batch(prompts, media, order, seed: int = 0):
    """A `grpo.batch.TrainBatch` of one sample per entry of ``order`` (an index into ``prompts`` / ``media``): the
    prompt, then 3 to 5 random generated tokens; consecutive samples of the same prompt share its media."""
    import torch

    from grpo.batch import build_batch
    from grpo.trajectory import Message, Trajectory

    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i, p in enumerate(order):
        gen = torch.randint(3, 80, (3 + i % 3,), generator=g).tolist()
        trajs.append(Trajectory(i // 2, p, "t", "", "", [Message("user", "", list(prompts[p])),
                                                         Message("assistant", "", gen, [-1.0] * len(gen))],
                                {}, media=media[p]))
    return build_batch(trajs, pad_id=0)


def plain_loss_and_grad_norm(model, batch, scale: float = 30.0):
    """``-Σ mask · logprob / scale`` of ``batch`` by plain autograd on ``model``, row by row unpadded, each row with
    its own images (an M-RoPE model places them itself from ``mm_token_type_ids``, as the processor gives them);
    returns (loss, gradient norm)."""
    import torch

    from grpo.system import vision
    from grpo.system.media import collate_media

    model.zero_grad()
    total = 0.0
    for b in range(len(batch)):
        n = int(batch.attention_mask_bt[b].sum())
        ids = batch.input_ids_bt[b: b + 1, :n]
        kw = collate_media([batch.media[b]])
        if vision.rope_index_module(model) is not None:
            kw["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        logits = model(input_ids=ids, **kw).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        loss = -(lp * batch.token_mask_bt[b, 1:n]).sum() / scale
        loss.backward()
        total += float(loss.detach())
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
    return total, float(norm)


# Fixtures for the test modules that import them: the tiny VLM saved once per module, and its processor.
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from grpo.tasks.visual import save_tiny_vlm

    return save_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")))


@pytest.fixture(scope="module")
def processor(vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    """The tiny VLM of ``vlm_dir`` loaded, vision ids banned, its logits sharpened (peaked distributions: sampled paths
    far from ties between batch shapes)."""
    import torch
    from transformers import AutoConfig

    from grpo.system import vision

    model = vision.auto_model_class(AutoConfig.from_pretrained(vlm_dir)).from_pretrained(vlm_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return vision.prepare_model(model).eval()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    """(directory with the config and tokenizer, processor, model): the tiny Qwen2-VL, then the tiny Qwen2.5-VL,
    their logits sharpened so sampled paths stay far from ties between batch shapes."""
    import torch

    from grpo.system import vision
    from grpo.tasks.toy import save_char_tokenizer
    from grpo.tasks.visual import build_qwen_vl_processor, build_qwen_vl_tokenizer, build_tiny_qwen_vl

    tok = build_qwen_vl_tokenizer()
    model = build_tiny_qwen_vl(tok, request.param)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    out = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(out)
    save_char_tokenizer(tok, out)
    return out, build_qwen_vl_processor(tok), vision.prepare_model(model).eval()


def qwen_prompts_and_media(qwen_dir, processor):
    """Four prompts through the data path (`grpo.system.vision.render_prompt`): pictures of three shapes (image
    grids 4x4, 6x2, 2x6 patches: 4, 3, 3 placeholders), one with two pictures, and a text-only one."""
    rows = [image_row("r:0", data_url((255, 0, 0)), text="colour?"),
            image_row("r:1", data_url((0, 0, 255), size=(8, 24)), text="c?"),
            image_row("r:2", data_url((0, 200, 0), size=(24, 8)), data_url((9, 9, 9), size=(16, 16)), text="two??"),
            text_row("r:3")]
    ds = dataset(qwen_dir, processor, rows)
    return [ds[i].prompt_ids for i in range(len(ds))], [ds[i].media for i in range(len(ds))]
