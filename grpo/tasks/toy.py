"""Tiny local models and tokenizers: what the CPU demo, the tests and the benchmarks run on.

Nothing here downloads anything. The tokenizer is character level (a `tokenizers` BPE with an explicit
vocabulary and no merges, wrapped in `PreTrainedTokenizerFast`), so any text over its alphabet round
trips exactly; the model is a random-init `LlamaForCausalLM` built from a config (Llama rather than Qwen2: for
model_type qwen2, transformers 5 `AutoTokenizer` replaces a custom tokenizer by Qwen2Tokenizer).

    >>> tok = build_char_tokenizer()
    >>> tok("1+2=")["input_ids"]          # <bos> then one id per character
    [1, 4, 13, 5, 16]
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
CHARS = (
    list(string.digits)
    + ["+", "-", "*", "=", " "]
    + list(string.ascii_lowercase)
    + list(string.ascii_uppercase)
    + list(".,?!:;'\"()[]/_<>{}\n")
)

# A minimal chat template for tests of the chat-template path (system/user/assistant turns as plain text).
SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

MODEL_SIZES = {
    # ~0.1M parameters: unit tests.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
    # ~0.4M parameters: the CPU demo.
    "small": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256),
}


def build_char_tokenizer(chat_template: str | None = None):
    """Character-level `PreTrainedTokenizerFast`: ids 0/1/2 = <pad>/<bos>/<eos>, then one id per char.

    Every encoding starts with <bos>; <eos> is never added (the model must generate it); padding is on
    the left (generation); characters outside the vocabulary are dropped.
    """
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
        truncation_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        hf_tok.chat_template = chat_template
    return hf_tok


def build_tiny_model(tokenizer, size: str = "tiny", seed: int = 0, max_position_embeddings: int = 512):
    """Random-init fp32 `LlamaForCausalLM` over `tokenizer`'s vocabulary (sizes in MODEL_SIZES)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        **MODEL_SIZES[size],
    )
    cfg.dtype = torch.float32
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model


def save_tiny_model(out_dir: str, size: str = "tiny", seed: int = 0, chat_template: str | None = None) -> str:
    """Build and save a tokenizer + random model into `out_dir` (loadable with `from_pretrained`)."""
    tok = build_char_tokenizer(chat_template)
    model = build_tiny_model(tok, size=size, seed=seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_char_tokenizer(tok, out_dir)
    return out_dir


def save_char_tokenizer(tok, out_dir: str) -> None:
    """`save_pretrained`, then name the generic class so `AutoTokenizer` does not swap in the model's own."""
    import json
    import os

    tok.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)


def right_padded(rows, pad_id: int):
    """Rows ``(ids, labels, ...)`` -> right-padded ``(ids_bt, labels_bt, attention_bt)``: ``pad_id`` and label -100
    on the padding (what `supervise` and `fit_exact` train on; a row's further fields are ignored here)."""
    import torch

    width = max(len(row[0]) for row in rows)
    ids_bt = torch.full((len(rows), width), pad_id)
    labels_bt = torch.full((len(rows), width), -100)
    attention_bt = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, labels, *_) in enumerate(rows):
        ids_bt[i, : len(ids)], labels_bt[i, : len(ids)] = torch.tensor(ids), torch.tensor(labels)
        attention_bt[i, : len(ids)] = 1
    return ids_bt, labels_bt, attention_bt


