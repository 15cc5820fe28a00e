"""The endpoint's ``POST /v1/messages`` (Anthropic's Messages API) on loopback, driven by the official ``anthropic``
client (raw HTTP for what a client cannot send): rendered by the same chat template as chat completions and recorded
the same way, system prompts, stop sequences and max_tokens, tools and tool results over several turns spliced onto
the model's own tokens, streaming, images, agents (a function and a program) whose samples train token-exact, and
every error in Anthropic's body (grpo/wings/agents/anthropic_messages.py, endpoint.py)."""

from __future__ import annotations

import json
import sys

import anthropic
import httpx
import pytest

from grpo.config import MasterConfig
from grpo.system.rollout import new_trajectories
from grpo.tasks.calculator import AGENT_CHAT_TEMPLATE
from grpo.tasks.factory import build_environments
from grpo.tasks.rows import PromptRow
from grpo.tasks.toy import build_char_tokenizer
from grpo.wings.agents.endpoint import Endpoint
from grpo.wings.agents.player import AgentPlayer
from tests.helpers.anthropic_agents import TOOLS
from tests.helpers.image_agents import mult_prob_error
from tests.helpers.scripted_backend import ScriptedBackend
from tests.integration.test_endpoint import MODEL, _cfg, _hf_endpoint, _post

USER = [{"role": "user", "content": "1+2="}]
# The toy template with an end-of-sequence token closing each assistant turn: what the prefix splice counts.
EOS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
AGENTS = "tests.helpers.anthropic_agents"


@pytest.fixture(scope="module")
def served():
    cfg = _cfg(max_body_bytes=20_000)
    cfg.policy.max_total_sequence_length = 96
    cfg.env = MasterConfig.model_validate({"env": {"name": "agent", "agent": {"fn": f"{AGENTS}:chatting_agent"}}}).env
    ep = _hf_endpoint(cfg, EOS_TEMPLATE)
    yield ep
    ep.close()


def _client(ep, key=None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=key or ep.api_key, max_retries=0,
                               timeout=60)


def _tokens(ep, messages: list[dict], **kw) -> list[int]:
    """/tokenize's tokens of OpenAI chat ``messages``: chat completions' rendering."""
    return _post(ep, "/tokenize", json.dumps({"model": MODEL, "messages": messages, **kw})).json()["tokens"]


def _answer(ep, seed_key: str, **kw) -> tuple[anthropic.types.Message, object]:
    """One call under a fresh session seeded by ``seed_key`` (the same key, the same tokens); its message and
    record."""
    key = ep.open_session(seed_key)
    with ep.serving():
        r = _client(ep, key).messages.create(model=MODEL, **{"max_tokens": 6, "messages": USER, **kw})
    [record] = ep.close_session(key)
    return r, record


def test_a_message_is_rendered_generated_and_recorded_as_chat_completions_are(served):
    """The prompt is chat's rendering of the same conversation (a system prompt as a string or as text blocks), the
    answer's text the generated tokens, usage their counts, and the call is recorded like a chat call."""
    r, record = _answer(served, "text", system="Be brief.")
    assert record.prompt_token_ids == _tokens(served, [{"role": "system", "content": "Be brief."}, *USER])
    assert r.usage.input_tokens == len(record.prompt_token_ids)
    assert r.usage.output_tokens == len(record.generation_token_ids) >= 1
    assert r.content[0].text == served.tokenizer.decode(record.generation_token_ids, skip_special_tokens=True)
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[record.finish_reason]
    assert r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert len(record.generation_log_probs) == len(record.generation_token_ids)
    blocks = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    _, blocks_record = _answer(served, "text", system=blocks)
    assert blocks_record.prompt_token_ids == _tokens(served, [{"role": "system", "content": blocks}, *USER])


