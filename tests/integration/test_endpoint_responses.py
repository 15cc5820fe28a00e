"""OpenAI's Responses API and the per-rollout base URL on loopback, driven by the official ``openai`` client (raw HTTP
for what a client cannot send): text, function tools and their results, multi-turn by ``previous_response_id`` and
by full ``input`` lists, each call recorded contiguous with the model's own tokens; a rollout's base URL attributes a
call to its sample whatever key comes with it; every error path is a clear 4xx in OpenAI's error shape; agents
playing over it train token-exact (grpo/wings/agents/openai_responses.py, endpoint.py, player.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from grpo.config import MasterConfig
from grpo.system.generation.hf import HFGeneration
from grpo.system.rollout import new_trajectories
from grpo.tasks.calculator import AGENT_CHAT_TEMPLATE
from grpo.tasks.factory import build_environments
from grpo.tasks.rows import PromptRow
from grpo.tasks.toy import build_char_tokenizer, build_tiny_model
from grpo.wings.agents.endpoint import Endpoint
from grpo.wings.agents.player import AgentPlayer
from tests.helpers import responses_agents
from tests.helpers.image_agents import TEMPLATE, data_url, mult_prob_error, vlm_endpoint
from tests.helpers.scripted_backend import ScriptedBackend

MODEL = "toy:tiny"
TOOLS = [{"type": "function", "name": "calc", "description": "Evaluate.", "strict": True, "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}]
# The policy writes its call without the spaces and newlines Qwen2.5's template puts around it: a history
# re-templated from the text would not hold the tokens the model generated.
CALL = '<tool_call>{"name":"calc","arguments":{"expression":"37*58"}}</tool_call>'


def _cfg(max_len: int = 2048, agent: str | None = None) -> MasterConfig:
    cfg = {"policy": {"model_name": MODEL, "precision": "float32", "max_total_sequence_length": max_len,
                      "generation": {"max_new_tokens": 6, "port_range_low": 26000, "port_range_high": 26999,
                                     "http_server": {"batch_window_s": 0.02}}}}
    if agent is not None:
        cfg["env"] = {"name": "agent", "agent": {"fn": agent}}
    return MasterConfig.model_validate(cfg)


def _model_writes(prompt: str) -> str:
    """The scripted policy: calls the calculator, then answers with its result."""
    return "It is 2146." if "<tool_response>" in prompt else CALL


@pytest.fixture(scope="module")
def served(qwen25):
    """The endpoint over Qwen2.5's tokenizer and template with the hermes tool parser, writing `_model_writes`."""
    cfg = _cfg()
    cfg.policy.generation.vllm_cfg.http_server_serving_chat_kwargs = {"tool_parser": "hermes"}
    ep = Endpoint(cfg, ScriptedBackend(qwen25, cfg.policy.generation, _model_writes), qwen25)
    ep.start()
    yield ep
    ep.close()


def _client(ep, key=None, base_url=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url or ep.base_url, api_key=key or ep.api_key, max_retries=0, timeout=60)


def _post(url: str, body: dict, key: str) -> httpx.Response:
    return httpx.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})


def _create(ep, key=None, base_url=None, **kw):
    kw = {"model": MODEL, "top_p": 1.0, **kw}
    with ep.serving():
        return _client(ep, key, base_url).responses.create(**kw)


def _contiguous(first, second) -> bool:
    """Whether call ``second``'s prompt begins with call ``first``'s prompt and generation (`CallRecord`s)."""
    seen = first.prompt_token_ids + first.generation_token_ids
    return second.prompt_token_ids[:len(seen)] == seen


def test_a_text_response(served):
    key = served.open_session("text")
    r = _create(served, key, input="What is 37*58?", instructions="Answer in digits.", metadata={"run": "a"})
    (record,) = served.close_session(key)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == CALL  # no tools in the request: the text stays text
    assert (r.instructions, r.metadata, r.store) == ("Answer in digits.", {"run": "a"}, True)
    prompt = served.tokenizer.decode(record.prompt_token_ids)
    assert "<|im_start|>system\nAnswer in digits.<|im_end|>" in prompt and "What is 37*58?" in prompt
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(record.prompt_token_ids),
                                                             len(record.generation_token_ids))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same prompt as chat completions renders it
    chat = [{"role": "system", "content": "Answer in digits."}, {"role": "user", "content": "What is 37*58?"}]
    tokens = _post(served.base_url.removesuffix("/v1") + "/tokenize", {"messages": chat}, served.api_key).json()
    assert tokens["tokens"] == record.prompt_token_ids


