"""The endpoint on loopback, driven by the official ``openai`` client (and raw HTTP for what a client cannot send):
chat, logprobs and the token fields, /tokenize equal to chat's rendering, /v1/models, /health, batching, the
sessions' records, tool calls and reasoning, and every error path (grpo/wings/agents/endpoint.py)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest

from grpo.config import MasterConfig
from grpo.wings.agents.endpoint import Endpoint
from grpo.wings.agents.endpoint_batching import BUSY_WAIT_S
from grpo.system.generation.hf import HFGeneration
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
from tests.helpers.scripted_backend import ScriptedBackend

MODEL = "toy:tiny"
USER = [{"role": "user", "content": "1+2="}]


def _cfg(generation_batch_size: int = 32, **http_server) -> MasterConfig:
    return MasterConfig.model_validate({"policy": {
        "model_name": MODEL, "precision": "float32", "max_total_sequence_length": 64,
        "generation_batch_size": generation_batch_size,
        "generation": {"max_new_tokens": 6, "val_temperature": 0.5, "port_range_low": 23000, "port_range_high": 23999,
                       "http_server": {"batch_window_s": 0.05, **http_server}}}})


class CountingHF(HFGeneration):
    """The hf backend, counting its generate calls and their batch sizes."""

    def generate(self, prompt_ids, seeds, **kw):
        self.batches = getattr(self, "batches", []) + [len(prompt_ids)]
        return super().generate(prompt_ids, seeds, **kw)


def _hf_endpoint(cfg: MasterConfig, template: str = SIMPLE_CHAT_TEMPLATE) -> Endpoint:
    """The endpoint over the hf backend (`CountingHF`) and a tiny model, started; the char tokenizer's chat template
    is ``template``."""
    tok = build_char_tokenizer(template)
    model = build_tiny_model(tok)
    ep = Endpoint(cfg, CountingHF(cfg.policy, tok, model.config, "cpu", model=model), tok)
    ep.start()
    return ep


@pytest.fixture(scope="module")
def served():
    ep = _hf_endpoint(_cfg(max_body_bytes=20_000))
    yield ep
    ep.close()


def _client(ep, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=key or ep.api_key, max_retries=0, timeout=60)


def _post(ep, path: str, content: bytes | str, key=None, **headers) -> httpx.Response:
    root = ep.base_url.removesuffix("/v1")
    return httpx.post(root + path, content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key or ep.api_key}", "Content-Type": "application/json",
                               **headers})


def test_chat_with_logprobs_carries_nemo_rls_token_fields(served):
    with served.serving(weight_version=7):
        r = _client(served).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, logprobs=True,
                                                    top_logprobs=1, n=2, seed=3)
    assert r.model_extra["weight_version"] == 7 and len(r.choices) == 2
    for choice in r.choices:
        extra = choice.message.model_extra
        gen, lps = extra["generation_token_ids"], extra["generation_log_probs"]
        assert 1 <= len(gen) <= 6 and len(lps) == len(gen) and all(-9999.0 <= x <= 0 for x in lps)
        assert [t.logprob for t in choice.logprobs.content] == lps
        assert choice.logprobs.content[0].top_logprobs[0].logprob == lps[0]
        assert choice.finish_reason in ("stop", "length")
    # /tokenize renders exactly as chat did
    tokens = _post(served, "/tokenize", json.dumps({"model": MODEL, "messages": USER})).json()["tokens"]
    assert tokens == r.choices[0].message.model_extra["prompt_token_ids"]
    assert r.usage.prompt_tokens == len(tokens)


def test_same_seed_same_answer_and_max_tokens_clamped(served):
    c = _client(served)
    with served.serving():
        a = c.chat.completions.create(model=MODEL, messages=USER, top_p=1.0, seed=11, max_tokens=3, logprobs=True)
        b = c.chat.completions.create(model=MODEL, messages=USER, top_p=1.0, seed=11, max_completion_tokens=3,
                                      logprobs=True)
        big = c.chat.completions.create(model=MODEL, messages=USER, top_p=1.0, max_tokens=10_000, logprobs=True)
    assert a.choices[0].message.model_extra == b.choices[0].message.model_extra
    assert len(a.choices[0].message.model_extra["generation_token_ids"]) <= 3
    extra = big.choices[0].message.model_extra
    assert len(extra["prompt_token_ids"]) + len(extra["generation_token_ids"]) <= 64


def test_models_and_health(served):
    assert [m.id for m in _client(served).models.list().data] == [MODEL]
    assert httpx.get(served.base_url.removesuffix("/v1") + "/health").json()["status"] == "ok"
    with pytest.raises(openai.AuthenticationError):
        _client(served, key="sk-wrong").models.list()


def test_requests_that_arrive_together_generate_together(served):
    """Requests wait while the endpoint is closed (weights may change), then go to the backend as one batch."""
    served.backend.batches = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_client(served).chat.completions.create, model=MODEL, messages=USER, top_p=1.0,
                               seed=i) for i in range(4)]
        time.sleep(1.0)
        assert served.backend.batches == [] and not any(f.done() for f in futures)
        with served.serving():
            answers = [f.result(timeout=60) for f in futures]
    assert served.backend.batches == [4] and len(answers) == 4


def test_requests_that_keep_coming_generate_together_up_to_a_full_chunk():
    """Agents whose answers came back together send their next calls one after another, over more than one
    batch_window_s: a batch takes requests while each comes within the window of the one before, and closes at a
    full policy.generation_batch_size (a steady stream never waits for ever)."""
    cfg = _cfg(generation_batch_size=3, batch_window_s=1.0)
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, ["ok"]), tok)
    ep.start()

    def batches(n: int, every_s: float) -> list[int]:
        ep.backend.calls = []
        with ep.serving(), concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = []
            for i in range(n):
                futures.append(pool.submit(_client(ep).chat.completions.create, model=MODEL, messages=USER,
                                           top_p=1.0, seed=i))
                time.sleep(every_s)
            assert all(f.result(timeout=60).choices[0].message.content == "ok" for f in futures)
        return [len(call) for call in ep.backend.calls]

    try:
        assert batches(3, every_s=0.6) == [3]  # 1.2 s from the first to the last: one batch
        assert batches(7, every_s=0.2) == [3, 3, 1]  # full chunks go at once; the last one after a quiet window
    finally:
        ep.close()


def test_a_batch_waits_for_a_request_the_server_is_still_reading():
    """A request still being read when the window after the last arrival ends (as the agents' next calls come while
    the server writes the last batch's answers): the batch waits for it instead of splitting the turn in two, for
    BUSY_WAIT_S at most (a client that never finishes its body holds no one back)."""
    cfg = _cfg(batch_window_s=0.3)
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, ["ok"]), tok)
    ep.start()
    body = json.dumps({"model": MODEL, "messages": USER, "top_p": 1.0}).encode()

    def slow_body(pause_s: float):
        yield body[:10]
        time.sleep(pause_s)  # the server has the headers: it is handling this request
        yield body[10:]

    def batches(pause_s: float) -> tuple[list[int], bool]:
        ep.backend.calls = []
        with ep.serving(), concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(_post, ep, "/v1/chat/completions", slow_body(pause_s))
            time.sleep(0.3)
            fast = _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0)
            slow_done_first = slow.done()
            assert fast.choices[0].message.content == "ok" and slow.result(timeout=60).status_code == 200
        return [len(call) for call in ep.backend.calls], slow_done_first

    try:
        assert batches(0.8)[0] == [2]
        assert BUSY_WAIT_S < 3 and batches(4.0) == ([1, 1], False)  # answered before the slow body ends
    finally:
        ep.close()


def test_a_sessions_calls_are_recorded(served):
    key = served.open_session("sample-0")
    with served.serving(weight_version=2):
        r = _client(served, key).chat.completions.create(model=MODEL, messages=USER, top_p=1.0, logprobs=True)
        _client(served, key).chat.completions.create(model=MODEL, messages=USER, top_p=0.5 * 2, n=2)
    records = served.close_session(key)
    extra = r.choices[0].message.model_extra
    assert len(records) == 3 and all(rec.weight_version == 2 for rec in records)
    assert (records[0].prompt_token_ids, records[0].generation_token_ids, records[0].generation_log_probs) == (
        extra["prompt_token_ids"], extra["generation_token_ids"], extra["generation_log_probs"])
    with pytest.raises(openai.AuthenticationError):  # a closed session's key is refused
        _client(served, key).models.list()


def test_a_shared_session_seeded_by_prompt_generates_the_same_set_whatever_order_its_calls_arrive_in(served):
    """NeMo-Gym's model server sends one key for all samples, and their concurrent calls reach the endpoint in no
    fixed order: seeded by call order, a launch sampled other tokens than the last (the gym demo's step-1 rewards
    differed, 0.156 / 0.180). Seeded by prompt, the same calls in another order give the same generations."""
    prompts = [[{"role": "user", "content": c}] for c in ("1+2=", "3+4=", "1+2=", "5+5=", "1+2=", "3+4=")]

    def play(order, seed_by_prompt):
        key = served.open_session("nemo_gym:7", seed_by_prompt=seed_by_prompt)
        with served.serving(weight_version=3):
            for i in order:
                _client(served, key).chat.completions.create(model=MODEL, messages=prompts[i], top_p=1.0)
        return sorted((tuple(r.prompt_token_ids), tuple(r.generation_token_ids)) for r in served.close_session(key))

    forward, backward = list(range(len(prompts))), list(reversed(range(len(prompts))))
    assert play(forward, True) == play(backward, True)
    assert play(forward, False) != play(backward, False)  # the order mattered before (this toy model, these calls)


def test_a_session_seeded_by_prompt_keeps_the_counts_of_recent_weight_versions_only(served):
    from grpo.wings.agents.endpoint import KEEP_VERSIONS, _Session

    session, first = _Session("nemo_gym:0", seed_by_prompt=True), {}
    for version in range(3 * KEEP_VERSIONS):
        with served.serving(weight_version=version):
            first[version] = served.call_seeds(session, [1, 2, 3], 2)
            assert served.call_seeds(session, [1, 2, 3], 2) != first[version]  # the prompt's second call: other seeds
    assert len(session.prompt_calls) == KEEP_VERSIONS
    assert len({s for seeds in first.values() for s in seeds}) == 2 * 3 * KEEP_VERSIONS  # versions seed apart


def test_validation_sampling_is_accepted(served):
    with served.serving():
        r = _client(served).chat.completions.create(model=MODEL, messages=USER, temperature=0.5, top_p=1.0)
    assert r.choices[0].message.role == "assistant"


@pytest.mark.parametrize("kw, status, words", [
    (dict(top_p=1.0, temperature=0.7), 400, "matches neither"),
    (dict(), 400, "top_p must be set"),
    (dict(top_p=1.0, extra_body={"top_k": 5}), 400, "top_k"),
    (dict(top_p=1.0, model="gpt-4o"), 404, "does not exist"),
    (dict(top_p=1.0, messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    (dict(top_p=1.0, n="two"), 400, "n:"),
    (dict(top_p=1.0, messages=[{"role": "user", "content": "9" * 80}]), 400, "no room"),
])
def test_bad_requests_get_openais_error_body(served, kw, status, words):
    kw = {"model": MODEL, "messages": USER, **kw}
    with served.serving(), pytest.raises(openai.APIStatusError) as err:
        _client(served).chat.completions.create(**kw)
    assert err.value.status_code == status and words in err.value.body["message"], err.value.body
    assert err.value.body["type"] in ("invalid_request_error",)


def test_wire_errors(served):
    assert _post(served, "/v1/chat/completions", b"{not json").status_code == 400
    assert _post(served, "/v1/chat/completions", b"[1, 2]").status_code == 400
    r = _post(served, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": USER, "top_p": 1.0}),
              key="nope")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 30_000}], "top_p": 1.0})
    r = _post(served, "/v1/chat/completions", huge)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]


def test_too_many_requests_in_flight_is_a_429():
    cfg = _cfg(max_concurrent_requests=1)
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, ["ok"]), tok)
    ep.start()
    try:
        first = threading.Thread(target=_client(ep).chat.completions.create,
                                 kwargs=dict(model=MODEL, messages=USER, top_p=1.0))
        first.start()  # waits: the endpoint is closed
        time.sleep(0.5)
        with pytest.raises(openai.RateLimitError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0)
        assert "max_concurrent_requests" in err.value.body["message"]
        with ep.serving():
            first.join(timeout=30)
    finally:
        ep.close()


def test_a_request_that_finds_no_generation_window_gets_a_503_with_retry_after():
    """While the run trains or checkpoints the endpoint is closed: a request waits http_server.max_wait_s for a window,
    then gets OpenAI's error body, a 503 and Retry-After (the last pause, rounded up); a window in time serves it."""
    cfg = _cfg(max_wait_s=0.5)
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, ["ok"]), tok)
    ep.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as err:  # no window yet: Retry-After is max_wait_s, at least 1
            _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0)
        assert 0.5 <= time.monotonic() - t0 < 5
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        assert err.value.body["type"] == "server_error" and "max_wait_s=0.5" in err.value.body["message"]
        with ep.serving():
            pass
        time.sleep(2.2)  # a pause of 2.2 s between two windows
        with ep.serving():
            assert _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0).choices
        with pytest.raises(openai.InternalServerError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=USER, top_p=1.0)
        assert err.value.response.headers["retry-after"] == "3"
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(  # a window opening in time serves the request
            _client(ep).chat.completions.create, model=MODEL, messages=USER, top_p=1.0)
        time.sleep(0.2)
        with ep.serving():
            assert waiting.result(timeout=30).choices[0].message.content == "ok"
    finally:
        ep.close()


