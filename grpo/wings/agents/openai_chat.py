"""OpenAI chat completions over token ids, without a server: the request schema, NeMo-RL's prefix splice, and the
parsers that turn generated text into an OpenAI message (what a request must pass before it is generated:
`grpo.wings.agents.openai_checks`). `grpo.wings.agents.endpoint` serves them.

Token in, token out (NeMo-RL's ``vllm_worker_async.py`` and ``openai_server_utils.py``): a history whose
assistant message carries the endpoint's token fields (``prompt_token_ids`` + ``generation_token_ids``), or a
request with ``required_prefix_token_ids``, is rendered by the chat template and then spliced
(`replace_prefix_tokens`): the model's own earlier tokens are kept and the template resumes after the N-th
end-of-sequence token, N being the count of EOS tokens in the template's rendering of the history up to the
last assistant message. So a template that re-tokenises or drops (Qwen3: ``<think>``) what the model wrote
does not change what the model is shown.

Parsers (``http_server_serving_chat_kwargs``; vLLM's names and behaviour):

- tool_parser ``hermes`` (vLLM's Hermes2ProToolParser: Qwen2.5, Qwen3, Hermes): every
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes a tool call, the content is the text
  before the first ``<tool_call>``; a call that is not valid JSON leaves the whole text as content (no tool
  calls), as vLLM's parser does; ``compact`` (the char-level toy: ``<calc>37*58</calc>``, tags of the request's
  tools only).
- reasoning_parser ``qwen3`` (the installed vLLM's Qwen3Parser, whose thinking starts open): text up to
  ``</think>`` or to the first ``<tool_call>`` is ``reasoning_content`` (``<think>`` dropped), the rest content
  (a stray ``</think>`` dropped outside tool calls); with ``enable_thinking: false`` in the request's (or the
  default) template variables there is no reasoning and the text is the content. ``deepseek_r1``: the text after
  the first ``<think>`` (all of it without one), up to ``</think>``, is reasoning, the rest content; without
  ``</think>`` all of it is reasoning.

On ``policy.generation.backend=vllm`` the endpoint uses vLLM's own parsers instead
(`grpo.wings.agents.vllm_chat_parsers`), any that vLLM registers; these are the hf backend's (and
``compact`` on both).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpo.tasks.nemo_gym import TOKEN_FIELDS
from grpo.tasks.tool_calls import HERMES_CLOSE, HERMES_OPEN, parse_tool_calls

# NeMo-RL's floor of a returned logprob (nemo_rl/models/generation/vllm/utils.py VLLM_LOGPROB_FLOOR).
LOGPROB_FLOOR = -9999.0
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IMAGE_PART = "image_url"  # OpenAI's image content part: {"type": "image_url", "image_url": {"url": ...}}
ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_SPAN = re.compile(f"({re.escape(HERMES_OPEN)}.*?(?:{re.escape(HERMES_CLOSE)}|\\Z))", re.DOTALL)


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and OpenAI's error body (`error_body`)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON.

        >>> error_body("bad", param="top_p")
        {'error': {'message': 'bad', 'type': 'invalid_request_error', 'param': 'top_p', 'code': None}}
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --------------------------------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------------------------------
class ChatMessage(BaseModel):
    """One message of a request; unknown fields pass (the token fields, ``name``, ``tool_call_id`` ...)."""

    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    prompt_token_ids: Optional[list[int]] = None
    generation_token_ids: Optional[list[int]] = None

    @field_validator("content")
    @classmethod
    def _text_and_image_parts(cls, v):
        """Content parts are text (``{"type": "text", "text": ...}``) or images (``{"type": "image_url",
        "image_url": {"url": ...}}``, OpenAI's); any other part is refused rather than dropped (dropping it would
        answer another prompt than the one sent). Whether the policy takes images is the endpoint's check."""
        for i, part in enumerate(v if isinstance(v, list) else ()):
            problem = part_problem(part)
            if problem is not None:
                raise ValueError(f"content part {i} {problem}")
        return v