@pytest.mark.parametrize("continued", ["full input", "previous_response_id"])
def test_a_tool_call_and_its_result_continue_on_the_models_own_tokens(served, continued):
    """The function call comes back as a function_call item; the client hands back its result (with the whole
    history, or after previous_response_id): the second call's prompt begins with the first call's prompt and the
    tokens the model generated (spliced), not the template's rendering of the call."""
    key = served.open_session(continued)
    question = [{"role": "user", "content": "What is 37*58?"}]
    first = _create(served, key, input=question, tools=TOOLS, instructions="Use tools.")
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments), call.call_id.startswith("call_")) == (
        "calc", {"expression": "37*58"}, True)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "2146"}
    if continued == "full input":
        second = _create(served, key, input=[*question, *first.output, result], tools=TOOLS, instructions="Use tools.")
    else:
        second = _create(served, key, input=[result], previous_response_id=first.id, tools=TOOLS,
                         instructions="Use tools.")
    records = served.close_session(key)
    assert second.output_text == "It is 2146." and second.previous_response_id == (
        first.id if continued == "previous_response_id" else None)
    assert "# Tools" in served.tokenizer.decode(records[0].prompt_token_ids)  # the tools were rendered
    assert _contiguous(*records)
    tail = served.tokenizer.decode(records[1].prompt_token_ids[len(records[0].prompt_token_ids):])
    assert tail.startswith(CALL) and "<tool_response>\n2146\n</tool_response>" in tail


@pytest.mark.parametrize("change", ["tool result", "answer", "instructions", "tools"])
def test_a_history_that_differs_from_the_answer_is_rendered_as_sent(served, change):
    """Only a history equal to what the endpoint answered carries its tokens: a rewritten tool result, an edited
    answer, other instructions or other tools are rendered as the client sent them (never the old tokens)."""
    key = served.open_session(change)
    question = [{"role": "user", "content": "What is 37*58?"}]
    first = _create(served, key, input=question, tools=TOOLS, instructions="Use tools.")
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "2146"}
    second = _create(served, key, input=[*question, *first.output, result], tools=TOOLS, instructions="Use tools.")
    kw = {"tools": TOOLS, "instructions": "Use tools."}
    history = [*question, *first.output, result, *second.output, {"role": "user", "content": "Thanks!"}]
    if change == "tool result":
        history[2] = {**result, "output": "2147"}
    elif change == "answer":
        history[3] = {**second.output[0].model_dump(), "content": [{"type": "output_text", "text": "It's 2146."}]}
    elif change == "instructions":
        kw["instructions"] = "Be brief."
    else:
        kw["tools"] = [{**TOOLS[0], "description": "Multiply."}]
    _create(served, key, input=history, **kw)
    records = served.close_session(key)
    assert _contiguous(records[0], records[1]) and not _contiguous(records[1], records[2])
    rendered = served.tokenizer.decode(records[2].prompt_token_ids)
    assert {"tool result": "2147", "answer": "It's 2146.", "instructions": "Be brief.",
            "tools": "Multiply."}[change] in rendered


def test_previous_response_id_is_the_keys_own_and_stored(served):
    a, b = served.open_session("a"), served.open_session("b")
    first = _create(served, a, input="What is 37*58?")
    unstored = _create(served, a, input="What is 37*58?", store=False)
    assert unstored.store is False
    for key, previous in [(b, first.id), (served.api_key, first.id), (a, unstored.id), (a, "resp_nope")]:
        with pytest.raises(openai.BadRequestError) as err:
            _create(served, key, input="more", previous_response_id=previous)
        body = err.value.body
        assert (body["param"], body["code"], body["type"]) == (
            "previous_response_id", "previous_response_not_found", "invalid_request_error")
        assert previous in body["message"]
    assert _create(served, a, input="more", previous_response_id=first.id).status == "completed"
    served.close_session(a), served.close_session(b)


