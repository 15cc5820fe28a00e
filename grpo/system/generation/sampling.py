"""Per-sample seeded sampling: temperature -> top-k -> top-p -> Gumbel-max.

argmax_v(x_v + G_v) with G_v ~ Gumbel(0, 1) i.i.d. is an exact sample from softmax(x). Each row draws
its noise from its own `torch.Generator`, seeded with the sample's seed, one draw of V values per
generated token; so a sample's tokens depend only on its prompt, its seed and the weights (up to float
rounding of the logits), not on the other rows of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from grpo.logprobs import filter_keep_mask

SEED_MASK = (1 << 63) - 1


def filter_logits(logits_bv: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float = 1.0) -> torch.Tensor:
    """The logits actually sampled from (fp32); removed tokens are -inf.

    x = logits / temperature, then the top-k / top-p filter of `grpo.logprobs.filter_keep_mask`. With nothing to do
    (fp32 logits, temperature 1, no filter) it is ``logits_bv`` itself, not a copy.

        >>> filter_logits(torch.tensor([[0.0, 1.0, 2.0]]), top_k=2)
        tensor([[-inf, 1., 2.]])
    """
    x_bv = logits_bv.float() if temperature == 1.0 else logits_bv.float() / temperature  # x / 1 is x, bit for bit
    if top_k is None and top_p >= 1.0:
        return x_bv
    return x_bv.masked_fill(~filter_keep_mask(x_bv, top_k, top_p), float("-inf"))


def processed_logprobs(logits_bv: torch.Tensor, tokens_b: torch.Tensor, temperature: float = 1.0,
                       top_k: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """log softmax(filter_logits(logits))[token]: the logprob under the distribution sampled from."""
    lp_bv = filter_logits(logits_bv, temperature, top_k, top_p).log_softmax(dim=-1)
    return lp_bv.gather(-1, tokens_b[:, None].long())[:, 0]


def gumbel_noise(generators: Sequence[torch.Generator], vocab: int, device) -> torch.Tensor:
    """[B, V] standard Gumbel noise, row b from ``generators[b]``: G = -log(E), E ~ Exp(1)."""
    rows = [torch.empty(vocab, device=device).exponential_(generator=g) for g in generators]
    return -torch.stack(rows).log()


def row_generators(seeds: Sequence[int], device) -> list[torch.Generator]:
    """One generator per sample, seeded with ``seed mod 2^63``."""
    return [torch.Generator(device=device).manual_seed(int(s) & SEED_MASK) for s in seeds]


class SeededSampler(LogitsProcessor):
    """A transformers `LogitsProcessor` for ``generate(do_sample=False)``: it returns
    filter_logits(scores) + Gumbel noise (no noise when greedy), so generate's argmax samples, and it
    records per step the chosen token and its processed logprob (``tokens``, ``logprobs``: lists of [B]).
    `sample` does the same for some rows of the batch only (a decode loop that drops finished rows).
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_k: int | None, top_p: float,
                 greedy: bool, device):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generators = None if greedy else row_generators(seeds, device)
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def sample(self, scores_av: torch.Tensor, rows_a: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [A], their processed logprobs [A], the scores argmax-ed [A, V])`` for the rows ``rows_a`` of the
        batch (row a of ``scores_av`` is sample ``rows_a[a]``: its own generator draws the noise). A sample's draws
        depend only on its seed and its own step count, whichever rows are present."""
        x_av = filter_logits(scores_av, self.temperature, self.top_k, self.top_p)
        lp_av = x_av.log_softmax(dim=-1)
        if self.generators is not None:
            x_av = x_av + gumbel_noise([self.generators[r] for r in rows_a], x_av.shape[-1], x_av.device)
        tok_a = x_av.argmax(dim=-1)
        return tok_a, lp_av.gather(-1, tok_a[:, None])[:, 0], x_av

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tok_b, lp_b, x_bv = self.sample(scores, range(scores.shape[0]))
        self.tokens.append(tok_b)
        self.logprobs.append(lp_b)
        return x_bv
