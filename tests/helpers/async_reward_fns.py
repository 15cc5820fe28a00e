"""Reward functions for tests/e2e/test_train_async_grpo.py (env.reward_fn="tests.helpers.async_reward_fns:<name>")."""

import os
import random
import re
import signal
import time


def random_delay_arithmetic(question: str, completion: str, answer: str, meta: dict) -> float:
    """The arithmetic reward, slow for some prompts: samples whose answer is a multiple of 5 sleep a
    random 0-0.3 s, the others answer at once. Some prompt batches are scored in milliseconds, others
    in seconds: the generation thread sometimes runs ahead to the staleness bound and sometimes the
    trainer waits for it."""
    if int(answer) % 5 == 0:
        time.sleep(random.uniform(0.0, 0.3))
    m = re.search(r"-?\d+", completion)
    return float(m is not None and m.group() == answer)


_scored = 0  # samples this worker process scored


def slow_arithmetic(question: str, completion: str, answer: str, meta: dict) -> float:
    """The arithmetic reward after a fixed 0.05 s per sample: with one reward worker (env.num_workers=1) a prompt
    batch of 16 samples is scored in >= 0.8 s, far longer than a tiny training step, so the next step's batch is
    still being generated when the trainer checkpoints (the resume tests' batch in flight).

    With ``GRPO_TEST_SIGNAL=<name>:<n>`` in the environment, scoring the n-th sample (1-based: sample 1 is the first
    of prompt batch 1, 33 the first of batch 3 with 16 samples a batch) sends the signal ``<name>`` (SIGTERM,
    SIGKILL) to the trainer process (this worker's parent): a stop or a kill at a known point of the run."""
    global _scored
    time.sleep(0.05)
    _scored += 1
    spec = os.environ.get("GRPO_TEST_SIGNAL")
    if spec and _scored == int(spec.split(":")[1]):
        os.kill(os.getppid(), getattr(signal, spec.split(":")[0]))
    m = re.search(r"-?\d+", completion)
    return float(m is not None and m.group() == answer)
