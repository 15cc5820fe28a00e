"""vLLM generations of the toy LLaVA's image prompts, in a process of their own: vLLM's transformers backend
(`VISION_LLM_KWARGS`) decorates transformers' decoder class (LlamaModel) in place, after which a transformers model
of that class in the same process cannot run ("'LlamaModel' object has no attribute 'do_not_compile'"). Run by
tests/integration/test_vllm_images.py.

    python tests/helpers/vllm_images_run.py MODEL_DIR

Prints one JSON line: {"once": [per seed, per row: {"prompt": ids vLLM ran, "tokens", "logprobs"}],
"twice": ids vLLM ran for row 0's EXPANDED ids sent with its raw picture}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from transformers import AutoConfig, AutoProcessor

from grpo.config.load import build_config
from grpo.system.generation.vllm_params import image_prompt, llm_kwargs
from grpo.system.vision import vision_token_ids

PICTURES = [(255, 0, 0), (0, 200, 0), (0, 0, 255), (240, 240, 0)]
QUESTIONS = ["<image>what colour?", "<image>how many?", "<image><image>and this one?", "<image>shape"]
SEEDS = (1, 2)


def trainer_rows(processor):
    """Each question's expanded ids as the trainer's data path makes them (the processor with the row's images),
    its images and its pixel values."""
    from PIL import Image

    rows = []
    for colour, text in zip(PICTURES, QUESTIONS):
        images = [Image.new("RGB", (16, 16), colour)] * text.count("<image>")
        enc = processor(text=text, images=images, return_tensors="pt")
        rows.append((enc["input_ids"][0].tolist(), images, enc["pixel_values"]))
    return rows


def main(model_dir: str) -> None:
    from vllm import LLM, SamplingParams

    processor = AutoProcessor.from_pretrained(model_dir)
    banned = vision_token_ids(AutoConfig.from_pretrained(model_dir))
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    cfg = build_config({"policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 128,
                                   "generation": {"backend": "hf", "max_new_tokens": 8, "vllm_cfg": {
                                       "enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}}}})
    llm = LLM(**llm_kwargs(cfg, model=model_dir, tokenizer=model_dir, rank=0, world_size=1, on_cpu=True,
                           sleep_mode_available=False, vision=True))
    allowed = [t for t in range(len(processor.tokenizer)) if t not in banned]  # the trainer bans them on its head

    def params(seed):
        return SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=seed, allowed_token_ids=allowed)

    rows = trainer_rows(processor)
    once = []
    for seed in SEEDS:
        outs = llm.generate([image_prompt(ids, images, image_id) for ids, images, _ in rows], params(seed),
                            use_tqdm=False)
        once.append([{"prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
                      "logprobs": [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                     for o in outs])
    ids, images, _ = rows[0]
    twice = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], params(0),
                         use_tqdm=False)[0]
    print(json.dumps({"once": once, "twice": list(twice.prompt_token_ids)}))


if __name__ == "__main__":
    main(sys.argv[1])
