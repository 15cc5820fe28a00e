"""policy.tokenizer.chat_template_kwargs (NeMo-RL's, e.g. Qwen3's enable_thinking): the template's extra variables
reach every rendering of grpo.system.chat.ChatFormat (the prompt, the observations and the generation prompt after
them, the role checks), with the real Qwen2.5 tokenizer and a template of our own that reads a variable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from grpo.config import DataConfig, MasterConfig, TokenizerConfig
from grpo.system.chat import ChatFormat, ChatFormatError
from grpo.system.data import PromptFormatter

# Qwen2.5's markup; the generation prompt opens a thinking block when enable_thinking is true, and a "tool" message
# is rendered only when show_tools is true.
THINKING = (
    "{% for m in messages %}{% if m.role != 'tool' or show_tools %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")
PROMPT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 17*23?"}]


def text(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_the_kwarg_reaches_the_prompt(qwen25):
    on = ChatFormat(qwen25, THINKING, chat_template_kwargs={"enable_thinking": True})
    off = ChatFormat(qwen25, THINKING, chat_template_kwargs={"enable_thinking": False})
    plain = ChatFormat(qwen25, THINKING)
    ids_on = [t for m in on.prompt_token_ids(PROMPT) for t in m]
    ids_off = [t for m in off.prompt_token_ids(PROMPT) for t in m]
    assert text(qwen25, ids_on).endswith("<|im_start|>assistant\n<think>\n")
    assert text(qwen25, ids_off).endswith("<|im_start|>assistant\n")
    assert ids_off == [t for m in plain.prompt_token_ids(PROMPT) for t in m]
    # What transformers renders with the same kwarg, token for token.
    rendered = qwen25.apply_chat_template(PROMPT, chat_template=THINKING, add_generation_prompt=True, tokenize=False,
                                          enable_thinking=True)
    assert ids_on == qwen25(rendered, add_special_tokens=False)["input_ids"]


def test_the_kwarg_reaches_later_turns(qwen25):
    chat = ChatFormat(qwen25, THINKING, chat_template_kwargs={"enable_thinking": True})
    history = PROMPT + [{"role": "assistant", "content": "391"}]
    generated = qwen25("391", add_special_tokens=False)["input_ids"] + qwen25.convert_tokens_to_ids(["<|im_end|>"])
    obs = chat.observation_ids(history, [{"role": "user", "content": "Sure?"}], generated)
    assert text(qwen25, obs) == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    no = ChatFormat(qwen25, THINKING).observation_ids(history, [{"role": "user", "content": "Sure?"}], generated)
    assert text(qwen25, no) == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"


def test_the_kwarg_reaches_the_role_check(qwen25):
    tool = [{"role": "tool", "content": "42"}]
    ChatFormat(qwen25, THINKING, chat_template_kwargs={"show_tools": True}).check_roles(tool)
    with pytest.raises(ChatFormatError, match="role 'tool'"):
        ChatFormat(qwen25, THINKING).check_roles(tool)


def test_a_kwarg_the_template_ignores_changes_nothing(qwen25):
    """Qwen2.5's own template reads no enable_thinking: the same tokens, as transformers renders them."""
    with_kw = ChatFormat(qwen25, "default", chat_template_kwargs={"enable_thinking": True})
    without = ChatFormat(qwen25, "default")
    assert with_kw.prompt_token_ids(PROMPT) == without.prompt_token_ids(PROMPT)
    history = PROMPT + [{"role": "assistant", "content": "391"}]
    new = [{"role": "user", "content": "Sure?"}]
    assert with_kw.observation_ids(history, new, [1, 2]) == without.observation_ids(history, new, [1, 2])


def test_prompt_formatter_and_config(qwen25):
    fmt = PromptFormatter(qwen25, DataConfig(), THINKING, chat_template_kwargs={"enable_thinking": True})
    prompt_text, ids = fmt.format("2+2?")
    assert prompt_text.endswith("assistant\n<think>\n") and text(qwen25, ids) == prompt_text
    cfg = MasterConfig.model_validate({"policy": {"tokenizer": {"chat_template_kwargs": {"enable_thinking": False}}}})
    assert cfg.policy.tokenizer.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValidationError, match=r"\['add_generation_prompt', 'tools'\] are set by grpo-ds"):
        TokenizerConfig(chat_template_kwargs={"tools": [], "add_generation_prompt": False, "enable_thinking": True})


def test_build_datasets_passes_the_config(qwen25):
    from grpo.run.run_setup import build_datasets

    cfg = MasterConfig.model_validate({"policy": {"tokenizer": {"chat_template": THINKING,
                                                                "chat_template_kwargs": {"enable_thinking": True}}},
                                       "data": {"dataset_name": "arithmetic", "num_train_samples": 4,
                                                "num_val_samples": 2}})
    formatter, *_ = build_datasets(cfg, qwen25, ["arithmetic"])
    assert formatter.text("1+1").endswith("<think>\n")
