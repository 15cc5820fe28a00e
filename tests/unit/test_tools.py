"""Tests of tool calling: schemas, parsing, argument checks, execution in worker processes, ToolEnvironment,
the calculator demo's pieces, and the Qwen2.5 chat template's rendering of tools."""

from __future__ import annotations

import doctest
import json
import multiprocessing as mp
import random
import time

import pytest
import torch

import grpo.tasks.calculator
import grpo.tasks.tool_calls
import grpo.tasks.tools
from grpo.config.load import load_config
from grpo.tasks.calculator import agent_targets, calc, calculator_rows, demo_transcript
from grpo.tasks.function import EnvError
from grpo.tasks.interface import check_return
from grpo.tasks.tool_calls import (ParsedCall, check_arguments, function_spec, parse_tool_calls, resolve_tools,
                                  stop_strings, tool_schemas)
from grpo.tasks.tools import ERROR_KINDS, INVALID_CALL_KINDS, TOOL_ERROR_KINDS, ToolEnvironment

FNS = "tests.helpers.tool_fns_for_tests"  # the repo is on sys.path (conftest.py); spawned workers inherit it
ARITH = "grpo.tasks.arithmetic:arithmetic_reward"


@pytest.mark.parametrize("module", [grpo.tasks.tool_calls, grpo.tasks.tools, grpo.tasks.calculator])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def hermes(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# --------------------------------------------------------------------------------------------------
# Tools and schemas
# --------------------------------------------------------------------------------------------------
def test_schemas_come_from_transformers():
    tools = resolve_tools([f"{FNS}:add", f"{FNS}:scale"])
    assert list(tools) == ["add", "scale"]
    add, scale = tool_schemas(tools)
    assert add == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first integer"},
                                                        "b": {"type": "integer", "description": "the second integer"}},
                       "required": ["a", "b"]},
        "return": {"type": "integer"}}}
    props = scale["function"]["parameters"]["properties"]
    assert props["values"] == {"type": "array", "items": {"type": "number"}, "description": "the numbers"}
    assert props["label"]["nullable"] is True and scale["function"]["parameters"]["required"] == ["values"]


@pytest.mark.parametrize("name,missing", [("undocumented", "no docstring"), ("untyped", "missing a type hint"),
                                          ("no_arg_doc", "no description for the argument 'a'")])
def test_schema_of_an_undocumented_or_untyped_tool_fails_naming_it(name, missing):
    with pytest.raises(EnvError, match=rf"tool {FNS}:{name}: cannot build its JSON schema: .*{missing}"):
        tool_schemas(resolve_tools([f"{FNS}:{name}"]))


def test_resolve_tools_errors():
    with pytest.raises(EnvError, match=r"env.tools='nomodule_xyz:f': cannot import"):
        resolve_tools(["nomodule_xyz:f"])
    with pytest.raises(EnvError, match=r"env.tools='add': expected 'package.module:function'"):
        resolve_tools(["add"])
    with pytest.raises(EnvError, match="two tools are named 'add'"):
        resolve_tools([f"{FNS}:add", f"{FNS}:add"])
    with pytest.raises(EnvError, match="top level of an importable module"):
        function_spec(lambda x: x)


@pytest.mark.parametrize("arguments,problem", [
    ({"a": 1, "b": 2}, None),
    ({"a": 1}, 'add is missing the argument "b"'),
    ({}, 'add is missing the arguments "a", "b"'),
    ({"a": 1, "b": 2, "c": 3}, 'add takes no argument "c" (its arguments: "a", "b")'),
    ({"a": "1", "b": 2}, 'argument "a" must be integer, got "1"'),
    ({"a": 1.5, "b": 2}, 'argument "a" must be integer, got 1.5'),
    ({"a": True, "b": 2}, 'argument "a" must be integer, got true'),
    ([1, 2], "arguments must be a JSON object, got [1, 2]"),
])
def test_check_arguments_against_the_schema(arguments, problem):
    schema = tool_schemas(resolve_tools([f"{FNS}:add"]))[0]
    assert check_arguments(schema, arguments) == problem


