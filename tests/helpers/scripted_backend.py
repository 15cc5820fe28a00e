"""A generation backend that writes given texts: the endpoint's tool-call and reasoning answers tested on the wire
with a real tokenizer (a random tiny model never writes a tool call). Everything else (the server, the batcher,
the tokenizer, the parsers) is the real code."""

from __future__ import annotations

from grpo.system.generation.base import GenerationBackend, GenerationOutput


class ScriptedBackend(GenerationBackend):
    """`GenerationBackend` whose i-th generated sample is ``texts[i % len(texts)]`` (or ``texts(prompt_text)``)
    followed by EOS, with logprob -0.5 per token; records every batch it was asked for (``calls``: the prompts of
    each call)."""

    def __init__(self, tokenizer, gen_cfg, texts: list[str]):
        self.tokenizer, self.sampling, self.texts = tokenizer, gen_cfg.sampling(), texts
        self.calls: list[list[list[int]]] = []
        self._n = 0

    def generate(self, prompt_ids, seeds, *, greedy=False, max_new_tokens=None, stop_strings=None, sampling=None):
        self.calls.append([list(p) for p in prompt_ids])
        outs = []
        for p in prompt_ids:
            text = (self.texts(self.tokenizer.decode(p)) if callable(self.texts)
                    else self.texts[self._n % len(self.texts)])
            self._n += 1
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            outs.append(GenerationOutput(list(p), ids, [-0.5] * len(ids), "stop", text))
        return outs

    def wake_up(self):
        pass

    def sleep(self):
        pass
