"""What every generation backend returns and implements, plus the stop / length rules they share.

A sample's completion depends only on its prompt, its seed and the weights: never on the batch it
was generated in, the world size, padding or resume. Callers pass one seed per sample
(`grpo.system.rollout.sample_seed`).
"""

from __future__ import annotations

import math

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from grpo.config import Sampling

if TYPE_CHECKING:
    import torch


@dataclass
class GenerationOutput:
    """One generated sample.

    ``completion_ids`` are the generated tokens, ending with the stop token (or the last token of the
    stop string) when it stopped; ``logprobs`` has one entry per completion token: the log-probability
    of that token under the distribution it was sampled from (temperature, top-k, top-p applied);
    ``text`` is the decoded completion without special tokens.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str


class GenerationBackend:
    """What the loops, the rollout code and the async producer use of a generation backend: every backend
    (`grpo.system.generation.hf.HFGeneration`, `grpo.system.generation.vllm.VllmGeneration`,
    `grpo.system.generation.remote.RemoteGeneration`) subclasses it, so callers never probe for a method.

    ``sampling``: the training profile (`grpo.config.Sampling`, frozen) a `generate` call without ``sampling`` uses;
    validation passes its own profile to each call, nothing is ever swapped on a backend. ``memory``:
    ``memory/<phase>_gb`` gauges for the step's log (empty where the backend measures none). ``stats``: counters the
    async loop logs as ``async/<name>`` (generation ranks' weight loads, ...). ``broken``: why the backend can no
    longer generate (generation ranks gone), else None: no retry can help then. ``in_flight``: the async producer's
    mid-request safe point (a callable, or None), for backends that can load weights between decode rounds.

    ``device`` (where the backend runs; None: nowhere in particular) and ``stream`` (the CUDA stream its engine was
    built on, None: the device's current one): `device_context` makes them the calling thread's, which every thread
    that calls a backend enters (CUDA's current device and stream are per thread).
    """

    sampling: Sampling
    memory: Mapping[str, float] = MappingProxyType({})  # a backend that measures assigns its own dict
    stats: Mapping[str, float] = MappingProxyType({})
    broken: str | None = None
    in_flight: Callable[[], None] | None = None
    loads_staged_weights: bool = False  # load_staged works (generation ranks): weights come from the stage
    device: torch.device | str | None = None
    stream: torch.cuda.Stream | None = None

    def device_context(self):
        """The backend's device and stream made the calling thread's current ones for a block (`on_device`): a
        thread other than the one that built the backend enters it before calling it (the endpoint's batcher)."""
        return on_device(self.device, self.stream)

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], *, greedy: bool = False,
                 max_new_tokens: int | Sequence[int] | None = None,
                 stop_strings: Sequence[Sequence[str] | None] | None = None,
                 sampling: Sampling | None = None) -> list[GenerationOutput]:
        """One output per prompt, in order; ``seeds[i]`` drives the sampling of sample i only.

        ``sampling``: the profile to sample with (None: the backend's ``sampling``, training's);
        ``max_new_tokens``: one cap for all, or one per sample (None: the profile's ``max_new_tokens``);
        ``stop_strings``: per sample, its stop strings (None for a sample, or for all: the profile's).
        """
        raise NotImplementedError

    def refit(self, engine) -> float:
        """Load the weights of the training engine (a collective); returns seconds taken."""
        raise NotImplementedError

    def lockstep_max(self, n_local: int) -> int:
        """The most samples any rank that generates in lockstep with this one holds (a tensor-parallel vLLM group);
        callers make as many `generate` calls as that rank needs. ``n_local`` where ranks generate alone."""
        return n_local

    def load_staged(self, stage, mid_request: bool = False) -> int:
        """Load the newest weights of the async loop's `grpo.system.replay.WeightStage`; returns their version.
        Only backends with ``loads_staged_weights`` (the hf thread's copy loads through the stage itself)."""
        raise NotImplementedError(f"{type(self).__name__} does not load staged weights")

    def sleep(self) -> None:
        """Free generation memory while training (no-op where unsupported)."""

    def wake_up(self) -> None:
        """Undo `sleep`."""

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks computed with older weights (no-op where nothing is cached between calls: hf)."""

    def close(self) -> None:
        """Release the backend."""


@contextmanager
def on_device(device, stream=None) -> Iterator[None]:
    """For the block, ``device`` is the calling thread's current CUDA device and ``stream`` (one of its streams;
    None: the one current there now) its current stream; nothing where ``device`` is not a CUDA device.

    Both are per thread, and a thread that never set them launches on cuda:0: an in-process vLLM engine sets its device
    only on the thread that built it (``vllm/v1/worker/gpu_worker.py``), launches its input-preparation kernels on
    the current device, and its runner caches the stream of its first step as its main stream, which the async copy
    of the sampled tokens waits for (``vllm/v1/worker/gpu/model_runner.py``, ``async_utils.py``): a thread that calls
    it must have the engine's device and the stream it was built on current."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield


def length_caps(prompt_lens: Sequence[int], max_new_tokens: int | Sequence[int],
                max_total_sequence_length: int) -> list[int]:
    """Per-sample completion budget: min(max_new_tokens_i, max_total_sequence_length - prompt_len_i).

        >>> length_caps([3, 10], max_new_tokens=8, max_total_sequence_length=12)
        [8, 2]
        >>> length_caps([3, 3], max_new_tokens=[1, 20], max_total_sequence_length=12)
        [1, 9]
    """
    per_sample = [max_new_tokens] * len(prompt_lens) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    caps = [min(m, max_total_sequence_length - n) for m, n in zip(per_sample, prompt_lens, strict=True)]
    bad = [i for i, c in enumerate(caps) if c <= 0]
    if bad:
        i = bad[0]
        raise ValueError(
            f"prompt {i} has {prompt_lens[i]} tokens, leaving no room under "
            f"policy.max_total_sequence_length={max_total_sequence_length} ({len(bad)} such prompts); "
            "filter them with data.max_input_seq_length"
        )
    return caps


def per_sample_stops(stop_strings: Sequence[Sequence[str] | None] | None, default: Sequence[str] | None,
                     n: int) -> list[list[str]]:
    """Each sample's stop strings: its own where given, else ``default`` (the config's).

        >>> per_sample_stops([None, ["</a>"]], default=["\\n"], n=2)
        [['\\n'], ['</a>']]
    """
    given = [None] * n if stop_strings is None else list(stop_strings)
    if len(given) != n:
        raise ValueError(f"generate: {n} prompts but {len(given)} stop-string lists")
    return [list(s) if s is not None else list(default or []) for s in given]


def cut_completion(ids: Sequence[int], cap: int, stop_token_ids: Sequence[int],
                   stop_strings: Sequence[str] | None, decode: Callable[[list[int]], str]) -> tuple[int, str]:
    """Where a completion ends: ``(n_tokens, finish_reason)``.

    Within the first ``cap`` tokens: right after the first stop token, or right after the token that
    completes the first occurrence of a stop string (whichever comes first): "stop"; otherwise
    ``min(len(ids), cap)`` tokens: "length".

        >>> cut_completion([5, 6, 2, 7], cap=10, stop_token_ids=[2], stop_strings=None, decode=str)
        (3, 'stop')
    """
    ids = list(ids[:cap])
    stop_ids = set(stop_token_ids)
    n = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), None)
    searchable = ids[: n - 1] if n is not None else ids  # a string completed by the stop token itself
    if stop_strings and any(s in decode(searchable) for s in stop_strings):
        # Shortest prefix whose text holds a stop string (prefix texts grow monotonically).
        lo, hi = 1, len(searchable)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(searchable[:mid]) for s in stop_strings):
                hi = mid
            else:
                lo = mid + 1
        return lo, "stop"
    if n is not None:
        return n, "stop"
    return len(ids), "length"


def chunk_slices(n_local: int, n_most: int, chunk_size: int) -> list[slice]:
    """Chunks of this rank's ``n_local`` samples such that every rank of a group makes the same number
    of `generate` calls: ceil(n_most / chunk_size) slices, where ``n_most`` is the largest share in the
    group; the slices past this rank's samples are empty (and still have to be generated).

        >>> chunk_slices(n_local=3, n_most=4, chunk_size=2)
        [slice(0, 2, None), slice(2, 3, None)]
        >>> chunk_slices(n_local=0, n_most=1, chunk_size=2)
        [slice(0, 0, None)]
    """
    return [slice(min(i, n_local), min(i + chunk_size, n_local))
            for i in range(0, math.ceil(n_most / chunk_size) * chunk_size, chunk_size)]
