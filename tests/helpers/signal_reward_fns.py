"""A reward function that signals the trainer in the middle of a rollout (issue 25's stop tests).

``GRPO_TEST_SIGNAL`` (a signal name) is sent to the trainer at the ``GRPO_TEST_SIGNAL_AT``-th call, counted
across the reward workers in the file ``GRPO_TEST_COUNTER``; without them it is the plain arithmetic reward.
"""

import fcntl
import multiprocessing
import os
import re
import signal


def arithmetic_then_signal(question: str, completion: str, answer: str, meta: dict) -> float:
    if os.environ.get("GRPO_TEST_SIGNAL"):
        with open(os.environ["GRPO_TEST_COUNTER"], "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            calls = len(f.read()) + 1
            f.write(".")
        if calls == int(os.environ["GRPO_TEST_SIGNAL_AT"]):
            trainer = os.getppid() if multiprocessing.parent_process() is not None else os.getpid()
            os.kill(trainer, getattr(signal, os.environ["GRPO_TEST_SIGNAL"]))
    m = re.search(r"-?\d+", completion)
    return float(m is not None and m.group() == answer)
