"""Sequence packing and dynamic batching: which rows form a micro-batch, and the packed row layout.

Two ways (NeMo-RL's ``policy.sequence_packing`` / ``policy.dynamic_batching``, mutually exclusive) to stop
paying for padding when lengths vary. Both group a rank's rows by a token budget; pure functions, no model:

* packing: `pack_bins` puts rows into micro-batches of at most ``capacity`` tokens (NeMo-RL's four algorithms,
  `PACKING_ALGORITHMS`); a micro-batch's samples run concatenated with positions restarting at 0
  (`packed_layout`), so the model sees (almost) no padding and attention is kept inside each sample by the
  position ids (`grpo.system.packed`).
* dynamic batching: `dynamic_micro_batches` sorts rows by length and cuts them into consecutive groups whose
  padded size (rows x longest rounded length) stays within the budget: short rows run many at a time.

Lengths are token counts of right-padded rows (``attention_mask.sum(-1)``).
"""

from __future__ import annotations

import random
from bisect import bisect
from collections.abc import Callable, Sequence

import torch


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= n.

        >>> round_up(57, 64), round_up(64, 64), round_up(5, 1)
        (64, 64, 5)
    """
    return -(-n // multiple) * multiple


def _check_fits(lengths: Sequence[int], capacity: int) -> None:
    if capacity <= 0:
        raise ValueError(f"bin capacity {capacity}: expected > 0 tokens")
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens exceeds the micro-batch budget of {capacity} tokens")


# --------------------------------------------------------------------------------------------------
# Bin packing (NeMo-RL's nemo_rl/data/packing/algorithms.py, same names and behaviour)
# --------------------------------------------------------------------------------------------------
def concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows in order; a new bin starts when the next row would overflow the current one. O(n).

        >>> concatenative([4, 1, 3, 2, 1, 3, 4, 5], 5)
        [[0, 1], [2, 3], [4, 5], [6], [7]]
    """
    _check_fits(lengths, capacity)
    bins: list[list[int]] = []
    used = capacity + 1
    for i, n in enumerate(lengths):
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def _first_fit(order: Sequence[tuple[int, int]], capacity: int) -> list[list[int]]:
    """Each (length, index) in ``order`` goes into the first bin with room, or a new bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for n, i in order:
        for j, r in enumerate(room):
            if n <= r:
                bins[j].append(i)
                room[j] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit over the rows sorted by length, longest first (ties: larger index first, as NeMo-RL's
    ``sort(reverse=True)`` of (length, index) pairs). O(n log n + n·bins).

        >>> first_fit_decreasing([4, 1, 3, 2, 1, 3, 4, 5], 5)
        [[7], [6, 4], [0, 1], [5, 3], [2]]
    """
    _check_fits(lengths, capacity)
    return _first_fit(sorted(((n, i) for i, n in enumerate(lengths)), reverse=True), capacity)


