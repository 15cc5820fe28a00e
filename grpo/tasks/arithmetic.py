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


def make_demo_model(out_dir: str, max_operand: int = 9, p_correct: float = 0.15, steps: int = 800, seed: int = 0,
                    log_every: int = 0) -> str:
    """Build the CPU demo's starting policy: the "small" model, supervised on sums with a systematic slip.

    The model is trained on prompts ``"{a}+{b}="`` (a, b in [0, max_operand]) with the target ``"{a+b}<eos>"``
    drawn with probability ``p_correct`` and ``"{a+b+1}<eos>"`` (one too many) otherwise. It learns the task's
    format and one habit shared by every prompt: sampled at temperature 1 it scores about ``p_correct``, and
    GRPO has one behaviour to unlearn, which each step's groups show side by side (right and off by one).

    Why a systematic slip: near misses spread over several wrong answers per prompt (``a+b+d``, d in
    {-3..3} \\ {0}: the demo until issue 35) leave GRPO a per-prompt sharpening of 100 prompts, which a
    0.4M-parameter model learns slowly (about +0.1 validation reward in 100 steps) and a larger learning rate
    turns into a collapse onto the answers' shared first digit; one shared slip is unlearned in tens of steps
    (+0.3 or more in 100 steps at seeds 0, 1, 2: scripts/measure_demos.py, docs/measurements.md). 800 supervised steps,
    not 400: the sums themselves must be known precisely, or GRPO trades the +1 slip for -1 and +-2 errors (seed 1
    stopped at 0.45 with 400). Deterministic for a given seed and thread count.
    """
    import random

    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model, save_char_tokenizer, supervise

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, size="small", seed=seed)
    rng = random.Random(seed)
    eos = tok.eos_token_id

    def sample_row() -> tuple[list[int], list[int]]:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        ans = a + b if rng.random() < p_correct else a + b + 1
        prompt = tok(f"{a}+{b}=")["input_ids"]
        target = tok(str(ans), add_special_tokens=False)["input_ids"] + [eos]
        return prompt + target, [-100] * len(prompt) + target

    supervise(model, tok.pad_token_id, sample_row, steps, batch_size=64, log_every=log_every, name="demo model")
    model.save_pretrained(out_dir, safe_serialization=True)
    save_char_tokenizer(tok, out_dir)
    return out_dir
