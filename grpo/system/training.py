"""The training forward: token logprobs of a batch on an engine, and the optimizer step over micro-batches;
with the two step phases that run them on the whole step's batch (`step_logprobs`, `train_step`).

Data parallelism: every rank holds the same global rollout batch and trains on its own shard, with a
loss normalised by GLOBAL counts, so the per-rank losses sum to the full-batch loss. DeepSpeed
averages gradients over ranks and divides by gradient_accumulation_steps; `train_on_batch` undoes
both, so one process on the full batch and N processes on shards apply the same update.

Every forward of a ZeRO-3 engine is a collective: all ranks call `compute_logprobs`, `train_on_batch`,
`step_logprobs` and `train_step` together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo.batch import (TrainBatch, build_batch, pad_columns, rank_slice, sample_chunks, select_rows, to_device,
                        trim_padding, with_fields)
from grpo.distillation import rows_by_teacher, trajectory_teacher_key
from grpo.logprobs import aligned_entropy_from_logits, aligned_logprobs_from_logits, mask_out_of_filter, needs_filter
from grpo.packing import dynamic_micro_batches, pack_bins, round_up
from grpo.loss import LossInputs, clipped_pg_loss_fn, loss_needs
from grpo.metrics import aggregate_rollout_metrics, global_valid_counts
from grpo.system.dist import all_gather_objects, all_reduce, comm_device
from grpo.system.engines import release_params
from grpo.system.generation.hf import sharing_kv_heads
from grpo.system.health import skip_nonfinite_loss
from grpo.system.packed import (Packing, attention_implementation, packed_forward, packed_row_tokens, unpack_aligned,
                                unpack_rows)
from grpo.system.rollout import single_turn
from grpo.system.shared_prefix import plan_shared_prefix, prompt_lengths, shares_prompts
from grpo.system.vision import image_keywords, multimodal_positions, with_dummy_image


# --------------------------------------------------------------------------------------------------
# Micro-batches by token budget (policy.sequence_packing / policy.dynamic_batching)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBatching:
    """How one phase (logprobs or training) cuts a rank's rows into micro-batches by token budget.

    ``packed``: each micro-batch is a bin of `grpo.packing.pack_bins`, run packed (`grpo.system.packed`) where
    that is the cheapest forward (`logprob_forward`); else (dynamic batching) `grpo.packing.dynamic_micro_batches`, run
    right-padded to its longest row rounded up to ``sequence_length_round``."""

    packed: bool
    mb_tokens: int
    sequence_length_round: int = 1
    algorithm: str = "modified_first_fit_decreasing"
    order: str = "packer"
    always_pack: bool = False   # tests: run the packed forward even where padded / shared rows are cheaper

    def packing(self) -> Packing | None:
        """The forwards' `grpo.system.packed.Packing` (None: dynamic batching, padded forwards)."""
        return Packing(self.sequence_length_round, self.always_pack) if self.packed else None

    def groups(self, lengths: list[int]) -> list[list[int]]:
        """Row indices of each micro-batch (every row in exactly one; an empty row counts as one token)."""
        lengths = [max(int(n), 1) for n in lengths]
        if self.packed:
            return pack_bins(lengths, self.mb_tokens, self.algorithm, self.order)
        return dynamic_micro_batches(lengths, self.mb_tokens, self.sequence_length_round)

    def width(self, longest: int, limit: int) -> int:
        """Columns a dynamic micro-batch runs with: its longest row rounded up, at most ``limit``."""
        return min(round_up(longest, self.sequence_length_round), limit)


def token_batching(policy_cfg, phase: str) -> TokenBatching | None:
    """The `TokenBatching` of ``phase`` ("train" or "logprob") from ``policy.sequence_packing`` /
    ``policy.dynamic_batching``; None when both are off (micro-batches of train_micro_batch_size /
    logprob_batch_size rows)."""
    budget = policy_cfg.mb_tokens(phase)
    if budget is None:
        return None
    sp = policy_cfg.sequence_packing
    if sp.enabled:
        return TokenBatching(True, budget, sp.sequence_length_round, sp.algorithm, sp.microbatch_order)
    return TokenBatching(False, budget, policy_cfg.dynamic_batching.sequence_length_round)