@pytest.mark.parametrize("kw, param, words", [
    (dict(input=[{"type": "web_search_call", "id": "ws_1", "status": "completed"}]), "input.0", "'web_search_call'"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input.0.content.0",
     "'input_file'"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]),
     "input.0.content.0", "text model"),
    (dict(input=[{"type": "function_call_output", "output": "4"}]), "input.0.call_id", "missing"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools.0", "function tools only"),
    (dict(input="x", tools=TOOLS, tool_choice="required"), "tool_choice", "constrained decoding"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": {}}}), "text.format",
     "constrained decoding"),
    (dict(input="x", temperature=0.3), "temperature", "matches neither"),
    (dict(input="x", top_p=None), "top_p", "top_p must be set"),
    (dict(input=["x"]), "input", "a string or a list of items"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "calc", "arguments": "{bad"}]), "input",
     "not valid JSON"),
    (dict(input="x", conversation="conv_1"), "conversation", "not supported"),
    (dict(input="x", background=True), "background", "not supported"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens", "greater than or equal to 1"),
])
def test_bad_requests_get_openais_error_body(served, kw, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        _create(served, **kw)
    assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body
    assert err.value.body["type"] == "invalid_request_error"


def test_stream_and_an_unknown_model_are_refused_by_name(served):
    with pytest.raises(openai.BadRequestError) as err:
        _create(served, input="x", stream=True)
    assert err.value.body["param"] == "stream" and "stream=true" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        _create(served, input="x", model="gpt-4o")
    assert err.value.body["code"] == "model_not_found"


def test_a_rollouts_base_url_attributes_its_calls_whatever_key_comes(served):
    """A harness that sends the run's key for all its conversations, at a sample's base URL: the calls are that
    sample's (chat completions and responses alike), /v1/models answers there; another sample's key is a 403, a wrong
    key a 401, an unknown or finished rollout a 404."""
    key, other = served.open_session("r0"), served.open_session("r1")
    url = served.rollout_url(key)
    assert url.startswith(served.base_url.removesuffix("/v1") + "/rollout/") and url.endswith("/v1")
    r = _create(served, base_url=url, input="What is 37*58?")
    with served.serving():
        _client(served, base_url=url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=1.0)
        _create(served, key, base_url=url, input="more", previous_response_id=r.id)  # the sample's key works too
    assert [m.id for m in _client(served, base_url=url).models.list().data] == [MODEL]
    with pytest.raises(openai.PermissionDeniedError) as err:
        _create(served, other, base_url=url, input="x")
    assert err.value.body["code"] == "rollout_key_mismatch"
    with pytest.raises(openai.AuthenticationError):
        _create(served, "sk-wrong", base_url=url, input="x")
    records = served.close_session(key)
    assert len(records) == 3 and served.close_session(other) == []
    gone = served.base_url.removesuffix("/v1") + "/rollout/0123456789abcdef/v1"
    for base in (url, gone):
        with pytest.raises(openai.NotFoundError) as err:
            _create(served, base_url=base, input="x")
        assert err.value.body["code"] == "rollout_not_found" and "unknown or finished" in err.value.body["message"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.0}
    r = _post(url + "/chat/completions", body, served.api_key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"


def test_agents_playing_over_responses_train_token_exact():
    """Agents (tests/helpers/responses_agents.py) play three turns each over the Responses API, by
    previous_response_id and by full input, at their rollout's base URL with the run's key: each sample is its own
    calls, contiguous (the model's own tokens spliced), and the trainer's logprobs of the generated tokens equal the
    sampler's (token_mult_prob_error within 1e-3 of 1)."""
    cfg = _cfg(max_len=160, agent="tests.helpers.responses_agents:three_turn_agent")
    tok = build_char_tokenizer(AGENT_CHAT_TEMPLATE)
    model = build_tiny_model(tok)
    ep = Endpoint(cfg, HFGeneration(cfg.policy, tok, model.config, "cpu", model=model), tok)
    ep.start()
    responses_agents.HARNESS_KEY[:] = [ep.api_key]
    try:
        ids = tok("37*58=")["input_ids"]
        rows = [PromptRow(0, "37*58=", "2146", "agent", [{"role": "user", "content": "37*58=", "token_ids": ids}],
                          ids)]
        trajs = new_trajectories(rows, 3)
        AgentPlayer(ep).play(trajs, [(1, 0, i, "train") for i in range(3)], build_environments(cfg.env))
    finally:
        responses_agents.HARNESS_KEY.clear()
        ep.close()
    assert [(t.failure, t.mask_sample, t.turns, t.reward) for t in trajs] == [(None, False, 3, 1.0)] * 3
    assert all(tok.decode(t.token_ids()).startswith("<bos>Be brief.37*58=") for t in trajs)
    assert abs(mult_prob_error(model, trajs, tok.pad_token_id) - 1.0) < 1e-3


def test_an_input_image_renders_as_chat_completions_renders_its_image_url_part():
    """A vision-language policy: an ``input_image`` part is the chat path's ``image_url`` part, its picture in the
    call's record and the same prompt ids as /tokenize gives the chat form."""
    cfg = MasterConfig.model_validate({"policy": {
        "model_name": "toy:tiny_vlm", "precision": "float32", "max_total_sequence_length": 96,
        "tokenizer": {"chat_template": TEMPLATE},
        "generation": {"max_new_tokens": 4, "port_range_low": 26000, "port_range_high": 26999,
                       "http_server": {"batch_window_s": 0.02}}}})
    ep = vlm_endpoint(cfg)
    red = data_url((255, 0, 0))
    try:
        key = ep.open_session("picture")
        _create(ep, key, model="toy:tiny_vlm", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": red, "detail": "auto"}, {"type": "input_text", "text": "colour?"}]}])
        (record,) = ep.close_session(key)
        chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": red}},
                                             {"type": "text", "text": "colour?"}]}]
        tokens = _post(ep.base_url.removesuffix("/v1") + "/tokenize", {"messages": chat}, ep.api_key).json()
    finally:
        ep.close()
    assert tokens["tokens"] == record.prompt_token_ids and record.media["pixel_values"].shape[0] == 1
