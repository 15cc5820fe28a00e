"""What a request to the endpoint must pass before it joins a batch (`grpo.wings.agents.endpoint` calls
these; `grpo.wings.agents.openai_chat` holds the schema): each failure is a `RequestError` 400 that names the
field, so one client's bad request fails that request only, never the batch it would have joined.

- the body: JSON whose strings are text and whose nesting is bounded (`parse_request`, `check_json_values`), then
  the schema (content parts are text or images, `grpo.wings.agents.openai_images`; another part is refused, never
  dropped);
- sampling: the run's training or validation parameters (`check_sampling`);
- token ids of a history: the model's (`check_token_ids`);
- tools and ``tool_choice``: as vLLM validates them, forcing a call refused (`check_tools`);
- the chat template: the run's, a request's own only where the run trusts it (`request_template`).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import ValidationError

from grpo.config import CHAT_TEMPLATE_ARGS_SET_BY_GRPO
from grpo.wings.agents.openai_chat import ChatRequest, RequestError

# A request body nested deeper than this (arrays and objects) is refused: no real request comes near it (a tool's
# JSON schema is a few levels deep), and what reads the request recurses.
MAX_JSON_DEPTH = 64


def parse_request(model_cls, body: bytes):
    """The request of ``body`` (JSON), or a `RequestError` 400 naming the first bad field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    check_json_values(data)
    return validated(model_cls, data)