def describe_batching(policy_cfg) -> str:
    """What the startup line says of the micro-batches.

        >>> from grpo.config import PolicyConfig
        >>> describe_batching(PolicyConfig(sequence_packing={"enabled": True, "train_mb_tokens": 1024}))
        'sequence packing (modified_first_fit_decreasing, 1024 tokens per training / 2048 per logprob micro-batch)'
    """
    p = policy_cfg
    if p.sequence_packing.enabled:
        kind = f"sequence packing ({p.sequence_packing.algorithm}, "
    elif p.dynamic_batching.enabled:
        kind = "dynamic batching ("
    else:
        return (f"{p.train_micro_batch_size} rows per training / {p.logprob_batch_size} per logprob micro-batch "
                "(sequence packing and dynamic batching off)")
    return kind + f"{p.mb_tokens('train')} tokens per training / {p.mb_tokens('logprob')} per logprob micro-batch)"


# --------------------------------------------------------------------------------------------------
# Logprobs and training on an engine
# --------------------------------------------------------------------------------------------------
def forward_logprobs(engine, input_ids_bt, attention_mask_bt, temperature: float = 1.0, chunk_size=None, *,
                     top_k: int | None = None, top_p: float = 1.0, return_unfiltered: bool = False,
                     prompt_lens_b: torch.Tensor | None = None, media: list | None = None):
    """Aligned token logprobs [B, T] with grad: 0 at position 0 and on padding, and at t

        log softmax_K(logits[t - 1] / temperature)[input_ids[t]]   (right-padded batches)

    with K the sampler's top-k / top-p keep set (`grpo.logprobs.token_logprobs`; the defaults filter
    nothing). A token outside K gets 0, as NeMo-RL's ``mask_out_neg_inf_logprobs`` does (see
    `grpo.logprobs.mask_out_of_filter`). ``return_unfiltered=True`` returns ``(filtered, unfiltered)``,
    the second with the temperature only, from the same pass over the logits.

    ``prompt_lens_b``: the rows' prompt lengths (`grpo.system.shared_prefix.prompt_lengths`); given, a prompt that
    several rows share goes through the model once (`grpo.system.shared_prefix`: same values up to rounding). Not
    under ZeRO-3, where every forward is a collective and ranks would have to agree on sharing. ``media``: the rows'
    images (`logprob_forward`).
    """
    lp_bt, full_bt, _ = logprob_forward(engine, input_ids_bt, attention_mask_bt, temperature, chunk_size, top_k=top_k,
                                 top_p=top_p, prompt_lens_b=prompt_lens_b, media=media)
    return (lp_bt, full_bt) if return_unfiltered else lp_bt


