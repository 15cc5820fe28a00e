"""grpo-ds's tool-call and reasoning parsers (the hf backend's: `grpo.wings.agents.openai_chat.parse_message`)
give what the installed vLLM's own parsers give (the vLLM backend's: `grpo.wings.agents.vllm_chat_parsers`)
on one corpus: good calls, several calls, broken JSON, text around calls, think tags present, absent, stray or
around calls; hermes, qwen3 and deepseek_r1, alone and together, thinking on and off. Skipped without vLLM."""

from __future__ import annotations

import copy
import importlib.util

import pytest

from grpo.wings.agents.openai_chat import parse_message

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)

from grpo.config import vllm_parser_names as registered_names  # noqa: E402
from grpo.wings.agents.vllm_chat_parsers import VllmChatParser, vllm_chat_parser  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def call(arguments: str, name: str = "calc") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


GOOD, OTHER = call('{"expression": "37*58"}'), call('{"expression": "2+2"}')
CORPUS = {
    "plain": "2146", "empty": "", "whitespace": "\n\n", "one call": GOOD, "text before": "Let me compute.\n" + GOOD,
    "text after": GOOD + " done", "text around": "a " + GOOD + " b", "two calls": GOOD + "\n" + OTHER,
    "text between": GOOD + " and " + OTHER, "broken json": "a" + call('{"expression": "1"'),
    "good then broken": GOOD + call("{oops"), "unclosed call": GOOD[:-len("\n</tool_call>")],
    "no name": '<tool_call>{"arguments": {"expression": "1"}}</tool_call>', "unicode": call('{"expression": "é×2"}'),
    "not json at all": "<tool_call>calc(1)</tool_call>", "close tag only": "x</tool_call>",
    "think": "<think>big numbers</think>2146", "think, newlines": "<think>\nhm\n</think>\n\n2146",
    "think not opened": "hm</think>2146", "think unclosed": "<think>hm", "think empty": "<think></think>2146",
    "think, no content": "<think>hm</think>", "think twice closed": "<think>a</think>b</think>c",
    "think opened mid": "a<think>b</think>c", "think opened twice": "<think>a<think>b</think>c",
    "only close": "</think>", "only open": "<think>", "think then call": "<think>hm</think>" + GOOD,
    "think then text and call": "<think>hm</think>ok " + GOOD + " c</think>d",
    "call inside think": "<think>a" + GOOD + "</think>b",
    "call then think": "x" + GOOD + "<think>y</think>z", "think, two calls": "<think>hm</think>" + GOOD + OTHER,
}
PAIRS = [("hermes", None), (None, "qwen3"), (None, "deepseek_r1"), ("hermes", "qwen3"), ("hermes", "deepseek_r1")]


@pytest.fixture(scope="module")
def tokenizer(qwen25):
    """The real Qwen2.5 tokenizer with Qwen3's think tokens added (vLLM's reasoning parsers look them up)."""
    tok = copy.deepcopy(qwen25)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def comparable(reasoning, content, calls) -> tuple:
    return reasoning, content, [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("tool_parser,reasoning_parser", PAIRS)
@pytest.mark.parametrize("thinking", [True, False])
def test_ours_equal_vllms_on_the_corpus(tokenizer, tool_parser, reasoning_parser, thinking):
    theirs = VllmChatParser(tokenizer, tool_parser, reasoning_parser)
    kwargs = {"enable_thinking": thinking}
    differ = {}
    for name, text in CORPUS.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        mine = comparable(*parse_message(text, tool_parser, reasoning_parser, TOOLS, kwargs))
        vllm = comparable(*theirs.parse(text, ids, TOOLS, "auto", kwargs))
        if mine != vllm:
            differ[name] = {"ours": mine, "vllm": vllm}
    assert not differ, differ


def test_tool_choice_none_parses_no_calls(tokenizer):
    theirs = VllmChatParser(tokenizer, "hermes", None)
    ids = tokenizer(GOOD, add_special_tokens=False)["input_ids"]
    assert theirs.parse(GOOD, ids, None, "none", {}) == (None, GOOD, [])
    assert parse_message(GOOD, "hermes", None, None, {}) == (None, GOOD, [])


def test_the_registries_are_read_without_importing_vllm_and_compact_stays_ours(tokenizer):
    assert {"hermes", "mistral", "llama3_json"} <= set(registered_names("tool_parser"))
    assert {"qwen3", "deepseek_r1"} <= set(registered_names("reasoning_parser"))
    assert "compact" not in registered_names("tool_parser")
    assert vllm_chat_parser(tokenizer, "compact", None) is None
    mixed = vllm_chat_parser(tokenizer, "compact", "qwen3")
    assert mixed.tool_parser is None  # the endpoint parses compact calls itself, after vLLM's reasoning split


def test_the_endpoint_on_the_vllm_backend_parses_with_vllms_parsers(tokenizer):
    """backend=vllm: a parser only vLLM has (llama3_json) parses the endpoint's answers; compact stays ours."""
    from grpo.config import MasterConfig
    from grpo.wings.agents.endpoint import Endpoint
    from grpo.wings.agents.openai_chat import ChatRequest

    def endpoint(**serving):
        cfg = MasterConfig.model_validate({"policy": {"model_name": "toy:tiny", "generation": {
            "backend": "vllm", "vllm_cfg": {"http_server_serving_chat_kwargs": serving}}}})
        return Endpoint(cfg, backend=None, tokenizer=tokenizer)

    req = ChatRequest(model="toy:tiny", messages=[{"role": "user", "content": "37*58?"}], tools=TOOLS, top_p=1.0)
    ep = endpoint(tool_parser="pythonic")
    assert isinstance(ep.vllm_parser, VllmChatParser)
    text = '[calc(expression="37*58")]'
    reasoning, content, calls = ep.parse(text, tokenizer(text)["input_ids"], req)
    assert calls[0]["function"] == {"name": "calc", "arguments": '{"expression": "37*58"}'}
    with pytest.raises(ValueError, match=r"http_server_serving_chat_kwargs: vLLM's tool_parser='llama3_json'.*"
                                         r"python_tag"):
        endpoint(tool_parser="llama3_json")  # its marker is no token of Qwen2.5's: vLLM refuses, and so do we
    ep = endpoint(tool_parser="compact", reasoning_parser="deepseek_r1")
    assert ep.vllm_parser.tool_parser is None
    text = "<think>hm</think><calc>37*58</calc>"
    reasoning, content, calls = ep.parse(text, tokenizer(text)["input_ids"], req)
    assert reasoning == "hm" and content is None and calls[0]["function"]["name"] == "calc"
