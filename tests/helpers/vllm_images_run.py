"""The vLLM backend (`grpo.system.generation.vllm.VllmGeneration`) generating the toy LLaVA's image prompts as a
generation rank runs it (``colocated=False``), in a process of its own: vLLM's transformers backend
(`VISION_LLM_KWARGS`) decorates transformers' decoder class (LlamaModel) in place, after which a transformers model of
that class in the same process cannot run ("'LlamaModel' object has no attribute 'do_not_compile'"). Run by
tests/integration/test_vllm_images.py.

    python tests/helpers/vllm_images_run.py MODEL_DIR

The backend gets the trainer's weights by name (`load_buckets`, as over the bridge) and each prompt as the trainer
holds it: the processor-expanded ids and the media a vLLM policy's processor makes (its raw pictures kept). Prints one
JSON line: {"once": [per seed, per row: {"tokens", "logprobs"}], "after_change": per row, the same prompts after the
vision tower's weights changed (`changed`), "twice": the error of a generation whose prompts were
sent expanded (the trl#6294 trap), "raw_twice": the ids vLLM itself ran for row 0's expanded ids sent with its picture}.
"""

from __future__ import annotations

import json
import os
import socket
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch

from grpo.config.load import build_config

PICTURES = [(255, 0, 0), (0, 200, 0), (0, 0, 255), (240, 240, 0)]
QUESTIONS = ["<image>what colour?", "<image>how many?", "<image><image>and this one?", "<image>shape"]
SEEDS = (1, 2)


def trainer_rows(processor):
    """Each question's expanded ids as the trainer's data path makes them (the processor with the row's images), its
    images and its media (pixel values, and the raw pictures where the processor keeps them)."""
    from PIL import Image

    from grpo.system.vision import encode_with_images

    rows = []
    for colour, text in zip(PICTURES, QUESTIONS):
        images = [Image.new("RGB", (16, 16), colour)] * text.count("<image>")
        ids, media = encode_with_images(processor, text, images)
        rows.append((ids, images, media))
    return rows


def changed(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The weights with the vision tower's and the projector's scaled by 1.5: the pictures' embeddings change."""
    return [(n, t * 1.5 if ("vision_tower" in n or "multi_modal_projector" in n) else t) for n, t in weights]


def config(model_dir: str):
    return build_config({"policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 128,
                                   "generation": {"backend": "vllm", "max_new_tokens": 8, "temperature": 1.0,
                                                  "colocated": {"enabled": False, "resources": {"gpus_per_node": 1}},
                                                  "vllm_cfg": {"enforce_eager": True,
                                                               "kv_cache_memory_bytes": 64 * 2**20}}}})


def main(model_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    from grpo.system.chat import load_tokenizer
    from grpo.system.generation import vllm_params
    from grpo.system.generation.vllm import VllmGeneration
    from grpo.system.vision import load_processor

    with socket.socket() as s:  # a generation rank's engine joins a process group (external_launcher)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = config(model_dir)
    # The trainer's parameters by the trainer's names, read before vLLM patches transformers' classes.
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    del model
    processor = load_processor(cfg.policy, AutoConfig.from_pretrained(model_dir))  # keeps the pictures (vLLM)
    gen = VllmGeneration(cfg, load_tokenizer(cfg.policy), None, torch.device("cpu"), colocated=False)
    gen.load_buckets([weights], [n for n, _ in weights])
    rows = trainer_rows(processor)
    prompts, media = [ids for ids, _, _ in rows], [m for _, _, m in rows]
    once = []
    for seed in SEEDS:
        outs = gen.generate(prompts, [seed * 100 + i for i in range(len(rows))], media=media)
        once.append([{"tokens": o.completion_ids, "logprobs": o.logprobs} for o in outs])
    # A weight change of the vision tower (`changed`), then the same pictures again: their embeddings must be the new
    # weights', not the ones vLLM cached for the same pictures (trl#7198).
    gen.load_buckets([changed(weights)], [n for n, _ in weights])
    outs = gen.generate(prompts, [7 + i for i in range(len(rows))], media=media)
    after_change = [{"tokens": o.completion_ids, "logprobs": o.logprobs} for o in outs]
    # The trap, through the backend: the trainer's expanded ids sent with their pictures.
    vllm_params.collapse_image_runs = lambda ids, image_token_id, counts: list(ids)
    try:
        gen.generate(prompts[:1], [0], media=media[:1])
        twice = None
    except RuntimeError as err:
        twice = str(err)
    from vllm import SamplingParams

    ids, images, _ = rows[0]
    raw = gen.llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}],
                           SamplingParams(max_tokens=1), use_tqdm=False)[0]
    gen.close()
    print(json.dumps({"once": once, "after_change": after_change, "twice": twice,
                      "raw_twice": list(raw.prompt_token_ids)}))


if __name__ == "__main__":
    main(sys.argv[1])
