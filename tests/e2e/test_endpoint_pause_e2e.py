"""An expose_http_server run without an agent environment (issue 32): outside requests sent with the official
``openai`` client to a real train_grpo.py process on loopback, all through its life, never hang. Those that find a
generation window (a rollout) are answered; those sent while it trains or checkpoints wait at most
http_server.max_wait_s and get a 503 with OpenAI's error body and Retry-After (slow: a real run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest

from tests.helpers.e2e import REPO, TINY, child_env, paths

MAX_WAIT_S = 0.5


@pytest.mark.slow
def test_outside_requests_are_answered_or_refused_never_left_hanging(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cmd = [sys.executable, "train_grpo.py", "--config", TINY, *paths(
        tmp_path, "grpo.max_num_steps=8", "checkpointing.save_period=1", "policy.generation.vllm_cfg.expose_http_server=true",
        f"policy.generation.vllm_cfg.http_server_serving_chat_kwargs.chat_template={template}",
        f"policy.generation.http_server.max_wait_s={MAX_WAIT_S}")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    info_path, results = tmp_path / "logs" / "endpoint.json", []
    try:
        deadline = time.monotonic() + 600
        while not info_path.exists() or not info_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        time.sleep(0.2)
        info = json.loads(info_path.read_text())
        client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0, timeout=60)
        while proc.poll() is None:
            t0 = time.monotonic()
            try:
                r = client.chat.completions.create(model=info["model"], messages=[{"role": "user", "content": "1+2="}],
                                                   temperature=1.0, top_p=1.0, max_tokens=3)
                results.append(("answered", time.monotonic() - t0, r.choices[0].finish_reason))
            except openai.APIStatusError as err:
                results.append((err.status_code, time.monotonic() - t0, err.response.headers.get("retry-after"),
                                err.body))
            except openai.APIConnectionError:  # the run has ended and its server with it
                results.append(("gone", time.monotonic() - t0))
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == 0, out[-4000:]
    answered = [r for r in results if r[0] == "answered"]
    refused = [r for r in results if r[0] == 503]
    assert answered, results
    assert not [r for r in results if r[0] not in ("answered", 503, "gone")], results
    assert [r for r in refused if r[3]["code"] == "generation_paused"], results
    for _, waited, retry_after, body in refused:
        assert body["type"] == "server_error" and body["code"] in ("generation_paused", "shutting_down"), body
        if body["code"] == "generation_paused":  # bounded: the wait, plus a loaded machine's slack
            assert MAX_WAIT_S <= waited < MAX_WAIT_S + 10 and int(retry_after) >= 1
