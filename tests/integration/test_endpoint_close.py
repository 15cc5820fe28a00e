"""The endpoint's close (issue 52, finding 7) on loopback with the official ``openai`` client: it used to wait 60 s for
the batcher and return while a batch still ran, after which the run closed the backend (vLLM) under it. Now no batch
starts once it closes, a batch still running past CLOSE_WAIT_S has its requests answered 503, and close returns only
once the backend call itself has returned."""

from __future__ import annotations

import threading
import time

import openai

from grpo.config import MasterConfig
from grpo.wings.agents import endpoint_batching
from grpo.wings.agents.endpoint import Endpoint
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer
from tests.helpers.scripted_backend import ScriptedBackend

MODEL = "toy:tiny"


class HeldBackend(ScriptedBackend):
    """Writes "3"; a generate call runs until ``release`` is set. ``events``: what happened, in order; `close` records
    whether a generate call was still running."""

    def __init__(self, tokenizer, gen_cfg):
        super().__init__(tokenizer, gen_cfg, ["3"])
        self.started, self.release, self.events = threading.Event(), threading.Event(), []
        self._generating = False

    def generate(self, prompt_ids, seeds, **kw):
        self._generating = True
        self.events.append("generate")
        self.started.set()
        self.release.wait(60)
        self.events.append("generated")
        self._generating = False
        return super().generate(prompt_ids, seeds, **kw)

    def close(self):
        self.events.append("closed under a running batch" if self._generating else "closed")


def test_close_answers_a_batch_that_overstays_and_never_returns_under_a_running_backend_call(monkeypatch):
    monkeypatch.setattr(endpoint_batching, "CLOSE_WAIT_S", 0.5, raising=False)
    cfg = MasterConfig.model_validate({"policy": {
        "model_name": MODEL, "max_total_sequence_length": 64,
        "generation": {"max_new_tokens": 6, "port_range_low": 27000, "port_range_high": 27999,
                       "http_server": {"batch_window_s": 0.01, "max_wait_s": 30.0}}}})
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    backend = HeldBackend(tok, cfg.policy.generation)
    ep = Endpoint(cfg, backend, tok)
    ep.start()
    answers: list = []

    def ask():
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=60)
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+2="}], top_p=1.0)
            answers.append("answered")
        except openai.APIStatusError as err:
            answers.append((err.status_code, err.body.get("code") if isinstance(err.body, dict) else None))

    def close_then_backend():  # the run's closables: the endpoint first, then the backend
        ep.close()
        backend.events.append("endpoint closed")
        backend.close()

    with ep.serving():
        request = threading.Thread(target=ask)
        request.start()
        assert backend.started.wait(30)
        closing = threading.Thread(target=close_then_backend)
        closing.start()
        request.join(15)
        assert answers == [(503, "shutting_down")], answers  # its client is not left waiting on the close
        time.sleep(0.5)
        assert closing.is_alive() and backend.events == ["generate"]  # close waits for the backend call
        backend.release.set()
        closing.join(30)
    assert not closing.is_alive()
    assert backend.events == ["generate", "generated", "endpoint closed", "closed"]