def logprob_forward(engine, input_ids_bt, attention_mask_bt, temperature: float = 1.0, chunk_size=None, *,
                    top_k: int | None = None, top_p: float = 1.0, prompt_lens_b: torch.Tensor | None = None,
                    needs: tuple[str, ...] = (), packing: Packing | None = None,
                    media: list | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`forward_logprobs`' ``(filtered, unfiltered, extras)``; ``extras`` holds what ``needs`` asks for
    (`grpo.loss.LOSS_NEEDS`): ``entropy_bt`` (`grpo.logprobs.aligned_entropy_from_logits`, masked like the
    logprobs) and ``logits_btv`` (the raw logits). A forward that needs them runs whole (no shared prompt).

    ``packing`` not None: the rows run packed (`grpo.system.packed`; same values up to rounding), when that puts fewer slots through the model than the padded rows (B x T) or, where
    ``prompt_lens_b`` lets them share prompts, the shared-prompt plan (the distinct prompts plus every row's padded
    continuation, `grpo.system.shared_prefix.SharedPrefixPlan.tokens`); packed slots: Σ over packed rows of their
    length (`grpo.system.packed.packed_row_tokens`). The time of these forwards follows the slots they run
    (measured on the bench model: docs/measurements.md, "Sequence packing"); ``packing.always``: packed
    regardless.

    ``media``: the rows' images (`grpo.system.vision`; a VLM's rows, None for a text one): they run padded, never
    packed or with shared prompts (neither carries the images yet: asking for either is an error)."""
    device = engine.device
    ids_bt, mask_bt = input_ids_bt.to(device), attention_mask_bt.to(device)
    module = getattr(engine, "module", engine)  # a DeepSpeed engine's model, or a plain model (tests, forks)
    images = image_keywords(module, media, device)
    if images and (packing is not None or prompt_lens_b is not None):
        raise ValueError("rows with images run padded: policy.sequence_packing and policy.shared_prompt_forward do "
                         "not carry a vision-language model's images yet (set both false)")

    def logprobs(logits_nlv, ids_nl):
        return aligned_logprobs_from_logits(logits_nlv, ids_nl, temperature, chunk_size, top_k=top_k, top_p=top_p,
                                            return_unfiltered=True)

    checkpointed = torch.is_grad_enabled() and getattr(module, "is_gradient_checkpointing", False)
    can_share = (prompt_lens_b is not None and not checkpointed and engine.zero_optimization_stage() != 3
                 and not needs)
    plan = plan_shared_prefix(ids_bt, mask_bt, prompt_lens_b) if can_share else None
    if packing is not None:   # the cheapest of padded, shared prompts and packed (fewest slots; ties: not packed)
        attention = attention_implementation(engine.module)
        other = plan.tokens() if plan is not None else ids_bt.numel()
        rnd = packing.sequence_length_round
        if packing.always or packed_row_tokens(mask_bt.sum(dim=1).tolist(), attention, rnd) < other:
            return _packed(engine, ids_bt, mask_bt, attention, rnd, logprobs, needs, temperature, chunk_size)
    shared = plan.logprobs(engine, logprobs) if plan is not None else None
    extras = {}
    if shared is not None:
        lp_bt, full_bt = shared
    else:
        # a VLM under ZeRO-3 (the only models with a dummy picture: grpo.system.engines), no image here: the dummy
        # picture runs the tower as on the ranks with images
        dummy = with_dummy_image(module, ids_bt, mask_bt) if not images and plan is None else None
        if dummy is None:  # positions: M-RoPE ones for Qwen-VL, the model's own count otherwise
            logits_btv = engine(input_ids=ids_bt, attention_mask=mask_bt, use_cache=False, **images,
                                **multimodal_positions(module, ids_bt, mask_bt, images)).logits
        else:
            B, T = ids_bt.shape
            logits_btv = engine(input_ids=dummy[0], attention_mask=dummy[1], use_cache=False, **dummy[2],
                                **multimodal_positions(module, dummy[0], dummy[1], dummy[2])).logits
            anchor = 0.0 * logits_btv[B:].sum()  # the tower's (zero) gradient reaches every rank's reduction
            logits_btv = logits_btv[:B, :T]
        lp_bt, full_bt = logprobs(logits_btv, ids_bt)
        if dummy is not None:
            lp_bt, full_bt = lp_bt + anchor, full_bt + anchor
        if "entropy" in needs:
            extras["entropy_bt"] = aligned_entropy_from_logits(logits_btv, mask_bt, temperature, chunk_size)
        if "logits" in needs:
            extras["logits_btv"] = logits_btv
    lp_bt, _ = mask_out_of_filter(lp_bt, mask_bt)
    return lp_bt, torch.where(mask_bt > 0, full_bt, 0.0), extras


def _packed(engine, ids_bt, mask_bt, attention, sequence_length_round, logprobs, needs, temperature, chunk_size):
    """`logprob_forward` on packed rows (`grpo.system.packed`), unpacked to ``[B, T]``."""
    logits_krv, ids_kr, source_kr = packed_forward(engine, attention, ids_bt, mask_bt, sequence_length_round)
    lp_kr, full_kr = logprobs(logits_krv, ids_kr)
    lp_bt, full_bt = unpack_aligned(lp_kr, source_kr, mask_bt), unpack_aligned(full_kr, source_kr, mask_bt)
    extras = {}
    if "entropy" in needs:
        h_kr = aligned_entropy_from_logits(logits_krv, torch.ones_like(ids_kr), temperature, chunk_size)
        extras["entropy_bt"] = unpack_aligned(h_kr, source_kr, mask_bt)
    if "logits" in needs:
        extras["logits_btv"] = unpack_rows(logits_krv, source_kr, mask_bt)
    lp_bt, _ = mask_out_of_filter(lp_bt, mask_bt)
    return lp_bt, full_bt, extras


@torch.no_grad()
@sharing_kv_heads()   # a grouped-query model's key/value heads go to the attention kernel as they are (same numbers)
def compute_logprobs(engine, input_ids_bt, attention_mask_bt, temperature: float, micro_batch_size: int,
                     chunk_size=None, *, top_k: int | None = None, top_p: float = 1.0,
                     prompt_lens_b: torch.Tensor | None = None, batching: TokenBatching | None = None,
                     media: list | None = None) -> torch.Tensor:
    """`forward_logprobs` without grad, micro-batch by micro-batch; returns [B, T] fp32 on the CPU.

    ``top_k`` / ``top_p``: the sampler's filter (policy.generation.top_k / top_p) for the previous-policy
    logprobs; leave them off for the reference policy (NeMo-RL: its top-k set is not the policy's).
    ``batching``: micro-batches by token budget (`TokenBatching`: packed rows or dynamic batches) instead of
    ``micro_batch_size`` rows (a packed micro-batch shares prompts only where that runs fewer tokens: `logprob_forward`).
    Ranks may hold different numbers of rows: every rank runs as many forwards as the busiest one
    (the extra ones on a dummy row), since each ZeRO-3 forward is a collective. ``media``: each row's images
    (`grpo.system.vision`), None for text rows.
    """
    was_training = engine.module.training
    engine.eval()
    B, T = input_ids_bt.shape
    if batching is None:
        groups = [list(range(i, min(i + micro_batch_size, B))) for i in range(0, B, micro_batch_size)]
    else:
        groups = batching.groups(attention_mask_bt.sum(dim=1).tolist())
    n_all = int(all_reduce(torch.tensor([len(groups)], device=comm_device()), op="max").item())
    out = torch.zeros((B, T), dtype=torch.float32)
    for i in range(n_all):
        if i < len(groups):
            rows = torch.tensor(groups[i], dtype=torch.long)
            mask = attention_mask_bt[rows]
            width = T   # fixed micro-batches: as many columns as the rows given (as before token batching)
            if batching is not None:
                width = max(int(mask.sum(dim=1).max()), 1)
                width = width if batching.packed else batching.width(width, T)
            lp, _, _ = logprob_forward(engine, input_ids_bt[rows, :width], mask[:, :width], temperature, chunk_size,
                                top_k=top_k, top_p=top_p,
                                prompt_lens_b=prompt_lens_b[rows] if prompt_lens_b is not None else None,
                                packing=batching.packing() if batching is not None else None,
                                media=[media[r] for r in groups[i]] if media is not None else None)
            out[rows, :width] = lp.float().cpu()
        else:
            dummy = torch.zeros((1, 2), dtype=torch.long)
            forward_logprobs(engine, dummy, torch.ones_like(dummy), temperature, chunk_size, top_k=top_k, top_p=top_p)
    release_params(engine)
    engine.train(was_training)
    return out


def _to_python(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.detach().cpu().tolist()
    return v


LossClosure = Callable[..., tuple[torch.Tensor, dict]]


def train_on_batch(engine, micro_batches: list[TrainBatch], loss_closure: LossClosure, *, temperature: float = 1.0,
                   chunk_size=None, top_k: int | None = None, top_p: float = 1.0, share_prompts: bool = False,
                   needs: tuple[str, ...] = (), packing: Packing | None = None, variable: bool = False) -> dict:
    """One optimizer step over this rank's micro-batches; returns metrics, loss, grad_norm, lr.

    A micro-batch is a `grpo.batch.TrainBatch`: its ``input_ids_bt`` and
    ``attention_mask_bt`` go through the model; the closure gets it with its tensors on the engine's device.
    ``logprobs_bt`` are `forward_logprobs` with ``temperature`` and the sampler's ``top_k`` / ``top_p``
    filter (policy.generation.*). With a filter on, the micro-batch also holds ``unfiltered_logprobs_bt``
    (temperature only, with grad, from the same forward): NeMo-RL's ``curr_logprobs_unfiltered``, for the
    KL term (`grpo.loss.clipped_pg_loss`'s ``unfiltered_logprobs``). ``share_prompts``: rows that share a
    prompt run it once (`grpo.system.shared_prefix`; prompts end where ``token_mask_bt`` starts). ``needs``: what
    the closure also gets from the same forward, as keywords (`grpo.loss.LOSS_NEEDS`: ``entropy_bt=``,
    ``logits_btv=``); none by default. ``packing``: each micro-batch runs packed (`grpo.system.packed`, rows
    padded to a multiple of it), or with its prompts shared where that runs fewer tokens (`logprob_forward`).

    ``variable``: the number of micro-batches is not DeepSpeed's gradient_accumulation_steps (micro-batches by
    token budget, `TokenBatching`): the ranks agree on the largest count, a rank with fewer runs the rest on a
    dummy row with a zero loss (each ZeRO-3 forward and backward is a collective), and the accumulation
    boundary is set by hand on the last one (``engine.set_gradient_accumulation_boundary``), so DeepSpeed
    reduces and steps exactly once. Without it the count must equal gradient_accumulation_steps.

    ``loss_closure(logprobs_bt, mb) -> (loss, metrics)`` must normalise by GLOBAL counts (all
    micro-batches of all ranks), so the losses sum to the full-batch loss L. DeepSpeed applies
    (1 / world) * sum_ranks (1 / GAS) * sum_mb grad(loss_mb); backward on world * loss_mb without
    the 1/GAS scaling makes that sum_ranks sum_mb grad(loss_mb) = grad(L).

    Returns ``loss`` = L (summed over micro-batches and ranks), the closure's metrics aggregated over
    micro-batches and ranks by `grpo.metrics.aggregate_rollout_metrics` (mean; min / max by name),
    ``grad_norm`` = |grad(L)| before clipping, and ``lr``, the learning rate this step used.
    """
    gas = engine.gradient_accumulation_steps()
    if not variable and len(micro_batches) != gas:
        raise ValueError(
            f"train_on_batch got {len(micro_batches)} micro-batches but DeepSpeed steps every "
            f"gradient_accumulation_steps={gas}: each rank needs policy.train_global_batch_size / world_size "
            "rows split into micro-batches of policy.train_micro_batch_size"
        )
    n_all = len(micro_batches)
    if variable:
        n_all = int(all_reduce(torch.tensor([len(micro_batches)], device=comm_device()), op="max").item())
    world = engine.dp_world_size
    lr = engine.get_lr()[0]
    engine.train()
    loss_sum, mb_metrics = 0.0, []
    try:
        for i in range(n_all):
            if variable:
                engine.set_gradient_accumulation_boundary(i == n_all - 1)
            if i >= len(micro_batches):  # a dummy: the collectives of a forward and a backward, zero gradient
                dummy = torch.zeros((1, 2), dtype=torch.long)
                lp_bt, _, _ = logprob_forward(engine, dummy, torch.ones_like(dummy), temperature, chunk_size)
                engine.backward(lp_bt.sum() * 0.0, scale_wrt_gas=False)
                engine.step()
                continue
            mb = to_device(micro_batches[i], engine.device)
            ids_bt, mask_bt = mb.input_ids_bt, mb.attention_mask_bt
            prompt_lens_b = prompt_lengths(mb.token_mask_bt, mask_bt) if share_prompts else None
            logprobs_bt, unfiltered_bt, extras = logprob_forward(engine, ids_bt, mask_bt, temperature, chunk_size,
                                                          top_k=top_k, top_p=top_p, prompt_lens_b=prompt_lens_b,
                                                          needs=needs, packing=packing, media=mb.media)
            if needs_filter(top_k, top_p):
                mb = with_fields(mb, unfiltered_logprobs_bt=unfiltered_bt)
            loss, metrics = loss_closure(logprobs_bt, mb, **extras)
            engine.backward(loss * world, scale_wrt_gas=False)
            engine.step()
            loss_sum += float(loss.detach())
            mb_metrics.append({k: _to_python(v) for k, v in metrics.items()})
    finally:
        if variable:  # back to DeepSpeed's own counting (the engine hands it to the optimizer on each backward)
            engine._is_gradient_accumulation_boundary = None
    total = all_reduce(torch.tensor([loss_sum], dtype=torch.float64, device=comm_device()))
    grad_norm = engine.get_global_grad_norm()
    return {**aggregate_rollout_metrics(all_gather_objects(mb_metrics)), "loss": float(total.item()),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": lr}


def token_micro_batches(batch: TrainBatch, batching: TokenBatching) -> list[TrainBatch]:
    """``batch``'s rows in `TokenBatching.groups`, each micro-batch trimmed to its longest row (a dynamic batch
    then padded to its rounded width)."""
    out = []
    for rows in batching.groups(batch.attention_mask_bt.sum(dim=1).tolist()):
        mb = trim_padding(select_rows(batch, rows))
        if not batching.packed:
            mb = pad_columns(mb, batching.width(mb.input_ids_bt.shape[1], batch.input_ids_bt.shape[1]))
        out.append(mb)
    return out


# --------------------------------------------------------------------------------------------------
# The step phases that run them (under the loops' "logprobs" and "train" banners)
# --------------------------------------------------------------------------------------------------
@dataclass
class LogprobEngines:
    """The engines `step_logprobs` scores with; None where the run skips them (`grpo.config.resolve_skip_flags`).
    ``teachers``: on-policy distillation's, one engine per loaded checkpoint by its primary alias
    (`grpo.distillation.shared_teachers`); empty without distillation."""

    prev: object | None
    reference: object | None
    teachers: dict[str, object] = field(default_factory=dict)  # on the training ranks, by alias
    teacher_ranks: object | None = None  # a grpo.system.teacher.RemoteTeacher: the teacher on ranks of its own


def gather_logprobs(engine, batch: TrainBatch, rank: int, world_size: int, temperature: float,
                    micro_batch_size: int, chunk_size: int | None = None, share_prompts: bool = False,
                    batching: TokenBatching | None = None, **top) -> torch.Tensor:
    """Logprobs ``[B, T]`` of the whole batch: each rank scores its share, then all ranks gather. ``top``:
    the sampler's ``top_k`` / ``top_p`` (`grpo.system.training.compute_logprobs`); ``share_prompts``: a prompt that
    several rows share goes through the model once (`grpo.system.shared_prefix`); ``batching``: micro-batches by
    token budget (`TokenBatching`)."""
    B, T = batch.input_ids_bt.shape
    sl = rank_slice(B, rank, world_size)
    attn = batch.attention_mask_bt[sl]
    t_local = max(int(attn.sum(dim=1).max().item()), 1) if len(attn) else 1
    prompt_lens_b = prompt_lengths(batch.token_mask_bt[sl], attn) if share_prompts else None
    lp = compute_logprobs(engine, batch.input_ids_bt[sl, :t_local], attn[:, :t_local], temperature,
                          micro_batch_size, chunk_size, prompt_lens_b=prompt_lens_b, batching=batching,
                          media=batch.media[sl] if batch.media is not None else None, **top)
    lp = torch.nn.functional.pad(lp.float().cpu(), (0, T - lp.shape[1]))
    return torch.cat(all_gather_objects([lp]), dim=0)


def step_logprobs(cfg, batch: TrainBatch, engines: LogprobEngines, rank: int, world_size: int) -> TrainBatch:
    """Previous-policy, reference and teacher logprobs ``[B, T]`` under the current weights (a collective).

    The previous policy's are scored under the sampling distribution (temperature, top-k, top-p: what the
    generation logprobs are), the reference's and teachers' with the temperature only, as NeMo-RL; each row by its own
    teacher (`teacher_logprobs`). A teacher on ranks of its own (``engines.teacher_ranks``,
    `grpo.system.teacher.RemoteTeacher`) gets the rows first and scores them while the trainers score the others; its
    logprobs come back padded to the batch's width."""
    remote = engines.teacher_ranks
    if remote is not None:
        remote.submit(batch)

    def score(engine, sampled: bool = False, rows: TrainBatch = batch):
        return None if engine is None else frozen_logprobs(cfg, rows, engine, rank, world_size, sampled)

    prev, ref = score(engines.prev, sampled=True), score(engines.reference)
    if remote is not None:
        teacher = remote.result(batch.input_ids_bt.shape[1])
    else:
        teacher = teacher_logprobs(cfg, batch, engines.teachers, lambda engine, rows: score(engine, rows=rows))
    return batch.replace(prev_logprobs_bt=prev, ref_logprobs_bt=ref, teacher_logprobs_bt=teacher)


