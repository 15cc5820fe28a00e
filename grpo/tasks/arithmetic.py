"""The built-in arithmetic task (the CPU demo): sums ``"a+b="`` -> ``"a+b"``, a regex reward, a demo model.

- `rows`: the procedural rows (``data.arithmetic_max_operand`` bounds the operands);
- `arithmetic_reward`: the first integer of the completion equals the answer; pure and fast (a regex), so it
  runs in the trainer process, with no worker pool;
- `make_demo_model`: the demo's starting policy (``toy:demo``).
"""

from __future__ import annotations

import random
import re

from grpo.tasks.rows import Row, split_seed

FIRST_INTEGER = re.compile(r"-?\d+")


def arithmetic_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    """1.0 if the first integer in ``completion`` equals ``int(answer)``, else 0.0.

    >>> arithmetic_reward("3+4=", "7 and then 8", "7", {})
    1.0
    >>> arithmetic_reward("3+4=", "it is 8, no 7", "7", {})
    0.0
    """
    match = FIRST_INTEGER.search(completion)
    return float(match is not None and int(match.group()) == int(answer))


def arithmetic_rows(n: int, max_operand: int, seed: int, split: str) -> list[Row]:
    """``n`` rows ``"a+b="`` -> ``"a+b"`` with a, b uniform in [0, max_operand], deterministic in seed."""
    rng = random.Random(split_seed(seed, split))
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b), "source": f"arithmetic/{split}:{i}", "meta": {}})
    return rows


def rows(name: str, data_cfg, n: int, seed: int, split: str) -> list[Row]:
    """The task's rows for ``data.dataset_name=arithmetic`` (`grpo.tasks.catalogue`)."""
    return arithmetic_rows(n, data_cfg.arithmetic_max_operand, seed, split)


def demo_targets(max_operand: int, p_correct: float) -> list[tuple[str, str, float]]:
    """The demo model's target distribution: every prompt ``"{a}+{b}="`` (a, b in [0, max_operand]) with its right
    sum at weight ``p_correct`` and the slip ``a+b+1`` at ``1 - p_correct``.

    >>> demo_targets(1, 0.15)[:2]
    [('0+0=', '0', 0.15), ('0+0=', '1', 0.85)]
    """
    return [(f"{a}+{b}=", str(a + b + slip), 1 - p_correct if slip else p_correct)
            for a in range(max_operand + 1) for b in range(max_operand + 1) for slip in (0, 1)]


def make_demo_model(out_dir: str, max_operand: int = 9, p_correct: float = 0.15, steps: int = 600, seed: int = 0,
                    log_every: int = 0) -> str:
    """Build the CPU demo's starting policy: the "small" model, fitted to sums with a systematic slip.

    The model is fitted (`grpo.tasks.toy.fit_exact`: the whole distribution every step, the learning rate decayed to
    0) to `demo_targets`: on every prompt ``"{a}+{b}="`` it writes the right sum with probability ``p_correct`` and
    ``a+b+1`` (one too many) otherwise, and nothing else (measured: 0.14-0.16 on each of the 100 prompts, under 0.5%
    on other answers). Sampled at temperature 1 it scores ``p_correct``, and GRPO has one behaviour to unlearn, which
    each step's groups show side by side (right and off by one).

    Why a systematic slip: near misses spread over several wrong answers per prompt (``a+b+d``, d in {-3..3} \\ {0}:
    the demo until issue 35) leave GRPO a per-prompt sharpening of 100 prompts, which a 0.4M-parameter model learns
    slowly; one shared slip is unlearned in tens of steps. Why an exact fit (issue 44): the model sampled 800 noisy
    batches at a constant learning rate until then, and ended wherever the last steps left it (the right sum at
    0.02 to 0.75 depending on the prompt), a state float rounding moved: the demo rose +0.44 to +0.73 on one CPU and
    +0.13 to +0.27 on another. The fitted model is the same function on every machine measured, and GRPO at a small
    learning rate (configs/cpu_demo.yaml) takes it from 0.15 to above 0.9 at every seed (docs/measurements.md).
    About 30 CPU-seconds.
    """
    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model, fit_exact, save_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, size="small", seed=seed)
    rows = []
    for question, answer, weight in demo_targets(max_operand, p_correct):
        prompt = tok(question)["input_ids"]
        target = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((prompt + target, [-100] * len(prompt) + target, weight))
    fit_exact(model, tok.pad_token_id, rows, steps, log_every=log_every, name="demo model")
    model.save_pretrained(out_dir, safe_serialization=True)
    save_char_tokenizer(tok, out_dir)
    return out_dir