def part_problem(part: dict) -> Optional[str]:
    """What is wrong with one content part of a request (None: a text part or an ``image_url`` part).

        >>> part_problem({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}) is None
        True
        >>> part_problem({"type": "input_audio", "input_audio": {}})
        "is of type 'input_audio': this endpoint takes text parts ({'type': 'text', 'text': ...}) and image parts ({'type': 'image_url', 'image_url': {'url': ...}})"
    """
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return None
    if kind == IMAGE_PART:
        image = part.get(IMAGE_PART)
        if isinstance(image, dict) and isinstance(image.get("url"), str):
            return None
        return f"is an image_url part without a url: expected {{'type': 'image_url', 'image_url': {{'url': ...}}}}"
    return (f"is of type {kind!r}: this endpoint takes text parts ({{'type': 'text', 'text': ...}}) and image parts "
            "({'type': 'image_url', 'image_url': {'url': ...}})")


def image_urls(messages) -> list[tuple[str, str]]:
    """``(where, url)`` of every image part of ``messages`` (`ChatMessage` list), in the order the chat template
    renders them: message by message, part by part; ``where`` names the part (``messages.0.content.1``).

        >>> m = ChatMessage(role="user", content=[{"type": "text", "text": "?"},
        ...                                       {"type": "image_url", "image_url": {"url": "data:x"}}])
        >>> image_urls([m])
        [('messages.0.content.1', 'data:x')]
    """
    return [(f"messages.{i}.content.{j}", part[IMAGE_PART]["url"]) for i, m in enumerate(messages)
            if isinstance(m.content, list) for j, part in enumerate(m.content) if part.get("type") == IMAGE_PART]


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's fields that change the answer, NeMo-RL's extras; other OpenAI
    fields (``user``, ``metadata``, ``parallel_tool_calls`` ...) are accepted and have no effect."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    n: int = Field(1, ge=1, le=64)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    required_prefix_token_ids: Optional[list[int]] = None
    stream: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v):
        """vLLM's ``ChatCompletionToolsParam``: each tool is ``{"type": "function", "function": {"name": ...}}``
        (the dicts are kept as sent: the chat template reads them)."""
        if v == []:
            raise ValueError("tools must not be an empty array: send at least one tool or leave tools out")
        for i, tool in enumerate(v or ()):
            fn = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not (
                    isinstance(fn.get("name"), str) and fn["name"]):
                raise ValueError(f"tool {i} is not a function tool with a name: expected "
                                 "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        return v

    def wanted_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): chat ``messages`` (rendered and spliced as a chat request) or a ``prompt``."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    prompt: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    required_prefix_token_ids: Optional[list[int]] = None


