"""Anthropic's Messages API (``POST /v1/messages``) as a dialect of the endpoint's chat completions, without a
server: a request becomes a `ChatRequest` (`chat_request`), rendered by the same chat template, generated in the same
batches and recorded the same way; the chat completion becomes Anthropic's Message (`anthropic_message`).
`grpo.wings.agents.endpoint` serves it.

The subset taken (anything else is a 400 naming the field or block, never dropped):

- ``messages``: ``user`` / ``assistant`` turns whose content is a string or blocks: ``text``; ``image`` (a
  ``base64`` or ``url`` source, as an ``image_url`` part: `grpo.wings.agents.openai_images` reads and bounds it);
  ``tool_use`` in an assistant turn (its tool call); ``tool_result`` in a user turn (a ``tool`` message, in the
  order the blocks come); ``thinking`` in an assistant turn (its ``reasoning_content``, what the reasoning parser
  split off). A last turn from the assistant (a prefill) is refused: the template would close it.
- ``system``: a string or text blocks (a ``system`` message first).
- ``tools`` (``name``, ``description``, ``input_schema``: a function tool whose parameters are the schema) and
  ``tool_choice`` ``auto`` / ``none``; ``any`` and a named ``tool`` force a call, which takes constrained decoding
  (`openai_checks.check_tools` says why the endpoint refuses it).
- ``max_tokens`` (required), ``stop_sequences``, ``temperature`` / ``top_p`` / ``top_k`` as the chat route takes
  sampling (`openai_checks.check_sampling`: the run's training or validation pair), except that a missing ``top_p``
  is the training one (`chat_request` says why).

The answer: content blocks ``thinking`` (with a reasoning parser), ``text`` and ``tool_use`` (the run's tool parser's
calls, ``toolu_`` ids); ``stop_reason`` ``stop_sequence`` (with the sequence), ``tool_use``, ``max_tokens`` or
``end_turn``; ``usage`` in tokens. ``stream=true`` answers the same message as Anthropic's server-sent events
(`sse_events`) once it is generated. Errors use Anthropic's body (`error_body`).

Multi-turn token splice: an Anthropic client hands back only content blocks, never the token fields the chat route
splices on. So the endpoint keeps, per sample's key, the tokens of each answer under the conversation that ends with
it (`conversation_key`); a request whose history up to its last assistant turn is one of those conversations is
spliced onto those tokens (NeMo-RL's splice, `openai_chat.replace_prefix_tokens`), and the sample's calls stay
contiguous: the trainer scores the tokens the model wrote, not a re-tokenised text.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from grpo.wings.agents.openai_chat import IMAGE_PART, ChatRequest, RequestError
from grpo.wings.agents.openai_checks import validated

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); another 4xx is an
# invalid_request_error, another 5xx an api_error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def error_body(err: RequestError) -> dict:
    """Anthropic's error JSON for a refused request.

        >>> error_body(RequestError(404, "no such model"))
        {'type': 'error', 'error': {'type': 'not_found_error', 'message': 'no such model'}}
    """
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class AnthropicMessage(BaseModel):
    """One turn of a request; its blocks are checked when it is turned into chat messages (`chat_messages`)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class MessagesRequest(BaseModel):
    """``POST /v1/messages``: Anthropic's fields that change the answer; others (``metadata``, ``service_tier``,
    ``cache_control`` on blocks ...) are accepted and have no effect."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    stream: bool = False


# --------------------------------------------------------------------------------------------------
# The request, as chat completions
# --------------------------------------------------------------------------------------------------
def chat_request(req: MessagesRequest, train_top_p: float) -> ChatRequest:
    """The chat completion request that generates ``req``'s answer: its messages (`chat_messages`), tools
    (`chat_tools`), stop sequences, ``max_tokens`` and sampling; ``logprobs`` on, so the answer carries the generated
    tokens (the stop sequence is read from them, the session's splice keeps them). A missing ``top_p`` is the run's
    training one (``train_top_p``), as a missing temperature is on both routes: Anthropic's SDK has no sampling
    arguments (a client sends them in ``extra_body``), so the chat route's "top_p must be set" would refuse every
    client."""
    top_p = train_top_p if req.top_p is None else req.top_p
    return validated(ChatRequest, dict(
        model=req.model, messages=chat_messages(req.system, req.messages), max_tokens=req.max_tokens,
        stop=req.stop_sequences or None, temperature=req.temperature, top_p=top_p, top_k=req.top_k,
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice), logprobs=True))


def chat_messages(system, messages: list[AnthropicMessage]) -> list[dict]:
    """OpenAI chat messages of an Anthropic conversation: ``system`` first, then each turn (`user_messages`,
    `assistant_message`); a 400 naming the first block that is not taken, or a last turn from the assistant.

        >>> chat_messages("Be brief.", [AnthropicMessage(role="user", content="2+2?")])
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2+2?'}]
    """
    if messages and messages[-1].role == "assistant":
        where = f"messages.{len(messages) - 1}"
        raise RequestError(400, f"{where}: the last message is the assistant's (a prefill), which this endpoint "
                                "does not continue: end with a user turn", param=where)
    return conversation(system, messages)


def conversation(system, messages: list[AnthropicMessage]) -> list[dict]:
    """`chat_messages` of any conversation, one that ends with the assistant's turn too."""
    out = [{"role": "system", "content": text_content(system, "system")}] if system else []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        out += [assistant_message(m.content, where)] if m.role == "assistant" else user_messages(m.content, where)
    return out


def text_content(content, where: str) -> Union[str, list[dict]]:
    """A string, or text blocks as text parts (the chat path joins them for the template); another block is a 400."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise RequestError(400, f"{where}.{j}: a block of type {block.get('type')!r} where text blocks "
                                    "({'type': 'text', 'text': ...}) are taken", param=f"{where}.{j}")
    return [{"type": "text", "text": block["text"]} for block in content]


def user_messages(content, where: str) -> list[dict]:
    """The chat messages of a user turn: each ``tool_result`` block a ``tool`` message, each run of other blocks
    (``text``, ``image``) a ``user`` message, in the order they come.

        >>> [m["role"] for m in user_messages([{"type": "tool_result", "tool_use_id": "t", "content": "4"},
        ...                                    {"type": "text", "text": "and 3+3?"}], "messages.2")]
        ['tool', 'user']
    """
    if isinstance(content, str) or not content:
        return [{"role": "user", "content": content or ""}]
    out: list[dict] = []
    for j, block in enumerate(content):
        here = f"{where}.content.{j}"
        if block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestError(400, f"{here}: a tool_result block without its tool_use_id", param=here)
            result = block.get("content", "")
            if not isinstance(result, (str, list)):
                raise RequestError(400, f"{here}.content: a tool result's content is a string or a list of text and "
                                        "image blocks", param=f"{here}.content")
            parts = result if isinstance(result, str) else [content_part(b, f"{here}.content.{k}")
                                                            for k, b in enumerate(result)]
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": parts})
            continue
        part = content_part(block, here)
        if out and out[-1]["role"] == "user":
            out[-1]["content"].append(part)
        else:
            out.append({"role": "user", "content": [part]})
    return out


def content_part(block: dict, where: str) -> dict:
    """The chat content part of a ``text`` or ``image`` block (an image's ``base64`` source as a ``data:`` URL, a
    ``url`` source as it is); another block is a 400 naming it.

        >>> content_part({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        ...              "messages.0.content.0")
        {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,AAAA'}}
    """
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise RequestError(400, f"{where}: a text block without its text ({{'type': 'text', 'text': ...}})",
                               param=where)
        return {"type": "text", "text": block["text"]}
    if kind == "image":
        source = block.get("source") if isinstance(block.get("source"), dict) else {}
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return {"type": IMAGE_PART, IMAGE_PART: {"url": f"data:{source.get('media_type')};base64,{source['data']}"}}
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return {"type": IMAGE_PART, IMAGE_PART: {"url": source["url"]}}
        raise RequestError(400, f"{where}: an image block whose source is neither base64 ({{'type': 'base64', "
                                "'media_type': ..., 'data': ...}) nor a url ({'type': 'url', 'url': ...})",
                           param=where)
    raise RequestError(400, f"{where}: a block of type {kind!r}, which this endpoint does not take: a user turn holds "
                            "text, image and tool_result blocks", param=where)


def assistant_message(content, where: str) -> dict:
    """The chat message of an assistant turn: its ``text`` blocks the content, its ``tool_use`` blocks the tool
    calls (``input`` as the JSON ``arguments``), its ``thinking`` the ``reasoning_content``.

        >>> assistant_message([{"type": "text", "text": "Let me add."},
        ...                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}}], "m")
        {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Let me add.'}], 'tool_calls': [{'id': 'toolu_1', 'type': 'function', 'function': {'name': 'add', 'arguments': '{"a": 2}'}}]}
    """
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: dict[str, Any] = {"role": "assistant", "content": []}
    for j, block in enumerate(content):
        here, kind = f"{where}.content.{j}", block.get("type")
        if kind == "text":
            message["content"].append(content_part(block, here))
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise RequestError(400, f"{here}: a tool_use block is {{'type': 'tool_use', 'id': ..., 'name': ..., "
                                        "'input': {...}}", param=here)
            message.setdefault("tool_calls", []).append(
                {"id": block["id"], "type": "function",
                 "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            message["reasoning_content"] = message.get("reasoning_content", "") + block["thinking"]
        else:
            raise RequestError(400, f"{here}: a block of type {kind!r}, which this endpoint does not take: an "
                                    "assistant turn holds text, tool_use and thinking blocks", param=here)
    return message


def chat_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    """OpenAI function tools of Anthropic's client tools (``input_schema`` as the ``parameters``); a server tool
    (one with a ``type`` such as ``web_search_20250305``) or a tool without a name is a 400 naming it.

        >>> chat_tools([{"name": "add", "description": "Add.", "input_schema": {"type": "object"}}])
        [{'type': 'function', 'function': {'name': 'add', 'description': 'Add.', 'parameters': {'type': 'object'}}}]
    """
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(400, f"tools.{i}: {tool.get('type') or 'a tool without a name'} is not a client tool: "
                                    "this endpoint takes {'name': ..., 'description': ..., 'input_schema': {...}}",
                               param=f"tools.{i}")
        described = {"description": tool["description"]} if tool.get("description") is not None else {}
        out.append({"type": "function", "function": {
            "name": tool["name"], **described,
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}})
    return out


def chat_tool_choice(choice: Optional[dict]) -> Optional[Union[str, dict]]:
    """OpenAI's ``tool_choice`` of Anthropic's: ``auto`` and ``none`` as they are, ``any`` as ``required`` and a named
    ``tool`` as a named function (both refused by `openai_checks.check_tools`: forcing a call takes constrained
    decoding); another value is a 400.

        >>> chat_tool_choice({"type": "any"}), chat_tool_choice({"type": "tool", "name": "add"})
        ('required', {'type': 'function', 'function': {'name': 'add'}})
    """
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(400, f"invalid tool_choice {choice!r}: expected {{'type': 'auto'}}, {{'type': 'none'}}, "
                            "{'type': 'any'} or {'type': 'tool', 'name': ...}", param="tool_choice")


# --------------------------------------------------------------------------------------------------
# The answer
# --------------------------------------------------------------------------------------------------
def anthropic_message(completion: dict, stop_sequence: Optional[str]) -> dict:
    """Anthropic's Message of a one-choice chat completion (`grpo.wings.agents.endpoint.Endpoint.chat`'s answer);
    ``stop_sequence``: the request's stop sequence the generation ended at, if any. A stop sequence is the stop
    reason before a tool call (the text was cut there), a tool call before the length. Text that is only whitespace
    beside tool calls (the newline after a reasoning) is no block: Anthropic's API refuses such a block in a history.

        >>> anthropic_message({"model": "m", "weight_version": 0, "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        ...     "choices": [{"message": {"content": "4"}, "finish_reason": "stop"}]}, None)["stop_reason"]
        'end_turn'
    """
    choice = choice_of(completion)
    message = choice["message"]
    blocks: list[dict] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    content, calls = message.get("content"), message.get("tool_calls")
    if content and (content.strip() or not calls):  # not the newline between the reasoning and a call
        blocks.append({"type": "text", "text": content})
    for call in calls or ():
        blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                       "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])})
    reason = "stop_sequence" if stop_sequence is not None else STOP_REASONS.get(choice["finish_reason"], "end_turn")
    usage = completion["usage"]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": completion["model"],
            "content": blocks, "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
            "weight_version": completion["weight_version"]}


def choice_of(completion: dict) -> dict:
    """The one choice of a chat completion made for a Messages request (which has no ``n``)."""
    [choice] = completion["choices"]
    return choice


def sse_events(message: dict) -> str:
    """Anthropic's server-sent events of a whole ``message`` (what ``stream=true`` answers once it is generated):
    ``message_start``, a start, one delta and a stop per content block, ``message_delta`` with the stop reason and
    the output tokens, ``message_stop``.

        >>> events = sse_events({"content": [{"type": "text", "text": "4"}], "stop_reason": "end_turn",
        ...                      "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 2}})
        >>> [line.removeprefix("event: ") for line in events.splitlines() if line.startswith("event:")]
        ['message_start', 'content_block_start', 'content_block_delta', 'content_block_stop', 'message_delta', 'message_stop']
    """
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    events = [("message_start", {"message": start})]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            empty, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        elif kind == "thinking":
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        events += [("content_block_start", {"index": index, "content_block": empty}),
                   ("content_block_delta", {"index": index, "delta": delta}),
                   ("content_block_stop", {"index": index})]
    events += [("message_delta", {"delta": {"stop_reason": message["stop_reason"],
                                            "stop_sequence": message["stop_sequence"]},
                                  "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
               ("message_stop", {})]
    return "".join(f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"
                   for name, data in events)


# --------------------------------------------------------------------------------------------------
# The session's splice
# --------------------------------------------------------------------------------------------------
def conversation_key(system, messages: list[AnthropicMessage]) -> str:
    """A digest of a conversation as the template reads it (`conversation`): equal for the conversation an answer
    ended and the history a client sends back with that answer as its last assistant turn, whatever form the client
    gives a block in (a string or text blocks, extra fields), and whether it keeps the thinking blocks (Anthropic's
    clients may drop them; the splice keeps the model's tokens, its thinking included, either way).

        >>> text = [AnthropicMessage(role="user", content="2+2?"), AnthropicMessage(role="assistant", content="4")]
        >>> blocks = [AnthropicMessage(role="user", content=[{"type": "text", "text": "2+2?"}]),
        ...           AnthropicMessage(role="assistant", content=[{"type": "thinking", "thinking": "hm"},
        ...                                                       {"type": "text", "text": "4", "citations": None}])]
        >>> conversation_key(None, text) == conversation_key(None, blocks)
        True
    """
    chat = conversation(system, messages)
    for m in chat:
        m.pop("reasoning_content", None)
        if isinstance(m.get("content"), list) and all(p.get("type") == "text" for p in m["content"]):
            m["content"] = "\n".join(p["text"] for p in m["content"])  # as the chat path joins them
    return hashlib.sha256(json.dumps(chat, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def history_key(req: MessagesRequest) -> Optional[str]:
    """`conversation_key` of ``req``'s history up to its last assistant turn (None without one): the conversation
    whose answer's tokens the request continues."""
    last = max((i for i, m in enumerate(req.messages) if m.role == "assistant"), default=None)
    return None if last is None else conversation_key(req.system, req.messages[:last + 1])


def answer_key(req: MessagesRequest, message: dict) -> str:
    """`conversation_key` of ``req``'s conversation followed by its answer ``message``."""
    answer = AnthropicMessage(role="assistant", content=message["content"])
    return conversation_key(req.system, [*req.messages, answer])