def test_check_arguments_nested_nullable_and_enum():
    schema = tool_schemas(resolve_tools([f"{FNS}:scale"]))[0]
    assert check_arguments(schema, {"values": [1, 2.5], "factor": 3, "label": None}) is None
    assert check_arguments(schema, {"values": [1, "x"]}) == 'argument "values"[1] must be number, got "x"'
    enum = {"function": {"name": "f", "parameters": {"properties": {"m": {"type": "string", "enum": ["a", "b"]}}}}}
    assert check_arguments(enum, {"m": "c"}) == 'argument "m" must be one of ["a", "b"], got "c"'


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------
def test_hermes_parsing_good_and_several_calls_in_order():
    text = ("Let me add.\n" + hermes("add", {"a": 1, "b": 2}) + "\nand\n" + hermes("add", {"a": 3, "b": 4})
            + '<tool_call>{"name": "odd_result"}</tool_call>')
    assert parse_tool_calls(text, "hermes") == [ParsedCall("add", {"a": 1, "b": 2}),
                                                ParsedCall("add", {"a": 3, "b": 4}), ParsedCall("odd_result", {})]
    assert parse_tool_calls("The answer is 7.", "hermes") == []


def test_hermes_parsing_problems():
    calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
                             '<tool_call>{"arguments": {}}</tool_call>'
                             '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
                             '<tool_call>"just a string"</tool_call>', "hermes")
    assert [c.problem for c in calls] == ["bad_json", "missing_name", "arguments_not_object", "missing_name"]
    assert "not valid JSON" in calls[0].detail and calls[2].name == "add"


def test_hermes_call_without_its_closing_tag_at_the_end():
    # A backend that strips the stop string leaves the call unclosed; it still counts.
    assert parse_tool_calls('ok <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', "hermes") == [
        ParsedCall("add", {"a": 1, "b": 2})]


def test_compact_parsing():
    schemas = {s["function"]["name"]: s for s in tool_schemas(resolve_tools([f"{FNS}:add", f"{FNS}:fail",
                                                                              f"grpo.tasks.calculator:calc"]))}
    text = '<calc>12*34</calc> then <b>bold</b> <fail>oops</fail><add>{"a": 1, "b": 2}</add><add>1</add><calc>5'
    calls = parse_tool_calls(text, "compact", schemas)
    assert calls[:4] == [ParsedCall("calc", {"expression": "12*34"}), ParsedCall("fail", {"message": "oops"}),
                         ParsedCall("add", {"a": 1, "b": 2}), ParsedCall("add", {}, "bad_json", calls[3].detail)]
    assert calls[4] == ParsedCall("calc", {"expression": "5"})  # unclosed at the very end
    assert "takes 2 arguments" in calls[3].detail
    assert parse_tool_calls("<add>{bad</add>", "compact", schemas)[0].problem == "bad_json"
    assert parse_tool_calls("<calc>1</calc>", "compact", {}) == []


def test_stop_strings_and_format_errors():
    assert stop_strings("hermes", ["add", "calc"]) == ["</tool_call>"]
    assert stop_strings("compact", ["add", "calc"]) == ["</add>", "</calc>"]
    with pytest.raises(EnvError, match="env.tool_call_format='xml': expected one of"):
        parse_tool_calls("", "xml")


# --------------------------------------------------------------------------------------------------
# ToolEnvironment: execution in worker processes
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env():
    env = ToolEnvironment([f"{FNS}:add", f"{FNS}:fail", f"{FNS}:nap", f"{FNS}:shout", f"{FNS}:odd_result"], ARITH,
                          timeout_s=2.0, max_result_chars=20, max_calls_per_turn=3, num_workers=2)
    env.start()
    yield env
    env.shutdown()
    assert [p for p in mp.active_children() if p.name == "grpo-tool-worker"] == []


def row(question="12*34=", answer="408"):
    return {"question": question, "answer": answer, "meta": {}, "task_name": "tools"}


