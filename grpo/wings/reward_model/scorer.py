"""The reward model's engine: a Bradley-Terry sequence classifier (``AutoModelForSequenceClassification``,
``num_labels=1``) that `grpo.wings.reward_model.environment.RewardModelEnvironment` scores conversations with.

Placement (``env.reward_model.placement``). NeMo-RL gives its reward model GPUs of its own
(``env.reward_model.resources``: a Ray placement group of ``gpus_per_node`` x ``num_nodes``). Here the reward model
lives on the training ranks, as the reference does (`grpo.system.engines.frozen_placement`):

- ``plain``: a frozen copy on every training rank (`grpo.system.engines.FrozenModel`); each rank scores its own
  samples, no collective;
- ``zero3``: a ZeRO-3 inference engine sharded over the training ranks (``deepspeed.initialize`` without an
  optimizer, the reference's ZeRO config ``policy.reference_deepspeed_config``, in the run's process group). Every
  forward is a collective: all ranks must run as many forwards, in the same order.

So scoring happens at one point of the rollout, not in the environment's step (which runs per rank, in a worker
thread, retried per sample): the environment leaves a `grpo.tasks.pending.PendingScore` per sample, and
`RewardModels.score_pending` scores them after the rank's conversations end, on every rank (even one whose
conversations failed: it scores nothing). Under ZeRO-3 the ranks first agree on the largest count n of pending
samples (one all-reduce), then each runs ceil(n / batch_size) forwards over its own samples, a one-token dummy batch
when it has run out (`grpo.system.generation.base.chunk_slices`, as lockstep generation does). The synchronous loop
and validation call it in the main thread; the asynchronous loop's producer thread hands it to the trainer thread
(`grpo.run.producer.TrainerDesk`), which runs it between two training steps: no two threads ever drive DeepSpeed
collectives on one group at once (DeepSpeed's ZeRO-3 hooks also keep process-global state,
``parameter_offload.FWD_MODULE_STACK``, that two concurrent forwards would interleave). With generation on ranks of
its own the trainers play and score the conversations, so the same holds. ``cluster.gpus_per_node=1``: the reward
model shares the one rank.

Offload (``env.reward_model.offload``, CUDA only): a plain copy lives in host memory and moves to the device for
`RewardModels.score_pending` only; a ZeRO-3 engine keeps its shards in host memory (ZeRO's ``offload_param``) and
fetches each layer when it runs (`offload_plan`). ``auto`` (the default) offloads when the weights a rank holds take
more than a quarter of its free device memory once the policy is built (`needs_offload`), agreed over the ranks.

When. The environments are built before the engines (the data needs them), but a reward model is placed and built
only by `RewardModels.place`, which setup calls once the policy, the reference and the generation backend exist
(vLLM's ``gpu_memory_utilization`` reserved) and the async loop once its generation thread's weight copy does: the
free memory ``auto`` weighs is what is left for the reward model (measured on an empty GPU, a 7-8B reward model
stayed resident and training, or vLLM's start, ran out of memory). Until then an environment holds a `ScorerSlot`.

Scoring. ``score`` pads a batch (``padding_side``: right as NeMo-RL, or left), runs the base model with the
attention mask and position ids counted over the real tokens (so padding on either side changes nothing), applies
the classification head and reads it at each conversation's last real token, in float32 (NeMo-RL's
``ScorePostProcessor``; `ScoreAtLastToken`). Reading the head at the last real token by the mask, not by looking
for the pad id as transformers' pooling does, keeps a conversation that ends in the pad token (EOS used as pad)
scored at its end.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

import torch

from grpo.system.engines import DTYPES, FrozenModel, frozen_placement, free_device_bytes, release_params, zero3_loading
from grpo.tasks.function import EnvError

logger = logging.getLogger(__name__)


class ScoreAtLastToken(torch.nn.Module):
    """A ForSequenceClassification model read at each row's last real token: ``forward(input_ids [B, T],
    attention_mask [B, T]) -> [B]`` float32 head logits. One module, so a ZeRO-3 engine wraps the whole forward
    (its hooks gather each submodule's shards as it runs)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        base = getattr(self.model, self.model.base_model_prefix)
        positions_bt = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden_btd = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions_bt).last_hidden_state
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.model.score(hidden_btd[rows, last_token_index(attention_mask)]).float()[:, 0]