def supervise(model, pad_id: int, make_row, steps: int, batch_size: int, log_every: int = 0,
              name: str = "toy model") -> None:
    """Supervised next-token training of a toy model: ``steps`` AdamW steps (lr 3e-3) on batches of
    ``make_row() -> (ids, labels)`` (labels -100 where a token is not trained), right-padded. A vision-language model's
    rows are ``(ids, labels, pixel_values)``: the batch's images go with it, row by row. Leaves the
    model in eval mode. Deterministic for a given ``make_row`` and thread count."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        rows = [make_row() for _ in range(batch_size)]
        ids_bt, labels_bt, attention_bt = right_padded(rows, pad_id)
        images = {"pixel_values": torch.cat([r[2] for r in rows])} if len(rows[0]) > 2 else {}
        loss = model(input_ids=ids_bt, attention_mask=attention_bt, labels=labels_bt, **images).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log_every and step % log_every == 0:
            print(f"{name} sft step {step} loss {loss.item():.3f}", flush=True)
    model.eval()


def fit_exact(model, pad_id: int, rows: list[tuple[list[int], list[int], float]], steps: int, lr: float = 3e-3,
              warmup_steps: int = 50, log_every: int = 0, name: str = "toy model") -> float:
    """Fit a toy model to an exact target distribution: every step is the same full batch of ``rows``
    ``(ids, labels, weight)`` (labels -100 where a token is not trained), the loss the weighted sum of each row's
    next-token negative log-likelihood over the sum of the weights; AdamW, ``warmup_steps`` of linear warmup, then
    a cosine decay to 0 at ``steps``, one torch thread (the caller's count restored). Returns the last loss.

    Why not `supervise`: targets sampled each step and a constant learning rate leave the model wherever the last
    noisy steps put it, a state that float rounding (the CPU, the thread count, the library versions) moves, and the
    demos learned from one machine's state and not from another's. A deterministic full batch and a decay to 0
    converge to the loss's minimiser: each prompt's answers at their weights, the same function on any machine up to
    small differences. Leaves the model in eval mode."""
    import math

    import torch

    ids_bt, labels_bt, attention_bt = right_padded(rows, pad_id)
    weights_b = torch.tensor([w for _, _, w in rows], dtype=torch.float32)
    weights_b = weights_b / weights_b.sum()

    def lr_factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * step / steps))

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for step in range(steps):
            logits_btv = model(input_ids=ids_bt, attention_mask=attention_bt).logits[:, :-1]
            nll_bt = torch.nn.functional.cross_entropy(logits_btv.transpose(1, 2), labels_bt[:, 1:], ignore_index=-100,
                                                       reduction="none")
            loss = (nll_bt.sum(dim=1) * weights_b).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            if log_every and step % log_every == 0:
                print(f"{name} fit step {step} loss {loss.item():.4f}", flush=True)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return loss.item()


def build_into(out: str, builder) -> None:
    """``builder(tmp)`` into ``<out>.tmp<PID>-<host>``, then renamed to ``out``: a reader never sees half a model.
    The temporary directory is removed if the build fails, is interrupted (Ctrl-C) or gets SIGTERM (the process
    then dies of the signal, as it would have); ones left by dead processes (kill -9) are removed first."""
    import os
    import shutil
    import signal
    import socket
    import threading

    remove_stale_builds(out)
    tmp = f"{out}.tmp{os.getpid()}-{socket.gethostname()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    handle = previous is not None  # Python can set handlers (main thread; None: one set outside Python)

    def on_sigterm(signum, frame):
        if previous == signal.SIG_DFL:  # die of the signal, as without this handler, minus the mess
            shutil.rmtree(tmp, ignore_errors=True)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif callable(previous):
            previous(signum, frame)

    if handle:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        builder(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        if handle:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_builds(out: str) -> list[str]:
    """Remove the ``<out>.tmp<PID>[-<host>]`` directories of builds whose process is gone (killed before they
    could clean up); a build of a live process, or of another host, stays. Returns the removed paths."""
    import glob
    import os
    import re
    import shutil
    import socket

    removed = []
    for path in glob.glob(glob.escape(out) + ".tmp*"):
        m = re.fullmatch(re.escape(out) + r"\.tmp(\d+)(?:-(.+))?", path)
        if m is None or (m.group(2) is not None and m.group(2) != socket.gethostname()):
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # alive (or reused: leave it)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
