"""Math rewards: 1.0 when the completion's final answer is the gold answer, else 0.0. Two verifiers, as NeMo-RL's
``env.math.math_verify_impl`` (``env.math_verify_impl`` here):

- ``hf_math_verify`` (`math_reward`, the default): math-verify; ``verify(parse(gold), parse(completion))``
  compares symbolically (``\\boxed{3/4}`` equals ``0.75``).
- ``dapo_math_verify`` (`dapo_math_reward`): DAPO's verifier (verl's ``math_dapo``): the last ``Answer: ...``
  line of the completion's last 300 characters, normalised, must equal the normalised gold as a string.

math-verify bounds its own parse/verify time with signals (SIGALRM), which only work in a process's
main thread: called from another thread, math-verify 0.9 raises and older versions silently score 0.
So this scorer runs in the main thread of the worker processes of `grpo.tasks.pool`, never in a thread
of the trainer (the async loop's generation thread included).
"""

from __future__ import annotations

import re

from math_verify import parse, verify


def gold_text(answer: str) -> str:
    """The gold answer without a GSM8K-style solution: the text after the last ``####``, if any.

    >>> gold_text("3 apples + 4 apples = 7\\n#### 7")
    '7'
    """
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def parse_gold(answer: str) -> list:
    """Parse a gold answer; without ``$`` delimiters it is read as LaTeX math (``$x+1$``) first, then as is.

    Plain gold strings like ``x+1`` parse to nothing without delimiters; ``42`` parses either way. Last,
    NeMo-RL's own form, ``\\boxed{gold}`` (a gold with an escaped dollar, ``\\$5``, parses only so).
    """
    gold = gold_text(answer)
    candidates = [gold] if "$" in gold else [f"${gold}$", gold]
    candidates.append("\\boxed{" + gold + "}")
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


# -- DAPO's verifier: NeMo-RL's math_verify_impl=dapo_math_verify (nemo_rl/environments/dapo_math_verifier.py) --
DAPO_TAIL_CHARS = 300  # only the completion's end is read (MATH-500's longest answer has 159 characters)
DAPO_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # "Answer: 42" -> "42"; the last one counts
# Applied in this order to both answers. Plain substring edits, so "an " and "a " go wherever they occur.
DAPO_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
DAPO_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}",
                "\\;", ",\\!", "{,}", '"', "\\dots")
DAPO_REWRITES = (  # regex -> replacement, in order (`.` stops at a newline: each line is rewritten alone)
    (r".*?\$(.*?)\$.*", r"$\1$"),  # keep the first $...$ of a line
    (r"\\text\{(.*?)\}", r"\1"),  # \text{x} -> x
    (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"),
    (r"\\boxed\{(.*)\}", r"\1"),  # greedy: up to the line's last "}"
    (r"frac([^{])(.)", r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (r"sqrt([^{])", r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def dapo_normalize(answer: str) -> str:
    r"""DAPO's normal form of a final answer: the text after the last ``=``, units and spaces dropped, ``$``,
    ``\text{}``, ``\boxed{}`` unwrapped, shorthand ``\frac12`` spelled out, thousands commas dropped.

    >>> [dapo_normalize(a) for a in ["x = 1,000", "\\frac12", "$5$ dollars", "\\boxed{10}^\\circ", "a 3\\text{ cm}"]]
    ['1000', '\\frac{1}{2}', '5', '10', '3']
    """
    answer = answer.split("=")[-1]
    for old, new in DAPO_REPLACED:
        answer = answer.replace(old, new)
    for text in DAPO_REMOVED:
        answer = answer.replace(text, "")
    for pattern, replacement in DAPO_REWRITES:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_answer(completion: str) -> str:
    r"""The normalised answer of the completion's last ``Answer:`` line within its last 300 characters, or
    ``"[INVALID]"`` when there is none (DAPO's placeholder, which no real gold equals).

    >>> dapo_answer("so x is 7.\nAnswer: $7$"), dapo_answer("The answer is 7"), dapo_answer("answer : 1\nANSWER:2")
    ('7', '[INVALID]', '2')
    """
    found = DAPO_ANSWER_LINE.findall(completion[-DAPO_TAIL_CHARS:])
    return dapo_normalize(found[-1] if found else "[INVALID]")


def dapo_math_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    r"""1.0 if DAPO's normalised answer line equals the normalised gold answer (string equality), else 0.0.

    Wrong, missing and unparseable answers all score 0.0 (no negative reward); nothing raises.

    >>> dapo_math_reward("q", "... so 2+2=4.\nAnswer: 4", "4", {}), dapo_math_reward("q", "\\boxed{4}", "4", {})
    (1.0, 0.0)
    """
    return float(dapo_answer(completion) == dapo_normalize(answer))
