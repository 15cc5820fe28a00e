"""grpo.system.chat with a real Qwen2.5 tokenizer and chat template: a conversation's tokens only grow at the end, and
equal what the template renders for the whole conversation (token in, token out)."""

from __future__ import annotations

import pytest

from grpo.system.chat import ChatFormat
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer


def play(chat: ChatFormat, tok, prompt: list[dict], turns: list[tuple[str, list[dict], str]]):
    """Token ids of a conversation built as the rollout builds it: the prompt's ids, then per turn the
    assistant's generated ids (its text, then ``ending``: the stop token the model emitted, or nothing when a stop
    string or the length cap ended it) and the observation's ids. Returns (ids, context ids before each turn)."""
    ids = [t for m in chat.prompt_token_ids(prompt) for t in m]
    history, contexts = list(prompt), []
    for content, observation, ending in turns:
        contexts.append(list(ids))
        generated = tok(content, add_special_tokens=False)["input_ids"] + (tok.convert_tokens_to_ids([ending])
                                                                             if ending else [])
        ids += generated
        history.append({"role": "assistant", "content": content})
        if observation:
            ids += chat.observation_ids(history, observation, generated)
            history += observation
    return ids, contexts, history


def test_qwen25_conversation_tokens_equal_the_rendered_conversation(qwen25):
    chat = ChatFormat(qwen25, "default")
    prompt = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 17*23?"}]
    turns = [("Let me think.", [{"role": "user", "content": "Go on."}], "<|im_end|>"),
             ("It is 391.", [{"role": "user", "content": "Sure?"}], "<|im_end|>"),
             ("Yes: 391", [], "<|im_end|>")]
    ids, contexts, history = play(chat, qwen25, prompt, turns)
    rendered = qwen25.apply_chat_template(history, tokenize=False)
    assert qwen25.decode(ids, skip_special_tokens=False) + "\n" == rendered
    assert ids == qwen25(rendered, add_special_tokens=False)["input_ids"][:-1]  # the final "\n" is not generated
    # Append-only: turn k's context is turn k - 1's context plus the new tokens.
    for earlier, later in zip(contexts, contexts[1:]):
        assert later[:len(earlier)] == earlier


def test_qwen25_tool_calls_cut_by_a_stop_string_get_the_end_of_turn_from_the_template(qwen25):
    tools = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string", "description": "e"}},
        "required": ["expression"]}}}]
    chat = ChatFormat(qwen25, "default", tools=tools)
    prompt = [{"role": "user", "content": "17*23?"}]
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "17*23"}}\n</tool_call>'
    turns = [(call, [{"role": "tool", "content": "391"}, {"role": "tool", "content": "(again) 391"}], ""),
             ("391", [], "<|im_end|>")]
    ids, _, history = play(chat, qwen25, prompt, turns)
    text = qwen25.decode(ids, skip_special_tokens=False)
    assert text + "\n" == qwen25.apply_chat_template(history, tools=tools, tokenize=False)
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n391<|im_end|>")


def test_plain_text_and_a_simple_template_append_observations_as_rendered():
    tok = build_char_tokenizer()
    plain = ChatFormat(tok)
    ids, _, _ = play(plain, tok, [{"role": "user", "content": "1+2="}], [("3", [{"role": "user", "content": "ok"}],
                                                                        "<eos>"), ("3", [], "<eos>")])
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>1+2=3<eos>ok3<eos>"
    simple = ChatFormat(tok, SIMPLE_CHAT_TEMPLATE)
    ids, _, history = play(simple, tok, [{"role": "user", "content": "1+2="}],
                           [("3", [{"role": "user", "content": "ok"}], ""), ("3", [], "")])
    assert tok.decode(ids, skip_special_tokens=False) + "\n" == tok.apply_chat_template(history, tokenize=False,
                                                                                        chat_template=SIMPLE_CHAT_TEMPLATE)
