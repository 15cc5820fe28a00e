"""The `hf` generation backend: transformers models on a plain, unsharded copy of the policy.

Each rank holds one copy; `refit` fills it from the ZeRO engine a few whole decoder layers at a time
(`grpo.system.weights.iter_gathered_params`). Generation is greedy decoding over `SeededSampler`'s scores
(filtered logits + per-sample Gumbel noise), with the KV cache, left padding and chunks of
`policy.generation_batch_size` prompts; a prompt that several rows of a chunk share is prefilled once
(``policy.shared_prompt_forward``). Per-sample limits (length cap, stop strings) are applied by a
per-row stop check and, exactly, by `cut_completion` afterwards, so a sample never depends on
the other rows of its chunk.

Two decode loops give the same samples (`policy.generation.hf_drop_finished_rows`): `decode_dropping_finished`,
this module's own loop over the model's KV cache, takes ended rows out of the batch and its cache (once they are
a quarter of it), so a chunk costs about the sum of its samples' lengths rather than its longest sample times its rows; transformers'
`generate` (false) decodes every row until the chunk's last one ends.

A decode step's work besides the matmuls, and what is done about it (the numbers stay those of transformers' own
cache and attention, bit for bit): the KV cache is written in place (`PreallocatedLayer`; transformers concatenates,
copying the whole cache every token), and a grouped-query model's masked attention hands its key/value heads to the
kernel (`sdpa_sharing_kv_heads`; transformers copies them ``num_key_value_groups`` times first).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
from transformers import (AttentionInterface, DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList)
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grpo.system.cpu_linear import packed_weights
from grpo.system.engines import DTYPES, apply_lora
from grpo.system.weights import iter_gathered_params
from grpo.system.generation.base import GenerationBackend, GenerationOutput, cut_completion, length_caps, per_sample_stops
from grpo.system.generation.sampling import SeededSampler
from grpo.system.shared_prefix import cache_for_rows, distinct_rows, shares_prompts
from grpo.system.vision import generate_keywords, image_keywords, multimodal_positions


def hits_stop_string(tail_ids: list[int], stops: list[str], decode) -> bool:
    """Whether the decoded tail of a row holds one of its stop strings."""
    return bool(stops) and any(s in decode(tail_ids) for s in stops)


class _RowLimits(StoppingCriteria):
    """Marks a row done once it has ``cap_b`` new tokens or its recent text holds one of its stop strings.

    Only an early exit: it never stops a row before `cut_completion` would end it (a stop string in
    the decoded tail of the last ``window`` tokens is also in the whole text).
    """

    def __init__(self, prompt_len: int, caps_b: torch.Tensor, stop_strings: list[list[str]], decode, window: int):
        self.prompt_len, self.caps_b, self.stop_strings = prompt_len, caps_b, stop_strings
        self.decode, self.window = decode, window

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        new_bt = input_ids[:, self.prompt_len:]
        done_b = self.caps_b.to(input_ids.device) <= new_bt.shape[1]
        if any(self.stop_strings):
            hit_b = [hits_stop_string(row[-self.window:], stops, self.decode)
                     for row, stops in zip(new_bt.tolist(), self.stop_strings)]
            done_b = done_b | torch.tensor(hit_b, device=input_ids.device)
        return done_b


class PreallocatedLayer(DynamicLayer):
    """transformers' `DynamicLayer` whose decode steps write into preallocated room instead of concatenating.

    `DynamicLayer` concatenates every step's keys and values to the cache: a new tensor each token, the whole cache
    copied. Here the first update (the prefill) is kept as given (contiguous, as the concatenation makes it); the
    next one moves the cache into buffers (``[B, H, room, D]``) with room for twice its length, up to ``capacity``
    (the most positions the caller will write), and steps write their positions in place until the room is full
    (then the buffers move again, as twice as large): a few moves per call instead of one per token, and never more
    than twice the memory of the filled part (as `DynamicLayer`'s concatenation briefly takes). ``keys`` /
    ``values`` are views of the filled part: attention reads the same numbers in the same shape. Where something
    replaced ``keys`` (transformers' own cache methods), the next update moves it into new buffers."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._keys_bhcd = self._values_bhcd = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self.keys, self.values = key_states.contiguous(), value_states.contiguous()
            return self.keys, self.values
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if not self._holds_keys() or end > self._keys_bhcd.shape[-2]:
            room = min(2 * end, self.capacity) if end <= self.capacity else 2 * end
            self._keys_bhcd, self._values_bhcd = (_with_room(x, room) for x in (self.keys, self.values))
        self._keys_bhcd[:, :, start:end] = key_states
        self._values_bhcd[:, :, start:end] = value_states
        self.keys, self.values = self._keys_bhcd[:, :, :end], self._values_bhcd[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (their room too, once there are buffers)."""
        if not self._holds_keys():
            return super().batch_select_indices(indices)
        n = self.keys.shape[-2]
        self._keys_bhcd, self._values_bhcd = self._keys_bhcd[indices], self._values_bhcd[indices]
        self.keys, self.values = self._keys_bhcd[:, :, :n], self._values_bhcd[:, :, :n]

    def _holds_keys(self) -> bool:
        """Whether ``keys`` is still the view of the buffers this layer last gave out."""
        return (self._keys_bhcd is not None and self.keys is not None and self.keys.shape[0] == self._keys_bhcd.shape[0]
                and self.keys.data_ptr() == self._keys_bhcd.data_ptr())


def _with_room(x_bhld: torch.Tensor, room: int) -> torch.Tensor:
    """``[B, H, room, D]``: ``x_bhld`` in its first L positions, the rest uninitialised."""
    out_bhrd = x_bhld.new_empty((*x_bhld.shape[:2], room, x_bhld.shape[3]))
    out_bhrd[:, :, :x_bhld.shape[2]] = x_bhld
    return out_bhrd


def preallocated_cache(model, capacity: int):
    """A `DynamicCache` for ``model`` whose layers are `PreallocatedLayer`s of ``capacity`` positions; None (the model
    makes its own cache) where a layer is not plain full attention (sliding windows, linear attention)."""
    cache = DynamicCache(config=model.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


_generating_here = threading.local()  # .on: this thread is inside `sharing_kv_heads`


def sdpa_sharing_kv_heads(module, query, key, value, attention_mask, **kwargs):
    """transformers' "sdpa" attention (registered in its place), except inside `sharing_kv_heads` without autograd on
    the CPU: there a grouped-query layer's masked attention hands its key/value heads to the kernel
    (``enable_gqa=True``, query head h reads key/value head h // groups) where transformers first copies each
    ``num_key_value_groups`` times (it does so whenever there is a mask). The kernel computes the same numbers."""
    if (not getattr(_generating_here, "on", False) or torch.is_grad_enabled() or attention_mask is None
            or getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out_bhqd = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"),
        enable_gqa=True)
    return out_bhqd.transpose(1, 2).contiguous(), None


AttentionInterface.register("sdpa", sdpa_sharing_kv_heads)


@contextmanager
def sharing_kv_heads():
    """For the block, this thread's "sdpa" attention shares key/value heads in the kernel (`sdpa_sharing_kv_heads`);
    other threads (a training step beside the async loop's generation thread) keep transformers' own."""
    saved = getattr(_generating_here, "on", False)
    _generating_here.on = True
    try:
        yield
    finally:
        _generating_here.on = saved


# Ended rows leave the batch once they are this share of it. Dropping copies the kept rows' KV cache (as each step's
# cache append does); rows that ended cost their cache append and attention every step they stay. At 1/4 the copy
# is repaid within about three steps, and the batch never holds more than 4/3 of its live rows.
DROP_ENDED_SHARE = 0.25


@torch.no_grad()
def decode_dropping_finished(model, ids_bt: torch.Tensor, mask_bt: torch.Tensor, cache, sampler: SeededSampler,
                             caps: list[int], stop_token_ids: list[int], stops: list[list[str]], decode,
                             window: int, pad_id: int, images: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode left-padded prompts ``ids_bt`` until each row ends, each step running only the rows not yet ended.

    Returns ``(tokens [B, max(caps)], logprobs [B, max(caps)])``: row b's generated tokens (the rest is ``pad_id`` /
    0), ending at its first stop token, its cap, or once its last ``window`` tokens hold one of its stop
    strings (`cut_completion` then finds the exact end). ``cache``: the KV cache of ``ids_bt[:, :-1]`` (a shared
    prompt's prefill) or None (prefill here, into a `preallocated_cache`). Rows that ended leave the batch once they
    are `DROP_ENDED_SHARE` of it: their rows of the KV cache (``cache.batch_select_indices``), of the attention mask
    and their generators; the others' tokens are those they would be with them present (each row attends to its own
    cache only and draws its own noise), up to float rounding (a row's matmul results can move by an ulp with the
    batch it sits in: measured on the bench model, 4 of 64 rows' logprobs by 4.8e-7 when rows left at other steps),
    and until they leave their tokens are not recorded. A cache that cannot select
    rows keeps them all. Positions are those transformers' generate gives: the count of the row's earlier tokens
    under the attention mask, or an M-RoPE model's own (`grpo.system.vision.multimodal_positions`, ``[3, B, L]``; a
    generated token's are its predecessor's plus one, as the model's rope deltas give).
    ``images``: the rows' image tensors (`grpo.system.media.collate_media`), given to the prefill only (the KV cache
    holds what they became).
    """
    B, T = ids_bt.shape[0], max(caps)
    device = ids_bt.device
    tokens_bt = torch.full((B, T), pad_id, dtype=torch.long)
    logprobs_bt = torch.zeros((B, T))
    stop_ids = torch.tensor(stop_token_ids, device=device)
    caps_b = torch.tensor(caps, device=device)
    L = ids_bt.shape[1]
    if cache is None:                                     # prefill every prompt token
        cache = preallocated_cache(model, L + T)
        step_ids = ids_bt
        positions = multimodal_positions(model, ids_bt, mask_bt, images or {}).get(
            "position_ids", (mask_bt.cumsum(-1) - 1).masked_fill(mask_bt == 0, 0))
    else:                                                 # the cache holds all but the prompts' last token
        step_ids = ids_bt[:, -1:]
        positions = mask_bt.sum(-1, keepdim=True) - 1
    rows_a = torch.arange(B, device=device)               # the samples still in the batch, in batch order
    alive_a = torch.ones(B, dtype=torch.bool, device=device)  # not ended (all of them once ended rows are dropped)
    mask_ac = torch.cat([mask_bt, mask_bt.new_ones((B, T))], dim=1)  # step t attends to the first L + t positions
    for t in range(T):
        out = model(input_ids=step_ids, attention_mask=mask_ac[:, :L + t], position_ids=positions,
                    past_key_values=cache, use_cache=True, **((images or {}) if t == 0 else {}))
        cache = out.past_key_values
        if cache is None:
            raise RuntimeError(f"HFGeneration: {type(model).__name__} returned no KV cache; generate with "
                               "policy.generation.hf_drop_finished_rows=false (transformers' generate)")
        tok_a, lp_a, _ = sampler.sample(out.logits[:, -1].float(), rows_a.tolist())
        del out
        live = alive_a.nonzero()[:, 0]
        rows = rows_a[live].tolist()
        tokens_bt[rows, t], logprobs_bt[rows, t] = tok_a[live].cpu(), lp_a[live].float().cpu()
        done_a = torch.isin(tok_a, stop_ids) | (caps_b[rows_a] <= t + 1)
        if any(stops[r] for r in rows):
            tails = tokens_bt[rows_a.tolist(), max(0, t + 1 - window):t + 1].tolist()
            hit = [hits_stop_string(tail, stops[r], decode) for tail, r in zip(tails, rows_a.tolist())]
            done_a |= torch.tensor(hit, device=device)
        alive_a &= ~done_a
        if not bool(alive_a.any()):
            break
        n_ended = len(rows_a) - int(alive_a.sum())
        if n_ended and n_ended >= DROP_ENDED_SHARE * len(rows_a) and hasattr(cache, "batch_select_indices"):
            keep = alive_a.nonzero()[:, 0]                   # drop the rows that ended
            cache.batch_select_indices(keep)
            rows_a, alive_a, mask_ac, tok_a = (x[keep] for x in (rows_a, alive_a, mask_ac, tok_a))
            positions = positions.index_select(-2, keep)  # [B, 1] or M-RoPE's [3, B, 1]
        step_ids, positions = tok_a[:, None], positions[..., -1:] + 1
    return tokens_bt, logprobs_bt


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


@contextmanager
def _generating(model, generation_config, rows: int):
    """``model`` in eval mode with ``generation_config`` for the block, its oneDNN layers' weights packed for
    ``rows``-row decode steps (`grpo.system.cpu_linear.packed_weights`); its mode and config restored after."""
    training, saved = model.training, model.generation_config
    model.eval()
    model.generation_config = generation_config
    try:
        with sharing_kv_heads(), packed_weights(model, rows):
            yield
    finally:
        model.generation_config = saved
        model.train(training)


class HFGeneration(GenerationBackend):
    """`GenerationBackend` on transformers. ``model``: use this plain model instead of a copy built
    from ``model_config`` (the copy needs `refit` before the first `generate`).

    ``shared=True``: ``model`` is the training engine's own module (its weights are whole on every rank:
    ZeRO-1/2); it is generated from as is, in eval mode for the call, and `refit` has nothing to copy. No
    second copy of the weights, no copying after each step (TRL does the same with its policy). With LoRA
    (``policy.lora``) both generate with the adapters on: the shared module is the peft model itself; the copy is
    a peft model whose `refit` moves only the adapters after the first."""

    def __init__(self, policy_cfg, tokenizer, model_config, device, *, model=None,
                 refit_bucket_numel: int = 2**28, shared: bool = False):
        from grpo.system.vision import auto_model_class, prepare_model

        self.cfg = getattr(policy_cfg, "policy", policy_cfg)
        self.sampling = self.cfg.generation.sampling()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.refit_bucket_numel = refit_bucket_numel
        self.shared = shared
        self._has_weights = model is not None
        if model is None:
            model = prepare_model(auto_model_class(model_config).from_config(
                model_config, dtype=DTYPES[self.cfg.precision], trust_remote_code=self.cfg.trust_remote_code),
                linear_kernel=self.cfg.cpu_linear_kernel)
            if self.cfg.lora.enabled:  # the same adapters as the policy's: refit moves only them after the first
                model = apply_lora(model, self.cfg.lora, vision_tower=self.cfg.vision.lora_vision_tower)
        self.model = model if shared else model.to(self.device).eval().requires_grad_(False)
        cfg_eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
        self.stop_token_ids = sorted(set(_as_list(tokenizer.eos_token_id) + _as_list(cfg_eos)
                                         + _as_list(self.cfg.generation.stop_token_ids)))
        if not self.stop_token_ids:
            raise ValueError("no stop token: the tokenizer has no eos_token and policy.generation.stop_token_ids "
                             "is empty")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        # A clean generation config: nothing from the checkpoint's (repetition penalty, sampling defaults). It is
        # set on the model only while generating (a shared training module exports its own).
        self._generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=self.stop_token_ids, pad_token_id=self.pad_id
        )
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stop_window(self, stops: list[list[str]]) -> int:
        """Tokens of decoded tail that surely hold any of these stop strings (a token has >= 1 character)."""
        return 4 * max((len(s) for row in stops for s in row), default=1) + 4

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], *, greedy: bool = False,
                 max_new_tokens=None, stop_strings=None, sampling=None,
                 media: list | None = None) -> list[GenerationOutput]:
        """See `grpo.system.generation.base.GenerationBackend.generate`. ``media``: each prompt's image tensors
        (`grpo.system.vision`; None: a text prompt), for a vision-language model whose ``prompt_ids`` hold the
        processor-expanded placeholders (they go to the model as they are)."""
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        if not self._has_weights:
            raise RuntimeError("HFGeneration: call refit(engine) before generate (the copy holds random weights)")
        sampling = sampling or self.sampling
        caps = length_caps([len(p) for p in prompt_ids], max_new_tokens or sampling.max_new_tokens,
                           self.cfg.max_total_sequence_length)
        stops = per_sample_stops(stop_strings, sampling.stop_strings, len(prompt_ids))
        bs = self.cfg.generation_batch_size
        out: list[GenerationOutput] = []
        with _generating(self.model, self._generation_config, min(bs, len(prompt_ids))):
            for i in range(0, len(prompt_ids), bs):
                out += self._generate_chunk(prompt_ids[i:i + bs], seeds[i:i + bs], caps[i:i + bs], stops[i:i + bs],
                                            greedy, sampling, (media or [None] * len(prompt_ids))[i:i + bs])
        return out

    def _generate_chunk(self, prompts, seeds, caps, stops, greedy, sampling, media) -> list[GenerationOutput]:
        B, L = len(prompts), max(len(p) for p in prompts)
        ids_bt = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask_bt = torch.zeros((B, L), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding
            ids_bt[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask_bt[b, L - len(p):] = 1
        sampler = SeededSampler(seeds, sampling.temperature, sampling.top_k, sampling.top_p, greedy, self.device)
        ids_bt, mask_bt = ids_bt.to(self.device), mask_bt.to(self.device)
        images = image_keywords(self.model, media, self.device)  # rows in order: each row's placeholders, its images
        cache = self._shared_prompt_cache(ids_bt, mask_bt, max(caps)) if not images and shares_prompts(
            self.cfg.shared_prompt_forward, self.model) else None
        if self.cfg.generation.hf_drop_finished_rows:
            new_bt, lp_bt = decode_dropping_finished(
                self.model, ids_bt, mask_bt, cache, sampler, caps, self.stop_token_ids, stops, self._decode,
                self._stop_window(stops), self.pad_id, images)
            chosen_bt = new_bt
        else:
            limits = _RowLimits(L, torch.tensor(caps), stops, self._decode, self._stop_window(stops))
            hf_config = GenerationConfig(max_new_tokens=max(caps), do_sample=False, num_beams=1, use_cache=True,
                                         eos_token_id=self.stop_token_ids, pad_token_id=self.pad_id,
                                         bos_token_id=self.tokenizer.bos_token_id)
            if cache is None:
                cache = preallocated_cache(self.model, L + max(caps))
            seqs_bt = self.model.generate(input_ids=ids_bt, attention_mask=mask_bt, past_key_values=cache,
                                          generation_config=hf_config, logits_processor=LogitsProcessorList([sampler]),
                                          stopping_criteria=StoppingCriteriaList([limits]), **images,
                                          **generate_keywords(self.model, ids_bt, images))
            new_bt = seqs_bt[:, L:].cpu()
            chosen_bt = torch.stack(sampler.tokens, dim=1).cpu()[:, :new_bt.shape[1]]
            lp_bt = torch.stack(sampler.logprobs, dim=1).float().cpu()[:, :new_bt.shape[1]]
        del cache
        outputs = []
        for b in range(B):
            ids = new_bt[b].tolist()
            n, reason = cut_completion(ids, caps[b], self.stop_token_ids, stops[b], self._decode)
            if chosen_bt[b, :n].tolist() != ids[:n]:
                raise RuntimeError("HFGeneration: generate did not pick the sampler's tokens (a logits processor "
                                   "after SeededSampler?)")
            outputs.append(GenerationOutput(prompt_ids=list(prompts[b]), completion_ids=ids[:n],
                                            logprobs=lp_bt[b, :n].tolist(), finish_reason=reason,
                                            text=self._decode(ids[:n])))
        return outputs

    def _shared_prompt_cache(self, ids_bt: torch.Tensor, mask_bt: torch.Tensor, max_new: int = 0):
        """The KV cache of the chunk's left-padded prompts but their last token, each distinct prompt computed
        once and copied to the rows that share it (G samples of a prompt: (G - 1) / G of the prefill saved);
        None when no prompt repeats. `generate` then runs from the prompts' last token, as it would after its
        own prefill (positions from the attention mask, as `generate` computes them)."""
        row_prompt, first = distinct_rows(ids_bt.tolist())
        if len(first) == len(row_prompt) or ids_bt.shape[1] < 2:
            return None
        first_u = torch.tensor(first, device=ids_bt.device)
        ids_ul, mask_ul = ids_bt[first_u, :-1], mask_bt[first_u, :-1]
        positions_ul = (mask_ul.cumsum(-1) - 1).masked_fill(mask_ul == 0, 1)
        out = self.model(input_ids=ids_ul, attention_mask=mask_ul, position_ids=positions_ul, use_cache=True,
                         past_key_values=preallocated_cache(self.model, ids_bt.shape[1] + max_new))
        return cache_for_rows(out, torch.tensor(row_prompt, device=ids_bt.device))

    def refit(self, engine) -> float:
        """Copy the engine's weights into this copy, a bucket of whole layers at a time (collective); nothing
        to do when the model is the engine's own (``shared``). With LoRA the copy is a peft model too: the first
        refit copies everything, later ones only the adapters (the base weights never change)."""
        if self.shared:
            return 0.0
        t0 = time.perf_counter()
        adapters_only = self._has_weights and self.cfg.lora.enabled
        params = {name: p for name, p in self.model.named_parameters() if ".lora_" in name or not adapters_only}
        seen = set()
        with torch.no_grad():
            for bucket in iter_gathered_params(engine, self.refit_bucket_numel, trainable_only=adapters_only):
                for name, full in bucket:
                    if name not in params:
                        raise KeyError(f"refit: engine parameter {name!r} has no counterpart in the generation copy")
                    params[name].copy_(full)
                    seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise KeyError(f"refit: the engine did not provide {missing[:5]} ({len(missing)} parameters)")
        self._has_weights = True
        return time.perf_counter() - t0

    def load_buckets(self, buckets, expected: list[str], reset_cache: bool = True) -> None:
        """Copy ``(name, tensor)`` buckets into the copy (a generation rank: the weights come over the bridge,
        `grpo.system.generation.remote`); every parameter of ``expected`` must arrive, and only known ones.
        ``reset_cache``: nothing to reset (no cache outlives a generate call)."""
        params = dict(self.model.named_parameters())
        seen = set()
        with torch.no_grad():
            for bucket in buckets:
                for name, full in bucket:
                    if name not in params:
                        raise KeyError(f"load: parameter {name!r} has no counterpart in the generation copy")
                    params[name].copy_(full)
                    seen.add(name)
        missing = sorted((set(params) | set(expected)) - seen)
        if missing:
            raise KeyError(f"load: no weights arrived for {missing[:5]} ({len(missing)} parameters)")
        self._has_weights = True

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        self.model = None
