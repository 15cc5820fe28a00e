"""Conversations as tokens: the initial prompt messages, and the tokens an observation appends.

Token in, token out. A conversation's tokens only ever grow at the end: the prompt's tokens, then each
assistant turn exactly as generated (never decoded and re-encoded), then each observation's tokens (raw, or
as the chat template renders it after the conversation so far: below), and so on. So the context of turn k is
exactly the context of turn k - 1 plus the new tokens, and the trainer scores the very tokens the
generator saw.

Two modes, from ``policy.tokenizer.chat_template``:

- plain text (None): the prompt is one ``user`` message tokenised with the tokenizer's special tokens
  (``<bos>``); an observation is its content tokenised without special tokens (NeMo-RL's behaviour);
- chat template ("default" = the tokenizer's own, or a Jinja string): each prompt message is the text the
  template adds for it. ``policy.tokenizer.chat_template_kwargs`` are the template's extra variables (Qwen3's
  ``enable_thinking``) in every rendering below.

An observation becomes tokens in one of two ways (``env.observation_format``, per environment):

- ``raw`` (`raw_observation_ids`): its content tokenised without special tokens, nothing added: NeMo-RL's
  ``run_multi_turn_rollout`` ("Tokenize the raw content from the environment"). The environment writes its
  own turn markup, and the next assistant turn is generated right after the content;
- ``chat_template`` (`observation_ids`): what the template adds after the assistant message just generated:
  the template's end-of-turn text the generation did not produce itself (e.g. the ``"\\n"`` after Qwen's
  ``<|im_end|>``, or the whole ``<|im_end|>\\n`` of a turn cut by length or by a stop string), the observation
  message(s) and the generation prompt of the next assistant turn. A role the template renders nothing for
  (Qwen2.5 drops ``environment``, the role NeMo-RL's environments answer with) is a `ChatFormatError`: the
  observation would vanish from the conversation without a word.

        >>> from grpo.tasks.toy import build_char_tokenizer, SIMPLE_CHAT_TEMPLATE
        >>> chat = ChatFormat(build_char_tokenizer(), SIMPLE_CHAT_TEMPLATE)
        >>> chat.observation_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        ...                       [{"role": "user", "content": "?"}], ended_with="")
        '\\nuser: ?\\nassistant: '
"""

from __future__ import annotations

from typing import Any

_SENTINEL = "\x00grpo-ds-assistant-content\x00"
# A neutral conversation that ends with an assistant turn: what an observation is rendered after when the
# template renders the history differently once more messages follow (e.g. Qwen3 drops old reasoning).
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatFormatError(ValueError):
    """A chat template that does not render conversations as an append-only text."""


