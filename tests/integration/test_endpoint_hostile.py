"""The endpoint against hostile or broken clients (issue 43), on loopback: the official ``openai`` client for
requests it can send, raw sockets for bodies it cannot (chunked past the limit, slow, abandoned). Each test is a
fault the endpoint had: a bad token id failing its whole batch, a request replacing the run's chat template or
freezing the event loop with one, a chunked body read whole before the 413, slow clients holding every slot and
disconnects logged as tracebacks, client garbage answered 500, tool_choice values accepted and ignored, image parts
silently dropped."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from grpo.wings.agents.endpoint import Endpoint
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer
from tests.helpers.scripted_backend import ScriptedBackend
from tests.integration.test_endpoint import MODEL, USER, _cfg, _client, _hf_endpoint, _post

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
# 3. token ids in a history
# --------------------------------------------------------------------------------------------------
# SIMPLE_CHAT_TEMPLATE with an end-of-turn token after assistant turns, where NeMo-RL's splice resumes the template
SPLICE_TEMPLATE = SIMPLE_CHAT_TEMPLATE.replace("{{ m['content'] }}",
                                               "{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}")


@pytest.fixture(scope="module")
def tiny():
    """The endpoint over the hf backend and a tiny model: an out-of-vocabulary id fails inside it."""
    ep = _hf_endpoint(_cfg(), SPLICE_TEMPLATE)
    yield ep
    ep.close()


@pytest.mark.parametrize("field, bad", [("generation_token_ids", 10_000), ("prompt_token_ids", -1)])
def test_a_bad_token_id_in_a_history_is_a_400_naming_it_and_fails_no_other_request(tiny, field, bad):
    """An agent hands back its history with the endpoint's token fields; one agent's history holds an id that is not
    the model's. Its request is refused by name before batching; the request queued beside it is answered."""
    with tiny.serving():
        first = _client(tiny).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, logprobs=True, seed=1)
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "2+2="}]
    broken = json.loads(json.dumps(history))
    broken[1][field][1] = bad
    tiny.backend.batches = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both wait while the endpoint is closed
        good = pool.submit(_client(tiny).chat.completions.create, model=MODEL, messages=history, top_p=1.0)
        refused = pool.submit(_client(tiny).chat.completions.create, model=MODEL, messages=broken, top_p=1.0)
        time.sleep(1.0)
        with tiny.serving():
            assert good.result(timeout=60).choices[0].message.role == "assistant"
            with pytest.raises(openai.BadRequestError) as err:
                refused.result(timeout=60)
    assert f"messages.1.{field}.1 = {bad} is not a token id" in err.value.body["message"]
    assert err.value.body["param"] == f"messages.1.{field}" and tiny.backend.batches == [1]


def test_a_padded_embeddings_extra_ids_are_the_models_too():
    """A model whose embedding has more rows than its tokenizer has tokens (Qwen2.5: 151,936 for 151,665) can sample
    an id past the tokenizer's: a history holding one is the policy's own and is served; one past the rows is not."""
    cfg = _cfg()
    tok = build_char_tokenizer(SPLICE_TEMPLATE)
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, ["ok"] * 3), tok, vocab_size=len(tok) + 8)
    ep.start()
    try:
        with ep.serving():
            first = _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, logprobs=True, seed=1)
            history = [*USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "x"}]
            history[1]["generation_token_ids"][0] = len(tok) + 7  # a padded row: the model's
            assert _client(ep).chat.completions.create(model=MODEL, messages=history, top_p=1.0).choices
            history[1]["generation_token_ids"][0] = len(tok) + 8
            with pytest.raises(openai.BadRequestError, match=f"= {len(tok) + 8} is not a token id"):
                _client(ep).chat.completions.create(model=MODEL, messages=history, top_p=1.0)
    finally:
        ep.close()


# --------------------------------------------------------------------------------------------------
# 4. a request's chat template; rendering off the event loop, bounded
# --------------------------------------------------------------------------------------------------
OWN = "X{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_requests_chat_template_is_refused_unless_the_run_trusts_it():
    """The run renders with the tokenizer's own template; a request may not replace it (vLLM's
    --trust-request-chat-template is off by default), in either spelling."""
    with _scripted() as ep, ep.serving():
        c = _client(ep)
        for extra, param in (({"chat_template_kwargs": {"chat_template": OWN}}, "chat_template_kwargs"),
                             ({"chat_template": OWN}, "chat_template")):
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(model=MODEL, messages=USER, top_p=1.0, extra_body=extra)
            assert err.value.body["param"] == param, err.value.body
        assert "trust_request_chat_template" in err.value.body["message"]
        r = c.chat.completions.create(model=MODEL, messages=USER, top_p=1.0, logprobs=True)
        assert ep.tokenizer.decode(r.choices[0].message.model_extra["prompt_token_ids"]) != "X1+2="
    with _scripted(trust_request_chat_template=True) as ep, ep.serving():
        r = _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, logprobs=True,
                                                extra_body={"chat_template": OWN})
        assert ep.tokenizer.decode(r.choices[0].message.model_extra["prompt_token_ids"]) == "X1+2="