def frozen_logprobs(cfg, batch: TrainBatch, engine, rank: int, world_size: int, sampled: bool = False) -> torch.Tensor:
    """An engine's logprobs ``[B, T]`` of the batch without training it (a collective of ``world_size`` ranks, each
    scoring its share), micro-batched as ``cfg.policy`` says: under the sampling distribution (``sampled``:
    temperature, top-k, top-p; the previous policy) or with the temperature only (the reference and teachers). The same
    call on the training ranks and on teacher ranks of their own (`grpo.system.teacher`, whose ``batch`` is a
    `grpo.system.teacher.ScoreRequest`: the fields read here)."""
    p, gen = cfg.policy, cfg.policy.generation
    top = dict(top_k=gen.top_k, top_p=gen.top_p) if sampled else {}
    return gather_logprobs(engine, batch, rank, world_size, gen.temperature, p.logprob_batch_size,
                           p.logprob_chunk_size, shares_prompts(p.shared_prompt_forward, engine.module),
                           batching=token_batching(p, "logprob"), **top)


def teacher_logprobs(cfg, batch: TrainBatch, teachers: dict[str, object],
                     score: Callable[[object, TrainBatch], torch.Tensor]) -> torch.Tensor | None:
    """Each row's logprobs ``[B, T]`` under its own teacher (`grpo.distillation.rows_by_teacher`: by its NeMo-Gym agent
    or task), None without teachers. ``score(engine, rows)`` is the collective `gather_logprobs` of a batch; every
    rank holds the whole batch, so every rank routes alike and scores the same sub-batches in the same order. One
    teacher for every row scores the batch as it is (the single teacher's path)."""
    if not teachers:
        return None
    rows = rows_by_teacher([trajectory_teacher_key(t) for t in batch.trajectories], cfg.on_policy_distillation)
    if len(rows) == 1:
        return score(teachers[next(iter(rows))], batch)
    out_bt = torch.zeros(batch.input_ids_bt.shape, dtype=torch.float32)
    for alias, index in rows.items():
        out_bt[index] = score(teachers[alias], batch.select(index))
    return out_bt