def test_max_tokens_and_stop_sequences_end_a_message_with_their_stop_reason(served):
    """A session's call k is seeded by (its seed key, k): the same key writes the same tokens, so a stop sequence
    taken from a first answer ends the second one there, and max_tokens cuts it."""
    for i in range(20):  # a seed whose answer runs to max_tokens with two different characters
        seed_key = f"stop-{i}"
        r, record = _answer(served, seed_key)
        if record.finish_reason == "length" and len(set(r.content[0].text)) >= 2:
            break
    text = r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    short, short_record = _answer(served, seed_key, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    assert short_record.generation_token_ids == record.generation_token_ids[:2]
    stop = text[1]
    stopped, _ = _answer(served, seed_key, stop_sequences=["never written", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert (stopped.content[0].text if stopped.content else "") == text[:text.index(stop)]


# The model writes its call's JSON without spaces: the template writes it back with them, so only the splice keeps
# the model's own tokens in the next call's prompt.
CALL = '<tool_call>\n{"name":"calc","arguments":{"expression":"37*58"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tooled(qwen25):
    cfg = _cfg()
    cfg.policy.max_total_sequence_length = 2048
    cfg.policy.generation.vllm_cfg.http_server_serving_chat_kwargs = {"tool_parser": "hermes",
                                                                       "reasoning_parser": "qwen3"}
    ep = Endpoint(cfg, ScriptedBackend(qwen25, cfg.policy.generation,
                                       lambda prompt: "<think>so</think>It is 2146." if "<tool_response>" in prompt else
                                       "<think>big numbers</think>\n" + CALL), qwen25)
    ep.start()
    yield ep
    ep.close()


def test_tool_use_and_tool_results_over_turns_continue_the_models_own_tokens(tooled):
    """Anthropic tools render as the template's tools; the tool parser's call comes back as a tool_use block (its
    reasoning a thinking block); the client hands the blocks back with a tool_result, which renders as a tool
    message, and the sample's next prompt begins with the tokens the model wrote."""
    key = tooled.open_session("tools")
    client = _client(tooled, key)
    messages = [{"role": "user", "content": "What is 37*58?"}]
    with tooled.serving():
        r = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=TOOLS)
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["thinking", "tool_use"]
        call = r.content[1]
        assert (call.name, call.input, call.id[:6]) == ("calc", {"expression": "37*58"}, "toolu_")
        assert r.content[0].thinking == "big numbers"
        messages += [{"role": "assistant", "content": r.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "2146"},
                                                  {"type": "text", "text": "So?"}]}]
        r2 = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=TOOLS,
                                    extra_body={"temperature": 1.0, "top_p": 1.0})
        r3 = client.messages.create(model=MODEL, max_tokens=200, messages=messages[:1], tools=TOOLS,
                                    tool_choice={"type": "none"})
    first, second, _ = tooled.close_session(key)
    assert r2.stop_reason == "end_turn" and [b.type for b in r2.content] == ["thinking", "text"]
    assert r2.content[1].text == "It is 2146."
    assert r3.stop_reason == "end_turn" and [b.type for b in r3.content] == ["thinking", "text"]  # no tool parsed
    prompt = tooled.tokenizer.decode(first.prompt_token_ids)
    assert "# Tools" in prompt and '"input_schema"' not in prompt and '"expression"' in prompt
    seen = first.prompt_token_ids + first.generation_token_ids
    assert second.prompt_token_ids[:len(seen)] == seen  # the model's own tokens, then the tool turn
    rest = tooled.tokenizer.decode(second.prompt_token_ids[len(seen):])
    assert "<tool_response>\n2146\n</tool_response>" in rest and rest.index("2146") < rest.index("So?")


def test_a_history_without_its_thinking_blocks_still_continues_the_models_tokens(tooled):
    """Anthropic's clients may drop a turn's thinking blocks (and send a block as a plain dict): still the session's
    answer, spliced onto the tokens the model wrote, its thinking included."""
    key = tooled.open_session("dropped thinking")
    question = [{"role": "user", "content": "What is 37*58?"}]
    with tooled.serving():
        r = _client(tooled, key).messages.create(model=MODEL, max_tokens=200, messages=question, tools=TOOLS)
        call = r.content[1]
        _client(tooled, key).messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=[
            *question, {"role": "assistant", "content": [call.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "2146"}]}])
    first, second = tooled.close_session(key)
    seen = first.prompt_token_ids + first.generation_token_ids
    assert second.prompt_token_ids[:len(seen)] == seen and "big numbers" in tooled.tokenizer.decode(seen)


def test_a_history_the_session_did_not_answer_is_rendered_by_the_template(tooled):
    """Another session's answer handed back is not this session's to splice: the history renders as chat
    completions render it without token fields (the call's JSON written the template's way, not the model's)."""
    question = [{"role": "user", "content": "What is 37*58?"}]
    a, b = tooled.open_session("a"), tooled.open_session("b")
    with tooled.serving():
        r = _client(tooled, a).messages.create(model=MODEL, max_tokens=200, messages=question, tools=TOOLS)
        call = r.content[1]
        _client(tooled, b).messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=[
            *question, {"role": "assistant", "content": r.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "2146"}]}])
    [first], [other] = tooled.close_session(a), tooled.close_session(b)
    seen = first.prompt_token_ids + first.generation_token_ids
    assert other.prompt_token_ids[:len(seen)] != seen
    assert other.prompt_token_ids == _tokens(tooled, [
        *question, {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "calc", "arguments": '{"expression": "37*58"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "2146"}], tools=[
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}} for t in TOOLS])


