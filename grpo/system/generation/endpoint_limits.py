"""What bounds one request's cost to the endpoint (`grpo.system.generation.endpoint`), whoever sends it:

- its body is read as it arrives (`read_body`): the first byte over ``http_server.max_body_bytes`` is a 413 and the
  rest is never read (a chunked body declares no length); a body not in full ``http_server.read_timeout_s`` after
  the headers is a 408. Both answers close the connection.
"""

from __future__ import annotations

import asyncio

from grpo.system.generation.openai_chat import RequestError


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
