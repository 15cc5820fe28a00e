"""Reward functions for tests/e2e/test_train_async_grpo.py (env.reward_fn="tests.helpers.async_reward_fns:<name>")."""

import random
import re
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