def test_a_streamed_message_is_the_same_message_as_events(tooled):
    key = tooled.open_session("stream")
    with tooled.serving(), _client(tooled, key).messages.stream(
            model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "What is 37*58?"}], tools=TOOLS) as s:
        final = s.get_final_message()
    [record] = tooled.close_session(key)
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == len(record.generation_token_ids)
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "big numbers" and final.content[1].input == {"expression": "37*58"}


def test_an_anthropic_agents_samples_train_token_exact(served):
    """An agent written with the anthropic client (two calls, its answer handed back as blocks): each sample's
    calls are contiguous (the session's splice), and the trainer's logprobs of its generated tokens equal the
    sampler's (token_mult_prob_error within 1e-3 of 1)."""
    envs = build_environments(served.cfg.env)
    ids = served.tokenizer("go")["input_ids"]
    trajs = new_trajectories([PromptRow(0, "go", "x", "agent", [{"role": "user", "content": "go", "token_ids": ids}],
                                        ids)], 4)
    AgentPlayer(served).play(trajs, [(1, 0, i, "train") for i in range(4)], envs)
    assert [(t.failure, t.mask_sample, t.turns) for t in trajs] == [(None, False, 2)] * 4
    assert abs(mult_prob_error(served.backend.model, trajs, served.tokenizer.pad_token_id) - 1.0) < 1e-3


@pytest.fixture(scope="module")
def calculator():
    """The agent tests' scripted policy (tests/integration/test_agent_env.py): a compact call, then the result."""
    tok = build_char_tokenizer(AGENT_CHAT_TEMPLATE)
    cfg = MasterConfig.model_validate({"policy": {
        "model_name": MODEL, "max_total_sequence_length": 96, "generation": {
            "max_new_tokens": 24, "port_range_low": 24000, "port_range_high": 24999,
            "vllm_cfg": {"http_server_serving_chat_kwargs": {"tool_parser": "compact"}}}}})
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation,
                                       lambda prompt: "2146" if "<r>" in prompt else "<calc>37*58</calc>"), tok)
    ep.start()
    yield ep
    ep.close()


@pytest.mark.parametrize("agent", [{"fn": f"{AGENTS}:calc_agent"}, {"command": [sys.executable, "-m", AGENTS]}])
def test_a_tool_using_anthropic_agent_plays_its_samples(calculator, agent):
    """A function given the endpoint's base_url, and a program that finds it in ANTHROPIC_BASE_URL /
    ANTHROPIC_API_KEY: the tool call, its result, the answer, one contiguous trajectory of the model's tokens."""
    envs = build_environments(MasterConfig.model_validate({"env": {"name": "agent", "agent": agent}}).env)
    ids = calculator.tokenizer("37*58=")["input_ids"]
    trajs = new_trajectories([PromptRow(0, "37*58=", "2146", "agent", [
        {"role": "user", "content": "37*58=", "token_ids": ids}], ids)], 2)
    AgentPlayer(calculator).play(trajs, [(1, 0, i, "train") for i in range(2)], envs)
    for t in trajs:
        assert (t.reward, t.failure, t.mask_sample, t.turns) == (1.0, None, False, 2)
        assert calculator.tokenizer.decode(t.token_ids()) == "<bos>37*58=<calc>37*58</calc><eos><r>2146</r>2146<eos>"