def test_tool_calls_and_reasoning_over_the_wire(qwen25):
    cfg = _cfg()
    cfg.policy.max_total_sequence_length = 2048
    cfg.policy.generation.vllm_cfg.http_server_serving_chat_kwargs = {"tool_parser": "hermes",
                                                                       "reasoning_parser": "qwen3"}
    text = ('<think>big numbers</think>\n<tool_call>\n{"name": "calc", "arguments": {"expression": "37*58"}}\n'
            '</tool_call>')
    ep = Endpoint(cfg, ScriptedBackend(qwen25, cfg.policy.generation, [text, "It is 2146."]), qwen25)
    ep.start()
    tools = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    try:
        c = _client(ep)
        messages = [{"role": "user", "content": "What is 37*58?"}]
        with ep.serving():
            r = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, top_p=1.0, logprobs=True)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.model_extra["reasoning_content"] == "big numbers"
            call = msg.tool_calls[0]
            assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "37*58"}
            assert "# Tools" in qwen25.decode(msg.model_extra["prompt_token_ids"])  # the tools were rendered
            # the agent hands the message back as the client gives it: its token fields ride along
            messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id,
                                                             "content": "2146"}]
            # vLLM's qwen3 parser (as installed) reads a text with no </think> as reasoning while thinking is on;
            # a request turns thinking off with its template variables, and the answer is content
            r2 = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, top_p=1.0, logprobs=True,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        prompt2 = r2.choices[0].message.model_extra["prompt_token_ids"]
        first = msg.model_extra["prompt_token_ids"] + msg.model_extra["generation_token_ids"]
        assert prompt2[:len(first)] == first  # contiguous: the model's own tokens, then the tool turn
        assert r2.choices[0].message.content == "It is 2146." and r2.choices[0].finish_reason == "stop"
        with ep.serving():  # tool_choice="none": the text stays content
            r3 = c.chat.completions.create(model=MODEL, messages=messages[:1], tools=tools, top_p=1.0,
                                           tool_choice="none")
        assert r3.choices[0].message.tool_calls is None
    finally:
        ep.close()
