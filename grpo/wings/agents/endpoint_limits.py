"""What bounds one request's cost to the endpoint (`grpo.wings.agents.endpoint`), whoever sends it:

- its body is read as it arrives (`read_body`): the first byte over ``http_server.max_body_bytes`` is a 413 and the
  rest is never read (a chunked body declares no length); a body not in full ``http_server.read_timeout_s`` after
  the headers is a 408. Both answers close the connection.
- it is parsed and rendered on a work thread, off the server's event loop (`Endpoint._off_loop`), and its chat
  template stops after ``http_server.render_timeout_s`` (`template_deadline`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import contextmanager

from grpo.wings.agents.openai_chat import RequestError

# Jinja compiles a template from a string into Python code whose frames carry this file name.
JINJA_TEMPLATE_FILE = "<template>"


async def read_body(request, limit: int, timeout_s: float) -> bytes:
    """The body of ``request`` (a Starlette request), or a `RequestError`: 413 once it is over ``limit`` bytes
    (declared or read so far), 408 when it has not all come within ``timeout_s``. Starlette's ``ClientDisconnect``
    passes through."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, f"the request body did not arrive in full within {timeout_s:g} s "
                                "(policy.generation.http_server.read_timeout_s)", code="request_timeout",
                           headers={"Connection": "close"}) from None
    return b"".join(chunks)


def _too_large(limit: int) -> RequestError:
    return RequestError(413, f"the request body is over {limit} bytes (policy.generation.http_server.max_body_bytes)",
                        headers={"Connection": "close"})


class TemplateTimeout(Exception):
    """A chat template ran past its deadline (`template_deadline`)."""


@contextmanager
def template_deadline(seconds: float):
    """Stop the Jinja template code this thread runs in the block once ``seconds`` have passed: a `TemplateTimeout`
    is raised inside the template (its loops are Python code: a trace function sees each line of them; other code
    runs untraced). Python code only: a single C call (``"x" * 10**9``) ends when it ends."""
    deadline = time.monotonic() + seconds

    def in_template(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template ran past {seconds:g} s")
        return in_template

    def on_call(frame, event, arg):
        return in_template if frame.f_code.co_filename == JINJA_TEMPLATE_FILE else None

    before = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(before)
