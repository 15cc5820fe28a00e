"""An outside client of a run's endpoint (issue 32): a real training process on loopback with
``policy.generation.vllm_cfg.expose_http_server``, sent chat requests one after another with the official ``openai``
client for as long as it runs; used by the endpoint's e2e tests of both loops."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openai

from tests.helpers.e2e import REPO, TINY, child_env, paths


def ask_while_it_runs(script: str, tmp: Path, *overrides: str, max_wait_s: float,
                      stop_when: Callable[[list[tuple]], bool] | None = None) -> tuple[list[tuple], str, int]:
    """Run ``script`` on tests/configs/tiny.yaml with the endpoint on (``http_server.max_wait_s`` = ``max_wait_s``)
    and ``overrides``; ask it "1+2=" until it exits. Returns ``(results, output, exit status)``; a result is
    ``("answered", seconds, weight_version)``, ``(status, seconds, retry_after, body)`` or ``("gone", seconds)``.

    ``stop_when(results)``: once true, SIGTERM the run (it finishes its step, saves and exits 143) and go on asking
    until it is gone. A run of many steps stopped so lasts as long as the client needs on any machine; one of a few
    steps can end before the client's first request on a fast one (8 steps of the tiny model take 0.7 s)."""
    template = tmp / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cmd = [sys.executable, script, "--config", TINY, *paths(
        tmp, *overrides, "policy.generation.vllm_cfg.expose_http_server=true",
        f"policy.generation.vllm_cfg.http_server_serving_chat_kwargs.chat_template={template}",
        f"policy.generation.http_server.max_wait_s={max_wait_s}")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    info_path, results = tmp / "logs" / "endpoint.json", []
    try:
        deadline = time.monotonic() + 600
        while not info_path.exists() or not info_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        time.sleep(0.2)
        info = json.loads(info_path.read_text())
        client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0, timeout=60)
        deadline, stopped = time.monotonic() + 600, False
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not end within 600 s"
            if stop_when is not None and not stopped and stop_when(results):
                proc.send_signal(signal.SIGTERM)
                stopped = True
            t0 = time.monotonic()
            try:
                r = client.chat.completions.create(model=info["model"], messages=[{"role": "user", "content": "1+2="}],
                                                   temperature=1.0, top_p=1.0, max_tokens=3)
                results.append(("answered", time.monotonic() - t0, r.model_extra["weight_version"]))
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
    return results, out, proc.returncode


def check_answered_or_refused(results: list[tuple], max_wait_s: float, steps: int) -> None:
    """Some requests answered, by weights of versions that never go back and never pass the ``steps`` trained; every
    other one a 503 with OpenAI's error body (a paused one after the bounded wait, with Retry-After), or refused once
    the run is gone; none anything else."""
    versions = [r[2] for r in results if r[0] == "answered"]
    assert versions and versions == sorted(versions) and 0 <= versions[0] and versions[-1] <= steps, results
    assert not [r for r in results if r[0] not in ("answered", 503, "gone")], results
    for _, waited, retry_after, body in [r for r in results if r[0] == 503]:
        assert body["type"] == "server_error" and body["code"] in ("generation_paused", "shutting_down"), body
        if body["code"] == "generation_paused":  # bounded: the wait, plus a loaded machine's slack
            assert max_wait_s <= waited < max_wait_s + 10 and int(retry_after) >= 1


def versions_answered(results: list[tuple]) -> int:
    """How many weight versions answered (the run has trained while the client asked)."""
    return len({r[2] for r in results if r[0] == "answered"})


def paused(results: list[tuple]) -> list[tuple]:
    """The 503s of requests that waited out ``http_server.max_wait_s`` outside every generation window."""
    return [r for r in results if r[0] == 503 and r[3]["code"] == "generation_paused"]
