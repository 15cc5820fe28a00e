"""Each distinct prompt through the model once: the logprobs of a batch whose rows share prompts.

A GRPO batch holds G completions of every prompt. The plain forward runs the prompt G times; here the
distinct prompts run once (a forward with the KV cache on), their keys and values are copied to the
rows that share them, and a second forward runs the rest of each row (its generated turns, and what
came between them) on top:

    forward 1:  the U distinct prompts  p_u = ids[b, :P_b]          (right-padded to max P_u)
    forward 2:  each row's continuation ids[b, P_b - 1 : len_b]      over the cache of its prompt

with ``P_b`` the row's first generated position (`prompt_lengths`). Forward 2 runs in length groups
(`length_groups`): rows of similar continuation length together, each group padded to its own longest
continuation rather than every row to the batch's longest (the rows of a GRPO batch end anywhere between
one token and the cap). Forward 2 starts one token early, at
the prompt's last token, whose logits score the first generated token; that token's cache entry from
forward 1 is masked out, so every token is seen once, at its own position (``position_ids`` are the
tokens' positions in the row). The causal attention, the positions and the gradient are those of the
plain forward (the copies of the cache sum their gradients back into the prompt's forward); only the
float rounding of differently shaped matmuls and attentions differs (about 1e-6 in fp32; a row's attention sums
over as many keys as its group's cache plus continuation holds, so the grouping changes the rounding too).

Saved: (G - 1) / G of the prompt tokens' forward (and backward, in training), and the continuations' padding
beyond their group's longest. The price: a forward call per length group beyond the prompts' (a parameter
gather each under ZeRO-3) and the cache's copies, so the rows are run
the plain way when no prompt repeats, when a prompt has fewer than 2 tokens, when the model returns no
cache (gradient checkpointing in training turns it off), and as ``policy.shared_prompt_forward`` says
(`shares_prompts`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo.system.vision import is_vision_config

# (logits [N, L, V], input_ids [N, L]) -> (logprobs [N, L], unfiltered logprobs [N, L]), contract-aligned
LogprobFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

AUTO_MIN_PARAMS = 10_000_000

# A length group's forward call, in padded slots (tokens through the model): a group of its own is made only where
# it saves more padding than this. On the bench model (25.2M parameters, 8 layers, 2 threads) a slot's forward and
# backward take about 1.3 ms (3.0 s for 2,312 slots), a call's own dispatch (8 layers, forward and backward) a few
# ms: 64 slots leaves a wide margin. The bench workload gets 2-3 groups (2,312 -> ~1,950 slots), the long tail ~10.
GROUP_CALL_SLOTS = 64


def shares_prompts(setting, module: torch.nn.Module) -> bool:
    """``policy.shared_prompt_forward`` for this model: True / False as set; ``"auto"``: a model of at least
    `AUTO_MIN_PARAMS` parameters (a smaller one runs so fast that the second forward call costs more than
    the prompt tokens it saves: measured on the bench workload's 82K-parameter model).

        >>> shares_prompts("auto", torch.nn.Linear(10, 10)), shares_prompts(True, torch.nn.Linear(10, 10))
        (False, True)
    """
    if setting != "auto":
        return bool(setting)
    if is_vision_config(getattr(module, "config", None)):  # a shared prompt's cache would not carry its images
        return False
    return sum(p.numel() for p in module.parameters()) >= AUTO_MIN_PARAMS


def distinct_rows(rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """(each row's number among the distinct rows, the first row of each distinct row), numbered in order of
    first appearance.

        >>> distinct_rows([[1, 2], [3], [1, 2]])
        ([0, 1, 0], [0, 1])
    """
    index: dict[tuple, int] = {}
    of_row, first = [], []
    for b, row in enumerate(rows):
        u = index.setdefault(tuple(row), len(index))
        if u == len(first):
            first.append(b)
        of_row.append(u)
    return of_row, first


def length_groups(lengths: list[int], call_slots: int) -> list[list[int]]:
    """The rows (indices into ``lengths``) in groups that each run padded to their longest, chosen to run the fewest
    slots: Σ over groups of (rows x longest), every group after the first costing ``call_slots`` more. Groups hold
    rows of consecutive lengths, longest group first, rows in their order within a group (an exact dynamic program
    over the distinct lengths).

        >>> length_groups([3, 30, 4, 31], call_slots=8)
        [[1, 3], [0, 2]]
        >>> length_groups([3, 30, 4, 31], call_slots=100)
        [[0, 1, 2, 3]]
    """
    distinct = sorted(set(lengths), reverse=True)          # the groups' longest rows are among these
    count = [sum(1 for n in lengths if n == d) for d in distinct]
    # best[i]: the cheapest split of the rows no longer than distinct[i] into groups; cut[i]: where its first ends
    D = len(distinct)
    best, cut = [0.0] * (D + 1), [D] * (D + 1)
    for i in range(D - 1, -1, -1):
        rows, best[i] = 0, float("inf")
        for j in range(i, D):   # a group of the lengths distinct[i..j], padded to distinct[i]
            rows += count[j]
            cost = rows * distinct[i] + (best[j + 1] + call_slots if j + 1 < D else 0)
            if cost < best[i]:
                best[i], cut[i] = cost, j + 1
    groups, i = [], 0
    while i < D:
        members = set(distinct[i:cut[i]])
        groups.append([b for b, n in enumerate(lengths) if n in members])
        i = cut[i]
    return groups


def selectable_cache(outputs):
    """The KV cache a forward returned (``use_cache=True``); None when there is none that can select rows."""
    cache = getattr(outputs, "past_key_values", None)
    return cache if cache is not None and hasattr(cache, "batch_select_indices") else None


def cache_for_rows(outputs, of_row_b: torch.Tensor):
    """The KV cache of a forward over distinct rows (``use_cache=True``), copied to the rows that share each
    (``of_row_b``: a row's distinct row); None when the model returned no cache that can select rows."""
    cache = selectable_cache(outputs)
    if cache is not None:
        cache.batch_select_indices(of_row_b)
    return cache


def rows_of_cache(cache, of_row_b: torch.Tensor):
    """`cache_for_rows` into a new cache object: the rows ``of_row_b`` of ``cache``, which is left as it is (for the
    next length group)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]   # selecting rows replaces a layer's tensors
    out.batch_select_indices(of_row_b)
    return out


def prompt_lengths(token_mask_bt: torch.Tensor, attention_mask_bt: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's first generated position (its prompt's length); a row with no generated token
    gets its length.

        >>> prompt_lengths(torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
        tensor([2, 3])
    """
    T = token_mask_bt.shape[1]
    first_b = torch.where(token_mask_bt > 0, torch.arange(T, device=token_mask_bt.device), T).min(dim=1).values
    return torch.minimum(first_b, attention_mask_bt.sum(dim=1)).long()


@dataclass
class SharedPrefixPlan:
    """The two forwards' inputs for rows ``ids_bt`` (see the module docstring)."""

    prompt_ids_ul: torch.Tensor      # [U, Lp] the distinct prompts, right-padded
    prompt_mask_ul: torch.Tensor
    row_prompt_b: torch.Tensor       # [B] which distinct prompt a row continues
    cont_ids_bc: torch.Tensor        # [B, C] ids[b, P_b - 1 : len_b], right-padded
    cont_attention_bl: torch.Tensor  # [B, Lp + C] the cache (its prompt minus the last token) + the continuation
    cont_positions_bc: torch.Tensor  # [B, C] positions P_b - 1, P_b, ...
    prompt_lens_b: torch.Tensor      # [B]
    seq_len: int                     # T of the rows
    groups: list[tuple[torch.Tensor, int]]  # forward 2's calls: (rows [n], width C_k: their longest continuation)

    def tokens(self) -> int:
        """Slots the forwards take: the distinct prompts (padded) plus each length group's padded continuations."""
        return self.prompt_ids_ul.numel() + sum(len(rows) * width for rows, width in self.groups)

    def logprobs(self, model, logprob_fn: LogprobFn) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``logprob_fn``'s two ``[B, T]`` outputs for the rows, as one plain forward would give them; None
        when the model returned no cache (the caller runs the plain forward)."""
        out = model(input_ids=self.prompt_ids_ul, attention_mask=self.prompt_mask_ul, use_cache=True)
        cache = selectable_cache(out)
        if cache is None:
            return None
        prompt_lp_ul, prompt_full_ul = logprob_fn(out.logits, self.prompt_ids_ul)
        del out
        C, Lp = self.cont_ids_bc.shape[1], self.prompt_ids_ul.shape[1]
        lps, fulls = [], []
        for rows_n, width in self.groups:   # each group padded to its own longest continuation (width <= C)
            if len(self.groups) == 1:   # one group: every row, the prompts' cache itself copied to them
                cache.batch_select_indices(self.row_prompt_b)
                rows_cache = cache
            else:
                rows_cache = rows_of_cache(cache, self.row_prompt_b[rows_n])
            ids_nc = self.cont_ids_bc[rows_n, :width]
            out = model(input_ids=ids_nc, attention_mask=self.cont_attention_bl[rows_n, :Lp + width],
                        position_ids=self.cont_positions_bc[rows_n, :width], past_key_values=rows_cache,
                        use_cache=True)
            lp_nc, full_nc = logprob_fn(out.logits, ids_nc)
            del out, rows_cache
            lps.append(torch.nn.functional.pad(lp_nc, (0, C - width)))
            fulls.append(torch.nn.functional.pad(full_nc, (0, C - width)))
        del cache
        cont_lp_bc, cont_full_bc = self._in_row_order(lps), self._in_row_order(fulls)
        return self._assemble(prompt_lp_ul, cont_lp_bc), self._assemble(prompt_full_ul, cont_full_bc)

    def _in_row_order(self, per_group: list[torch.Tensor]) -> torch.Tensor:
        """``[B, C]``: the groups' ``[n, C]`` outputs put back in the rows' order."""
        if len(per_group) == 1:
            return per_group[0]
        order_b = torch.cat([rows_n for rows_n, _ in self.groups])
        return torch.cat(per_group)[torch.argsort(order_b)]

    def _assemble(self, prompt_ul: torch.Tensor, cont_bc: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: position t < P_b from the row's prompt, t >= P_b from its continuation (index
        t - P_b + 1: the continuation starts at the prompt's last token)."""
        B, T = cont_bc.shape[0], self.seq_len
        t_bt = torch.arange(T, device=cont_bc.device).expand(B, T)
        p_b1 = self.prompt_lens_b[:, None]
        from_prompt_bt = prompt_ul[self.row_prompt_b].gather(1, t_bt.clamp(max=prompt_ul.shape[1] - 1))
        from_cont_bt = cont_bc.gather(1, (t_bt - p_b1 + 1).clamp(0, cont_bc.shape[1] - 1))
        return torch.where(t_bt < p_b1, from_prompt_bt, from_cont_bt)


def plan_shared_prefix(ids_bt: torch.Tensor, mask_bt: torch.Tensor,
                       prompt_lens_b: torch.Tensor) -> Optional[SharedPrefixPlan]:
    """The plan for right-padded rows ``ids_bt`` whose first ``prompt_lens_b`` tokens are their prompts; None
    when no prompt repeats or a prompt has fewer than 2 tokens (then the plain forward is as cheap)."""
    B, T = ids_bt.shape
    lens_b = mask_bt.sum(dim=1).long()
    p_b = prompt_lens_b.to(ids_bt.device).long()
    if B < 2 or int(p_b.min()) < 2:
        return None
    prefixes = [row[:p] for row, p in zip(ids_bt.cpu().tolist(), p_b.tolist())]
    row_prompt, first = distinct_rows(prefixes)
    if len(first) == B:
        return None
    prompts = [prefixes[b] for b in first]
    Lp = max(len(p) for p in prompts)
    prompt_ids = torch.zeros((len(prompts), Lp), dtype=ids_bt.dtype)
    prompt_mask = torch.zeros((len(prompts), Lp), dtype=mask_bt.dtype)
    for u, p in enumerate(prompts):
        prompt_ids[u, :len(p)] = torch.tensor(p, dtype=ids_bt.dtype)
        prompt_mask[u, :len(p)] = 1
    dev = ids_bt.device
    cont_len_b = (lens_b - p_b + 1).clamp(min=1)
    C = int(cont_len_b.max())
    j_c = torch.arange(C, device=dev)
    cont_mask_bc = (j_c[None] < cont_len_b[:, None]).to(mask_bt.dtype)
    positions_bc = p_b[:, None] - 1 + j_c[None]
    cont_ids_bc = ids_bt.gather(1, positions_bc.clamp(max=T - 1)) * cont_mask_bc.to(ids_bt.dtype)
    cached_bl = (torch.arange(Lp, device=dev)[None] < (p_b - 1)[:, None]).to(mask_bt.dtype)
    cont_lens = cont_len_b.tolist()
    groups = [(torch.tensor(rows, device=dev), max(cont_lens[b] for b in rows))
              for rows in length_groups(cont_lens, GROUP_CALL_SLOTS)]
    return SharedPrefixPlan(
        prompt_ids_ul=prompt_ids.to(dev), prompt_mask_ul=prompt_mask.to(dev),
        row_prompt_b=torch.tensor(row_prompt, device=dev), cont_ids_bc=cont_ids_bc,
        cont_attention_bl=torch.cat([cached_bl, cont_mask_bc], dim=1), cont_positions_bc=positions_bc,
        prompt_lens_b=p_b, seq_len=T, groups=groups,
    )
