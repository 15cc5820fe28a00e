"""OpenAI's Responses API (``POST /v1/responses``) as a dialect of the endpoint's chat completions: a request becomes a
chat request (`chat_request`), which the endpoint renders, generates in its batches and records exactly as it does
``/v1/chat/completions`` (`grpo.wings.agents.endpoint.Endpoint.chat`: the same chat template, tool and reasoning
parsers, seeds and `CallRecord`); the chat answer becomes a Response object (`response_body`).

The subset the official ``openai`` client (and the OpenAI Agents SDK's non-streaming ``Runner.run``) uses:

- ``input``: a string (one user message) or items: messages (``user`` / ``system`` / ``developer`` / ``assistant``,
  text as a string or ``input_text`` / ``output_text`` parts, ``input_image`` parts with an ``image_url`` for a
  vision-language policy), ``function_call``, ``function_call_output`` and ``reasoning`` items. Consecutive
  assistant items (reasoning, a message, function calls) are one assistant turn of the chat template, as a Response's
  output is one generation. Any other item or part type is a 400 naming it, never dropped.
- ``instructions``: a system message before the input (not carried over by ``previous_response_id``, as OpenAI's);
  ``tools``: function tools (``{"type": "function", "name", "parameters"}``), ``tool_choice`` as chat completions
  takes it; ``max_output_tokens``; ``temperature`` / ``top_p``: the run's training or validation pair, as chat
  completions checks them; ``store``; ``metadata`` echoed. ``stream``, ``background``, ``conversation``, a stored
  ``prompt`` and a ``text.format`` other than text are 400s naming the field.
- Multi-turn by full ``input`` lists or by ``previous_response_id``: every response is remembered under the key that
  made it (a sample's own, or the run's), the newest `RESPONSES_KEPT` of each; ``previous_response_id`` continues one
  that was stored (``store`` not false) under the same key, its conversation and output before the new input.

Token in, token out without token fields on the wire: a client of this API never hands them back, so the endpoint
keeps them. When the conversation's last assistant turn is a response it made (`Remembered`), and everything before
it, the tools and the template variables equal what that response answered, the turn carries that call's
``prompt_token_ids`` / ``generation_token_ids`` and the chat path splices the model's own tokens
(`grpo.wings.agents.openai_chat.replace_prefix_tokens`): a sample's calls stay contiguous and train token-exact. A
history that differs (a rewritten tool result, an edited answer, changed instructions) is rendered as sent, never
replaced by what the model saw before.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from grpo.tasks.nemo_gym import TOKEN_FIELDS
from grpo.wings.agents.openai_chat import ChatRequest, RequestError, tool_call

RESPONSES_KEPT = 64  # responses remembered per key (a sample's or the run's): what previous_response_id can name
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text", "text")  # text parts (output_text: an assistant message handed back)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields that change the answer (module docstring); other fields of OpenAI's
    (``include``, ``reasoning``, ``truncation``, ``parallel_tool_calls``, ``user``, ...) are accepted and have no
    effect. ``chat_template_kwargs`` and ``seed`` (extra fields, as chat completions takes them) pass through."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    store: Optional[bool] = None  # None: OpenAI's default, true
    stream: Optional[bool] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    text: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    seed: Optional[int] = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_items(cls, v):
        if isinstance(v, str) or (isinstance(v, list) and all(isinstance(item, dict) for item in v)):
            return v
        raise ValueError("expected a string or a list of items (JSON objects)")


@dataclass
class Remembered:
    """A response the endpoint made: the chat messages it answered (``history``: without its instructions, what
    ``previous_response_id`` continues; ``prompt``: with them, as rendered), its tools and template variables, its
    ``reply`` (the assistant message with the call's token fields), and whether the client may name it (``stored``)."""

    history: list[dict]
    prompt: list[dict]
    tools: Optional[list[dict]]
    template_kwargs: Optional[dict]
    reply: dict
    stored: bool


class ResponseStore:
    """The responses of one key, the newest `RESPONSES_KEPT`: by response id, and which response each output item
    id (``msg_...``, ``fc_...``, ``rs_...``) came from."""

    def __init__(self, kept: int = RESPONSES_KEPT):
        self.kept = kept
        self._responses: OrderedDict[str, Remembered] = OrderedDict()
        self._items: dict[str, str] = {}
        self._lock = threading.Lock()  # requests of one key are read on the endpoint's work threads

    def put(self, response_id: str, remembered: Remembered, item_ids: list[str]) -> None:
        with self._lock:
            self._responses[response_id] = remembered
            self._items.update((i, response_id) for i in item_ids)
            while len(self._responses) > self.kept:
                old, _ = self._responses.popitem(last=False)
                self._items = {i: r for i, r in self._items.items() if r != old}

    def get(self, response_id: str) -> Optional[Remembered]:
        with self._lock:
            return self._responses.get(response_id)

    def made(self, item_ids: list[str]) -> Optional[str]:
        """The id of the response whose output held all of ``item_ids`` (None: none, or not one response's)."""
        with self._lock:
            made = {self._items.get(i) for i in item_ids}
        return made.pop() if len(made) == 1 else None

    def continued(self, response_id: str) -> Remembered:
        """The stored response ``previous_response_id`` names, or OpenAI's 400 ``previous_response_not_found``."""
        found = self.get(response_id)
        if found is None or not found.stored:
            raise RequestError(400, f"previous_response_id: no stored response {response_id!r} under this key (a "
                                    f"response is kept when store is not false, the newest {self.kept} per key, and "
                                    "only for the key that made it)", param="previous_response_id",
                               code="previous_response_not_found")
        return found


# --------------------------------------------------------------------------------------------------
# Request -> chat
# --------------------------------------------------------------------------------------------------
def refuse_unsupported(req: ResponsesRequest) -> None:
    """A 400 naming the first field this endpoint does not serve (module docstring)."""
    if req.stream:
        raise RequestError(400, "stream=true is not supported by this endpoint: send stream=false (the OpenAI "
                                "Agents SDK's Runner.run does)", param="stream")
    if req.background:
        raise RequestError(400, "background=true is not supported by this endpoint", param="background")
    if req.conversation is not None:
        raise RequestError(400, "conversation is not supported by this endpoint: send the items as input, or "
                                "continue a response with previous_response_id", param="conversation")
    if req.prompt is not None:
        raise RequestError(400, "prompt (a stored prompt template) is not supported by this endpoint: send "
                                "instructions and input", param="prompt")
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise RequestError(400, f"text.format of type {fmt.get('type')!r} is not supported: structured output takes "
                                "constrained decoding, which would train the policy on tokens it did not sample; "
                                "send text and let the reward judge it", param="text.format")


def chat_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    """Responses function tools as chat completions' (``{"type": "function", "function": {...}}``); another tool type
    (a built-in such as ``web_search``) is a 400 naming it.

        >>> chat_tools([{"type": "function", "name": "calc", "parameters": {"type": "object"}, "strict": True}])
        [{'type': 'function', 'function': {'name': 'calc', 'parameters': {'type': 'object'}}}]
    """
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(400, f"tools.{i}: a tool of type {tool.get('type')!r}; this endpoint runs no tools "
                                    "of its own and takes function tools only: {'type': 'function', 'name': ..., "
                                    "'parameters': {...}}", param=f"tools.{i}")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice):
    """Responses' ``tool_choice`` in chat completions' form (``{"type": "function", "name": n}`` ->
    ``{"type": "function", "function": {"name": n}}``); strings pass. `openai_checks.check_tools` judges it.

        >>> chat_tool_choice({"type": "function", "name": "calc"}), chat_tool_choice("auto")
        ({'type': 'function', 'function': {'name': 'calc'}}, 'auto')
    """
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def content_parts(content, where: str) -> Union[str, list[dict]]:
    """A message's content for the chat template: a string as it is; parts as chat parts (text parts as
    ``{"type": "text"}``, ``input_image`` as ``image_url``); another part is a 400 naming it.

        >>> content_parts([{"type": "input_text", "text": "hi"}], "input.0.content")
        [{'type': 'text', 'text': 'hi'}]
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: expected a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise RequestError(400, f"{where}.{j}: a content part of type {kind!r}; this endpoint takes input_text, "
                                    "output_text and input_image (with an image_url) parts", param=f"{where}.{j}")
    return parts


def text_of(parts, where: str) -> str:
    """The text of an assistant message's or a reasoning item's parts (text, ``reasoning_text`` or ``summary_text``
    parts), joined; a string passes.

        >>> text_of([{"type": "output_text", "text": "4", "annotations": []}], "input.1.content")
        '4'
    """
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) and p.get(
            "type") in (*TEXT_PARTS, "reasoning_text", "summary_text") for p in parts):
        raise RequestError(400, f"{where}: the model's own items hand back text parts only (output_text, "
                                "reasoning_text, summary_text)", param=where)
    return "".join(p["text"] for p in parts)


@dataclass
class _Turn:
    """An assistant turn being gathered from consecutive assistant items, and the ids of those items."""

    reasoning: Optional[str] = None
    content: Optional[str] = None
    calls: list[dict] = field(default_factory=list)
    item_ids: list[str] = field(default_factory=list)

    def message(self) -> dict:
        return assistant_message(self.content, self.calls, self.reasoning)


def assistant_message(content: Optional[str], calls: list[dict], reasoning: Optional[str]) -> dict:
    """An assistant chat message in one form whichever side made it (a reply or items handed back), so the two
    compare equal when they say the same: empty text is no text.

        >>> assistant_message("", [], None)
        {'role': 'assistant', 'content': None}
    """
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def chat_messages(items: Union[str, list[dict]]) -> tuple[list[dict], list[str], dict[int, list[str]]]:
    """``(messages, sources, turn_items)``: the chat messages of a request's ``input`` (module docstring), where each
    came from (``input.<i>``, its first item), and for each assistant message gathered from items, the ids of those
    items (by message index). A 400 names the first item or part this endpoint does not take.

        >>> msgs, sources, ids = chat_messages([{"role": "user", "content": "2+2?"},
        ...     {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calc", "arguments": "{}"},
        ...     {"type": "function_call_output", "call_id": "call_1", "output": "4"}])
        >>> [m["role"] for m in msgs], msgs[1]["tool_calls"][0]["id"], msgs[2]["tool_call_id"], sources, ids
        (['user', 'assistant', 'tool'], 'call_1', 'call_1', ['input.0', 'input.1', 'input.2'], {1: ['fc_1']})
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"], {}
    messages: list[dict] = []
    sources: list[str] = []
    turn_items: dict[int, list[str]] = {}
    turn: Optional[_Turn] = None

    def flush():
        nonlocal turn
        if turn is not None:
            turn_items[len(messages)] = turn.item_ids
            messages.append(turn.message())
            turn = None

    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type") or ("message" if "role" in item else None)
        role = item.get("role")
        if kind not in ITEM_TYPES or (kind == "message" and role not in MESSAGE_ROLES):
            what = f"a message of role {role!r}" if kind == "message" else f"an item of type {kind!r}"
            raise RequestError(400, f"{where}: {what}; this endpoint takes messages (roles {list(MESSAGE_ROLES)}), "
                                    "function_call, function_call_output and reasoning items", param=where)
        assistant = kind in ("function_call", "reasoning") or (kind == "message" and role == "assistant")
        if not assistant:
            flush()
            sources.append(where)
            if kind == "message":
                messages.append({"role": role, "content": content_parts(item.get("content"), f"{where}.content")})
            else:
                messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                                 "content": content_parts(_field(item, "output", where, (str, list)),
                                                          f"{where}.output")})
            continue
        # a reasoning item or a message begins the next turn once this one has text or calls
        if turn is None or (kind != "function_call" and (turn.content is not None or turn.calls)):
            flush()
            turn = _Turn()
            sources.append(where)
        if item.get("id"):
            turn.item_ids.append(item["id"])
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            turn.reasoning = text_of(parts, f"{where}.content")
        elif kind == "message":
            turn.content = text_of(item.get("content"), f"{where}.content")
        else:
            turn.calls.append(tool_call(_field(item, "name", where), _field(item, "arguments", where),
                                        _field(item, "call_id", where)))
    flush()
    return messages, sources, turn_items


