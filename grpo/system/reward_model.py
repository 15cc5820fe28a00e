"""The reward model's engine: a Bradley-Terry sequence classifier (``AutoModelForSequenceClassification``,
``num_labels=1``) that `grpo.tasks.reward_model.RewardModelEnvironment` scores conversations with.

Placement. NeMo-RL gives its reward model GPUs of its own (``env.reward_model.resources``: a Ray placement group of
``gpus_per_node`` x ``num_nodes``; with one node, the policy still gets all of ``cluster.gpus_per_node``). Here the
reward model is a frozen copy on every training rank, on the rank's device, beside the policy (the reference's
``plain`` placement, `grpo.system.engines.FrozenModel`): each rank scores its own slice of the rollout with no
collective, so it works unchanged in the synchronous loop, in the asynchronous loop's producer thread and with
generation on ranks of its own (the trainers score). With ``cluster.gpus_per_node=1`` it shares the one rank;
``resources`` is read only for the translation table. A model too large for a copy per rank (ZeRO-3 sharding over
the ranks) is not supported yet: a ZeRO-3 forward is a collective, and environment steps run per rank, in threads,
retried per sample, so the ranks' calls do not line up.

Scoring. ``score`` pads a batch (``padding_side``: right as NeMo-RL, or left), runs the base model with the
attention mask and position ids counted over the real tokens (so padding on either side changes nothing), applies
the classification head and reads it at each conversation's last real token, in float32 (NeMo-RL's
``ScorePostProcessor``). Reading the head at the last real token by the mask, not by looking for the pad id as
transformers' pooling does, keeps a conversation that ends in the pad token (EOS used as pad) scored at its end.
"""

from __future__ import annotations

import torch

from grpo.system.engines import DTYPES, FrozenModel


class RewardModelScorer:
    """A frozen reward model on ``device`` and its tokenizer; `score` returns ``[B]`` float32 logits."""

    def __init__(self, rm_cfg, device: torch.device, padding_side: str = "right"):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from grpo.tasks.catalogue import resolve_model_name

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        model_name = resolve_model_name(rm_cfg.model_name, rank)  # "toy:demo_rm": rank 0 builds it on first use
        path = rm_cfg.checkpoint_path or model_name
        self.tokenizer = AutoTokenizer.from_pretrained(rm_cfg.tokenizer.name or model_name)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        config = AutoConfig.from_pretrained(path)
        config.num_labels = 1  # NeMo-RL sets it for a Bradley-Terry model: the head's single output
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=DTYPES[rm_cfg.precision])
        self.base = getattr(model, model.base_model_prefix, None)
        self.head = getattr(model, "score", None)
        if self.base is None or not isinstance(self.head, torch.nn.Module):
            raise ValueError(f"env.reward_model.model_name={rm_cfg.model_name!r}: {type(model).__name__} has no "
                             "'score' head over its base model (the ForSequenceClassification layout of Llama, Qwen2, "
                             "Qwen3, Mistral, Gemma)")
        self.engine = FrozenModel(model, device)
        self.device = device
        self.padding_side = padding_side
        self.pad_id = int(self.tokenizer.pad_token_id)

    @torch.no_grad()
    def score(self, token_ids: list[list[int]]) -> torch.Tensor:
        """The head's logit at each conversation's last token, ``[B]`` float32 on the CPU (one forward)."""
        ids_bt, mask_bt = pad(token_ids, self.pad_id, self.padding_side)
        ids_bt, mask_bt = ids_bt.to(self.device), mask_bt.to(self.device)
        positions_bt = (mask_bt.cumsum(-1) - 1).clamp(min=0)
        hidden_btd = self.base(input_ids=ids_bt, attention_mask=mask_bt, position_ids=positions_bt).last_hidden_state
        last_b = last_token_index(mask_bt)
        rows = torch.arange(len(token_ids), device=self.device)
        return self.head(hidden_btd[rows, last_b]).float()[:, 0].cpu()

    def close(self) -> None:
        """Drop the model (idempotent: a training and a validation environment may share one scorer)."""
        self.engine = self.base = self.head = None


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


class RewardModels:
    """The run's reward models by section: one scorer per ``env.reward_model`` section, shared by the training
    and validation environments that name it (built on first use, closed with the run)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._built: dict[int, RewardModelScorer] = {}

    def __call__(self, rm_cfg) -> RewardModelScorer:
        key = id(rm_cfg)
        if key not in self._built:
            self._built[key] = RewardModelScorer(rm_cfg, self.device)
        return self._built[key]

    def close(self) -> None:
        for scorer in self._built.values():
            scorer.close()
        self._built.clear()