def first_fit_shuffle(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """First fit over the rows in a random order (``random.Random(seed)``: NeMo-RL shuffles with the
    global ``random``; a seeded generator keeps runs and ranks reproducible). O(n·bins)."""
    _check_fits(lengths, capacity)
    order = [(n, i) for i, n in enumerate(lengths)]
    random.Random(seed).shuffle(order)
    return _first_fit(order, capacity)


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson & Garey's (1985) modified first fit decreasing, as NeMo-RL implements it. With C the capacity,
    rows are large (> C/2), medium (> C/3), small (> C/6) or tiny:

    1. one bin per large row (longest first);
    2. forward over those bins: add the longest medium row that fits;
    3. backward over the bins without a medium row: add the shortest small row and the longest small row
       that fits beside it;
    4. forward over the bins: greedily add the longest remaining row that fits, until none fits;
    5. the rest, longest first, into new bins kept sorted by load: a row joins the least loaded new bin if it
       fits there, else opens one (NeMo-RL's O(n log n) form of its first fit decreasing step).

        >>> modified_first_fit_decreasing([4, 1, 3, 2, 1, 3, 4, 5], 5)
        [[7], [0], [6], [2, 3], [5, 1, 4]]
    """
    _check_fits(lengths, capacity)
    if any(n <= 0 for n in lengths):
        raise ValueError("sequence lengths must be positive")
    items = list(enumerate(lengths))
    large = sorted((x for x in items if x[1] > capacity / 2), key=lambda x: x[1], reverse=True)
    medium = sorted((x for x in items if capacity / 3 < x[1] <= capacity / 2), key=lambda x: x[1], reverse=True)
    small = sorted((x for x in items if capacity / 6 < x[1] <= capacity / 3), key=lambda x: x[1])
    tiny = sorted((x for x in items if x[1] <= capacity / 6), key=lambda x: x[1])

    def load(b):
        return sum(n for _, n in b)

    bins = [[x] for x in large]
    for b in bins:                                                     # 2
        for k, (_, n) in enumerate(medium):
            if n <= capacity - load(b):
                b.append(medium.pop(k))
                break
    for b in reversed(bins):                                           # 3
        if any(capacity / 3 < n <= capacity / 2 for _, n in b) or len(small) < 2:
            continue
        room = capacity - load(b)
        if small[0][1] + small[1][1] > room:
            continue
        first = small.pop(0)
        for k in range(len(small) - 1, -1, -1):
            if small[k][1] <= room - first[1]:
                b.extend([first, small.pop(k)])
                break
    rest = sorted(medium + small + tiny, key=lambda x: x[1], reverse=True)
    for b in bins:                                                     # 4
        while rest:
            room = capacity - load(b)
            k = next((k for k, (_, n) in enumerate(rest) if n <= room), None)
            if k is None:
                break
            b.append(rest.pop(k))
    new_bins: list[list[tuple[int, int]]] = [[]]                        # 5
    new_loads = [0]
    for i, n in rest:
        if n <= capacity - new_loads[0]:
            b, used = new_bins.pop(0), new_loads.pop(0)
        else:
            b, used = [], 0
        b.append((i, n))
        k = bisect(new_loads, used + n)
        new_bins.insert(k, b)
        new_loads.insert(k, used + n)
    return [[i for i, _ in b] for b in bins + new_bins if b]


PACKING_ALGORITHMS: dict[str, Callable[[Sequence[int], int], list[list[int]]]] = {
    "concatenative": concatenative,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
}


def pack_bins(lengths: Sequence[int], capacity: int, algorithm: str = "modified_first_fit_decreasing",
              order: str = "packer") -> list[list[int]]:
    """Row indices grouped into bins of at most ``capacity`` tokens by ``algorithm`` (`PACKING_ALGORITHMS`);
    every row in exactly one bin. ``order``: ``packer`` keeps the algorithm's bin order, ``largest_first``
    runs the fullest bins first (NeMo-RL's ``microbatch_order``; the allocator then reuses the largest
    shape's memory).

        >>> pack_bins([4, 1, 3, 2], 5, "concatenative", order="largest_first")
        [[0, 1], [2, 3]]
    """
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"packing algorithm {algorithm!r}: expected one of {sorted(PACKING_ALGORITHMS)}")
    bins = PACKING_ALGORITHMS[algorithm](list(lengths), capacity)
    if order == "largest_first":
        bins = sorted(bins, key=lambda b: sum(lengths[i] for i in b), reverse=True)
    elif order != "packer":
        raise ValueError(f"microbatch_order {order!r}: expected packer or largest_first")
    return bins


# --------------------------------------------------------------------------------------------------
# Dynamic batching (NeMo-RL's BatchedDataDict.shard_by_batch_size with dynamic_batching_args)
# --------------------------------------------------------------------------------------------------
def dynamic_micro_batches(lengths: Sequence[int], budget: int, sequence_length_round: int = 1) -> list[list[int]]:
    """Rows sorted by length (shortest first, stable), cut into consecutive micro-batches while

        rows_in_mb · max_{rows in mb} round_up(length, sequence_length_round) <= budget

    (a new micro-batch starts when the next row would break it). Each micro-batch then runs right-padded to its
    own longest (rounded) row.

        >>> dynamic_micro_batches([7, 2, 4, 6, 3, 4], 16)
        [[1, 4, 2, 5], [3, 0]]
    """
    padded = [round_up(n, sequence_length_round) for n in lengths]
    _check_fits(padded, budget)
    groups: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * max(longest, padded[i]) <= budget:
            groups[-1].append(i)
            longest = max(longest, padded[i])
        else:
            groups.append([i])
            longest = padded[i]
    return groups


# --------------------------------------------------------------------------------------------------
# The packed rows
# --------------------------------------------------------------------------------------------------
def packed_layout(lengths_b: torch.Tensor, rows: Sequence[Sequence[int]], row_len: int,
                  seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``source_kr``, ``positions_kr``) of K = len(rows) packed rows of ``row_len`` tokens; row k holds the samples
    ``rows[k]`` (indices into ``lengths_b``) back to back, then padding:

        source_kr[k, r]    = the flat index b·T + t of the token that packed slot (k, r) holds (row-major in a
                             ``[B, T]`` layout with T = ``seq_len``, default the longest); -1 on padding
        positions_kr[k, r] = t, the token's position in its own sample (0, 1, ..., len_b − 1 for each sample),
                             and 0, 1, ... again on a row's trailing padding (a sequence of its own)

    A position that does not continue its predecessor (t != previous + 1) starts a new sample: that is how
    transformers finds the samples of a packed row (`grpo.system.packed`).

        >>> packed_layout(torch.tensor([2, 3, 1]), [[1, 2], [0]], 4)
        (tensor([[ 3,  4,  5,  6],
                [ 0,  1, -1, -1]]), tensor([[0, 1, 2, 0],
                [0, 1, 0, 1]]))
    """
    lengths = [int(n) for n in lengths_b.tolist()]
    T = seq_len if seq_len is not None else max(lengths, default=0)
    source_kr = torch.full((len(rows), row_len), -1, dtype=torch.long)
    positions_kr = torch.zeros((len(rows), row_len), dtype=torch.long)
    for k, row in enumerate(rows):
        used = 0
        for b in row:
            n = lengths[b]
            source_kr[k, used: used + n] = b * T + torch.arange(n)
            positions_kr[k, used: used + n] = torch.arange(n)
            used += n
        if used > row_len:
            raise ValueError(f"packed row {k} holds {used} tokens > row_len={row_len}")
        positions_kr[k, used:] = torch.arange(row_len - used)
    return source_kr, positions_kr


def unpack(values_n: torch.Tensor, source_n: torch.Tensor, shape_bt: tuple[int, int]) -> torch.Tensor:
    """A packed row's per-token values ``[N, ...]`` back to the ``[B, T, ...]`` layout (0 where no token was
    packed: padding). Differentiable (a scatter of the packed values).

        >>> unpack(torch.tensor([1., 2., 3., 4., 5., 0.]), torch.tensor([0, 1, 3, 4, 5, -1]), (2, 3))
        tensor([[1., 2., 0.],
                [3., 4., 5.]])
    """
    B, T = shape_bt
    keep_n = source_n >= 0
    out = values_n.new_zeros((B * T, *values_n.shape[1:]))
    out = out.index_copy(0, source_n[keep_n].to(values_n.device), values_n[keep_n.to(values_n.device)])
    return out.reshape(B, T, *values_n.shape[1:])
