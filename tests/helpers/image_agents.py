"""The endpoint with images in tests (tests/integration/test_endpoint_images.py, test_nemo_gym_images.py): the tiny
VLM's endpoint, pictures as data: URLs, an agent that drives the endpoint with the official openai client (a picture
in its first turn, another in a tool result), and the trainer's token_mult_prob_error of played samples."""

from __future__ import annotations

import base64
import io

import openai
from PIL import Image

from grpo.tasks.visual import VLM_CHAT_TEMPLATE

MODEL = "toy:tiny_vlm"
# The tiny VLM's template with an end-of-sequence token after each assistant turn: what the prefix splice counts.
TEMPLATE = VLM_CHAT_TEMPLATE.replace("{{ '\\n' }}{% endfor %}",
                                     "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}")


def vlm_endpoint(cfg):
    """The endpoint over the hf backend and a fresh tiny VLM (its vision ids banned, as a run prepares it), started;
    the model is ``endpoint.model``."""
    from grpo.system import vision
    from grpo.system.generation.hf import HFGeneration
    from grpo.tasks.visual import build_tiny_vlm, build_vlm_processor, build_vlm_tokenizer
    from grpo.wings.agents.endpoint import Endpoint

    tok = build_vlm_tokenizer()
    model = vision.prepare_model(build_tiny_vlm(tok)).eval()
    ep = Endpoint(cfg, HFGeneration(cfg.policy, tok, model.config, "cpu", model=model), tok,
                  processor=build_vlm_processor(tok))
    ep.model = model
    ep.start()
    return ep


def mult_prob_error(model, trajs, pad_id: int) -> float:
    """clipped_pg_loss's token_mult_prob_error of played samples ``trajs``: the generation logprobs against the
    trainer's forward (`grpo.system.training.forward_logprobs`) over their tokens and their media."""
    import torch

    from grpo.batch import build_batch
    from grpo.config.load import build_config
    from grpo.loss import clipped_pg_loss
    from grpo.system.training import forward_logprobs

    batch = build_batch(trajs, pad_id)
    with torch.no_grad():
        prev_bt = forward_logprobs(model, batch.input_ids_bt, batch.attention_mask_bt, media=batch.media)
    cfg = build_config({"loss_fn": {"reference_policy_kl_penalty": 0.0}}).loss_fn
    _, metrics = clipped_pg_loss(prev_bt, prev_bt, torch.zeros(len(trajs)), batch.token_mask_bt,
                                 torch.ones(len(trajs)), cfg, generation_logprobs=batch.generation_logprobs_bt)
    return float(metrics["token_mult_prob_error"])


def data_url(colour, size=(16, 16)) -> str:
    """A one-colour PNG as OpenAI's ``data:`` image URL."""
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def picture_agent(row, base_url, api_key, model):
    """Two calls: a picture and a question, then the answer back with the token fields and a tool result holding a
    second picture (role tool, an image part, as vLLM and OpenAI take it)."""
    messages = [{"role": "user", "content": [image_part(data_url((255, 0, 0))), {"type": "text", "text": "colour?"}]}]
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        r = await client.chat.completions.create(model=model, messages=messages, logprobs=True, **row["sampling"])
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "call_0",
                         "content": [{"type": "text", "text": "look:"}, image_part(data_url((0, 0, 255)))]})
        r = await client.chat.completions.create(model=model, messages=messages, logprobs=True, **row["sampling"])
    return float(len(r.choices[0].message.content or "") % 2)  # rewards that differ within a group


async def forwarding_agent(row, base_url, api_key, model):
    """One call with the row's prompt messages sent unchanged (a row's pictures are its ``image_url`` parts)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        r = await client.chat.completions.create(model=model, messages=row["messages"], logprobs=True,
                                                 **row["sampling"])
    return float(len(r.choices[0].message.content or "") % 2)
