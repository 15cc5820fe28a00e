"""The endpoint's generation windows and weight versions as the async loop uses them (issue 32), on loopback with the
official ``openai`` client: a weight change waits for the batch in flight and an answer records the version its batch
started with; windows of two threads overlap; a run that ends while a batch generates answers it, and what comes
after gets OpenAI's 503, never a bare 500 or a hang."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import openai
import pytest

from grpo.config import MasterConfig
from grpo.wings.agents.endpoint import Endpoint
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer
from tests.helpers.scripted_backend import ScriptedBackend

MODEL = "toy:tiny"
USER = [{"role": "user", "content": "1+2="}]


class SlowBackend(ScriptedBackend):
    """Writes "3"; each generate call takes ``delay_s`` and sets ``started`` when it begins."""

    def __init__(self, tokenizer, gen_cfg, delay_s: float):
        super().__init__(tokenizer, gen_cfg, ["3"])
        self.delay_s, self.started = delay_s, threading.Event()

    def generate(self, prompt_ids, seeds, **kw):
        self.started.set()
        time.sleep(self.delay_s)
        return super().generate(prompt_ids, seeds, **kw)


def _endpoint(delay_s: float) -> Endpoint:
    cfg = MasterConfig.model_validate({"policy": {
        "model_name": MODEL, "max_total_sequence_length": 64,
        "generation": {"max_new_tokens": 6, "port_range_low": 25000, "port_range_high": 25999,
                       "http_server": {"batch_window_s": 0.01, "max_wait_s": 5.0}}}})
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    ep = Endpoint(cfg, SlowBackend(tok, cfg.policy.generation, delay_s), tok)
    ep.start()
    return ep


def _ask(ep: Endpoint):
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=30)
    return client.chat.completions.create(model=MODEL, messages=USER, top_p=1.0)


@pytest.fixture
def slow():
    ep = _endpoint(delay_s=1.0)
    yield ep
    ep.close()


def test_a_weight_change_waits_for_the_batch_in_flight_which_keeps_its_version(slow):
    with slow.serving(weight_version=3), concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_ask, slow)
        assert slow.backend.started.wait(10)
        t0 = time.monotonic()
        assert slow.load_weights(lambda: 4) == 4  # the generation thread's load: after the batch, never during it
        waited = time.monotonic() - t0
        assert first.result(30).model_extra["weight_version"] == 3 and waited > 0.3
        assert _ask(slow).model_extra["weight_version"] == 4


def test_overlapping_windows_keep_the_endpoint_open_until_the_last_closes(slow):
    slow.backend.delay_s = 0.0
    outer_done = threading.Event()
    with slow.serving(weight_version=1):
        def inner():  # the trainer's validation window, in another thread, with no version of its own
            with slow.serving():
                pass
            outer_done.set()

        threading.Thread(target=inner).start()
        assert outer_done.wait(10)
        assert _ask(slow).model_extra["weight_version"] == 1  # still open, still labelled by the thread's version


def test_a_run_that_ends_answers_the_batch_in_flight_and_refuses_the_rest_with_503():
    ep = _endpoint(delay_s=2.0)  # longer than the server's graceful shutdown
    results = []

    def ask():
        try:
            results.append(("answered", _ask(ep).choices[0].message.content))
        except openai.APIStatusError as err:
            results.append((err.status_code, err.body if isinstance(err.body, dict) else err.response.text))
        except openai.APIConnectionError:
            results.append(("gone",))

    with ep.serving():
        first = threading.Thread(target=ask)
        first.start()
        assert ep.backend.started.wait(10)
        closing = threading.Thread(target=ep.close)
        closing.start()
        time.sleep(0.3)
        later = threading.Thread(target=ask)  # sent while the run shuts its endpoint down
        later.start()
        for t in (first, later, closing):
            t.join(30)
            assert not t.is_alive()
    assert results[0] == ("answered", "3") or ("answered", "3") in results, results
    for r in results:
        assert r[0] in ("answered", "gone") or (r[0] == 503 and r[1]["code"] == "shutting_down"), results
