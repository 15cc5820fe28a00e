"""The endpoint's chat layer without a server (grpo/wings/agents/openai_chat.py): NeMo-RL's prefix splice
(its own test cases, then the real Qwen2.5 template with tool calls and think tags), the sampling checks, the
tool-call and reasoning parsers."""

from __future__ import annotations

import json

import pytest

from grpo.config import MasterConfig
from grpo.wings.agents.endpoint import Endpoint
from grpo.wings.agents.openai_chat import (ChatRequest, RequestError, extract_tool_calls, replace_prefix_tokens,
                                                split_reasoning)
from grpo.wings.agents.openai_checks import check_sampling

CALC_TOOL = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                              "parameters": {"type": "object", "properties": {
                                                  "expression": {"type": "string"}}, "required": ["expression"]}}}


# --------------------------------------------------------------------------------------------------
# replace_prefix_tokens: NeMo-RL's cases (tests/unit/models/generation/test_openai_server_utils.py)
# --------------------------------------------------------------------------------------------------
def test_splice_first_turn_is_the_template():
    assert replace_prefix_tokens(2, [], [9, 2], [9, 2, 33, 44]) == [9, 2, 33, 44]


def test_splice_cuts_at_the_last_eos_of_the_prefix():
    assert replace_prefix_tokens(2, [100, 2], [9, 2, 9, 2], [9, 2, 9, 2, 77, 88]) == [100, 2, 77, 88]


def test_splice_counts_eos_when_the_template_drops_reasoning():
    assert replace_prefix_tokens(2, [11, 12, 99, 99, 99, 55, 2], [11, 12, 88, 88, 88, 56, 2],
                                 [11, 12, 56, 2, 70, 71, 2, 40, 41]) == [11, 12, 99, 99, 99, 55, 2, 70, 71, 2, 40, 41]


def test_splice_model_output_without_eos_keeps_all_its_tokens():
    # cut by max_tokens: no EOS at the end of the model's tokens; the template's EOS follows them
    assert replace_prefix_tokens(2, [11, 12, 7], [11, 12, 8, 2], [11, 12, 8, 2, 5]) == [11, 12, 7, 2, 5]


def test_splice_without_the_eos_is_a_400():
    with pytest.raises(RequestError) as err:
        replace_prefix_tokens(2, [7, 2], [9, 9, 9], [9, 9, 9, 2, 10])
    assert err.value.status == 400 and "end-of-sequence token #0" in err.value.message


# --------------------------------------------------------------------------------------------------
# The splice on the real Qwen2.5 template: history with tool calls and think tags
# --------------------------------------------------------------------------------------------------
def _endpoint(tok, template: str | None = None) -> Endpoint:
    serving = {"tool_parser": "hermes"} | ({"chat_template": template} if template else {})
    cfg = MasterConfig.model_validate({"policy": {"model_name": "toy:tiny", "max_total_sequence_length": 4096,
                                                  "generation": {"vllm_cfg": {
                                                      "http_server_serving_chat_kwargs": serving}}}})
    return Endpoint(cfg, None, tok)


def _odd_tokens(tok, text: str) -> list[int]:
    """``text`` tokenised in 3-character pieces: decodes to the same text, but not the ids the template would give."""
    return [t for i in range(0, len(text), 3) for t in tok(text[i:i + 3], add_special_tokens=False)["input_ids"]]


GENERATED = ('<think>\nThe product is big, so I use the tool.\n</think>\n<tool_call>\n{"name": "calc", "arguments": '
             '{"expression": "37*58"}}\n</tool_call>')


def _second_turn(ep: Endpoint, tok):
    first = ChatRequest(model="m", messages=[{"role": "user", "content": "What is 37*58?"}], tools=[CALC_TOOL])
    prompt = ep.prompt_ids(first)
    generated = _odd_tokens(tok, GENERATED) + [tok.eos_token_id]
    assert tok.decode(generated, skip_special_tokens=True) == GENERATED
    content, calls = extract_tool_calls(GENERATED, "hermes", [CALC_TOOL])
    assistant = {"role": "assistant", "content": content, "tool_calls": calls, "prompt_token_ids": prompt,
                 "generation_token_ids": generated}
    second = ChatRequest(model="m", tools=[CALC_TOOL], messages=[
        {"role": "user", "content": "What is 37*58?"}, assistant,
        {"role": "tool", "content": "2146", "tool_call_id": calls[0]["id"]}])
    return prompt, generated, second