def _messages(ep, body: dict | bytes, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(ep.base_url.removesuffix("/v1") + "/v1/messages", content=content, timeout=60,
                      headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01", **headers})


def test_a_samples_key_in_x_api_key_is_recorded_and_a_wrong_one_refused(served):
    """Anthropic's clients send their key in x-api-key: a sample's key there is its session, as a Bearer key is."""
    key = served.open_session("header")
    with served.serving():
        r = _messages(served, {"model": MODEL, "max_tokens": 3, "messages": USER}, **{"x-api-key": key})
    [record] = served.close_session(key)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == len(record.generation_token_ids)
    for headers in ({"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"}, {}):
        r = _messages(served, {"model": MODEL, "max_tokens": 3, "messages": USER}, **headers)
        assert r.status_code == 401 and r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": r.json()["error"]["message"]}}
        assert "x-api-key" in r.json()["error"]["message"]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"model": "claude-opus-4", "max_tokens": 3, "messages": USER}, 404, "not_found_error", "does not exist"),
    ({"max_tokens": 3, "messages": USER, "temperature": 0.7}, 400, "invalid_request_error", "matches neither"),
    ({"max_tokens": 3, "messages": USER, "top_k": 5}, 400, "invalid_request_error", "top_k"),
    ({"max_tokens": 3, "messages": [*USER, {"role": "assistant", "content": "3"}]}, 400, "invalid_request_error",
     "messages.1: the last message is the assistant's (a prefill)"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "invalid_request_error", "messages.0.content.0: a block of type 'document'"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": [IMAGE]}]}, 400, "invalid_request_error",
     "messages.0.content.0: an image part, and this run's policy (toy:tiny) is a text model"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
     400, "invalid_request_error", "messages.0.content.0: an image block whose source is neither"),
    ({"max_tokens": 3, "messages": USER, "system": [{"type": "image"}]}, 400, "invalid_request_error",
     "system.0: a block of type 'image'"),
    ({"max_tokens": 3, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools.0: web_search_20250305 is not a client tool"),
    ({"max_tokens": 3, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "constrained decoding"),
    ({"max_tokens": 3, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "sometimes"}}, 400,
     "invalid_request_error", "invalid tool_choice"),
    ({"max_tokens": 3, "messages": USER, "tools": TOOLS}, 400, "invalid_request_error", "need a tool parser"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": "9" * 90}]}, 400, "invalid_request_error",
     "no room"),
    ({"max_tokens": 0, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "1"}]}]}, 400,
     "invalid_request_error", "messages.0.content.0: a tool_result block without its tool_use_id"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                  "content": 5}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.content: a tool result's content is a string or a list"),
    ({"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "invalid_request_error", "messages.0.content.0: a text block without its text"),
])
def test_bad_requests_get_anthropics_error_body(served, body, status, kind, words):
    with served.serving():
        r = _messages(served, {"model": MODEL, **body}, **{"x-api-key": served.api_key})
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == kind and words in r.json()["error"]["message"], r.text


def test_wire_errors_in_anthropics_body(served):
    key = {"x-api-key": served.api_key}
    for body in (b"{not json", b"[1, 2]"):
        r = _messages(served, body, **key)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _messages(served, {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x" * 30_000}]},
                  **key)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.NotFoundError) as err:  # the client reads the body too
        _client(served).messages.create(model="claude-opus-4", max_tokens=3, messages=USER)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_image_blocks_render_as_chat_completions_image_parts():
    """A vision-language policy: Anthropic's base64 image block (in a user turn and in a tool result) is chat's
    ``data:`` image part: the same prompt tokens and pictures as /tokenize's chat rendering."""
    import torch

    from tests.helpers.image_agents import data_url, image_part, vlm_endpoint
    from tests.integration.test_endpoint_images import _cfg as vlm_cfg

    red, blue = data_url((255, 0, 0)), data_url((0, 0, 255))

    def block(url: str) -> dict:
        media_type, data = url.removeprefix("data:").split(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}

    ep = vlm_endpoint(vlm_cfg(max_image_pixels=64 * 64))
    try:
        key = ep.open_session("picture")
        with ep.serving():
            r = _client(ep, key).messages.create(model=ep.model_name, max_tokens=3, messages=[
                {"role": "user", "content": [block(red), {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "look:"}, block(blue)]}]}])
        [record] = ep.close_session(key)
        chat = [{"role": "user", "content": [image_part(red), {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                    "name": "look", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "text", "text": "look:"},
                                                                         image_part(blue)]}]
        assert record.prompt_token_ids == _tokens(ep, chat) and r.usage.input_tokens == len(record.prompt_token_ids)
        assert record.media["pixel_values"].shape[0] == 2
        assert not torch.equal(record.media["pixel_values"][0], record.media["pixel_values"][1])
    finally:
        ep.close()


def test_a_request_that_finds_no_generation_window_is_anthropics_overloaded_error():
    """While the run trains the endpoint is closed: past http_server.max_wait_s the 503 (with Retry-After) comes in
    Anthropic's body, which its client reads as a server error to retry."""
    cfg = _cfg(max_wait_s=0.3)
    tok = build_char_tokenizer(EOS_TEMPLATE)
    ep = Endpoint(cfg, ScriptedBackend(tok, cfg.policy.generation, ["ok"]), tok)
    ep.start()
    try:
        with pytest.raises(anthropic.InternalServerError) as err:
            _client(ep).messages.create(model=MODEL, max_tokens=3, messages=USER)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "overloaded_error"
        assert "max_wait_s=0.3" in err.value.body["error"]["message"]
    finally:
        ep.close()
