"""Phases of a GRPO step that both loops share (train_grpo.py and train_async_grpo.py).

Each function does one phase for the whole process group: ranks split the work, then gather, so
every rank returns the same global result.
"""

from __future__ import annotations

import time

import torch

from grpo.rollout import all_gather_objects, rank_slice, repeat_prompts, sample_seed


def build_datasets(cfg, tokenizer):
    """(train rows, train PromptDataset, val PromptDataset): prompts formatted and tokenised once."""
    from grpo.data import PromptDataset, PromptFormatter, load_rows

    formatter = PromptFormatter(tokenizer, cfg.data, cfg.policy.tokenizer.chat_template)
    train_rows = load_rows(cfg.data, "train", seed=cfg.grpo.seed)
    val_rows = load_rows(cfg.data, "val", seed=cfg.grpo.seed)
    max_len = cfg.data.max_input_seq_length
    return train_rows, PromptDataset(train_rows, formatter, max_len), PromptDataset(val_rows, formatter, max_len)


def load_tokenizer(policy_cfg):
    """The policy's tokenizer (or `policy.tokenizer.name`); pad falls back to EOS."""
    from transformers import AutoTokenizer

    name = policy_cfg.tokenizer.name or policy_cfg.model_name
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=policy_cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_generation_backend(cfg, tokenizer, policy_engine, device):
    """`policy.generation.backend`: "hf" (transformers generate, any device) or "vllm" (colocated)."""
    backend = cfg.policy.generation.backend
    if backend == "hf":
        from grpo.generation.hf import HFGeneration

        return HFGeneration(cfg.policy, tokenizer, policy_engine.module.config, device,
                            refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)
    from grpo.generation.vllm import VllmGeneration

    return VllmGeneration(cfg, tokenizer, policy_engine, device,
                          refit_bucket_numel=cfg.policy.generation.refit_bucket_numel)


def components_tensor(components: list[dict] | None) -> torch.Tensor | None:
    """Per-sample reward-component dicts -> ``[B, K]`` (keys sorted; a missing component counts 0)."""
    if not components or all(c is None for c in components):
        return None
    keys = sorted({k for c in components if c for k in c})
    return torch.tensor([[float((c or {}).get(k, 0.0)) for k in keys] for c in components], dtype=torch.float32)


def gather_logprobs(engine, batch: dict, rank: int, world_size: int, temperature: float, micro_batch_size: int,
                    chunk_size: int | None = None) -> torch.Tensor:
    """Logprobs ``[B, T]`` of the whole batch: each rank scores its share, then all ranks gather."""
    from grpo.engines import compute_logprobs

    B, T = batch["input_ids"].shape
    sl = rank_slice(B, rank, world_size)
    attn = batch["attention_mask"][sl]
    t_local = max(int(attn.sum(dim=1).max().item()), 1) if len(attn) else 1
    lp = compute_logprobs(engine, batch["input_ids"][sl, :t_local], attn[:, :t_local], temperature,
                          micro_batch_size, chunk_size)
    lp = torch.nn.functional.pad(lp.float().cpu(), (0, T - lp.shape[1]))
    return torch.cat(all_gather_objects([lp]), dim=0)


def tokens_per_second(batch: dict, seconds: float) -> float:
    """Generated tokens of the step (all samples, all ranks) per wall-clock second."""
    return float(batch["token_mask"].sum().item()) / max(seconds, 1e-9)


def rollout_metrics(batch: dict, train_results: list[dict]) -> dict:
    """The step's train/* metrics: rewards, lengths, and the loss metrics of each optimizer step."""
    from grpo.metrics import aggregate_rollout_metrics

    lengths = batch["response_lengths"].float()
    agg = aggregate_rollout_metrics(train_results)
    # The loss of a GRPO step is the sum of its optimizer steps' losses; the other loss metrics are
    # means over micro-batches (kl_penalty is the KL itself, before the beta weight).
    agg["loss"] = sum(float(r["loss"]) for r in train_results)
    agg["kl"] = agg.get("kl_penalty", 0.0)
    out = {f"train/{k}": v for k, v in agg.items()}
    out.update({
        "train/reward_mean": batch["raw_rewards"].mean().item(),
        "train/reward_std": batch["raw_rewards"].std().item() if len(lengths) > 1 else 0.0,
        "train/shaped_reward_mean": batch["rewards"].mean().item(),
        "train/advantage_abs_mean": batch["advantages"].abs().sum().item()
        / max(batch["token_mask"].sum().item(), 1.0),
        "train/response_length_mean": lengths.mean().item(),
        "train/response_length_max": lengths.max().item(),
        "train/num_completion_tokens": lengths.sum().item(),
        "train/truncated_frac": batch["truncated"].float().mean().item(),
        "train/num_valid_samples": batch["sample_mask"].sum().item(),
        "train/num_samples": float(len(lengths)),
    })
    return out


def pass_at_k(rewards_b: torch.Tensor, prompt_ids_b: torch.Tensor) -> float:
    """Fraction of prompts with at least one of their k samples rewarded (reward > 0)."""
    groups = torch.unique(prompt_ids_b)
    hits = [(rewards_b[prompt_ids_b == g] > 0).any().item() for g in groups]
    return float(sum(hits)) / max(len(hits), 1)


