"""Tool calls without torch: tools from Python functions, their JSON schemas, parsing calls out of an
assistant message, checking arguments, and running one call (the tool worker's side).

A tool is a typed, documented function (``env.tools: ["package.module:function", ...]``)::

    def calc(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: integers with + - * / ( ), e.g. "12*34"
        \"\"\"

Its JSON schema comes from transformers' ``get_json_schema`` (what ``apply_chat_template(..., tools=...)``
takes); its name is the function's ``__name__``.

Call formats (``env.tool_call_format``); the closing tag is the per-turn stop string:

- ``hermes`` (Hermes / Qwen2.5 / Qwen3): ``<tool_call>\\n{"name": "calc", "arguments": {"expression":
  "12*34"}}\\n</tool_call>``, several per message; stop string ``</tool_call>``. Results are tool messages
  whose content is the bare result (the chat template wraps them, Qwen2.5: in ``<tool_response>``).
- ``compact`` (the char-level toy tokenizer): ``<calc>12*34</calc>``: the tag is the tool's name, the body
  is its only argument (or a JSON object of arguments); only tags of known tools count as calls; stop
  strings ``</name>`` per tool. Results come back as ``<r>408</r>`` (a plain-text conversation has no
  template to mark them).

A call whose closing tag is missing at the very end of the message (a backend that strips the stop string)
still counts.

This module imports no torch, so the tool worker processes start fast; `grpo.tasks.tools` builds the
environment on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from grpo.tasks.function import EnvError, resolve_function

FORMATS = ("hermes", "compact")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


class ParsedCall(NamedTuple):
    """One tool call found in a message, or a problem in its place (``problem`` is then an error kind:
    ``bad_json``, ``missing_name``, ``arguments_not_object``, and ``detail`` says what is wrong)."""

    name: str | None
    arguments: dict
    problem: str | None = None
    detail: str = ""


# --------------------------------------------------------------------------------------------------
# Tools and their schemas
# --------------------------------------------------------------------------------------------------
def function_spec(fn: Callable) -> str:
    """A module-level function -> its ``"module:qualname"`` spec (how worker processes find it).

    >>> function_spec(json.dumps)
    'json:dumps'
    """
    spec = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', None)}"
    try:
        found = resolve_function(spec, "env.tools")
    except EnvError:
        found = None
    if found is not fn:
        raise EnvError(f"tool {fn!r}: worker processes import tools by name, so define it at the top level of an "
                       "importable module (not in __main__, a closure or a lambda) and pass it as 'module:function'")
    return spec


def resolve_tools(specs: Sequence[str | Callable]) -> dict[str, Callable]:
    """``["package.module:function", ...]`` (or the functions) -> ``{function name: function}``.

    >>> sorted(resolve_tools(["json:dumps", "json:loads"]))
    ['dumps', 'loads']
    """
    tools: dict[str, Callable] = {}
    for spec in specs:
        fn = spec if callable(spec) else resolve_function(spec, "env.tools")
        name = fn.__name__
        if name in tools:
            raise EnvError(f"env.tools: two tools are named {name!r} ({spec!r} and an earlier one); tool names "
                           "are function names and must be unique")
        tools[name] = fn
    return tools


def tool_schemas(tools: dict[str, Callable] | Sequence[Callable]) -> list[dict]:
    """JSON schemas of the tools (``apply_chat_template(..., tools=...)``), by transformers' ``get_json_schema``.

    A function without type hints on every argument or without a Google-style docstring (a description
    and an ``Args:`` line per argument) fails with an EnvError naming it and what is missing.
    """
    from transformers.utils import get_json_schema

    fns = list(tools.values()) if isinstance(tools, dict) else list(tools)
    schemas = []
    for fn in fns:
        try:
            schemas.append(get_json_schema(fn))
        except Exception as err:
            raise EnvError(
                f"tool {getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}: cannot build its JSON "
                f"schema: {err}. A tool needs a type hint on every argument and a docstring with a description "
                "and an 'Args:' section describing each argument"
            ) from err
    return schemas


def _type_problem(value: Any, schema: dict, where: str) -> str | None:
    """Why ``value`` does not fit the JSON ``schema`` (types, enum, array items), or None."""
    if value is None and schema.get("nullable"):
        return None
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(isinstance(value, _JSON_TYPES.get(t, object)) and not (t in ("integer", "number") and
                                                                           isinstance(value, bool))
                   for t in allowed):
            return f"{where} must be {' or '.join(allowed)}, got {json.dumps(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = _type_problem(item, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    return None


def check_arguments(schema: dict, arguments: Any) -> str | None:
    """The problem with a call's arguments under a tool's schema (as the model should read it), or None.

    >>> s = {"function": {"name": "add", "parameters": {"type": "object", "properties": {
    ...     "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    >>> check_arguments(s, {"a": 1, "b": 2}) is None
    True
    >>> check_arguments(s, {"a": 1, "b": "2"})
    'argument "b" must be integer, got "2"'
    >>> check_arguments(s, {"a": 1, "c": 2})
    'add takes no argument "c" (its arguments: "a", "b")'
    """
    fn = schema["function"]
    params = fn.get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {json.dumps(arguments)}"
    names = ", ".join(json.dumps(p) for p in props) or "none"
    for key in arguments:
        if key not in props:
            return f"{fn['name']} takes no argument {json.dumps(key)} (its arguments: {names})"
    missing = [p for p in required if p not in arguments]
    if missing:
        return f"{fn['name']} is missing the argument{'s' * (len(missing) > 1)} {', '.join(map(json.dumps, missing))}"
    for key, value in arguments.items():
        problem = _type_problem(value, props[key], f"argument {json.dumps(key)}")
        if problem:
            return problem
    return None


# --------------------------------------------------------------------------------------------------
# Formats: parsing, stop strings, results
# --------------------------------------------------------------------------------------------------
def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise EnvError(f"env.tool_call_format={fmt!r}: expected one of {list(FORMATS)}")
    return fmt


def stop_strings(fmt: str, tool_names: Sequence[str]) -> list[str]:
    """The stop strings of a tool turn: the closing tag(s) of the format.

    >>> stop_strings("hermes", ["calc"]), stop_strings("compact", ["calc", "python"])
    (['</tool_call>'], ['</calc>', '</python>'])
    """
    return [HERMES_CLOSE] if check_format(fmt) == "hermes" else [f"</{name}>" for name in tool_names]


def _hermes_call(body: str) -> ParsedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ParsedCall(None, {}, "bad_json", f"the tool call is not valid JSON ({err}); write "
                          '<tool_call>{"name": <tool name>, "arguments": {...}}</tool_call>')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ParsedCall(None, {}, "missing_name", 'the tool call has no "name" (a string): write '
                          '{"name": <tool name>, "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ParsedCall(obj["name"], {}, "arguments_not_object",
                          f'"arguments" must be a JSON object, got {json.dumps(arguments)}')
    return ParsedCall(obj["name"], arguments)


def _compact_arguments(name: str, body: str, schemas: dict[str, dict]) -> ParsedCall:
    """``<name>body</name>``: body is a JSON object of arguments, or the value of the tool's only argument."""
    if body.lstrip().startswith("{"):
        try:
            return ParsedCall(name, json.loads(body))
        except json.JSONDecodeError as err:
            return ParsedCall(name, {}, "bad_json", f"the arguments of {name} are not a valid JSON object ({err})")
    props = schemas[name].get("function", {}).get("parameters", {}).get("properties", {})
    if not props and not body.strip():
        return ParsedCall(name, {})
    if len(props) != 1:
        return ParsedCall(name, {}, "bad_json", f"{name} takes {len(props)} arguments: write them as a JSON object, "
                          f"<{name}>{{...}}</{name}>")
    (param, pschema), = props.items()
    if pschema.get("type", "string") == "string":
        return ParsedCall(name, {param: body})
    try:
        return ParsedCall(name, {param: json.loads(body)})
    except json.JSONDecodeError:
        return ParsedCall(name, {param: body})  # the argument check reports the wrong type


def parse_tool_calls(text: str, fmt: str, schemas: dict[str, dict] | None = None) -> list[ParsedCall]:
    """The tool calls of an assistant message, in order; a malformed call is a `ParsedCall` with a problem.

    ``schemas`` (``{name: schema}``) is needed by ``compact`` only: which tags are tools, and how a body
    maps to arguments.

    >>> parse_tool_calls('<tool_call>\\n{"name": "calc", "arguments": {"expression": "2*3"}}\\n</tool_call>', "hermes")
    [ParsedCall(name='calc', arguments={'expression': '2*3'}, problem=None, detail='')]
    >>> [c.problem for c in parse_tool_calls("<tool_call>{oops</tool_call><tool_call>[1]", "hermes")]
    ['bad_json', 'missing_name']
    >>> s = {"calc": {"function": {"parameters": {"properties": {"expression": {"type": "string"}}}}}}
    >>> parse_tool_calls("<calc>12*34</calc> and <b>x</b>", "compact", s)
    [ParsedCall(name='calc', arguments={'expression': '12*34'}, problem=None, detail='')]
    """
    if check_format(fmt) == "hermes":
        return [_hermes_call(m.group(1).strip()) for m in _HERMES_CALL.finditer(text)]
    schemas = schemas or {}
    if not schemas:
        return []
    names = "|".join(re.escape(n) for n in schemas)
    pattern = re.compile(rf"<({names})>(.*?)(?:</\1>|\Z)", re.DOTALL)
    return [_compact_arguments(m.group(1), m.group(2), schemas) for m in pattern.finditer(text)]


def format_result(fmt: str, text: str) -> str:
    """A tool message's content: the bare result (hermes: the chat template wraps it) or ``<r>...</r>``.

    >>> format_result("hermes", "408"), format_result("compact", "408")
    ('408', '<r>408</r>')
    """
    return text if check_format(fmt) == "hermes" else f"<r>{text}</r>"


def truncate(text: str, max_chars: int) -> str:
    """``text`` cut to its first and last ``max_chars / 2`` characters (the end of a traceback or of a
    program's output matters as much as its start), with a marker saying how many were cut.

    >>> truncate("abcdefgh", 4), truncate("abc", 3)
    ('ab...[4 chars cut]...gh', 'abc')
    """
    if len(text) <= max_chars:
        return text
    head = max_chars - max_chars // 2
    return f"{text[:head]}...[{len(text) - max_chars} chars cut]...{text[len(text) - max_chars // 2:]}"


# --------------------------------------------------------------------------------------------------
# Running one call (inside a tool worker process)
# --------------------------------------------------------------------------------------------------
def result_to_text(result: Any) -> str:
    """A tool's return value as text: strings as they are, anything else as JSON; TypeError otherwise.

    >>> result_to_text("hi"), result_to_text(408), result_to_text({"a": [1, 2.5]})
    ('hi', '408', '{"a": [1, 2.5]}')
    """
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"the tool returned a {type(result).__name__}, which cannot be turned into text; "
                        "return a string or JSON-serialisable values") from err


def load_tools(specs: Sequence[str]) -> dict[str, Callable]:
    """The tool worker's ``load``: import the tools once."""
    return resolve_tools(specs)


def run_tool_call(tools: dict[str, Callable], task: dict) -> tuple[str, str]:
    """The tool worker's ``call``: ``task = {"name", "arguments", "max_chars"}`` -> ``(kind, text)``.

    kind ``ok`` (text: the result), ``exception`` (``Type: message`` of what the tool raised) or
    ``bad_result`` (a result that cannot be turned into text); text is truncated to ``max_chars``.

    >>> tools = {"inv": lambda x: 1 / x}
    >>> run_tool_call(tools, {"name": "inv", "arguments": {"x": 4}, "max_chars": 10})
    ('ok', '0.25')
    >>> run_tool_call(tools, {"name": "inv", "arguments": {"x": 0}, "max_chars": 100})
    ('exception', 'ZeroDivisionError: division by zero')
    """
    try:
        result = tools[task["name"]](**task["arguments"])
    except Exception as err:
        return "exception", truncate(f"{type(err).__name__}: {err}", task["max_chars"])
    try:
        return "ok", truncate(result_to_text(result), task["max_chars"])
    except TypeError as err:
        return "bad_result", str(err)