def step(env, *texts, metadata=None):
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in texts]
    ret = env.step(logs, metadata or [row() for _ in texts])
    return check_return(ret, len(texts))


def contents(ret, b):
    return [m["content"] for m in ret.observations[b]]


def test_tool_turn_runs_calls_in_order_and_final_answer_is_verified(env):
    env.global_post_process_and_metrics([])
    ret = step(env, hermes("add", {"a": 2, "b": 3}) + hermes("shout", {"text": "ab", "times": 2}), "408", "407")
    assert contents(ret, 0) == ["5", "abab"] and [m["role"] for m in ret.observations[0]] == ["tool", "tool"]
    assert [m["name"] for m in ret.observations[0]] == ["add", "shout"]
    assert ret.rewards.tolist() == [0.0, 1.0, 0.0] and ret.terminateds.tolist() == [False, True, True]
    assert ret.next_stop_strings == [["</tool_call>"], None, None]
    assert ret.answers == [None, "408", "407"]
    assert ret.metadata[0] == {**row(), "tool_calls": 2, "invalid_tool_call": False, "tool_error": False}
    assert ret.metadata[1]["invalid_tool_call"] is False

    # The next turn of sample 0: its metadata carries on, a final answer ends it.
    ret2 = step(env, "408", metadata=[ret.metadata[0]])
    assert ret2.rewards.tolist() == [1.0] and ret2.metadata[0]["tool_calls"] == 2
    _, metrics = env.global_post_process_and_metrics([])
    assert metrics["tool_calls_per_sample"] == pytest.approx(2 / 3)
    assert metrics["samples_with_tool_calls"] == pytest.approx(1 / 3)
    assert metrics["tool_calls_per_sample/add"] == pytest.approx(1 / 3)
    assert metrics["tool_error_rate"] == 0.0 and metrics["invalid_call_rate"] == 0.0 and metrics["tool_s"] > 0
    assert set(metrics) >= {f"tool_errors/{k}" for k in ERROR_KINDS}
    assert env.global_post_process_and_metrics([]) == ([], {})  # reset after each call


def test_every_failure_gives_a_readable_error_and_only_invalid_calls_flag_the_message(env):
    """An invalid call (bad JSON, unknown tool, bad arguments, one call too many) flags the message
    invalid_tool_call; a well-formed call whose tool raises or returns what cannot be text is a tool error
    (NeMo-RL: its detector flags only calls the model wrote wrong; a tool's run-time error is the call's output)."""
    env.global_post_process_and_metrics([])
    texts = [
        hermes("add", {"a": 1, "b": "2"}),                      # wrong argument type
        hermes("nope", {}),                                     # unknown tool
        hermes("fail", {"message": "boom"}),                    # the tool raises
        hermes("odd_result", {}),                               # a result that is not text
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # bad JSON
        hermes("add", {"a": 1, "b": 1}) + hermes("shout", {"text": "x", "times": 100}),  # fine; result truncated
        hermes("add", {"a": 1, "b": 1}) * 4,                    # one call too many
    ]
    ret = step(env, *texts)
    flags = [md["invalid_tool_call"] for md in ret.metadata]
    assert flags == [True, True, False, False, True, False, True]
    assert [md["tool_error"] for md in ret.metadata] == [False, False, True, True, False, False, False]
    assert contents(ret, 0) == ['error: argument "b" must be integer, got "2"']
    assert contents(ret, 1) == ["error: unknown tool 'nope' (the tools: add, fail, nap, shout, odd_result)"]
    assert contents(ret, 2) == ["error: RuntimeError: boom"]
    assert contents(ret, 3)[0].startswith("error: the tool returned a set, which cannot be turned into text")
    assert contents(ret, 4)[0].startswith("error: the tool call is not valid JSON")
    assert contents(ret, 5) == ["2", "x" * 10 + "...[80 chars cut]..." + "x" * 10]
    assert contents(ret, 6) == ["2", "2", "2", "error: not run: at most 3 tool calls per message"]
    assert not ret.terminateds.any() and ret.rewards.tolist() == [0.0] * 7
    _, metrics = env.global_post_process_and_metrics([])
    calls = 1 + 1 + 1 + 1 + 1 + 2 + 4
    for kind in ("bad_arguments", "unknown_tool", "exception", "bad_result", "bad_json", "too_many_calls"):
        assert metrics[f"tool_errors/{kind}"] == pytest.approx(1 / calls), kind
    assert metrics["invalid_call_rate"] == pytest.approx(4 / calls) and metrics["num_invalid_calls"] == 4
    assert metrics["tool_error_rate"] == pytest.approx(2 / calls) and metrics["num_tool_errors"] == 2


