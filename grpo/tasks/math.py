"""Math reward with math-verify: 1.0 when the completion's final answer is equivalent to the gold answer.

``verify(parse(gold), parse(completion))`` compares symbolically (``\\boxed{3/4}`` equals ``0.75``).
math-verify bounds its own parse/verify time with signals (SIGALRM), which only work in a process's
main thread: called from another thread, math-verify 0.9 raises and older versions silently score 0.
So this scorer runs in the main thread of the worker processes of `grpo.tasks.pool`, never in a thread
of the trainer (the async loop's generation thread included).
"""

from __future__ import annotations

from math_verify import parse, verify


def gold_text(answer: str) -> str:
    """The gold answer without a GSM8K-style solution: the text after the last ``####``, if any.

    >>> gold_text("3 apples + 4 apples = 7\\n#### 7")
    '7'
    """
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def parse_gold(answer: str) -> list:
    """Parse a gold answer; without ``$`` delimiters it is read as LaTeX math (``$x+1$``) first, then as is.

    Plain gold strings like ``x+1`` parse to nothing without delimiters; ``42`` parses either way.
    """
    gold = gold_text(answer)
    candidates = [gold] if "$" in gold else [f"${gold}$", gold]
    for text in candidates:
        parsed = parse(text)
        if parsed:
            return parsed
    return []


def math_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    """1.0 if math-verify finds the completion's answer equivalent to the gold answer, else 0.0.

    A gold answer math-verify cannot parse raises (the sample is counted as an error, not as wrong).
    """
    gold = parse_gold(answer)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
    return float(verify(gold, parse(completion)))
