"""One ZeRO-3 training step of the tiny VLM on 2 ranks, rank 0's micro-batches with images and rank 1's text only
(DeepSpeed#7170: without a dummy picture the ranks' vision-tower gathers never pair up); run by
tests/integration/test_vision_training.py::test_two_ranks_one_with_images_one_without_train_as_one_process.

    torchrun --nproc_per_node 2 tests/helpers/vision_dist_step.py VLM_DIR OUT.pt

Rank 0 saves the logprobs of the batch before the step (each rank scoring its half) and what `train_on_batch`
returned (loss and gradient norm over both ranks).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

ORDER = [0, 0, 3, 4, 4, 4]  # rows 0-2 (rank 0): images; rows 3-5 (rank 1): the text-only prompt


def main(vlm_dir: str, out_path: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
    from transformers import AutoProcessor

    from grpo.config import MasterConfig
    from grpo.system import engines
    from grpo.system.dist import all_gather_objects, init_distributed, rank_slice
    from grpo.system.training import compute_logprobs, train_on_batch
    from tests.helpers.vision_rows import sample_batch, sample_prompts

    rank, _, world, _ = init_distributed()
    prompts, media = sample_prompts(vlm_dir, AutoProcessor.from_pretrained(vlm_dir))
    batch = sample_batch(prompts, media, ORDER)
    cfg = MasterConfig.model_validate({
        "policy": {"model_name": vlm_dir, "precision": "float32", "train_global_batch_size": len(ORDER),
                   "train_micro_batch_size": 1, "deepspeed_config": "ds_configs/zero3.json", "max_grad_norm": 1e6},
        "grpo": {"num_prompts_per_step": 3, "num_generations_per_prompt": 2}})
    engine = engines.build_policy_engine(cfg, world, total_optimizer_steps=1)
    mine = batch.shard(rank, world)
    assert (mine.media is not None and all(m is not None for m in mine.media)) == (rank == 0)
    sl = rank_slice(len(batch), rank, world)  # logprobs before the step: the initial weights'
    lp = compute_logprobs(engine, batch.input_ids_bt[sl], batch.attention_mask_bt[sl], 1.0, micro_batch_size=2,
                          media=batch.media[sl])
    logprobs = torch.cat(all_gather_objects([lp]))
    out = train_on_batch(engine, mine.micro_batches(1),
                         lambda lp, mb: (-(lp * mb.token_mask_bt).sum() / 30.0, {}))
    if rank == 0:
        torch.save({"loss": out["loss"], "grad_norm": out["grad_norm"], "logprobs": logprobs, "world": world},
                   out_path)
    engines.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    from grpo.system.engines import exit_process

    exit_process(0)