def test_error_kinds_split_into_invalid_calls_and_tool_errors():
    assert set(INVALID_CALL_KINDS) | set(TOOL_ERROR_KINDS) == set(ERROR_KINDS)
    assert not set(INVALID_CALL_KINDS) & set(TOOL_ERROR_KINDS)
    assert {"exception", "timeout"} <= set(TOOL_ERROR_KINDS)
    assert {"bad_json", "unknown_tool", "bad_arguments"} <= set(INVALID_CALL_KINDS)


def test_a_timeout_costs_only_its_call(env):
    start = time.monotonic()
    ret = step(env, hermes("nap", {"seconds": 30}) + hermes("add", {"a": 1, "b": 1}), hermes("nap", {"seconds": 0.1}))
    assert time.monotonic() - start < 15
    assert contents(ret, 0) == ["error: the call did not finish within 2s", "2"]
    assert contents(ret, 1) == ["slept 0.1"]
    assert [md["invalid_tool_call"] for md in ret.metadata] == [False, False]  # a timeout is a tool error
    assert [md["tool_error"] for md in ret.metadata] == [True, False]
    metrics = env.global_post_process_and_metrics([])[1]
    assert metrics["tool_errors/timeout"] > 0 and metrics["num_tool_errors"] == 1
    assert step(env, hermes("add", {"a": 5, "b": 5})).observations[0][0]["content"] == "10"  # the pool recovered


def test_disabled_tools_answer_every_call_with_an_error():
    env = ToolEnvironment(["grpo.tasks.calculator:calc"], ARITH, tool_call_format="compact", disable_tools=True,
                          num_workers=1)
    try:
        ret = step(env, "<calc>12*34</calc>", "408")
        assert contents(ret, 0) == ["<r>error: disabled</r>"]
        assert ret.metadata[0]["tool_error"] and not ret.metadata[0]["invalid_tool_call"]  # the call was fine
        assert ret.next_stop_strings[0] == ["</calc>"]
        assert ret.rewards.tolist() == [0.0, 1.0]
        assert env._pool._workers == []  # nothing ran
    finally:
        env.shutdown()


def test_a_verifier_failure_is_a_reward_failure_of_its_sample_and_a_tool_error_is_not(tmp_path):
    """The verifier raising is a reward failure (reported, never scored 0); the router verifies that sample again
    and only it: a sample mid-tool-call is not called again, its tool does not run twice."""
    from grpo.tasks.failures import RetryPolicy
    from grpo.tasks.router import Environments

    env = ToolEnvironment([f"{FNS}:add", f"{FNS}:fail"], "tests.helpers.reward_fns_for_tests:by_question",
                          num_workers=1, verifier_timeout_s=10)
    try:
        ret = step(env, "1", "1", hermes("fail", {"message": "boom"}), metadata=[row("raise", "1"), row("ok", "1"), row()])
        assert [f and (f.reason, f.kind) for f in ret.failures] == [("reward_error", "data"), None, None]
        assert ret.rewards[1] == 1.0 and ret.terminateds.tolist() == [True, True, False]
        assert ret.observations[2][0]["content"] == "error: RuntimeError: boom"  # a tool error: the policy's outcome
        assert env.global_post_process_and_metrics([])[1]["verifier_error_rate"] == 0.5

        envs = Environments({"tools": env}, 30, retry=RetryPolicy(3, 2, 0.5, 1.0), sleep=lambda s: None)
        once = {"question": "once", "answer": "1", "meta": {"once": str(tmp_path / "once")}, "task_name": "tools"}
        logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}]
                for t in ("1", hermes("add", {"a": 1, "b": 2}))]
        ret, retries = envs.step("tools", logs, [once, row()])
        assert ret.failures == [None, None] and retries == [1, 0]
        assert ret.rewards[0] == 1.0 and ret.observations[1][0]["content"] == "3"
        metrics = env.global_post_process_and_metrics([])[1]
        assert metrics["tool_calls_per_sample"] == 0.5  # two samples, counted once each; one call, run once
        assert metrics["verifier_error_rate"] == 0.5  # per verification: the failed one and its retry
    finally:
        env.shutdown()


