"""The endpoint against hostile or broken clients (issue 43), on loopback: the official ``openai`` client for
requests it can send, raw sockets for bodies it cannot (chunked past the limit, slow, abandoned). Each test is a
fault the endpoint had: a chunked body read whole before the 413, slow clients holding every slot and disconnects
logged as tracebacks."""

from __future__ import annotations

import json
import logging
import socket
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

from grpo.system.generation.endpoint import Endpoint
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer
from tests.helpers.scripted_backend import ScriptedBackend
from tests.integration.test_endpoint import MODEL, USER, _cfg, _client

BODY = json.dumps({"model": MODEL, "messages": USER, "top_p": 1.0}).encode()


@contextmanager
def _scripted(texts=("ok",), tool_parser: str | None = None, **http_server):
    """An endpoint over `ScriptedBackend` with these ``policy.generation.http_server`` settings."""
    cfg = _cfg(**http_server)
    if tool_parser is not None:
        cfg.policy.generation.vllm_cfg.http_server_serving_chat_kwargs = {"tool_parser": tool_parser}
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, list(texts)), tok)
    ep.start()
    try:
        yield ep
    finally:
        ep.close()


def _open(ep: Endpoint, head: str, sent: bytes) -> socket.socket:
    """A raw connection that has sent a POST to /v1/chat/completions with header line(s) ``head`` and the first
    bytes ``sent`` of its body, and sends nothing more."""
    url = urlsplit(ep.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=20)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {ep.api_key}"
                 f"\r\nContent-Type: application/json\r\n{head}\r\n\r\n".encode() + sent)
    return sock


def _answer(sock: socket.socket) -> tuple[int, str]:
    """The status and body of the answer on ``sock`` (read until the server closes the connection)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


# --------------------------------------------------------------------------------------------------
# 11, 12. bodies: chunked past the limit, slow, abandoned
# --------------------------------------------------------------------------------------------------
def test_a_chunked_body_is_refused_at_max_body_bytes_without_reading_the_rest():
    """A chunked body declares no length: the 413 comes once max_body_bytes have arrived, while the client has not
    finished (and never will)."""
    with _scripted(max_body_bytes=20_000) as ep:
        chunk = b"x" * 4096
        sock = _open(ep, "Transfer-Encoding: chunked", b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk)
                                                               for _ in range(6)))  # 24 KiB, no last chunk
        status, body = _answer(sock)
    assert status == 413 and "max_body_bytes" in body


def test_a_slow_body_holds_no_slot_and_is_answered_408_after_read_timeout_s():
    """A client that sends its headers and part of its body holds none of max_concurrent_requests: the run's agents
    are served meanwhile; after read_timeout_s it is answered 408."""
    with _scripted(max_concurrent_requests=1, read_timeout_s=3.0) as ep:
        slow = _open(ep, f"Content-Length: {len(BODY)}", BODY[:10])
        time.sleep(0.3)
        with ep.serving():
            assert _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0).choices
        status, body = _answer(slow)
    assert status == 408 and "read_timeout_s" in body


def test_clients_gone_mid_body_or_cut_off_by_the_runs_end_log_no_traceback(caplog):
    """A client that disconnects mid-body is one line of the run's log; clients still sending when the run ends are
    answered 503 (uvicorn says once that it cancelled them), never a traceback each."""
    uvicorn_log = logging.getLogger("uvicorn")  # uvicorn's loggers do not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            with _scripted() as ep:
                _open(ep, f"Content-Length: {len(BODY)}", BODY[:10]).close()
                deadline = time.monotonic() + 20
                while not caplog.records and time.monotonic() < deadline:
                    time.sleep(0.05)
                [gone] = caplog.records
                cut_off = [_open(ep, f"Content-Length: {len(BODY)}", BODY[:10]) for _ in range(3)]
                time.sleep(0.3)
            answers = [_answer(sock) for sock in cut_off]
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert "disconnected before its request body was complete" in gone.getMessage()
    assert all(r.exc_info is None for r in caplog.records), caplog.text
    assert [status for status, _ in answers] == [503] * 3
