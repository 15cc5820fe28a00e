"""The reward-model demo's reward model (``toy:demo_rm``, configs/cpu_demo_reward_model.yaml): a tiny sequence
classifier, fitted locally on first use (no download, about a minute on a loaded 2-core machine), that prefers a
correct sum.

The policy is the default demo's (``toy:demo``: it writes ``a+b+1`` for 85% of its sums) and the reward model is the
only thing that scores it: a ``LlamaForSequenceClassification`` (``num_labels=1``) whose body starts as the demo
policy's (which knows the sums: fitted from a random body, a classifier of this size had not learnt to check them
after 2000 steps) with a new one-output head, regressed (mean squared error) onto 1 for a conversation
``"<bos>{a}+{b}={a+b}<eos>"`` and 0 for a wrong answer, over operands 0..4 (the demo's
``data.arithmetic_max_operand``: 25 questions). Its head logit is therefore near the arithmetic reward (1 right, 0
wrong): the demo's validation reward is the reward model's own score, on the scale of the default demo's accuracy,
and it rises as GRPO unlearns the slip.

The conversation is what the reward-model wing's `render_conversation` (grpo/wings/reward_model/environment.py)
makes of the demo's chat (user ``"3+4="``,
assistant ``"7"``) with this model's chat template, which concatenates the messages' contents: ``<bos>3+4=7<eos>``
(BOS in front, EOS appended, as NeMo-RL renders for its reward model). Deterministic for a given seed and thread
count.
"""

from __future__ import annotations

import random

# The reward model's chat template: the messages' contents, one after the other (no roles: the demo has one prompt
# and one answer, as "3+4=" and "7").
CONTENT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def demo_rm_example(rng: random.Random, max_operand: int) -> tuple[str, float]:
    """One fitting example: ``("{a}+{b}={c}", target)``, target 1.0 when ``c == a+b``: half right, a third the demo
    policy's slip ``a+b+1``, the rest near misses ``a+b+d`` (``d`` in -2, -1, 2, 3) or random numbers of one or two
    digits.

        >>> rng = random.Random(3)
        >>> [demo_rm_example(rng, 4) for _ in range(4)]
        [('1+4=6', 0.0), ('2+4=6', 1.0), ('4+0=5', 0.0), ('3+2=6', 0.0)]
    """
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    u = rng.random()
    if u < 0.5:
        c = a + b
    elif u < 0.83:
        c = a + b + 1
    elif u < 0.93:
        c = max(0, a + b + rng.choice([-2, -1, 2, 3]))
    else:
        c = rng.randint(0, 10 ** rng.randint(1, 2) - 1)
    return f"{a}+{b}={c}", float(c == a + b)


def make_demo_reward_model(out_dir: str, max_operand: int = 4, steps: int = 600, batch_size: int = 64,
                           seed: int = 0, lr: float = 2e-3, log_every: int = 0) -> str:
    """Fit and save the demo's reward model (module docstring) into ``out_dir``, with its tokenizer (chat template
    `CONTENT_TEMPLATE`); returns ``out_dir``. AdamW (cosine from ``lr``), right-padded batches, the head read at
    each row's last token (transformers' pooling: the rows have no pad token inside)."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo.tasks.catalogue import resolve_model_name
    from grpo.tasks.toy import build_char_tokenizer, save_char_tokenizer

    tok = build_char_tokenizer(CONTENT_TEMPLATE)
    base = resolve_model_name("toy:demo")  # the demo policy's body knows the sums: a head over it learns fast
    config = LlamaConfig.from_pretrained(base, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # not the load report's expected "lm_head unused, score new"
    try:
        model = LlamaForSequenceClassification.from_pretrained(base, config=config, dtype=torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 5x faster than two threads on a shared 2-core machine (the run's setting, restored)
    try:
        _fit(model, tok, random.Random(seed), max_operand, steps, batch_size, lr, log_every)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_char_tokenizer(tok, out_dir)
    return out_dir


def _fit(model, tok, rng: random.Random, max_operand: int, steps: int, batch_size: int, lr: float,
         log_every: int) -> None:
    """`make_demo_reward_model`'s regression: ``steps`` AdamW steps on batches of `demo_rm_example`."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    for step in range(steps):
        rows = [demo_rm_example(rng, max_operand) for _ in range(batch_size)]
        ids = [tok(text)["input_ids"] + [tok.eos_token_id] for text, _ in rows]  # <bos> ... <eos>, as rendered
        width = max(len(x) for x in ids)
        ids_bt = torch.full((batch_size, width), tok.pad_token_id)
        mask_bt = torch.zeros((batch_size, width), dtype=torch.long)
        for i, x in enumerate(ids):
            ids_bt[i, : len(x)], mask_bt[i, : len(x)] = torch.tensor(x), 1
        targets_b = torch.tensor([t for _, t in rows])
        scores_b = model(input_ids=ids_bt, attention_mask=mask_bt).logits[:, 0]
        loss = torch.nn.functional.mse_loss(scores_b, targets_b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if log_every and step % log_every == 0:
            print(f"demo reward model step {step} mse {loss.item():.4f}", flush=True)
    model.eval()