def _check_splice(ep, tok, prompt, generated, second):
    spliced = ep.prompt_ids(second)
    kept = prompt + generated[:-1]
    assert spliced[:len(kept)] == kept  # the model's own tokens, think tags and tool call as generated
    tail = "<|im_end|>\n<|im_start|>user\n<tool_response>\n2146\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert spliced[len(kept):] == tok(tail, add_special_tokens=False)["input_ids"]  # the template resumes at the EOS
    assert ep.render(second.messages, second.tools, None, True) != spliced  # without the splice: other tokens
    return spliced


def test_splice_on_qwen25_keeps_the_models_tool_call_and_think_tokens(qwen25):
    ep = _endpoint(qwen25)
    prompt, generated, second = _second_turn(ep, qwen25)
    _check_splice(ep, qwen25, prompt, generated, second)
    # the same splice when the history comes as required_prefix_token_ids instead of the message fields
    bare = second.model_copy(update={"messages": [m.model_copy(update={"prompt_token_ids": None,
                                                                       "generation_token_ids": None})
                                                  for m in second.messages],
                                     "required_prefix_token_ids": prompt + generated})
    assert ep.prompt_ids(bare) == ep.prompt_ids(second)


def test_splice_survives_a_template_that_drops_think_from_history(qwen25):
    """Qwen3's template strips earlier reasoning when it re-renders history: the EOS count still finds the
    boundary, and the model keeps seeing its own reasoning tokens."""
    from tests.helpers.qwen_tokenizer import QWEN25_CHAT_TEMPLATE

    old = "{{- '\\n' + message.content }}"
    assert old in QWEN25_CHAT_TEMPLATE
    stripping = QWEN25_CHAT_TEMPLATE.replace(old, "{{- '\\n' + message.content.split('</think>')[-1].lstrip('\\n') }}")
    ep = _endpoint(qwen25, stripping)
    prompt, generated, second = _second_turn(ep, qwen25)
    assert "<think>" not in qwen25.decode(ep.render(second.messages, second.tools, None, True))
    spliced = _check_splice(ep, qwen25, prompt, generated, second)
    assert "<think>" in qwen25.decode(spliced)


# --------------------------------------------------------------------------------------------------
# Sampling checks, parsers
# --------------------------------------------------------------------------------------------------
def _req(**kw) -> ChatRequest:
    return ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


@pytest.mark.parametrize("kw, profile", [(dict(top_p=1.0), "train"), (dict(temperature=1.0, top_p=1.0), "train"),
                                         (dict(temperature=0.6, top_p=0.95), "val"),
                                         (dict(top_p=1.0, top_k=-1), "train")])
def test_sampling_must_be_the_runs(kw, profile):
    assert check_sampling(_req(**kw), (1.0, 1.0), (0.6, 0.95)) == profile


@pytest.mark.parametrize("kw, param, words", [
    (dict(), "top_p", "top_p must be set"), (dict(temperature=0.7, top_p=1.0), "temperature", "temperature=1.0"),
    (dict(top_p=1.0, top_k=20), "top_k", "unset or -1")])
def test_other_sampling_is_a_400_naming_the_expected_values(kw, param, words):
    with pytest.raises(RequestError) as err:
        check_sampling(_req(**kw), (1.0, 1.0), (0.6, 0.95))
    assert err.value.status == 400 and err.value.param == param and words in err.value.message


def test_hermes_calls_and_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "calc", "arguments": {"expression": "4"}}\n</tool_call>'
    content, calls = extract_tool_calls(text, "hermes", [CALC_TOOL])
    assert content == "Let me compute.\n"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expression": "2*3"}, {"expression": "4"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # a broken call leaves the text as content (vLLM's parser), as does a request without tools
    assert extract_tool_calls("<tool_call>{oops</tool_call>", "hermes", [CALC_TOOL]) == (
        "<tool_call>{oops</tool_call>", [])
    assert extract_tool_calls(text, "hermes", None) == (text, [])


def test_compact_calls_of_the_requests_tools_only():
    content, calls = extract_tool_calls("<calc>37*58</calc>", "compact", [CALC_TOOL])
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"expression": "37*58"}
    assert extract_tool_calls("<b>x</b>", "compact", [CALC_TOOL]) == ("<b>x</b>", [])


def test_reasoning_split():
    assert split_reasoning("<think>a</think>b", "deepseek_r1") == ("a", "b")
    assert split_reasoning("a</think>", "qwen3") == ("a", None)
