"""An agent for tests of the endpoint with images (tests/integration/test_endpoint_images.py): it drives the endpoint
with the official openai client, sends a picture in its first turn and another one in a tool result."""

from __future__ import annotations

import base64
import io

import openai
from PIL import Image


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
        await client.chat.completions.create(model=model, messages=messages, logprobs=True, **row["sampling"])
    return 1.0
