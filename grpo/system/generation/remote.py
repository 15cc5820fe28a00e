"""Generation on ranks of its own (``policy.generation.colocated.enabled=false``), no Ray.

Of the W ranks a launcher starts, the last R only generate (`grpo.system.dist.init_split`); trainer rank 0 talks
to them over the bridge (`grpo.system.bridge`):

    trainers: generate(prompts) -- gather to trainer 0 -> split over the engines -> bridge -> scatter back
    after training: refit(engine) -- ZeRO-3 gathered a few layers at a time -> broadcast bucket by bucket, each
    acknowledged over gloo
    generation rank i: serve() -- hello -> [generate | load weights]* -> close

`RemoteGeneration` is the trainers' `GenerationBackend` (the loops and the rollout code do not know the
difference): sleep / wake_up are no-ops; `generate` and `refit` are collectives of the trainers over their own
gloo group (`group`); only trainer 0 touches the bridge, from one thread at a time. An error on the bridge (a
generation rank died or hangs) reaches every trainer: trainer 0 still completes the scatter, with the error.

`grpo.system.generation.server.serve` is a generation rank's whole life: a vLLM engine (``external_launcher`` over
the generation ranks' own default group, tensor-parallel groups among them; never sleeping) or a plain transformers
copy (`grpo.system.generation.hf.HFGeneration`), loading weights as they arrive (no disk round trip; vLLM's prefix
cache reset after each load). It returns when trainer 0 says close, and raises `BridgeError` when trainer 0 is
gone.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterable

import torch

from grpo.system.bridge import Bridge, BridgeError
from grpo.system.dist import broadcast_object, raise_agreed
from grpo.batch import rank_slice
from grpo.system.generation.base import GenerationBackend, GenerationOutput, length_caps, per_sample_stops
from grpo.system.media import pack_media, unpack_media

# How long trainer 0 waits for the generation ranks to start their engines (at least; bridge_timeout_s if longer):
# a vLLM engine that compiles its graphs takes minutes.
START_TIMEOUT_S = 1800.0


def engine_shares(n: int, num_ranks: int, tp: int) -> list[slice]:
    """Which of ``n`` requests each generation rank receives: the engines (``num_ranks / tp`` groups of ``tp``
    consecutive ranks) get contiguous shares; a group's first rank receives its share, the others nothing (vLLM's
    ``generate_in_group`` gathers the group's prompts on every rank of it).

        >>> engine_shares(5, 4, 2)
        [slice(0, 3, None), slice(0, 0, None), slice(3, 5, None), slice(0, 0, None)]
    """
    engines = num_ranks // tp
    out = []
    for r in range(num_ranks):
        out.append(rank_slice(n, r // tp, engines) if r % tp == 0 else slice(0, 0))
    return out


def bucket_specs(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple, str]]:
    """``(name, shape, dtype name)`` of a bucket's tensors: what a generation rank allocates to receive them.

        >>> bucket_specs([("w", torch.zeros(2, 3))])
        [('w', (2, 3), 'float32')]
    """
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]


class RemoteGeneration(GenerationBackend):
    """The trainers' `GenerationBackend` when generation runs on ranks of its own. Built on every trainer (a
    collective: the trainers' gloo group); ``bridge``: trainer 0's end (None on the other trainers, and on trainer 0
    when the bridge did not form: ``bridge_error`` says why, and every trainer raises it); ``model_path``: the
    resolved ``policy.model_name`` the generation ranks load."""

    loads_staged_weights = True  # the async producer pushes the stage's weights to the generation ranks

    def __init__(self, cfg, layout, bridge: Bridge | None, model_path: str, device: torch.device, tokenizer=None,
                 model_eos=None, bridge_error: str | None = None):
        import torch.distributed as dist

        from grpo.system.generation.vllm_params import stop_token_ids

        self.cfg, self.layout, self.bridge, self.device = cfg, layout, bridge, device
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer, model_eos, cfg.policy.generation) if tokenizer is not None else []
        a = cfg.grpo.async_grpo
        self.chunk_tokens, self.recompute_kv = a.in_flight_chunk_tokens, a.recompute_kv_cache_after_weight_updates
        # The async producer's mid-request safe point (in_flight_weight_updates): a collective of the trainers that
        # loads the newest staged weights; None: a request is generated in one go.
        self.in_flight = None
        self._stale_cache = False  # an in-flight load kept the prefix cache of the old weights
        self.sampling = cfg.policy.generation.sampling()  # a call's own profile goes to the generation ranks
        self.num_ranks = layout.num_generation
        self.tp = cfg.policy.generation.vllm_cfg.tensor_parallel_size if cfg.policy.generation.backend == "vllm" else 1
        self.bucket_numel = cfg.policy.generation.refit_bucket_numel
        self.group = dist.new_group(backend="gloo") if layout.world_size > 1 else None
        self.version = -1  # the weight version the generation ranks hold (async loop)
        # Set on every trainer once the bridge has failed (a generation rank died or hangs): nothing can generate any
        # more, so the async producer stops at once instead of retrying (grpo.run.producer).
        self.broken: str | None = None
        self.memory: dict[str, float] = {}
        self.stats = {"weight_loads": 0, "in_flight_weight_updates": 0, "kv_cache_recomputes": 0,
                      "multi_version_samples": 0}
        error = bridge_error  # trainer 0 could not form the bridge (a generation rank never joined)
        if bridge is not None:
            try:
                replies = self._ask_all("hello", [{"model": model_path}] * self.num_ranks,
                                        timeout_s=max(START_TIMEOUT_S, bridge.timeout_s))
                error = _errors(replies)
            except BridgeError as err:
                error = str(err)
        self._agree(error, "starting the generation ranks")

    # ---------------------------------------------------------------- GenerationBackend
    def lockstep_max(self, n_local: int) -> int:
        """The most samples any trainer holds (a collective of the trainers): each makes as many `generate`
        calls as that trainer needs."""
        if self.group is None:
            return n_local
        import torch.distributed as dist

        n = torch.tensor([n_local], dtype=torch.long)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return int(n.item())

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], *, greedy: bool = False,
                 max_new_tokens=None, stop_strings=None, sampling=None, media: list | None = None
                 ) -> list[GenerationOutput]:
        """See `grpo.system.generation.base.GenerationBackend.generate`. A collective of the trainers: every
        trainer calls it the same number of times (empty lists included). ``media``: each prompt's images (a
        vision-language model's, `grpo.system.vision`; None: text prompts), packed so that the prompts sharing one
        dict (a prompt group) carry it once, to the other trainers and over the bridge (`pack_media`)."""
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        request, error, sampling = None, None, sampling or self.sampling
        try:  # a bad request on one trainer must not leave the others in the gather: all raise it together
            caps = length_caps([len(p) for p in prompt_ids], max_new_tokens or sampling.max_new_tokens,
                               self.cfg.policy.max_total_sequence_length) if prompt_ids else []
            stops = per_sample_stops(stop_strings, sampling.stop_strings, len(prompt_ids))
            if media is not None and len(media) != len(prompt_ids):
                raise ValueError(f"generate: {len(prompt_ids)} prompts but media for {len(media)}")
            request = [list(map(list, prompt_ids)), [int(s) for s in seeds], caps, stops, pack_media(media)]
        except ValueError as err:
            error = f"trainer rank {self.layout.rank}: {err}"
        gathered = self._gather((request, error))
        errors = [e for _, e in gathered if e is not None]
        if errors:
            raise ValueError("; ".join(errors))
        parts = [r for r, _ in gathered]
        flat = [[x for p in parts for x in p[k]] for k in range(4)]
        rows = [unpack_media(p[4], len(p[0])) or [None] * len(p[0]) for p in parts]
        flat_media = [m for r in rows for m in r] if any(p[4] is not None for p in parts) else None
        result = (self._generate_in_flight(*flat, greedy=greedy, sampling=sampling, media=flat_media)
                  if self.in_flight is not None else self._round(*flat, greedy=greedy, sampling=sampling,
                                                                 media=flat_media))
        start = sum(len(p[0]) for p in parts[: self.layout.rank])
        return result[start:start + len(prompt_ids)]

    def _round(self, prompts, seeds, caps, stops, *, greedy: bool, sampling, media=None) -> list[GenerationOutput]:
        """One generation of the trainers' whole batch (the same lists on every trainer): trainer 0 sends it, every
        trainer gets all the outputs (or raises `BridgeError` with trainer 0's)."""
        result, broken = None, None
        if self.bridge is not None:
            result = (self._generate_remote(prompts, seeds, caps, stops, greedy=greedy, sampling=sampling,
                                            media=media) if prompts else [])
            broken = self.bridge.broken
        result, self.broken = self._broadcast((result, broken))
        if isinstance(result, str):
            raise BridgeError(result)
        return result

    def _generate_in_flight(self, prompts, seeds, caps, stops, *, greedy: bool, sampling,
                            media=None) -> list[GenerationOutput]:
        """NeMo-RL's in-flight weight updates: every request is decoded ``in_flight_chunk_tokens`` tokens at a time;
        between rounds the newest staged weights are loaded (``self.in_flight``) and the unfinished requests go on
        from their partial output (prompt + tokens so far, the rest of their budget). Where a completion ends is
        decided on the whole completion (`cut_completion`: a stop string across two rounds counts). A sample whose
        rounds saw several weight versions is counted in ``stats["multi_version_samples"]``. ``media``: each request's
        images, sent again with its continuation (they belong to its prompt)."""
        from grpo.system.generation.base import cut_completion

        n = len(prompts)
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        reason: list[str | None] = [None] * n
        versions: list[set[int]] = [set() for _ in range(n)]
        for k in itertools.count():
            todo = [i for i in range(n) if reason[i] is None]
            if k > 0 and todo:  # a safe point between rounds: newer weights may come in
                self.in_flight()
            # every trainer holds the same lists: they agree on `todo` and on every round
            if k > 0 and not todo:
                break
            outs = self._round([prompts[i] + ids[i] for i in todo], [round_seed(seeds[i], k) for i in todo],
                               [min(self.chunk_tokens, caps[i] - len(ids[i])) for i in todo],
                               [stops[i] for i in todo], greedy=greedy, sampling=sampling,
                               media=None if media is None else [media[i] for i in todo])
            for i, out in zip(todo, outs):
                ids[i] += out.completion_ids
                logprobs[i] += out.logprobs
                versions[i].add(self.version)
                cut, why = cut_completion(ids[i], caps[i], self.stop_ids, stops[i], self._decode)
                if why == "stop" or out.finish_reason == "stop":
                    ids[i], logprobs[i], reason[i] = ids[i][:cut], logprobs[i][:cut], "stop"
                elif len(ids[i]) >= caps[i]:
                    reason[i] = "length"
            if not todo:
                break
        if self._stale_cache:  # in-flight loads kept old blocks for the continued requests: no later request gets them
            self._reset_cache()
        self.stats["multi_version_samples"] += sum(len(v) > 1 for v in versions)
        return [GenerationOutput(prompt_ids=list(p), completion_ids=c, logprobs=lp, finish_reason=r,
                                 text=self._decode(c)) for p, c, lp, r in zip(prompts, ids, logprobs, reason)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _reset_cache(self) -> None:
        """Trainer 0: every generation rank drops its prefix cache (a collective of the trainers, errors agreed)."""
        error = None
        if self.bridge is not None:
            try:
                error = _errors(self._ask_all("reset_cache", [None] * self.num_ranks))
            except BridgeError as err:
                error = str(err)
        error = self._broadcast(error)
        if error is not None:
            raise BridgeError(error)
        self._stale_cache = False

    def refit(self, engine) -> float:
        """Load ``engine``'s weights into every generation rank: gathered from ZeRO-3 a few whole layers at a time
        (a collective of the trainers), broadcast by trainer 0 bucket by bucket. Raises
        `grpo.system.rollout.RolloutError` on every trainer when a generation rank failed."""
        from grpo.system.weights import iter_gathered_params

        t0 = time.perf_counter()
        expected = [name for name, _ in engine.module.named_parameters()]
        error = self.load_weights(iter_gathered_params(engine, self.bucket_numel), expected, self.version + 1)
        self._agree(error, "loading the new weights")
        return time.perf_counter() - t0

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], expected: list[str],
                     version: int, reset_cache: bool = True) -> str | None:
        """Trainer 0: broadcast ``buckets`` to the generation ranks as weight ``version``; returns an error
        message or None. The other trainers iterate ``buckets`` too (it may be a collective) and return None.
        Not a collective by itself: `refit` and the async producer make the trainers agree."""
        if self.bridge is None:
            for _ in buckets:
                pass
            return None
        error = None
        try:
            for r in self._peers():
                self.bridge.send(("load", {"expected": expected, "version": version, "reset_cache": reset_cache}), r)
        except BridgeError as err:
            error = str(err)
        for bucket in buckets:  # to the end even after an error: the gathers are collectives of the trainers
            if error is not None:
                continue
            try:
                specs = bucket_specs(bucket)
                for r in self._peers():
                    self.bridge.send(("bucket", specs), r)
                for _, t in bucket:
                    self.bridge.broadcast(t.detach().to(self.bridge.device).contiguous())
                self.bridge.wait_acknowledged()  # a dead or hung rank is named within the bridge's timeout
            except BridgeError as err:
                error = str(err)
        if error is None:
            try:
                error = _errors(self._ask_all("end", [None] * self.num_ranks), " could not load the weights")
            except BridgeError as err:
                error = str(err)
        if error is None:
            self.version = version
            self.stats["weight_loads"] += 1
        return error

    def load_staged(self, stage, mid_request: bool = False) -> int:
        """The async loop's safe point (the producer thread): trainer 0 pushes the newest weights of ``stage``
        (`grpo.system.replay.WeightStage`) when they are newer than what the generation ranks hold; returns the
        version they hold, the same on every trainer (a collective of the trainers). ``mid_request``: an in-flight
        update between two rounds of unfinished requests; their prefix cache is reset (recomputed) only with
        ``recompute_kv_cache_after_weight_updates``, as in NeMo-RL; at any other point it is always reset."""
        from grpo.system.rollout import RolloutError
        from grpo.system.weights import layer_buckets

        error, before = None, self.version
        reset = self.recompute_kv or not mid_request
        if self.bridge is not None:
            with stage.newer_than(self.version) as staged:
                if staged is not None:
                    version, tensors = staged
                    error = self.load_weights(layer_buckets(list(tensors.items()), self.bucket_numel),
                                              list(tensors), version, reset_cache=reset)
        version, error = self._broadcast((self.version, error))
        if error is not None:
            raise RolloutError(f"loading weights into the generation ranks: {error}")
        self.version = version
        if mid_request and version != before:
            self.stats["in_flight_weight_updates"] += 1
            self.stats["kv_cache_recomputes"] += int(reset)
            self._stale_cache = self._stale_cache or not reset
        elif version != before:
            self._stale_cache = False
        return version

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        """Tell the generation ranks to exit (trainer 0; nothing when the bridge already failed)."""
        if self.bridge is not None and self.bridge.broken is None:
            for r in self._peers():
                try:
                    self.bridge.send(("close", None), r)
                except BridgeError:
                    break
            self.bridge.broken = "closed: the run is over"  # a second close, or a late call, sends nothing

    # ---------------------------------------------------------------- helpers
    def _peers(self) -> range:
        return range(1, 1 + self.num_ranks)

    def _generate_remote(self, prompts, seeds, caps, stops, *, greedy: bool, sampling,
                         media=None) -> list[GenerationOutput] | str:
        """Trainer 0: the whole batch over the engines; the outputs in order, or an error message. An engine's
        share of ``media`` goes with its prompts, each distinct dict once (`generate_command`)."""
        shares = engine_shares(len(prompts), self.num_ranks, self.tp)
        try:
            replies = self._ask_all("generate", [generate_command(prompts, seeds, caps, stops, greedy, sampling, media,
                                                                  sl) for sl in shares])
        except BridgeError as err:
            return str(err)
        return _errors(replies) or [o for _, outs in replies for o in outs]

    def _ask_all(self, command: str, args: list, timeout_s: float | None = None) -> list[tuple[str, object]]:
        """Trainer 0: ``(command, args[i])`` to generation rank i, then every rank's answer ``(kind, result)`` in rank
        order (``timeout_s``: the wait for each, None: the bridge's). Raises `BridgeError`."""
        for r, arg in zip(self._peers(), args, strict=True):
            self.bridge.send((command, arg), r)
        return [self.bridge.recv(r, timeout_s=timeout_s) for r in self._peers()]

    def _gather(self, item) -> list:
        if self.group is None:
            return [item]
        import torch.distributed as dist

        parts: list = [None] * self.layout.world_size
        dist.all_gather_object(parts, item, group=self.group)
        return parts

    def _broadcast(self, item):
        return broadcast_object(item, self.group)

    def _agree(self, error: str | None, doing: str) -> None:
        """Trainer 0's ``error`` on every trainer, raised as `grpo.system.rollout.RolloutError` (a collective)."""
        from grpo.system.rollout import RolloutError

        raise_agreed(error, doing, RolloutError, self.group)