def train_step(cfg, policy, batch: TrainBatch, rank: int, world_size: int,
               loss_fn: Callable[[LossInputs], tuple[torch.Tensor, dict]] = clipped_pg_loss_fn) -> list[dict]:
    """One optimizer step per ``policy.train_global_batch_size`` samples of the batch; returns each step's
    metrics (`grpo.system.training.train_on_batch`).

    Each rank trains its shard in micro-batches; ``loss_fn(inputs) -> (loss, metrics)`` gets a
    `grpo.loss.LossInputs` per micro-batch (the logprobs with grad, the micro-batch, ``cfg``, and the global
    valid-token / valid-sequence counts of the optimizer step, `grpo.metrics.global_valid_counts`) and must
    normalise by those counts, so the update does not depend on micro-batching or world size. The default,
    `grpo.loss.clipped_pg_loss_fn`, is `grpo.loss.clipped_pg_loss`. A ``loss_fn.needs`` of ``("entropy",)`` /
    ``("logits",)`` (`grpo.loss.loss_needs`) adds ``inputs.entropy_bt`` / ``inputs.logits_btv`` from the same
    forward. A micro-batch with a non-finite loss makes its optimizer step a no-op
    (`grpo.system.health.skip_nonfinite_loss`).
    """
    p, gen = cfg.policy, cfg.policy.generation
    needs = loss_needs(loss_fn)
    batching = token_batching(p, "train")
    results = []
    # Optimizer steps count samples: a sample's branch rows (TrainBatch.branch_b) train in its step, and then a rank
    # has more rows than gradient_accumulation_steps micro-batches hold: its count varies (as under token batching).
    branched = not bool(batch.first_rows().all())
    for rows in sample_chunks(batch, p.train_global_batch_size):
        mine = batch.select(rows).shard(rank, world_size)
        n_tokens, n_seqs = global_valid_counts(mine.token_mask_bt, mine.sample_mask_b)
        n_correct = None  # VAPO's NLL normaliser: the step's valid tokens of samples with reward > 0
        if cfg.loss_fn.positive_example_nll_weight > 0:
            n_correct, _ = global_valid_counts(mine.token_mask_bt, mine.sample_mask_b * (mine.rewards_b > 0))

        def loss_closure(logprobs_bt, mb: TrainBatch, n_tokens=n_tokens, n_seqs=n_seqs, n_correct=n_correct, **extras):
            return loss_fn(LossInputs(logprobs_bt, mb, cfg, global_valid_tokens=n_tokens, global_valid_seqs=n_seqs,
                                      global_correct_tokens=n_correct, **extras))

        mbs = (mine.micro_batches(p.train_micro_batch_size) if batching is None
               else token_micro_batches(mine, batching))
        results.append(train_on_batch(policy, mbs, skip_nonfinite_loss(loss_closure), temperature=gen.temperature,
                                      top_k=gen.top_k, top_p=gen.top_p,
                                      share_prompts=shares_prompts(p.shared_prompt_forward, policy.module),
                                      needs=needs, variable=batching is not None or branched,
                                      packing=batching.packing() if batching is not None else None))
    return results


def mult_prob_error(engine, outputs: list, pad_id: int, temperature: float = 1.0) -> float:
    """token_mult_prob_error of plain generation outputs against ``engine``: the mean over generated tokens of
    exp|generation logprob − engine logprob| (1.0: the two agree). A check of a generation backend."""
    b = build_batch(single_turn(outputs), pad_id)
    ref_bt = compute_logprobs(engine, b.input_ids_bt, b.attention_mask_bt, temperature, micro_batch_size=len(b))
    mask_bt = b.token_mask_bt
    return float((torch.exp((b.generation_logprobs_bt - ref_bt).abs()) * mask_bt).sum() / mask_bt.sum())
