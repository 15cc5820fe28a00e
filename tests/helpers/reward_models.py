"""Tiny reward models built locally (no download): a Qwen2 ``ForSequenceClassification`` with ``num_labels=1`` over the
real Qwen2.5 tokenizer (`tests.helpers.qwen_tokenizer`), saved with it as a ``from_pretrained`` directory."""

from __future__ import annotations

import os


def save_tiny_reward_model(out_dir: str, seed: int = 0) -> str:
    """A random-init Qwen2ForSequenceClassification (hidden 64, 2 layers, num_labels=1) and its tokenizer in
    ``out_dir``; returns ``out_dir``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from tests.helpers.qwen_tokenizer import qwen25_tokenizer

    tok = qwen25_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         num_labels=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a head large enough that scores differ visibly between texts
        model.score.weight.normal_(0.0, 1.0)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