def validated(model_cls, data: dict):
    """``model_cls`` of ``data``, or a `RequestError` 400 naming the first bad field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise RequestError(400, f"{where}: {message} (got {str(first.get('input'))[:200]!r})",
                           param=where) from None


def check_json_values(data: Any) -> None:
    """A `RequestError` 400 naming where the request holds a string that is not text (a lone surrogate such as
    ``"\\ud800"``: JSON can escape it, UTF-8 cannot encode it, and the tokenizer fails on it) or nests deeper than
    `MAX_JSON_DEPTH`.

        >>> check_json_values({"messages": [{"role": "user", "content": "\\ud800"}]})
        Traceback (most recent call last):
        ...
        grpo.wings.agents.openai_chat.RequestError: messages.0.content: '\\ud800' at character 0 is a lone surrogate, not text
    """
    stack = [("", data, 0)]
    while stack:
        where, value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise RequestError(400, f"{where}: the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                                   param=where)
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                if isinstance(key, str):
                    _check_text(key, f"{where} (a key)" if where else "a key")
                stack.append((f"{where}.{key}" if where else str(key), item, depth + 1))


def _check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(400, f"{where or 'the body'}: {value[err.start]!r} at character {err.start} is a lone "
                                "surrogate, not text", param=where or None) from None


def check_sampling(req: ChatRequest, train: tuple[float, float], val: tuple[float, float]) -> str:
    """Which of the run's sampling profiles the request asks for: ``"train"`` or ``"val"`` (NeMo-RL's assertions,
    answered as a 400 here). ``top_p`` must be given; ``(temperature, top_p)`` must equal the training pair or the
    validation pair (a missing temperature means the training one); ``top_k`` unset or -1.

        >>> r = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], top_p=1.0)
        >>> check_sampling(r, (1.0, 1.0), (0.5, 1.0))
        'train'
    """
    if req.top_k not in (None, -1):
        raise RequestError(400, f"top_k={req.top_k}: the endpoint samples as the run does; top_k must be unset or -1",
                           param="top_k")
    if req.top_p is None:
        raise RequestError(400, f"top_p must be set explicitly (training: top_p={train[1]}, validation: "
                                f"top_p={val[1]})", param="top_p")
    temperature = train[0] if req.temperature is None else req.temperature
    if (temperature, req.top_p) == tuple(train):
        return "train"
    if (temperature, req.top_p) == tuple(val):
        return "val"
    raise RequestError(400, f"sampling (temperature={temperature}, top_p={req.top_p}) matches neither the training "
                            f"parameters (temperature={train[0]}, top_p={train[1]}) nor the validation ones "
                            f"(temperature={val[0]}, top_p={val[1]})", param="temperature")


def check_token_ids(req, vocab_size: int) -> None:
    """Every token id the request carries (``required_prefix_token_ids``, the messages' ``prompt_token_ids`` and
    ``generation_token_ids``) must be one of the model's, ``0 <= id < vocab_size``: a 400 naming the first that is
    not and where it is, before the request joins a batch (an out-of-vocabulary id fails inside the model, and with it
    every request of the batch).

        >>> r = ChatRequest(model="m", messages=[{"role": "assistant", "content": "x", "prompt_token_ids": [1],
        ...                                       "generation_token_ids": [5, -1]}])
        >>> check_token_ids(r, 10)
        Traceback (most recent call last):
        ...
        grpo.wings.agents.openai_chat.RequestError: messages.0.generation_token_ids.1 = -1 is not a token id of this model (expected 0 <= id < 10)
    """
    fields = [("required_prefix_token_ids", req.required_prefix_token_ids)]
    for i, m in enumerate(req.messages or ()):
        fields += [(f"messages.{i}.prompt_token_ids", m.prompt_token_ids),
                   (f"messages.{i}.generation_token_ids", m.generation_token_ids)]
    for where, ids in fields:
        for j, tid in enumerate(ids or ()):
            if not 0 <= tid < vocab_size:
                raise RequestError(400, f"{where}.{j} = {tid} is not a token id of this model (expected 0 <= id < "
                                        f"{vocab_size})", param=where)


def check_tools(req: ChatRequest, tool_parser: Optional[str]) -> None:
    """``tools`` / ``tool_choice`` as vLLM's chat server takes them, a 400 otherwise: tool_choice "none", "auto"
    (the default with tools: the policy decides; needs the run's ``tool_parser``, as vLLM needs
    ``--tool-call-parser``), and nothing else. vLLM checks the values as here ("bogus", a function not in ``tools``)
    and enforces "required" and a named function by constrained decoding; the endpoint refuses them: a grammar
    would make the policy write tokens it did not choose, and the trainer would train on them with logprobs of
    another distribution than the one they were sampled from (the hf backend has no constrained decoding at all).
    An agent that needs a tool call sends "auto" and lets the reward judge what the policy did.

        >>> tools = [{"type": "function", "function": {"name": "calc"}}]
        >>> check_tools(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools), "hermes")
        >>> check_tools(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
        ...                         tool_choice="bogus"), "hermes")
        Traceback (most recent call last):
        ...
        grpo.wings.agents.openai_chat.RequestError: invalid value for tool_choice: 'bogus': expected "none", "auto", "required" or a named function
    """
    choice = req.tool_choice
    if choice == "none":
        return
    if choice is not None and not req.tools:
        raise RequestError(400, f"tool_choice={choice!r} needs tools: the request has none", param="tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise RequestError(400, f"invalid value for tool_choice: {choice!r}: a named function is "
                                    "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        names = [t["function"]["name"] for t in req.tools]
        if name not in names:
            raise RequestError(400, f"tool_choice names the function {name!r}, which is not one of the request's "
                                    f"tools {names}", param="tool_choice")
        forced = f"the function {name!r}"
    elif choice not in (None, "auto", "required"):
        raise RequestError(400, f"invalid value for tool_choice: {choice!r}: expected \"none\", \"auto\", "
                                "\"required\" or a named function", param="tool_choice")
    else:
        forced = "a tool call" if choice == "required" else None
    if forced is not None:
        raise RequestError(400, f"tool_choice={choice!r} is not supported: forcing {forced} takes constrained decoding, "
                                "which would train the policy on tokens it did not sample; send tool_choice=\"auto\" "
                                "(the policy decides) and let the reward judge its call", param="tool_choice")
    if req.tools and tool_parser is None:
        raise RequestError(400, "tools with tool_choice=\"auto\" need a tool parser, and this run has none "
                                "(policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser); "
                                "tool_choice=\"none\" renders the tools and leaves the answer as text",
                           param="tool_choice")


def request_template(req, trusted: bool) -> Optional[str]:
    """The request's own chat template (its ``chat_template`` field), or None. vLLM's rules: without
    ``trusted`` (``http_server.trust_request_chat_template``) a request that sends one is refused; the template
    never comes in ``chat_template_kwargs``, nor does another argument the endpoint sets itself (``tokenize``,
    ``tools``, ...)."""
    taken = sorted(set(req.chat_template_kwargs or ()) & CHAT_TEMPLATE_ARGS_SET_BY_GRPO)
    if taken:
        raise RequestError(400, f"chat_template_kwargs: {taken} are not template variables (a template is the "
                                "request's chat_template field)", param="chat_template_kwargs")
    if req.chat_template is not None and not trusted:
        raise RequestError(400, "the request sends a chat_template, and this run does not take one from a request "
                                "(policy.generation.http_server.trust_request_chat_template=false, as vLLM's "
                                "--trust-request-chat-template)", param="chat_template")
    return req.chat_template