def generate_command(prompts, seeds, caps, stops, greedy: bool, sampling, media: list | None, sl: slice) -> dict:
    """The ``generate`` command of one engine's share ``sl`` of a batch: its prompts, seeds, length caps and stop
    strings, and, for image prompts, ``media`` as `grpo.system.media.pack_media` packs the share's (a prompt
    group's one dict sent once, not once per sample); the generation rank unpacks it (`grpo.system.generation.server`).

        >>> generate_command([[1], [2]], [7, 8], [4, 4], [None, None], False, None, None, slice(1, 2))["prompts"]
        [[2]]
    """
    command = {"prompts": prompts[sl], "seeds": seeds[sl], "caps": caps[sl], "stops": stops[sl], "greedy": greedy,
               "sampling": sampling}
    if media is not None:
        command["media"] = pack_media(media[sl])
    return command


def _errors(replies: list[tuple[str, object]], what: str = "") -> str | None:
    """The generation ranks' error answers as one message (``generation rank i<what>: message``), or None.

        >>> _errors([("ok", None), ("error", "boom")], " could not load the weights")
        'generation rank 1 could not load the weights: boom'
    """
    return "; ".join(f"generation rank {i}{what}: {msg}" for i, (kind, msg) in enumerate(replies)
                     if kind == "error") or None


def round_seed(seed: int, k: int) -> int:
    """The seed of round ``k`` of an in-flight request (round 0: its own): a continued request is a new vLLM
    request, whose sampler restarts from its seed.

        >>> round_seed(7, 0), round_seed(7, 1) != round_seed(7, 2)
        (7, True)
    """
    if k == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{k}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
