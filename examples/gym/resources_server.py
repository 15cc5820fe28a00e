"""A NeMo-Gym resources server in plain FastAPI: the calculator task, so Gym's protocol is visible without installing
Gym (which needs Python >= 3.13 and Ray). Gym's ``SimpleResourcesServer`` serves the same routes:

- ``POST /seed_session``: the row (as the agent got it) starts a session; the session id comes back as a cookie,
  which the agent sends with every later call (Gym's session middleware does the same).
- ``POST /calc``: the one tool, one route per tool: ``{"expression": "37*58"}`` -> ``2146`` (the text the model
  is shown).
- ``POST /verify``: the row and the agent's ``response`` (its ``output`` items) -> the verify response: the request
  echoed, ``reward`` (1 when the first integer of the final assistant message equals the row's
  ``expected_answer``, else 0) and ``reward_components`` (``correct``, ``used_tool`` x 0: named parts whose sum is
  the reward, as Gym's multi-reward servers return them). A row's own fields pass through, so a row's
  ``instance_config: {mask_sample: true}`` reaches the trainer as Gym's does.

Run by the stand-in launcher (examples/gym/launch.py) as ``python resources_server.py --name NAME --config FILE``.
"""

from __future__ import annotations

import ast
import operator
import re
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

SESSIONS: dict[str, dict] = {}
FIRST_INTEGER = re.compile(r"-?\d+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg}


def calc(expression: str) -> str:
    """An integer expression of + - * // % and parentheses, evaluated safely (no names, no calls)."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression {expression!r}")
    return str(ev(ast.parse(expression, mode="eval")))


def final_text(response: dict) -> str:
    """The text of the last assistant message among the response's output items ('' if it has none)."""
    for item in reversed(response.get("output") or []):
        if item.get("type") == "message" and item.get("role") == "assistant":
            return "".join(part.get("text", "") for part in item.get("content") or [])
    return ""


def app() -> FastAPI:
    api = FastAPI(title="calculator resources server")

    @api.post("/seed_session")
    async def seed_session(request: Request):
        row = await request.json()
        session = secrets.token_hex(8)
        SESSIONS[session] = {"row": row, "tool_calls": 0}
        response = PlainTextResponse("{}", media_type="application/json")
        response.set_cookie("session_id", session)
        return response

    @api.post("/calc")
    async def calc_route(request: Request):
        body = await request.json()
        session = SESSIONS.get(request.cookies.get("session_id", ""))
        if session is not None:
            session["tool_calls"] += 1
        try:
            return PlainTextResponse(calc(str(body.get("expression", ""))))
        except Exception as err:  # a bad call is the model's mistake: it is shown the error
            return PlainTextResponse(f"error: {err}")

    @api.post("/verify")
    async def verify(request: Request):
        body = await request.json()
        SESSIONS.pop(request.cookies.get("session_id", ""), None)
        match = FIRST_INTEGER.search(final_text(body["response"]))
        expected = str(body.get("expected_answer", ""))
        correct = float(match is not None and expected.lstrip("-").isdigit() and int(match.group()) == int(expected))
        return {**body, "reward": correct, "reward_components": {"correct": correct}}

    return api


if __name__ == "__main__":
    from serve import serve  # examples/gym/serve.py: this server's host and port from the launcher's config

    serve(app())
