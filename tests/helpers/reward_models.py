"""Tiny Qwen2 models built locally (no download) over the real Qwen2.5 tokenizer (`tests.helpers.qwen_tokenizer`), saved
with it as ``from_pretrained`` directories: a reward model (``ForSequenceClassification``, ``num_labels=1``) and a
policy (``ForCausalLM``) for NeMo-RL's Qwen2.5 recipes."""

from __future__ import annotations

import os


def save_tiny_reward_model(out_dir: str, seed: int = 0) -> str:
    """A random-init Qwen2ForSequenceClassification (hidden 64, 2 layers, num_labels=1) and its tokenizer in
    ``out_dir``; returns ``out_dir``."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    tok, config = _tiny_qwen2_config(num_labels=1)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a head large enough that scores differ visibly between texts
        model.score.weight.normal_(0.0, 1.0)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def save_tiny_qwen2_lm(out_dir: str, seed: int = 0) -> str:
    """A random-init Qwen2ForCausalLM (hidden 64, 2 layers, tied embeddings) and the Qwen2.5 tokenizer with its chat
    template in ``out_dir``; returns ``out_dir``."""
    import torch
    from transformers import Qwen2ForCausalLM

    tok, config = _tiny_qwen2_config(tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def _tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config

    from tests.helpers.qwen_tokenizer import qwen25_tokenizer

    tok = qwen25_tokenizer()
    config = Qwen2Config(**{**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   tie_word_embeddings=False), **overrides})
    return tok, config