# 10^8 loop steps: most of a minute of Python, unless stopped
HEAVY = "{% for i in range(100000) %}{% for j in range(1000) %}{% set x = j %}{% endfor %}{% endfor %}x"


def test_rendering_runs_off_the_event_loop_and_stops_at_render_timeout_s():
    """A heavy (trusted) template: /health answers while it renders, and the rendering is stopped after
    render_timeout_s with a 400; a rendering longer than the context could hold is refused before it is encoded."""
    with _scripted(trust_request_chat_template=True, render_timeout_s=2.0) as ep, ep.serving():
        root = ep.base_url.removesuffix("/v1")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            heavy = pool.submit(_post, ep, "/v1/chat/completions",
                                json.dumps({"model": MODEL, "messages": USER, "top_p": 1.0, "chat_template": HEAVY}))
            time.sleep(0.5)  # it renders now
            assert httpx.get(root + "/health", timeout=30).json()["status"] == "ok"
            assert not heavy.done()
            r = heavy.result(timeout=60)
        assert r.status_code == 400 and "render_timeout_s" in r.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0,
                                                extra_body={"chat_template": "{{ 'x' * 100000 }}"})
        assert "characters, more than policy.max_total_sequence_length=64" in err.value.body["message"]


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


# --------------------------------------------------------------------------------------------------
# 13. client garbage
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, words", [
    (json.dumps({"model": MODEL, "top_p": 1.0, "messages": [{"role": "user", "content": "1+\ud800"}]}),
     "messages.0.content: '\\ud800' at character 2 is a lone surrogate"),
    (json.dumps({"model": MODEL, "top_p": 1.0, "messages": USER, "user": "\udfff"}), "user:"),
    ('{"model": "%s", "top_p": 1.0, "messages": %s, "metadata": %s}' % (MODEL, json.dumps(USER),
                                                                          "[" * 100_000 + "]" * 100_000),
     "nested more than 64 levels"),
    ('{"model": "%s", "top_p": 1.0, "messages": %s, "metadata": %s}' % (MODEL, json.dumps(USER), "[" * 70 + "]" * 70),
     "metadata.0.0.0"),
])
def test_client_garbage_is_a_400_naming_it(body, words):
    with _scripted(max_body_bytes=1_000_000) as ep, ep.serving():
        r = _post(ep, "/v1/chat/completions", body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


# --------------------------------------------------------------------------------------------------
# 17. tool_choice; image parts
# --------------------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.mark.parametrize("kw, words", [
    (dict(tools=TOOLS, tool_choice="bogus"), "invalid value for tool_choice: 'bogus'"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}}),
     "'search', which is not one of the request's tools ['calc']"),
    (dict(tool_choice="auto"), "needs tools"),
    (dict(tools=TOOLS, tool_choice="required"), "constrained decoding"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calc"}}), "constrained decoding"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools:"),
])
def test_tool_choice_is_checked_as_vllm_does_and_forcing_a_call_is_refused(kw, words):
    with _scripted(tool_parser="compact") as ep, ep.serving():
        with pytest.raises(openai.BadRequestError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, **kw)
    assert words in err.value.body["message"], err.value.body


def test_tools_are_parsed_with_auto_and_need_a_tool_parser():
    with _scripted(texts=["<calc>1+2</calc>"], tool_parser="compact") as ep, ep.serving():
        for choice in ({}, {"tool_choice": "auto"}):
            r = _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, tools=TOOLS, **choice)
            assert r.choices[0].message.tool_calls[0].function.name == "calc"
    with _scripted(texts=["<calc>1+2</calc>"]) as ep, ep.serving():  # no tool parser: vLLM refuses "auto" too
        with pytest.raises(openai.BadRequestError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, tools=TOOLS)
        assert "need a tool parser" in err.value.body["message"]
        r = _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, tools=TOOLS, tool_choice="none")
        assert r.choices[0].message.content == "<calc>1+2</calc>"


def test_an_image_part_is_a_400_naming_it_never_dropped():
    """A text-only policy's endpoint refuses an image part by name (a vision-language policy's renders it:
    tests/integration/test_endpoint_images.py), and a part of another type on any policy."""
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
             {"type": "text", "text": "1+2="}]
    with _scripted() as ep, ep.serving():
        with pytest.raises(openai.BadRequestError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], top_p=1.0)
        assert "messages.0.content.0: an image part" in err.value.body["message"]
        assert "is a text model" in err.value.body["message"]
        assert err.value.body["param"] == "messages.0.content.0"
        audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
        with pytest.raises(openai.BadRequestError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [audio]}],
                                                top_p=1.0)
        assert "content part 0 is of type 'input_audio'" in err.value.body["message"]
        assert err.value.body["param"] == "messages.0.content"
        r = _client(ep).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts[1:]}],
                                                top_p=1.0)
        assert r.choices[0].message.content == "ok"
