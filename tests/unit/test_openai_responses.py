"""The Responses dialect without a server (grpo/wings/agents/openai_responses.py): items to chat messages, a chat
answer to a Response, and which history carries the model's own tokens."""

from __future__ import annotations

import pytest

from grpo.wings.agents.openai_chat import RequestError
from grpo.wings.agents.openai_responses import (
    Remembered, ResponsesRequest, ResponseStore, chat_messages, output_items, response_body, with_own_tokens,
)

CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}


def _chat(finish_reason: str, message: dict) -> dict:
    return {"created": 1, "model": "m", "weight_version": 3, "choices": [{"finish_reason": finish_reason,
                                                                           "message": message}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def test_a_generation_cut_at_its_limit_is_incomplete():
    req = ResponsesRequest(model="m", input="x", max_output_tokens=2)
    message = {"role": "assistant", "content": "ab"}
    cut = response_body(req, _chat("length", message), output_items(message), "resp_1")
    assert (cut["status"], cut["incomplete_details"], cut["usage"]["output_tokens"]) == (
        "incomplete", {"reason": "max_output_tokens"}, 2)
    done = response_body(req, _chat("stop", message), output_items(message), "resp_1")
    assert (done["status"], done["incomplete_details"], done["weight_version"]) == ("completed", None, 3)


def test_an_answers_items_come_back_as_one_assistant_turn():
    """Reasoning, text and calls of one answer, handed back as items, are the one assistant message they came from;
    a second answer's items begin another."""
    message = {"role": "assistant", "content": "hm", "reasoning_content": "think", "tool_calls": [CALL]}
    items = output_items(message)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    result = {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "1"}]}
    again = output_items({"role": "assistant", "content": "one"})
    messages, sources, turn_items = chat_messages([{"role": "user", "content": "x"}, *items, result, *again, *again])
    assert sources == ["input.0", "input.1", "input.4", "input.5", "input.6"]
    assert messages[1] == message
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "1"}]}
    assert [m["content"] for m in messages[3:]] == ["one", "one"]
    assert turn_items == {1: [i["id"] for i in items], 3: [again[0]["id"]], 4: [again[0]["id"]]}


def test_only_the_exact_history_of_a_reply_carries_its_tokens():
    store = ResponseStore(kept=2)
    prompt = [{"role": "user", "content": "x"}]
    reply = {"role": "assistant", "content": "y", "prompt_token_ids": [1], "generation_token_ids": [2]}
    store.put("resp_a", Remembered(prompt, prompt, None, None, reply, True), ["msg_a"])
    sent = prompt + [{"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]
    assert with_own_tokens(sent, {1: "resp_a"}, store, None, None)[1] == reply
    edited = [{"role": "user", "content": "x!"}] + sent[1:]
    assert with_own_tokens(edited, {1: "resp_a"}, store, None, None) == edited
    assert with_own_tokens(sent, {1: "resp_a"}, store, [{"type": "function"}], None) == sent
    assert with_own_tokens(sent, {}, store, None, None) == sent
    for i in range(2):  # the oldest is forgotten past `kept`
        store.put(f"resp_{i}", Remembered(prompt, prompt, None, None, reply, True), [f"msg_{i}"])
    assert store.made(["msg_a"]) is None and with_own_tokens(sent, {1: "resp_a"}, store, None, None) == sent
    with pytest.raises(RequestError, match="previous_response_id: no stored response 'resp_a'"):
        store.continued("resp_a")