def test_unknown_verifier_fails_at_construction():
    with pytest.raises(EnvError, match="env.reward_fn='nomodule_xyz:f': cannot import"):
        ToolEnvironment([f"{FNS}:add"], "nomodule_xyz:f")


# --------------------------------------------------------------------------------------------------
# The calculator demo's pieces
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression,want", [("37*58", "2146"), (" 2 + 3*4 ", "14"), ("(1+2)/4", "0.75"),
                                             ("-3**2", "-9"), ("7//2", "3"), ("2**10", "1024")])
def test_calc(expression, want):
    assert calc(expression) == want


@pytest.mark.parametrize("expression,error", [("__import__('os')", "unsupported expression"),
                                              ("x+1", "unsupported expression"), ("1+", "cannot parse"),
                                              ("9**9**9", "too large"), ("10**20*10**20", "larger than"),
                                              ("1" * 201, "longer than")])
def test_calc_refuses_what_is_not_arithmetic(expression, error):
    with pytest.raises(ValueError, match=error):
        calc(expression)
    with pytest.raises(ZeroDivisionError):
        calc("1/0")


def test_calculator_rows_and_transcripts():
    rows = calculator_rows(50, seed=1, split="val")
    assert rows == calculator_rows(50, seed=1, split="val") and rows != calculator_rows(50, seed=1, split="train")
    for r in rows:
        a, b = map(int, r["question"].rstrip("=").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == str(a * b)
    rng = random.Random(0)
    kinds = [len(demo_transcript(37, 58, rng, p_tool=0.5, p_call_ok=1.0, p_copy_ok=1.0)) for _ in range(400)]
    assert 0.4 < kinds.count(3) / 400 < 0.6  # the tool path (call, result, answer) about half the time
    direct = [demo_transcript(37, 58, rng, 0.0, 1.0, 1.0)[0][0] for _ in range(50)]
    assert "2146" not in direct  # a direct answer is never trained to be right


def test_the_agent_demo_asks_only_what_its_model_is_fitted_to():
    """toy:calc_agent is fitted to an exact distribution over the demo's products (issue 44): every question the
    agent demo asks is one of them, each with the tool path (its result copied) and a wrong direct answer, weights
    summing to 1."""
    from tests.helpers.e2e import REPO

    cfg = load_config(str(REPO / "configs" / "cpu_demo_agent.yaml"))
    targets = agent_targets(cfg.data.calculator_max_operand, p_tool=0.25)
    by_prompt = {}
    for question, turns, weight in targets:
        by_prompt.setdefault(question, []).append((turns, weight))
    for split in ("train", "val"):
        asked = {r["question"] for r in grpo.tasks.calculator.rows("calculator", cfg.data, 2048, 0, split)}
        assert asked <= set(by_prompt), sorted(asked - set(by_prompt))[:5]
    for question, paths in by_prompt.items():
        product = calc(question.rstrip("="))
        (tool, w_tool), (direct, w_direct) = paths
        assert [text for text, _ in tool] == [f"<calc>{question.rstrip('=')}</calc>", f"<r>{product}</r>", product]
        assert direct[0][0] != product and w_tool + w_direct == 1.0


def test_calculator_env_end_to_end_in_compact_format():
    env = ToolEnvironment(["grpo.tasks.calculator:calc"], ARITH, tool_call_format="compact", num_workers=1,
                          max_result_chars=200)
    try:
        assert env.stop_strings == ["</calc>"]
        ret = step(env, "<calc>37*58</calc>", "<calc>1/0</calc>", "<calc>os</calc>",
                   metadata=[row("37*58=", "2146")] * 3)
        assert contents(ret, 0) == ["<r>2146</r>"] and not ret.metadata[0]["invalid_tool_call"]
        assert contents(ret, 1) == ["<r>error: ZeroDivisionError: division by zero</r>"]
        assert contents(ret, 2)[0].startswith("<r>error: ValueError: unsupported expression")
        final = step(env, "2146", metadata=[ret.metadata[0]])
        assert final.rewards.tolist() == [1.0] and final.answers == ["2146"]
    finally:
        env.shutdown()


# --------------------------------------------------------------------------------------------------
# A real Qwen2.5 tokenizer: what the model sees and emits
# --------------------------------------------------------------------------------------------------
def test_qwen25_tokenizer_ids(qwen25):
    assert qwen25("hello world")["input_ids"] == [14990, 1879]
    assert (qwen25.eos_token_id, qwen25.pad_token_id, qwen25.bos_token_id) == (151645, 151643, None)
    assert qwen25.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [151657, 151658]


def test_qwen25_template_renders_tools_calls_and_responses(qwen25):
    schemas = tool_schemas(resolve_tools([f"{FNS}:add"]))
    messages = [{"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": hermes("add", {"a": 2, "b": 3})},
                {"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "6"}]
    text = qwen25.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                           "\n\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(schemas[0]) + "\n</tools>" in text
    assert text.endswith("<|im_start|>assistant\n" + hermes("add", {"a": 2, "b": 3}) + "<|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_qwen25_generated_call_decodes_and_parses(qwen25):
    # As a rollout sees it: generated ids, decoded with special tokens skipped, ending at the stop string.
    ids = qwen25(hermes("add", {"a": 2, "b": 3}), add_special_tokens=False)["input_ids"]
    assert ids[0] == 151657 and ids[-1] == 151658  # <tool_call> ... </tool_call> are single tokens
    text = qwen25.decode(ids + [qwen25.eos_token_id], skip_special_tokens=True)
    assert text.endswith(stop_strings("hermes", ["add"])[0])  # not special: kept in the decoded text
    assert parse_tool_calls(text, "hermes") == [ParsedCall("add", {"a": 2, "b": 3})]


def test_toolenv_rewards_are_a_tensor_per_sample(env):
    ret = env.step([[{"role": "assistant", "content": "408"}]], [row()])
    assert isinstance(ret.rewards, torch.Tensor) and ret.rewards.dtype == torch.float32


def test_qwen25_tool_turn_only_appends_tokens(qwen25):
    # What a multi-turn rollout relies on: the conversation re-rendered after a tool turn is the old prompt,
    # the generated call (which stopped at </tool_call>, without <|im_end|>) and an observation suffix, and
    # tokenizing the pieces separately gives the same ids as tokenizing the whole.
    schemas = tool_schemas(resolve_tools([f"{FNS}:add"]))
    user = [{"role": "user", "content": "What is 2+3?"}]
    prompt = qwen25.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True)
    call = hermes("add", {"a": 2, "b": 3})
    after = user + [{"role": "assistant", "content": call}, {"role": "tool", "content": "5"}]
    full = qwen25.apply_chat_template(after, tools=schemas, tokenize=False, add_generation_prompt=True)
    observation = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert full == prompt + call + observation
    ids = [qwen25(part, add_special_tokens=False)["input_ids"] for part in (prompt, call, observation)]
    assert ids[0] + ids[1] + ids[2] == qwen25(full, add_special_tokens=False)["input_ids"]