def needs_offload(offload: bool | str, device_type: str, placement: str, nbytes: int, world_size: int,
                  free_bytes: int | None) -> bool:
    """``env.reward_model.offload`` resolved: ``auto`` offloads on an accelerator when the weights this rank holds
    (all of them for a plain copy, a 1/world_size shard under ZeRO-3) take more than a quarter of its free memory
    once the policy is built (the rule `frozen_placement` places by); never on the CPU.

        >>> needs_offload("auto", "cuda", "plain", nbytes=40, world_size=1, free_bytes=100)
        True
        >>> needs_offload("auto", "cuda", "zero3", nbytes=40, world_size=2, free_bytes=100), needs_offload(True, "cpu", "plain", 1, 1, 1)
        (False, False)
    """
    if device_type != "cuda":
        return False
    if offload != "auto":
        return bool(offload)
    held = nbytes if placement == "plain" else -(-nbytes // world_size)
    return free_bytes is not None and held > free_bytes / 4


def resolve_offload(rm_cfg, device: torch.device, placement: str, world_size: int,
                    free_bytes: int | None = None) -> bool:
    """`needs_offload` for ``rm_cfg`` on ``device`` (its weights' size read from its config only when ``auto`` on
    an accelerator must weigh them) against ``free_bytes`` (None: the device's free memory now)."""
    if rm_cfg.offload != "auto" or device.type != "cuda":
        return needs_offload(rm_cfg.offload, device.type, placement, 0, world_size, None)
    nbytes = num_params(rm_cfg) * DTYPES[rm_cfg.precision].itemsize
    free = free_bytes if free_bytes is not None else free_device_bytes(device)
    return needs_offload("auto", device.type, placement, nbytes, world_size, free)


def offload_plan(offload: bool, device_type: str, placement: str) -> str:
    """How ``env.reward_model.offload`` keeps the weights off the accelerator while the policy trains: ``none``
    (not asked, or no accelerator: on the CPU the weights are in host memory already), ``move`` (a plain copy:
    to the device to score, back to the host after) or ``offload_param`` (a ZeRO-3 engine: ZeRO keeps the shards
    on the host and fetches each layer's for its forward).

        >>> offload_plan(True, "cuda", "plain"), offload_plan(True, "cuda", "zero3"), offload_plan(True, "cpu", "zero3")
        ('move', 'offload_param', 'none')
    """
    if not offload or device_type != "cuda":
        return "none"
    return "move" if placement == "plain" else "offload_param"


def reward_model_ds_config(rm_cfg, policy, world_size: int, hidden_size: int | None, param_offload: bool) -> dict:
    """The reward model's ZeRO-3 inference config: the reference's JSON (``policy.reference_deepspeed_config``)
    with its auto values filled for the reward model (its precision, ``batch_size`` as the micro batch), and ZeRO's
    ``offload_param`` to pinned host memory when ``param_offload``."""
    from grpo.system.ds_config import build_ds_config

    as_policy = policy.model_copy(update={"precision": rm_cfg.precision, "logprob_batch_size": rm_cfg.batch_size})
    ds = build_ds_config(policy.reference_deepspeed_config, as_policy, world_size, for_training=False,
                         hidden_size=hidden_size)
    if param_offload:
        ds.setdefault("zero_optimization", {})["offload_param"] = {"device": "cpu", "pin_memory": True}
    return ds


class RewardModelScorer:
    """A frozen reward model and its tokenizer; `score` returns ``[B]`` float32 logits (one forward).

    ``placement``: ``plain`` (a `FrozenModel` on ``device``) or ``zero3`` (a ZeRO-3 inference engine over the
    ranks; needs ``policy``, the run's policy config, for the reference's DeepSpeed JSON, and ``world_size``).
    ``deferred``: the environment leaves its samples to `RewardModels.score_pending` instead of calling `score`
    (the run's scorers are; a scorer used alone is not). ``index``: its number among the run's reward models."""

    def __init__(self, rm_cfg, device: torch.device, padding_side: str = "right", *, placement: str = "plain",
                 policy=None, world_size: int = 1, deferred: bool = False, index: int = 0,
                 offload: bool | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from grpo.system.cpu_linear import use_onednn_linears

        key, path, config = reward_model_config(rm_cfg)
        tok_key, tok_name = (("env.reward_model.tokenizer.name", rm_cfg.tokenizer.name) if rm_cfg.tokenizer.name
                             else ("env.reward_model.model_name", resolve_toy(rm_cfg.model_name)))
        self.tokenizer = from_hub(AutoTokenizer.from_pretrained, tok_name, tok_key)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if offload is None:  # a scorer used alone: auto by this rank's free memory now
            offload = resolve_offload(rm_cfg, device, placement, world_size)
        self.plan = offload_plan(offload, device.type, placement)
        ds_config = None
        if placement == "zero3":
            hidden = getattr(config.get_text_config(), "hidden_size", None)
            ds_config = reward_model_ds_config(rm_cfg, policy, world_size, hidden, self.plan == "offload_param")
        with zero3_loading(ds_config or {}):  # under ZeRO-3 each rank loads its shards only
            model, info = AutoModelForSequenceClassification.from_pretrained(  # what is untrained: refused below
                path, config=config, dtype=DTYPES[rm_cfg.precision], output_loading_info=True,
                ignore_mismatched_sizes=True)
        if getattr(model, model.base_model_prefix, None) is None or not isinstance(getattr(model, "score", None),
                                                                                  torch.nn.Module):
            raise EnvError(f"{key}={path!r}: {type(model).__name__} has no 'score' head over its base model (the "
                           "ForSequenceClassification layout of Llama, Qwen2, Qwen3, Mistral, Gemma)")
        untrained = untrained_weights(info)
        if untrained:  # every rank read the whole state dict's names: all refuse together, none waits
            raise EnvError(untrained_message(key, path, untrained, config.architectures))
        module = ScoreAtLastToken(model).requires_grad_(False)
        if placement == "zero3":
            import deepspeed

            self.engine, *_ = deepspeed.initialize(model=module, config=ds_config)
            self.engine.eval()
        else:  # the run's CPU matmul kernel, as for the policy's models (policy.cpu_linear_kernel)
            use_onednn_linears(module, getattr(policy, "cpu_linear_kernel", "auto"))
            self.engine = FrozenModel(module, torch.device("cpu") if self.plan == "move" else device)
        self.device, self.name = device, rm_cfg.model_name
        self.placement, self.collective = placement, placement == "zero3"
        self.deferred, self.index = deferred, index
        self.batch_size = rm_cfg.batch_size
        self._lock = threading.Lock()
        self.padding_side = padding_side
        self.pad_id = int(self.tokenizer.pad_token_id)

    @torch.no_grad()
    def score(self, token_ids: list[list[int]]) -> torch.Tensor:
        """The head's logit at each conversation's last token, ``[B]`` float32 on the CPU (one forward; under ZeRO-3
        a collective)."""
        ids_bt, mask_bt = pad(token_ids, self.pad_id, self.padding_side)
        return self.engine(input_ids=ids_bt.to(self.device), attention_mask=mask_bt.to(self.device)).cpu()

    @contextmanager
    def on_device(self):
        """Around a scoring pass: with offload ``move``, the copy on the device inside and back in host memory after;
        otherwise nothing moves."""
        with self._lock:  # one scoring pass at a time (the async loop's validation and producer share scorers)
            if self.plan != "move":
                yield
                return
            self.engine.module.to(self.device)
            try:
                yield
            finally:
                self.engine.module.to("cpu")
                torch.cuda.empty_cache()

    def score_lockstep(self, token_ids: list[list[int]], n_most: int) -> torch.Tensor:
        """``[len(token_ids)]`` scores in batches of ``batch_size``; under ZeRO-3 in ceil(n_most / batch_size)
        forwards, ``n_most`` being the largest count over the ranks (a one-token dummy batch once this rank's
        run out), so every rank runs the same forwards."""
        from grpo.system.generation.base import chunk_slices

        out = []
        for sl in chunk_slices(len(token_ids), n_most if self.collective else len(token_ids), self.batch_size):
            chunk = token_ids[sl]
            scores = self.score(chunk or [[self.pad_id]])
            if chunk:
                out.append(scores)
        if self.collective:
            release_params(self.engine)  # nothing left gathered or in flight
        return torch.cat(out) if out else torch.zeros(0)

    def close(self) -> None:
        """Drop the model (idempotent: a training and a validation environment may share one scorer)."""
        self.engine = None


def pad(token_ids: list[list[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` token ids padded with ``pad_id`` on ``side`` and their attention mask.

        >>> pad([[5, 6, 7], [8]], 0, "left")
        (tensor([[5, 6, 7],
                [0, 0, 8]]), tensor([[1, 1, 1],
                [0, 0, 1]]))
    """
    width = max(len(x) for x in token_ids)
    ids = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_ids), width), dtype=torch.long)
    for b, x in enumerate(token_ids):
        span = slice(width - len(x), width) if side == "left" else slice(0, len(x))
        ids[b, span] = torch.tensor(x, dtype=torch.long)
        mask[b, span] = 1
    return ids, mask


def last_token_index(mask_bt: torch.Tensor) -> torch.Tensor:
    """``[B]``: the position of each row's last real token (mask 1), for padding on either side.

        >>> last_token_index(torch.tensor([[1, 1, 0], [0, 1, 1]]))
        tensor([1, 2])
    """
    positions_bt = torch.arange(mask_bt.shape[-1], device=mask_bt.device).expand_as(mask_bt)
    return (positions_bt * mask_bt).argmax(-1)


class ScorerSlot:
    """What an environment holds of one of the run's reward models (a `environment.Scorer`) from the
    environments' build on: ``deferred`` and ``index`` at once, everything else (``tokenizer``, ``score``,
    ``on_device``, ...) the `RewardModelScorer`'s, which `RewardModels.place` builds once the engines exist."""

    deferred = True  # scored at the rollout's scoring point (`RewardModels.score_pending`)

    def __init__(self, rm_cfg, index: int):
        self.cfg, self.index = rm_cfg, index
        self.scorer: RewardModelScorer | None = None
        self.free_bytes: int | None = None  # the free memory its placement weighed (`RewardModels.place`)

    def __getattr__(self, name):
        if name in ("cfg", "index", "scorer", "free_bytes"):  # not set yet
            raise AttributeError(name)
        if self.scorer is None:
            raise RuntimeError(f"env.reward_model {self.cfg.model_name!r} is not placed yet: RewardModels.place() builds "
                               "it once the policy and the generation backend are built")
        return getattr(self.scorer, name)


class RewardModels:
    """The run's reward models by section: one per ``env.reward_model`` section, shared by the training and
    validation environments that name it (a `ScorerSlot` each, in the same order on every rank), built by `place`
    once the engines are (module docstring), closed with the run. ``policy``, ``world_size``: the run's, for the
    ZeRO-3 placement. The scorers are deferred: their samples are scored by `score_pending`, the rollout's
    collective point."""

    def __init__(self, device: torch.device, policy=None, world_size: int = 1):
        self.device, self.policy, self.world_size = device, policy, world_size
        self._slots: dict[int, ScorerSlot] = {}

    def __call__(self, rm_cfg) -> ScorerSlot:
        key = id(rm_cfg)
        if key not in self._slots:
            self._slots[key] = ScorerSlot(rm_cfg, index=len(self._slots))
        return self._slots[key]

    def place(self, log=None) -> None:
        """Build every reward model asked for and not built yet, in order (the same on every rank), each placed and
        offloaded by the device's free memory read just before it (`placement`, `offload`; collectives with several
        ranks): call it once the policy, the reference and the generation backend take their memory. ``log``: gets
        `describe`'s line when something was built."""
        todo = [slot for slot in self._slots.values() if slot.scorer is None]
        for slot in todo:
            slot.free_bytes = free_device_bytes(self.device)
            placement = self.placement(slot.cfg, slot.free_bytes)
            slot.scorer = RewardModelScorer(slot.cfg, self.device, placement=placement, policy=self.policy,
                                            world_size=self.world_size, deferred=True, index=slot.index,
                                            offload=self.offload(slot.cfg, placement, slot.free_bytes))
        if todo and log is not None:
            log(self.describe())

    def placement(self, rm_cfg, free_bytes: int | None) -> str:
        """``env.reward_model.placement``, auto resolved as the reference's (`frozen_placement`, against
        ``free_bytes``) and agreed over the ranks (zero3 when any rank needs it: free memory is per rank). A
        collective when there are several ranks."""
        from grpo.system.dist import any_rank

        placement = rm_cfg.placement
        if placement == "auto" and self.world_size > 1:
            placement = frozen_placement("auto", rm_cfg.precision, self.world_size, num_params(rm_cfg), free_bytes)
            placement = "zero3" if any_rank(placement == "zero3") else "plain"
        return "plain" if placement == "auto" else placement

    def offload(self, rm_cfg, placement: str, free_bytes: int | None) -> bool:
        """``env.reward_model.offload`` resolved on this rank against ``free_bytes`` (`needs_offload`; ``auto``
        agreed over the ranks: all offload when any must). A collective when ``auto`` on several ranks."""
        mine = resolve_offload(rm_cfg, self.device, placement, self.world_size, free_bytes)
        if rm_cfg.offload != "auto" or self.device.type != "cuda" or self.world_size == 1:
            return mine
        from grpo.system.dist import any_rank

        return any_rank(mine)

    @property
    def _built(self) -> list[RewardModelScorer]:
        return [slot.scorer for slot in self._slots.values() if slot.scorer is not None]

    def describe(self) -> str:
        """One startup line: where each built reward model runs, and the free memory its placement weighed.

            >>> RewardModels(torch.device("cpu")).describe()
            'reward models: none'
        """
        where = {"plain": "a frozen copy on each rank", "zero3": f"a ZeRO-3 engine over {self.world_size} rank(s)"}
        offload = {"none": "", "move": ", in host memory between scorings", "offload_param": ", shards in host memory"}
        parts = [f"{slot.scorer.name} ({where[slot.scorer.placement]}{offload[slot.scorer.plan]}, batches of "
                 f"{slot.scorer.batch_size}; placed with {free_gib(slot.free_bytes)} free on {self.device})"
                 for slot in self._slots.values() if slot.scorer is not None]
        return "reward models: " + ("; ".join(parts) or "none") + (
            ", scored once per rollout after its conversations" if parts else "")

    def __len__(self) -> int:
        """How many reward models the run has, built or not (0: nothing to score, no scoring point)."""
        return len(self._slots)

    @property
    def collective(self) -> bool:
        """Whether `score_pending` runs collectives (a ZeRO-3 reward model)."""
        return any(s.collective for s in self._built)

    @property
    def on_trainer_thread(self) -> bool:
        """Whether the async loop's producer hands `score_pending` to the trainer thread (`grpo.run.producer.TrainerDesk`):
        a ZeRO-3 engine (collectives on the default group, which is the trainer's) or a copy that moves to the device
        to score (``offload`` ``move``: from the producer thread it would come onto the device while the trainer
        trains, and empty the allocator's cache under it)."""
        return any(s.collective or s.plan == "move" for s in self._built)

    def score_pending(self, trajectories: list) -> float:
        """Score every `grpo.tasks.pending.PendingScore` of these trajectories (this rank's) and add the scores
        to their rewards (`grpo.tasks.pending.add_score`); returns the seconds it took. With a ZeRO-3 reward
        model a collective over the default group: every rank calls it once per rollout, with its samples or none."""
        from grpo.system.dist import all_reduce
        from grpo.tasks.pending import PENDING, add_score

        t0 = time.perf_counter()
        scorers = list(self._slots.values())  # by index (each placed by now: its environment rendered with it)
        todo: list[list] = [[] for _ in scorers]
        for t in trajectories:
            for p in (t.metadata.pop(PENDING, None) if isinstance(t.metadata, dict) else None) or []:
                if t.scored:
                    todo[p.model].append((t, p))
        counts = torch.tensor([len(items) for items in todo], dtype=torch.long)
        if self.collective:
            from grpo.system.dist import comm_device

            counts = all_reduce(counts.to(comm_device()), op="max").cpu()
        for scorer, items, n_most in zip(scorers, todo, counts.tolist()):
            if n_most == 0:
                continue
            with scorer.on_device():
                scores = scorer.score_lockstep([p.token_ids for _, p in items], n_most)
            problems = [add_score(t, p, s) for (t, p), s in zip(items, scores.tolist())]
            failed = [x for x in problems if x is not None]
            if failed:  # each such sample failed (env_malformed), counted in rollout/failed_samples
                logger.warning("reward model %s: %d of %d samples failed: %s", scorer.name, len(failed), len(items),
                               failed[0])
        return time.perf_counter() - t0

    def close(self) -> None:
        for scorer in self._built:
            scorer.close()
        self._slots.clear()


def free_gib(nbytes: int | None) -> str:
    """``nbytes`` as GiB for a log line.

        >>> free_gib(3 * 2**30 // 2), free_gib(None)
        ('1.50 GiB', 'unknown memory')
    """
    return "unknown memory" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def num_params(rm_cfg) -> int:
    """The reward model's parameter count, from its config alone (the meta device: nothing allocated)."""
    from transformers import AutoModelForSequenceClassification

    _, _, config = reward_model_config(rm_cfg)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# Loading: what to load, and a checkpoint that is no reward model refused by name
# --------------------------------------------------------------------------------------------------
def resolve_toy(name: str) -> str:
    """``toy:demo_rm`` -> its local directory (rank 0 builds it on first use, the others wait); others unchanged."""
    from grpo.tasks.catalogue import resolve_model_name

    return resolve_model_name(name, torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)


def reward_model_config(rm_cfg):
    """``(key, path, config)``: where the weights come from (``env.reward_model.checkpoint_path``, else
    ``model_name``), named by its key for messages, and their transformers config with ``num_labels = 1`` (NeMo-RL
    sets it for a Bradley-Terry model: the head's single output)."""
    from transformers import AutoConfig

    key, path = (("env.reward_model.checkpoint_path", rm_cfg.checkpoint_path) if rm_cfg.checkpoint_path
                 else ("env.reward_model.model_name", resolve_toy(rm_cfg.model_name)))
    config = from_hub(AutoConfig.from_pretrained, path, key)
    config.num_labels = 1
    return key, path, config


def from_hub(load, name: str, key: str):
    """``load(name)`` (a transformers ``from_pretrained``); a name it cannot load (a local path not there, a
    directory that holds no model or tokenizer, a hub name not in the cache under ``HF_HUB_OFFLINE=1``, no such
    repository) is an `EnvError`: one line naming the key, the name and transformers' first line, not transformers'
    traceback and its message without the key."""
    import os

    from grpo.config import model_path_problem

    problem = model_path_problem(name, key)  # checked at config load too; here for a scorer built by hand
    if problem is not None:
        raise EnvError(problem)
    try:
        return load(name)
    except (OSError, ValueError) as err:
        import huggingface_hub

        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if os.path.isdir(name):
            raise EnvError(f"{key}={name!r}: a directory transformers cannot load from: {first}") from None
        why = ("not in the Hugging Face cache, and HF_HUB_OFFLINE=1 downloads nothing"
               if huggingface_hub.is_offline_mode() else first)
        raise EnvError(f"{key}={name!r}: not a local directory, and it cannot be loaded as a hub name: {why}") from None


def untrained_weights(loading_info: dict) -> dict[str, str]:
    """The weights ``from_pretrained(..., output_loading_info=True, ignore_mismatched_sizes=True)`` did not take from
    the checkpoint, which transformers initialised at random: name -> why (missing, or its shape there), sorted.

        >>> untrained_weights({"missing_keys": {"score.weight"}, "mismatched_keys": set(), "unexpected_keys": {"x"}})
        {'score.weight': 'is not in it'}
        >>> untrained_weights({"missing_keys": set(), "mismatched_keys": {("score.weight", (2, 64), (1, 64))}})
        {'score.weight': 'is [2, 64] in it, [1, 64] here'}
    """
    out = {k: "is not in it" for k in loading_info.get("missing_keys") or ()}
    for k in loading_info.get("mismatched_keys") or ():
        name, theirs, ours = k if isinstance(k, tuple) else (k, None, None)
        out[name] = f"is {list(theirs)} in it, {list(ours)} here" if theirs is not None else "has another shape there"
    return dict(sorted(out.items()))


def untrained_message(key: str, path: str, untrained: dict[str, str], architectures: list[str] | None) -> str:
    """The refusal of a checkpoint whose weights ``untrained`` (`untrained_weights`) were initialised at random: a
    reward model that scores noise.

        >>> untrained_message("k", "/m", {"score.weight": "is not in it"}, ["Qwen2ForCausalLM"]).split(" (transformers")[0]
        "k='/m': a Qwen2ForCausalLM checkpoint, not a reward model: score.weight is not in it"
    """
    saved = f"a {', '.join(architectures)} checkpoint" if architectures else "this checkpoint"
    head = all(k.startswith("score.") for k in untrained)
    names = list(untrained)
    shown = "; ".join(f"{k} {untrained[k]}" for k in names[:4]) + (f"; {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{key}={path!r}: {saved}{', not a reward model' if head else ''}: {shown} (transformers initialised "
            f"{'it' if len(names) == 1 else 'them'} at random: the run would train on noise); give a "
            "ForSequenceClassification checkpoint with one output, trained as a reward model (NeMo-RL's Bradley-Terry "
            "model)")
