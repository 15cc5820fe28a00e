"""vLLM's own tool-call and reasoning parsers, for the endpoint on ``policy.generation.backend=vllm``.

NeMo-RL's endpoint is vLLM's OpenAIServingChat, which turns generated text into an OpenAI message with the parsers
named by ``http_server_serving_chat_kwargs.tool_parser`` / ``reasoning_parser`` (vLLM's ``ParserManager``: the
``ToolParserManager`` and ``ReasoningParserManager`` registries). On the vLLM backend the endpoint does the same
(`VllmChatParser`), so a NeMo-RL recipe's parser names mean what they mean there, every vLLM parser included. A
name vLLM does not register (``compact``, the char-level toy's format) falls back to grpo-ds's own parser
(`grpo.wings.agents.openai_chat`), which is also what the hf backend uses.

`grpo.config.vllm_parser_names` reads the installed vLLM's registries from its source, without importing vLLM
(15-30 s), so the config checks a name at load time (`grpo.config.parser_problem`).
"""

from __future__ import annotations

from typing import Any, Optional

from grpo.config import vllm_parser_names
from grpo.wings.agents.openai_chat import tool_call


def vllm_chat_parser(tokenizer, tool_parser: Optional[str],
                     reasoning_parser: Optional[str]) -> Optional["VllmChatParser"]:
    """vLLM's parser of the names it registers (the others, e.g. ``compact``, stay grpo-ds's); None when it
    registers neither. Raises ValueError (naming the keys) when vLLM finds a parser unfit for the tokenizer (its
    markers are not tokens of it), as vLLM's server refuses to start then."""
    tool = tool_parser if tool_parser in (vllm_parser_names("tool_parser") or ()) else None
    reasoning = reasoning_parser if reasoning_parser in (vllm_parser_names("reasoning_parser") or ()) else None
    if not (tool or reasoning):
        return None
    try:
        return VllmChatParser(tokenizer, tool, reasoning)
    except (TypeError, ValueError, KeyError, RuntimeError) as err:  # vLLM checks the parsers against the tokenizer
        raise ValueError(f"policy.generation.vllm_cfg.http_server_serving_chat_kwargs: vLLM's tool_parser={tool!r} / "
                         f"reasoning_parser={reasoning!r} cannot parse this model's output: {err}") from None


class VllmChatParser:
    """vLLM's parser for a generated text (the one its OpenAIServingChat composes from ``tool_parser`` and
    ``reasoning_parser``; either may be None)."""

    def __init__(self, tokenizer, tool_parser: Optional[str], reasoning_parser: Optional[str]):
        from vllm.parser.parser_manager import ParserManager
        from vllm.tokenizers.hf import get_cached_tokenizer

        # vLLM's own proxy, as its server holds it: the vocabulary (which each request's parser reads) built once
        self.tokenizer = tokenizer = get_cached_tokenizer(tokenizer)
        self.tool_parser = tool_parser
        self.parser_cls = ParserManager.get_parser(tool_parser_name=tool_parser,
                                                   reasoning_parser_name=reasoning_parser,
                                                   enable_auto_tools=tool_parser is not None, tokenizer=tokenizer)

    def parse(self, text: str, token_ids: list[int], tools: Optional[list[dict]], tool_choice: Any,
              template_kwargs: dict) -> tuple[Optional[str], Optional[str], list[dict]]:
        """``(reasoning_content, content, tool_calls)`` of ``text`` as vLLM's chat serving makes them for a
        request with ``tools`` / ``tool_choice`` rendered with ``template_kwargs`` (Qwen3's ``enable_thinking``
        decides whether an unclosed ``<think>`` is reasoning); tool calls as OpenAI dicts."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="grpo", messages=[{"role": "user", "content": ""}], tools=tools or None,
                                        tool_choice=tool_choice if tools else None,
                                        chat_template_kwargs=template_kwargs or None)
        parser = self.parser_cls(self.tokenizer, request.tools, chat_template_kwargs=template_kwargs)
        use_tools = self.tool_parser is not None and bool(tools) and tool_choice != "none"
        reasoning, content, calls = parser.parse(text, request, enable_auto_tools=use_tools,
                                                 model_output_token_ids=token_ids)
        if not use_tools:
            calls = []
        out = [tool_call(c.name, c.arguments, getattr(c, "id", None)) for c in (calls or [])]
        return reasoning, content, out