class ChatFormat:
    """Renders messages with ``chat_template`` (None: plain text; "default": the tokenizer's own; else a
    Jinja string) and tokenises them. ``tools``: JSON schemas passed to the template (tool calling).
    ``chat_template_kwargs``: the template's extra variables (``policy.tokenizer.chat_template_kwargs``, e.g.
    ``{"enable_thinking": False}``), passed to every rendering: the prompt, observations, the role checks (as
    NeMo-RL binds them to ``tokenizer.apply_chat_template``); a variable the template does not read changes
    nothing. ``processor``: a vision-language policy's (`grpo.system.vision.load_processor`; None for a text
    model): it tokenises prompts and observations that carry images."""

    def __init__(self, tokenizer, chat_template: str | None = None, tools: list[dict] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, processor=None):
        self.tokenizer = tokenizer
        self.processor = processor
        self.chat_template = chat_template
        self.tools = tools or None
        self.template_kwargs = dict(chat_template_kwargs or {})
        if chat_template == "default" and not getattr(tokenizer, "chat_template", None):
            raise ChatFormatError("policy.tokenizer.chat_template='default' but the tokenizer has no chat template")
        self._tail = None if chat_template is None else self._assistant_tail()
        self._renders_role: dict[str, bool] = {}

    @property
    def plain(self) -> bool:
        return self.chat_template is None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (role / content dicts)."""
        kwargs = dict(self.template_kwargs)
        if self.chat_template != "default":
            kwargs["chat_template"] = self.chat_template
        if self.tools:
            kwargs["tools"] = self.tools
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)

    def encode(self, text: str, special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    # ---------------------------------------------------------------- the prompt
    def prompt_token_ids(self, messages: list[dict[str, Any]]) -> list[list[int]]:
        """Token ids of each prompt message; together they are the prompt, ending with the generation prompt.

        Plain text: a single message, tokenised with special tokens. Chat template: message i's tokens are
        the text rendering messages[:i + 1] adds to messages[:i] (the last one with the generation prompt).
        """
        if self.plain:
            if len(messages) != 1:
                raise ChatFormatError(f"a prompt of {len(messages)} messages needs a chat template "
                                      "(set policy.tokenizer.chat_template)")
            return [self.encode(messages[0]["content"], special_tokens=True)]
        return [self.encode(text) for text in self.prompt_texts(messages)]

    def prompt_texts(self, messages: list[dict[str, Any]]) -> list[str]:
        """Chat template: the text rendering messages[:i + 1] adds to messages[:i], for each message i (the last
        with the generation prompt); `prompt_token_ids` tokenises them (a VLM's processor does, with its images)."""
        if self.plain:
            raise ChatFormatError("a prompt with images needs a chat template (set policy.tokenizer.chat_template)")
        texts, prev = [], ""
        for i in range(len(messages)):
            text = self.render(messages[: i + 1], add_generation_prompt=i == len(messages) - 1)
            if not text.startswith(prev):
                raise ChatFormatError(f"the chat template renders message {i} by rewriting the messages before it; "
                                      "grpo-ds needs a template whose text only grows at the end")
            texts.append(text[len(prev):])
            prev = text
        return texts

    # ---------------------------------------------------------------- observations
    def _assistant_tail(self) -> str:
        """What the template writes after an assistant message's content (Qwen: ``"<|im_end|>\\n"``)."""
        text = self.render(_BASE[:1] + [{"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False)
        if _SENTINEL not in text:
            raise ChatFormatError("the chat template does not render assistant messages' content")
        return text[text.index(_SENTINEL) + len(_SENTINEL):]

    def raw_observation_ids(self, new: list[dict[str, Any]]) -> list[int]:
        """NeMo-RL's observation tokens: the messages' content, joined, tokenised without special tokens; no
        template, no generation prompt (the next assistant turn starts right after it).

            >>> from grpo.tasks.toy import build_char_tokenizer
            >>> tok = build_char_tokenizer()
            >>> ChatFormat(tok).raw_observation_ids([{"role": "environment", "content": "ok"}]) == tok.encode(
            ...     "ok", add_special_tokens=False)
            True
        """
        return self.encode("".join(m["content"] for m in new))

    def check_roles(self, new: list[dict[str, Any]]) -> None:
        """ChatFormatError when the template renders nothing of a message of one of ``new``'s roles (checked
        once per role, with a marker as the content, after a neutral user / assistant exchange)."""
        if self.plain:
            return
        for role in dict.fromkeys(m["role"] for m in new):
            if role not in self._renders_role:
                text = self.render(_BASE + [{"role": role, "content": _SENTINEL}], add_generation_prompt=True)
                self._renders_role[role] = _SENTINEL in text
            if not self._renders_role[role]:
                raise ChatFormatError(
                    f"the chat template renders nothing for a message of role {role!r}: its observations would "
                    "vanish from the conversation")

    def observation_text(self, history: list[dict[str, Any]], new: list[dict[str, Any]], ended_with: str) -> str:
        """The text that follows the generated tokens of ``history[-1]`` (the assistant turn just generated)
        when ``new`` messages are appended, up to the next assistant turn's generation prompt.

        ``ended_with``: the text of the special token that ended the generation ("" when it stopped on a
        stop string or by length). When the template's end-of-turn text starts with it (Qwen's
        ``<|im_end|>``), it is not written again. A role the template drops raises `ChatFormatError`
        (`check_roles`).
        """
        if self.plain:
            return "".join(m["content"] for m in new)
        self.check_roles(new)
        full = self.render(history + new, add_generation_prompt=True)
        prev = self.render(history, add_generation_prompt=False)
        if full.startswith(prev):
            added = full[len(prev):]
        else:  # the template rewrites earlier turns once more follow: render the new messages after a neutral turn
            base = self.render(_BASE, add_generation_prompt=False)
            added = self.render(_BASE + new, add_generation_prompt=True)[len(base):]
        tail = self._tail
        if ended_with and tail.startswith(ended_with):
            tail = tail[len(ended_with):]
        return tail + added

    def observation_ids(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                        generated_ids: list[int]) -> list[int]:
        """Tokens of `observation_text` (``generated_ids``: the assistant turn's generated tokens)."""
        return self.encode(self.observation_text(history, new, self.ended_with(generated_ids)))

    def ended_with(self, generated_ids: list[int]) -> str:
        """The text of the special token that ended a generation (its last id), "" when it ended otherwise."""
        last = generated_ids[-1] if generated_ids else None
        special = last is not None and last in set(self.tokenizer.all_special_ids)
        return self.tokenizer.decode([last], skip_special_tokens=False) if special else ""


def load_tokenizer(policy_cfg):
    """The policy's tokenizer (or `policy.tokenizer.name`); pad falls back to EOS."""
    from transformers import AutoTokenizer

    name = policy_cfg.tokenizer.name or policy_cfg.model_name
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=policy_cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
