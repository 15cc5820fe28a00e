"""An LLM judge as an environment (``env.name: judge``, ``env.judge``): each completion is put into a prompt
template, sent to any OpenAI-compatible server (``/v1/chat/completions``, through the official ``openai`` client),
and the judge's answer gives the reward.

    env:
      name: judge
      judge:
        base_url: http://127.0.0.1:8000/v1
        model: my-judge
        prompt_template: "Question: {question}\\nAnswer: {completion}\\nReference: {answer}\\nGive 'Score: <0-10>'."
        score_pattern: "Score:\\\\s*(-?[0-9.]+)"     # the last match's group 1 is the score
        max_score: 10                             # reward = score / max_score

The judge is outside the policy, so what goes wrong there is a failure of the sample, never a score
(`grpo.tasks.failures`; NeMo-Gym's judges turn their errors into reward 0, the bias this avoids): a request past
``timeout_s`` (``env_timeout``, infra), no connection (``connection``, infra), an HTTP error (``http_5xx`` /
``http_429`` / ``http_408``: infra; another 4xx: data), an answer with no score in it, or a score that is no reward
(NaN, or so large that float32 makes it inf: `grpo.tasks.failures.reward_problem`) (``env_malformed``, data): only
that sample fails.
The router retries them within ``grpo.rollout_failure``'s budgets, then the sample is masked and counted. The
client itself does not retry (``max_retries=0``): the budgets are the router's. Requests run ``max_concurrency`` at
a time; the API key is read from the environment variable ``api_key_env`` (never written into the config).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from grpo.tasks.failures import Failure, classify_exception, http_reason, http_status, reward_problem
from grpo.tasks.interface import Environment, EnvironmentReturn


def parse_score(text: str, pattern: str) -> float | None:
    """Group 1 of the last match of ``pattern`` in the judge's answer, as a number; None without one.

        >>> parse_score("ok. Score: 3\\nno wait, Score: 8", r"Score:\\s*(-?[0-9.]+)"), parse_score("fine", r"Score:(\\d)")
        (8.0, None)
    """
    found = re.findall(pattern, text or "")
    if not found:
        return None
    last = found[-1][0] if isinstance(found[-1], tuple) else found[-1]
    try:
        return float(last)
    except ValueError:
        return None


def request_failure(err: BaseException) -> Failure:
    """The `Failure` of a request that raised: a timeout, no connection, an HTTP status, anything else by its class.

        >>> request_failure(TimeoutError("slow")).reason, request_failure(ConnectionRefusedError()).reason
        ('env_timeout', 'connection')
    """
    names = {c.__name__ for c in type(err).__mro__}
    detail = f"{type(err).__name__}: {err}"
    if names & {"APITimeoutError", "TimeoutError", "ReadTimeout", "ConnectTimeout"}:
        return Failure.of("env_timeout", detail)
    status = http_status(err)
    if status is not None:
        return Failure.of(http_reason(status), detail)
    if names & {"APIConnectionError", "ConnectionError", "ConnectError"}:
        return Failure.of("connection", detail)
    return Failure.of("env_error", detail, classify_exception(err))


class JudgeEnvironment(Environment):
    """One turn: each conversation's last assistant message judged; every sample terminated."""

    reward_kind = "scalar"

    def __init__(self, cfg):
        from openai import OpenAI

        self.cfg = cfg
        api_key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        self.client = OpenAI(base_url=cfg.base_url, api_key=api_key or "none", timeout=cfg.timeout_s, max_retries=0)
        self.pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="judge")

    def judge_one(self, question: str, completion: str, answer: str) -> tuple[float, Failure | None]:
        """(reward, None), or (0.0 placeholder, the `Failure`)."""
        prompt = self.cfg.prompt_template.format(question=question, completion=completion, answer=answer)
        try:
            reply = self.client.chat.completions.create(
                model=self.cfg.model, messages=[{"role": "user", "content": prompt}],
                temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens)
            text = reply.choices[0].message.content
        except Exception as err:  # noqa: BLE001 - every transport and server error becomes a Failure
            return 0.0, request_failure(err)
        score = parse_score(text, self.cfg.score_pattern)
        if score is None:
            return 0.0, Failure.of("env_malformed", f"the judge's answer has no score ({self.cfg.score_pattern!r}): "
                                   f"{(text or '')[:500]!r}")
        problem = reward_problem(score / self.cfg.max_score, f"the judge's score {score:g} / max_score "
                                                            f"{self.cfg.max_score:g}")
        if problem is not None:  # "Score: nan", or 400 digits: this sample fails, the others keep their scores
            return 0.0, Failure.of("env_malformed", f"{problem}; the judge's answer: {(text or '')[:500]!r}")
        return score / self.cfg.max_score, None

    def step(self, message_logs: list, metadata: list) -> EnvironmentReturn:
        import torch

        completions = [next((m["content"] for m in reversed(log) if m["role"] == "assistant"), "")
                       for log in message_logs]
        jobs = [self.pool.submit(self.judge_one, str((md or {}).get("question", "")), c, str((md or {}).get("answer", "")))
                for c, md in zip(completions, metadata)]
        results = [j.result() for j in jobs]
        n = len(message_logs)
        return EnvironmentReturn(observations=[{"role": "user", "content": ""}] * n, metadata=[None] * n,
                                 next_stop_strings=[None] * n, rewards=torch.tensor([r for r, _ in results]),
                                 terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n,
                                 failures=[f for _, f in results])

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
