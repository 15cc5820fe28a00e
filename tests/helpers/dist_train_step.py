"""Two optimizer steps of the ZeRO-3 policy engine on a fixed global batch; run by tests/integration/test_engines.py.

    python tests/helpers/dist_train_step.py MODEL_DIR OUT.pt EXPORT_DIR                     # 1 process
    torchrun --nproc_per_node 2 tests/helpers/dist_train_step.py MODEL_DIR OUT.pt EXPORT_DIR  # 2 processes, half each
    torchrun --nproc_per_node 2 tests/helpers/dist_train_step.py MODEL_DIR OUT.pt - packed,dynamic
        # the same steps with micro-batches by token budget (`BATCHINGS`), one result per name, no export

Each rank trains on its contiguous shard with a loss normalised by the GLOBAL token count. Rank 0
saves the updated weights, what `train_on_batch` returned and logprobs; the weights are also
exported as HF safetensors. `make_batch` / `batch_loss` are also
the test's single-process plain-PyTorch reference.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 2
# eps = 1 makes the first Adam updates ~ lr * g / (|g| + 1): sensitive to the gradient's scale, which
# a wrong DP / gradient-accumulation compensation would change (with eps = 1e-8 Adam hides it).
RUN = {"lr": 0.05, "eps": 1.0, "weight_decay": 0.01, "warmup_steps": 2, "max_grad_norm": 1e6}


def make_batch(step: int, vocab: int):
    """A right-padded `grpo.batch.TrainBatch`: prompt of 3-5 tokens, completion of 2-7 tokens, one advantage per
    row (on each of its tokens)."""
    from tests.helpers.batches import train_batch

    g = torch.Generator().manual_seed(1000 + step)
    T = 12
    ids = torch.zeros((GLOBAL_BATCH, T), dtype=torch.long)
    attn = torch.zeros((GLOBAL_BATCH, T), dtype=torch.long)
    token_mask = torch.zeros((GLOBAL_BATCH, T))
    for b in range(GLOBAL_BATCH):
        p = int(torch.randint(3, 6, (1,), generator=g))
        c = int(torch.randint(2, 8, (1,), generator=g))
        ids[b, : p + c] = torch.randint(3, vocab, (p + c,), generator=g)
        attn[b, : p + c] = 1
        token_mask[b, p: p + c] = 1.0
    adv = torch.randn(GLOBAL_BATCH, generator=g)
    return train_batch(input_ids_bt=ids, attention_mask_bt=attn, token_mask_bt=token_mask,
                       advantages_bt=adv[:, None].repeat(1, T))


def batch_loss(logprobs_bt: torch.Tensor, mb, global_tokens: float) -> torch.Tensor:
    """Σ mask · (−A·lp + 0.5·lp²) / global_tokens: a policy-gradient term plus a non-linear one."""
    m = mb.token_mask_bt
    per_token = -mb.advantages_bt * logprobs_bt + 0.5 * logprobs_bt**2
    return (per_token * m).sum() / global_tokens


def batchings():
    """Micro-batches by token budget (`grpo.system.training.TokenBatching`) the helper can train with: budgets small
    enough that the ranks' shards split into different numbers of micro-batches; packed rows even where padded
    ones would be as cheap (these lengths are too even for packing to save anything)."""
    from grpo.system.training import TokenBatching

    return {"packed": TokenBatching(True, 18, always_pack=True), "dynamic": TokenBatching(False, 20, 4)}


def train_and_collect(model_dir: str, export_dir: str | None = None, batching=None,
                      deepspeed_config: str = "auto") -> tuple[dict, list[dict], torch.Tensor]:
    """STEPS calls of `train_on_batch` on this rank's shard, then logprobs of `make_batch(STEPS)` with
    ranks holding unequal shares (5 rows: 3 + 2 with 2 ranks, so unequal forward counts) and an HF
    export. ``batching``: micro-batches by token budget (`grpo.system.training.TokenBatching`) in both;
    ``deepspeed_config``: policy.deepspeed_config (auto: no ZeRO on one rank in fp32, ZeRO-3 on several).
    Returns (full weights, results, logprobs [5, T]); each result also holds ``micro_batches``, every rank's
    count. Needs the process group."""
    from grpo.system import engines, weights
    from grpo.system.training import compute_logprobs, token_micro_batches, train_on_batch
    from grpo.config import MasterConfig
    from grpo.batch import micro_batches, select_rows
    from grpo.batch import rank_slice
    from grpo.system.dist import all_gather_objects

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = MasterConfig.model_validate({
        "policy": {"model_name": model_dir, "precision": "float32", "train_global_batch_size": GLOBAL_BATCH,
                   "deepspeed_config": deepspeed_config,
                   "train_micro_batch_size": MICRO_BATCH, "max_grad_norm": RUN["max_grad_norm"],
                   "optimizer": {"lr": RUN["lr"], "eps": RUN["eps"], "weight_decay": RUN["weight_decay"]},
                   "scheduler": {"name": "cosine", "warmup_steps": RUN["warmup_steps"]}},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
    })
    engine = engines.build_policy_engine(cfg, world, total_optimizer_steps=STEPS)
    vocab = engine.module.config.vocab_size
    per_rank = GLOBAL_BATCH // world
    results = []
    for step in range(STEPS):
        batch = make_batch(step, vocab)
        global_tokens = float(batch.token_mask_bt.sum())
        mine = select_rows(batch, slice(rank * per_rank, (rank + 1) * per_rank))
        mbs = micro_batches(mine, MICRO_BATCH) if batching is None else token_micro_batches(mine, batching)
        results.append(train_on_batch(
            engine, mbs,
            lambda lp, mb, n=global_tokens: (batch_loss(lp, mb, n), {"tokens": mb.token_mask_bt.sum()}),
            variable=batching is not None,
            packing=batching.packing() if batching is not None else None,
        ))
        results[-1]["micro_batches"] = all_gather_objects([len(mbs)])
    full = {name: t.clone() for bucket in weights.iter_gathered_params(engine) for name, t in bucket}
    rows = select_rows(make_batch(STEPS, vocab), slice(0, 5))
    mine = select_rows(rows, rank_slice(5, rank, world))
    lp = compute_logprobs(engine, mine.input_ids_bt, mine.attention_mask_bt, 1.0, micro_batch_size=2,
                          batching=batching)
    logprobs = torch.cat(all_gather_objects([lp]))
    if export_dir is not None:
        from grpo.tasks.toy import build_char_tokenizer

        weights.export_hf(engine, export_dir, build_char_tokenizer())
    return full, results, logprobs


def main(model_dir: str, out_path: str, export_dir: str, names: str | None = None) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
    from grpo.system import engines
    from grpo.system.dist import init_distributed

    rank, _, world, _ = init_distributed()
    if names:
        out = {"world": world}
        for name in names.split(","):
            out[name] = train_and_collect(model_dir, None, batchings()[name])
        if rank == 0:
            torch.save(out, out_path)
        engines.shutdown()
        return
    weights, results, logprobs = train_and_collect(model_dir, export_dir)
    if rank == 0:
        torch.save({"weights": weights, "results": results, "logprobs": logprobs, "world": world}, out_path)
    engines.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    from grpo.system.engines import exit_process

    exit_process(0)