# --------------------------------------------------------------------------------------------------
# Rendering and NeMo-RL's prefix splice
# --------------------------------------------------------------------------------------------------
def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them: list content joined into text (a newline between text parts,
    as vLLM joins them for a template that reads strings), but list content with an image part kept as parts, as the
    data path gives a row's to the template (an image as ``{"type": "image"}``: the template writes its placeholder,
    `grpo.system.vision.render_prompt`), a tool call's ``arguments`` string parsed into an object
    (vLLM does the same; Qwen's template writes them with tojson), the token fields left out.

        >>> parts = [{"type": "text", "text": "2+2"}, {"type": "text", "text": "="}]
        >>> template_messages([ChatMessage(role="user", content=parts)])[0]["content"].splitlines()
        ['2+2', '=']

        >>> m = ChatMessage(role="assistant", content=None, tool_calls=[{"id": "c", "type": "function",
        ...     "function": {"name": "calc", "arguments": '{"x": 1}'}}])
        >>> template_messages([m])[0]["tool_calls"][0]["function"]["arguments"]
        {'x': 1}
    """
    out = []
    for m in messages:
        d = {k: v for k, v in m.model_dump(exclude_none=True).items()
             if k not in TOKEN_FIELDS}
        content = d.get("content")
        if isinstance(content, list) and any(part.get("type") == IMAGE_PART for part in content):
            d["content"] = [{"type": "image"} if part.get("type") == IMAGE_PART else  # as the data path's rows
                            {"type": "text", "text": part["text"]} for part in content]
        elif isinstance(content, list):
            d["content"] = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))  # vLLM's
        d.setdefault("content", "")
        if d.get("tool_calls"):
            calls = []
            for call in d["tool_calls"]:
                call = json.loads(json.dumps(call))
                fn = call.get("function", {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        raise RequestError(400, f"a tool call's arguments are not valid JSON: "
                                                f"{fn['arguments'][:200]!r}", param="messages") from None
                calls.append(call)
            d["tool_calls"] = calls
        out.append(d)
    return out


def required_prefix(req) -> Optional[list[int]]:
    """NeMo-RL's ``model_post_init``: ``required_prefix_token_ids`` if given, else the last message that carries
    ``prompt_token_ids``: its ``prompt_token_ids + generation_token_ids``; None without either."""
    if req.required_prefix_token_ids is not None:
        return list(req.required_prefix_token_ids)
    for m in reversed(req.messages or []):
        if m.prompt_token_ids is not None:
            return list(m.prompt_token_ids) + list(m.generation_token_ids or [])
    return None


def replace_prefix_tokens(eos_token_id: int, model_prefix_token_ids: list[int], template_prefix_token_ids: list[int],
                          template_token_ids: list[int]) -> list[int]:
    """NeMo-RL's ``replace_prefix_tokens``: the model's tokens up to (not including) its final EOS, then the
    template's tokens from its N-th EOS on, N = the count of EOS in ``template_prefix_token_ids``. A template
    without that EOS is a `RequestError` (NeMo-RL asserts).

        >>> replace_prefix_tokens(2, [11, 12, 13, 40, 41, 220, 17, 2], [11, 12, 13, 40, 41, 1001, 2],
        ...                       [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41])
        [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]
    """
    if not model_prefix_token_ids:
        return list(template_token_ids)
    cut_end = len(model_prefix_token_ids) - (model_prefix_token_ids[-1] == eos_token_id)
    needed, seen = template_prefix_token_ids.count(eos_token_id), 0
    for pos, tid in enumerate(template_token_ids):
        if tid == eos_token_id:
            seen += 1
            if seen == needed:
                return list(model_prefix_token_ids[:cut_end]) + list(template_token_ids[pos:])
    raise RequestError(400, f"the prefix splice needs end-of-sequence token #{needed} (id {eos_token_id}) in the "
                            f"rendered conversation, which has {seen}: the history's assistant turns must end with "
                            "the template's end-of-turn token", param="messages")


# --------------------------------------------------------------------------------------------------
# Output parsing
# --------------------------------------------------------------------------------------------------
def split_reasoning(text: str, parser: Optional[str], thinking: bool = True) -> tuple[Optional[str], Optional[str]]:
    """``(reasoning_content, content)`` of a generated text, as the installed vLLM's parser of that name splits it
    (module docstring; tests/unit/test_vllm_parsers.py compares them). ``thinking``: the request's
    ``enable_thinking`` template variable (only qwen3 reads it). Empty parts are None, except deepseek_r1's reasoning.

        >>> split_reasoning("<think>hm</think>42", "qwen3"), split_reasoning("hm", "qwen3")
        (('hm', '42'), ('hm', None))
        >>> split_reasoning("<think>hm</think>42", "qwen3", thinking=False)
        (None, '<think>hm</think>42')
        >>> split_reasoning("hm", "deepseek_r1"), split_reasoning("x", None)
        (('hm', None), (None, 'x'))
    """
    if parser is None:
        return None, text
    if parser == "deepseek_r1":  # vLLM's BaseThinkingReasoningParser.extract_reasoning
        before, start, after = text.partition(THINK_OPEN)
        text = after if start else before
        if THINK_CLOSE not in text:
            return text, None
        reasoning, _, content = text.partition(THINK_CLOSE)
        return reasoning, content or None
    if not thinking:  # qwen3 without thinking: no reasoning, the text unchanged
        return None, text
    # qwen3 (vLLM's Qwen3Parser): reasoning until </think> or a <tool_call> (which it leaves to the content); <think>
    # is dropped from the reasoning, a stray </think> from the content outside tool calls.
    ends = [i for i in (text.find(THINK_CLOSE), text.find(HERMES_OPEN)) if i >= 0]
    cut = min(ends) if ends else len(text)
    reasoning = text[:cut].replace(THINK_OPEN, "")
    rest = text[cut:].removeprefix(THINK_CLOSE)
    parts = _TOOL_SPAN.split(rest)  # odd items: the tool calls' spans, kept as they are
    content = "".join(p if i % 2 else p.replace(THINK_CLOSE, "") for i, p in enumerate(parts))
    return reasoning or None, content or None


def extract_tool_calls(text: str, parser: Optional[str], tools: Optional[list[dict]]) -> tuple[Optional[str], list[dict]]:
    """``(content, tool_calls)``: OpenAI tool calls parsed from ``text`` (module docstring); no parser or no
    ``tools`` in the request: the text is the content.

        >>> content, calls = extract_tool_calls('ok<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>',
        ...                                     "hermes", [{"type": "function", "function": {"name": "calc"}}])
        >>> content, calls[0]["function"]
        ('ok', {'name': 'calc', 'arguments': '{"x": 1}'})
    """
    if parser is None or not tools:
        return text, []
    if parser == "hermes":
        if HERMES_OPEN not in text:
            return text, []
        parsed, start = parse_tool_calls(text, "hermes"), text.index(HERMES_OPEN)
    else:
        schemas = {t["function"]["name"]: t for t in tools if isinstance(t.get("function"), dict)}
        parsed = parse_tool_calls(text, "compact", schemas)
        if not parsed:
            return text, []
        start = min(text.index(f"<{c.name}>") for c in parsed if c.name and f"<{c.name}>" in text)
    if not parsed or any(c.problem for c in parsed):  # vLLM's parser: a broken call leaves the text as content
        return text, []
    calls = [tool_call(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in parsed]
    return text[:start] or None, calls


def tool_call(name: str, arguments: str, call_id: Optional[str] = None) -> dict:
    """One OpenAI ``tool_calls`` entry (``arguments``: a JSON string), with a fresh ``call_...`` id unless given."""
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_message(text: str, tool_parser: Optional[str], reasoning_parser: Optional[str], tools: Optional[list[dict]],
                  template_kwargs: dict) -> tuple[Optional[str], Optional[str], list[dict]]:
    """``(reasoning_content, content, tool_calls)`` of a generated text, as vLLM's chat serving makes them: the
    reasoning split first (`split_reasoning`, ``enable_thinking`` read from ``template_kwargs``), then the tool calls
    parsed out of the content (`extract_tool_calls`; ``tools`` None when tool_choice is "none").

        >>> parse_message("<think>a</think>b", None, "qwen3", None, {"enable_thinking": True})
        ('a', 'b', [])
    """
    reasoning, content = split_reasoning(text, reasoning_parser, bool(template_kwargs.get("enable_thinking", True)))
    if content is None:
        return reasoning, None, []
    content, calls = extract_tool_calls(content, tool_parser, tools)
    return reasoning, content, calls


def cut_at_stop(text: str, stops: list[str]) -> str:
    """The text before the first of the request's stop strings (OpenAI leaves them out of the content).

        >>> cut_at_stop("12</a>3", ["</a>"])
        '12'
    """
    stop = first_stop(text, stops)
    return text if stop is None else text[:text.index(stop)]


def first_stop(text: str, stops: list[str]) -> Optional[str]:
    """The stop string that occurs first in ``text`` (the one generation ended at), or None.

        >>> first_stop("1;2.", [".", ";"]), first_stop("12", ["."])
        (';', None)
    """
    hits = [(text.index(s), s) for s in stops if s and s in text]
    return min(hits)[1] if hits else None