def _field(item: dict, name: str, where: str, types=str):
    value = item.get(name)
    if not isinstance(value, types):
        raise RequestError(400, f"{where}.{name}: missing or not a {getattr(types, '__name__', 'string or list')} "
                                f"in an item of type {item.get('type')!r}", param=f"{where}.{name}")
    return value


def plain(message: dict) -> dict:
    """The message without the token fields."""
    return {k: v for k, v in message.items() if k not in TOKEN_FIELDS}


def with_own_tokens(messages: list[dict], origin: dict[int, str], store: ResponseStore, tools, kwargs) -> list[dict]:
    """``messages`` with the call's token fields on the last assistant message when it is the reply of a response
    ``origin`` names (by message index) and everything the call answered equals what it answered then (module
    docstring): the chat path then splices the model's own tokens. Otherwise unchanged."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    made = store.get(origin.get(last, "")) if last is not None else None
    if made is None or (made.tools, made.template_kwargs) != (tools, kwargs) or made.prompt != messages[:last] \
            or plain(made.reply) != messages[last]:
        return messages
    return messages[:last] + [made.reply] + messages[last + 1:]


@dataclass
class Conversation:
    """What a request asks to continue: ``history`` (the earlier conversation and the input: what a later
    ``previous_response_id`` continues), ``prompt`` (the instructions, then the history: what is rendered),
    ``messages`` (the prompt with the token fields of a reply of this key's, `with_own_tokens`: what the chat
    request carries) and ``sources`` (where each prompt message came from: ``instructions``,
    ``previous_response_id``, ``input.<i>``)."""

    history: list[dict]
    prompt: list[dict]
    messages: list[dict]
    sources: list[str]


def conversation(req: ResponsesRequest, store: ResponseStore) -> Conversation:
    """The `Conversation` of ``req``: ``previous_response_id``'s history and reply (a 400 when ``store`` has no
    stored response of that id), then the input."""
    items, sources, turn_items = chat_messages(req.input)
    origin = {i: store.made(ids) for i, ids in turn_items.items()}
    history: list[dict] = []
    if req.previous_response_id is not None:
        before = store.continued(req.previous_response_id)
        history = before.history + [plain(before.reply)]
        origin = {len(history) - 1: req.previous_response_id, **{len(history) + i: r for i, r in origin.items()}}
        sources = ["previous_response_id"] * len(history) + sources
    history += items
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    prompt = system + history
    origin = {len(system) + i: r for i, r in origin.items() if r is not None}
    messages = with_own_tokens(prompt, origin, store, chat_tools(req.tools), req.chat_template_kwargs)
    return Conversation(history, prompt, messages, ["instructions"] * len(system) + sources)


def in_input_terms(err: RequestError, sources: list[str]) -> RequestError:
    """A chat path's error about ``messages.<k>...`` renamed for the request that was sent: ``input.<i>...`` (or
    ``instructions``, ``previous_response_id``), by where the k-th message came from (``sources``).

        >>> err = in_input_terms(RequestError(400, "messages.1.content.0: bad", param="messages.1.content.0"),
        ...                      ["instructions", "input.0"])
        >>> err.param, err.message
        ('input.0.content.0', 'input.0.content.0: bad')
    """
    head, _, rest = (err.param or "").partition(".")
    if head != "messages":
        return err
    index, dot, tail = rest.partition(".")
    if not (index.isdigit() and int(index) < len(sources)):  # the whole conversation
        return RequestError(err.status, err.message, "input", err.kind, err.code, err.headers)
    renamed = sources[int(index)] + dot + tail
    return RequestError(err.status, err.message.replace(err.param, renamed), renamed, err.kind, err.code, err.headers)


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatRequest:
    """The chat completions request the endpoint generates for ``req`` (``messages``: `conversation`'s): the same
    model, sampling, tools and template variables; ``logprobs`` on, so the answer carries the call's token fields
    that `response_body` keeps."""
    data = {"model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
            "max_tokens": req.max_output_tokens, "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice), "chat_template_kwargs": req.chat_template_kwargs,
            "seed": req.seed, "logprobs": True}
    try:
        return ChatRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as err:
        first = err.errors()[0]
        raise RequestError(400, f"input: {first['msg'].removeprefix('Value error, ')}", param="input") from None


# --------------------------------------------------------------------------------------------------
# Chat answer -> Response
# --------------------------------------------------------------------------------------------------
def output_items(message: dict) -> list[dict]:
    """A Response's ``output`` for a generated chat message: a ``reasoning`` item (with reasoning), a ``message``
    (with text, or when nothing else came), a ``function_call`` per tool call (its ``call_id`` the chat call's id).

        >>> [i["type"] for i in output_items({"role": "assistant", "content": "hm", "tool_calls": [
        ...     {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]})]
        ['message', 'function_call']
    """
    items = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    items += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
               "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
              for c in calls]
    return items


def response_body(req: ResponsesRequest, chat: dict, output: list[dict], response_id: str) -> dict:
    """OpenAI's Response object for ``req`` from the endpoint's chat answer ``chat`` (one choice) and its
    ``output`` items: ``incomplete`` (``max_output_tokens``) when generation stopped at its token limit."""
    choice, usage = chat["choices"][0], chat["usage"]
    cut = choice["finish_reason"] == "length"
    return {"id": response_id, "object": "response", "created_at": chat["created"], "completed_at": time.time(),
            "model": chat["model"], "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions, "metadata": req.metadata or {}, "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]},
            "weight_version": chat["weight_version"]}


async def create_response(endpoint, req: ResponsesRequest, session, store: ResponseStore) -> dict:
    """Answer ``req`` through ``endpoint.chat`` (the chat path: checks, rendering, batches, the session's record)
    and remember it in ``store`` (the key's). The conversation is gathered on the endpoint's work threads, as
    requests are parsed there (a long ``input`` costs the event loop nothing)."""
    refuse_unsupported(req)
    talk = await endpoint._off_loop(conversation, req, store)
    try:
        chat = await endpoint.chat(chat_request(req, talk.messages), session)
    except RequestError as err:
        raise in_input_terms(err, talk.sources) from None
    message = chat["choices"][0]["message"]
    reply = assistant_message(message.get("content"), message.get("tool_calls") or [],
                              message.get("reasoning_content"))
    reply.update((k, message[k]) for k in TOKEN_FIELDS)
    output = output_items(message)
    response_id = f"resp_{uuid.uuid4().hex}"
    store.put(response_id, Remembered(talk.history, talk.prompt, chat_tools(req.tools),
                                      req.chat_template_kwargs, reply, req.store is not False),
              [item["id"] for item in output])
    return response_body(req, chat, output, response_id)