def run_validation(cfg, generator, env, val_ds, rank: int, world_size: int) -> tuple[dict, list[dict]]:
    """Score up to `max_val_samples` prompts x `val_num_generations_per_prompt` samples.

    Sampling seeds depend only on the sample's index (not the step), so successive validations
    differ only by the weights. Returns (metrics, samples) with reward_mean, pass@k,
    response_length_mean and truncated_frac.
    """
    g = cfg.grpo
    n = min(len(val_ds), g.max_val_samples or len(val_ds))
    k = g.val_num_generations_per_prompt
    rows = [val_ds[i] for i in range(n)]
    rewards, lengths, truncated, prompt_ids, samples = [], [], [], [], []
    timing: dict = {}
    bs = g.val_batch_size or n
    for start in range(0, n, bs):
        r = generate_and_score(cfg, generator, env, rows[start: start + bs], 0, start // bs, rank, world_size,
                               timing, num_generations=k, stream="val")
        rewards += r["rewards"]
        prompt_ids += [start + i for i in r["prompt_idx"]]
        lengths += [len(c) for c in r["completion_ids"]]
        truncated += [o.finish_reason == "length" for o in r["outputs"]]
        samples += [{"question": s["question"], "completion": o.text, "answer": s["answer"], "reward": rw}
                    for s, o, rw in zip(r["samples"], r["outputs"], r["rewards"])]
    rewards_b = torch.tensor(rewards)
    metrics = {
        "reward_mean": rewards_b.mean().item(),
        f"pass@{k}": pass_at_k(rewards_b, torch.tensor(prompt_ids)),
        "response_length_mean": float(sum(lengths)) / max(len(lengths), 1),
        "truncated_frac": float(sum(truncated)) / max(len(truncated), 1),
        "num_samples": float(len(rewards)),
        "generate_s": timing.get("timing/generate_s", 0.0),
    }
    return metrics, samples


class RolloutError(RuntimeError):
    """Generation or scoring of a prompt batch raised on some rank (every rank raises it together)."""


def generate_and_score(cfg, generator, env, prompts: list[dict], step: int, gen_batch: int, rank: int,
                       world_size: int, timing: dict, *, num_generations: int | None = None, stream: str = "train",
                       before_chunk=None, group=None) -> dict:
    """Generate ``num_generations`` completions per prompt and score them; returns the global rollout.

    Sample i of the batch is seeded with ``sample_seed(grpo.seed, step, gen_batch * len(samples) + i,
    stream)``, so its completion does not depend on which rank generates it. Each rank generates its
    contiguous share in chunks of ``policy.generation_batch_size``, between ``generator.wake_up()`` and
    ``generator.sleep()`` (no-ops for hf; vLLM's step order); before each chunk
    ``before_chunk()`` runs (the async loop's safe point to load new weights) and returns the weight
    version the chunk uses. Each rank scores its own samples, then the results are gathered over
    ``group`` (None: the default group), so every rank returns the same lists: samples, outputs,
    rewards, components ``[B, K]`` or None, component_dicts, versions, texts, completion_ids,
    prompt_idx, and summed scoring metrics. An exception on any rank becomes a `RolloutError` on
    every rank (no rank is left waiting in a collective).
    """
    import logging
    import traceback

    samples = repeat_prompts(prompts, num_generations or cfg.grpo.num_generations_per_prompt)
    base = gen_batch * len(samples)
    seeds = [sample_seed(cfg.grpo.seed, step, base + i, stream) for i in range(len(samples))]
    mine = rank_slice(len(samples), rank, world_size)
    local_samples, local_seeds = samples[mine], seeds[mine]
    bs = cfg.policy.generation_batch_size
    local = {"rows": [], "counts": (0, 0, 0), "error": None}
    try:
        t = time.perf_counter()
        outputs, versions = [], []
        generator.wake_up()  # colocated vLLM: KV cache back (weights came with the last refit)
        try:
            for i in range(0, len(local_samples), bs):
                version = before_chunk() if before_chunk is not None else 0
                chunk = generator.generate([s["prompt_ids"] for s in local_samples[i:i + bs]],
                                           local_seeds[i:i + bs])
                outputs += chunk
                versions += [version] * len(chunk)
        finally:
            generator.sleep()  # step 1 of the vLLM order: free the device for training
        timing["timing/generate_s"] = timing.get("timing/generate_s", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        scored = env.score([{"question": s["question"], "completion": o.text, "answer": s["answer"],
                             "meta": s["meta"]} for s, o in zip(local_samples, outputs)])
        timing["timing/score_s"] = timing.get("timing/score_s", 0.0) + time.perf_counter() - t
        comps = scored.components or [None] * len(outputs)
        local["rows"] = list(zip(outputs, scored.rewards, comps, versions))
        local["counts"] = (scored.num_errors, scored.num_timeouts, len(outputs))
    except Exception as err:  # reported to every rank below; the caller decides whether to go on
        logging.getLogger(__name__).warning("rank %d: rollout of step %d failed:\n%s", rank, step,
                                            traceback.format_exc())
        local["error"] = f"rank {rank}: {type(err).__name__}: {err}"
    parts = all_gather_objects([local], group)
    errors = [p["error"] for p in parts if p["error"] is not None]
    if errors:
        raise RolloutError("; ".join(errors))
    rows = [r for p in parts for r in p["rows"]]
    n_err, n_to, n_all = (sum(p["counts"][i] for p in parts) for i in range(3))
    return {
        "samples": samples,
        "outputs": [r[0] for r in rows],
        "rewards": [float(r[1]) for r in rows],
        "components": components_tensor([r[2] for r in rows]),
        "component_dicts": [r[2] for r in rows],
        "versions": [int(r[3]) for r in rows],
        "texts": [r[0].text for r in rows],
        "completion_ids": [list(r[0].completion_ids) for r in rows],
        "prompt_idx": [s["prompt_idx"] for s in samples],
        "metrics": {"reward_errors": n_err, "reward_timeouts": n_to,
                    "reward_error_rate": (n_err + n_to) / max(n_all, 1)},
    }
