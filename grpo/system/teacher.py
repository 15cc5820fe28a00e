"""The distillation teachers: built on the training ranks like the reference, or on ranks of their own
(``on_policy_distillation.non_colocated_teachers.enabled=true``, NeMo-RL's non-colocated teachers), no Ray.

Of the W ranks a launcher starts, the K before the generation ranks only run teachers
(`grpo.system.dist.split_ranks`): one block of ``default_teacher_cfg`` ranks per loaded teacher, in the order of
`grpo.config.loaded_teachers` (NeMo-RL's worker group per teacher; `grpo.system.dist.teacher_block`), each block its
own process group that builds only its teacher. Trainer rank 0 talks to them over a bridge of their own
(`grpo.system.bridge`, prefix ``teacher_bridge``: bridge rank 0 = trainer 0, 1 + i = teacher rank i; gloo only,
nothing but rows and logprobs travel):

    trainers (step_logprobs): submit(batch) -> score the previous policy and the reference -> result(T)
    trainer 0: each row to its teacher (`grpo.distillation.rows_by_teacher`, by agent or task): ("score", its rows)
               -> every rank of that teacher's block; they score their share, the block's rank 0 answers [b, T'] ->
               each answer right-padded with 0 to the batch's width T (`pad_teacher_logprobs`), put back in row
               order [B, T] -> broadcast to the trainers
    teacher rank i: serve_teacher() -- join the bridge -> build its teacher -> ready | error -> [score]* -> close

The rows go trimmed to the batch's longest row (T' <= T) with their images (a vision-language teacher's), so the
teacher ranks score exactly what a teacher on the training ranks scores (`grpo.system.training.frozen_logprobs`).
A teacher rank that fails to start or to score answers its error; one that dies or hangs is named by the bridge
within ``non_colocated_teachers.timeout_s``: every trainer raises `TeacherError` (one line), never waits forever.

Errors name the teacher rank and its teacher's alias (``teacher rank 2 ('code')``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from grpo.system.bridge import Bridge, BridgeError
from grpo.system.dist import broadcast_object, raise_agreed

logger = logging.getLogger(__name__)

PREFIX = "teacher_bridge"
PEERS = ("teacher rank", "on_policy_distillation.non_colocated_teachers.timeout_s")
# How long trainer 0 waits for the teacher ranks to load the teacher (at least; timeout_s if longer).
START_TIMEOUT_S = 1800.0


class TeacherError(RuntimeError):
    """The teacher ranks could not start or score a batch, or are gone (the message names the rank and why)."""


def pad_teacher_logprobs(teacher_logprobs_bt: torch.Tensor, train_T: int) -> torch.Tensor:
    """Teacher logprobs ``[B, T']`` right-padded with 0 to the training width ``train_T`` (NeMo-RL's
    ``_pad_teacher_logprobs``): the teacher scores the rows trimmed to their longest, the batch may be wider. 0 is
    safe: the token mask zeros padding in the advantages. Wider than ``train_T`` is a bug upstream: ValueError.

        >>> pad_teacher_logprobs(torch.tensor([[-1.0, -2.0]]), 4)
        tensor([[-1., -2.,  0.,  0.]])
    """
    teacher_T = teacher_logprobs_bt.shape[1]
    if teacher_T > train_T:
        raise ValueError(f"teacher logprobs are {teacher_T} tokens wide, wider than the training batch's {train_T}: "
                         "the teacher ranks scored other rows than the batch's")
    if teacher_T < train_T:
        teacher_logprobs_bt = torch.nn.functional.pad(teacher_logprobs_bt, (0, train_T - teacher_T), value=0.0)
    return teacher_logprobs_bt


@dataclass
class ScoreRequest:
    """The rows a teacher rank scores: what `grpo.system.training.gather_logprobs` reads of a batch (ids, attention,
    the token mask that says where prompts end, each row's images), columns cut to the longest row; ``media`` travels
    packed (`grpo.system.media.pack_media`: a prompt group's images once)."""

    input_ids_bt: torch.Tensor
    attention_mask_bt: torch.Tensor
    token_mask_bt: torch.Tensor
    media: object = None

    @classmethod
    def of(cls, batch) -> "ScoreRequest":
        """``batch``'s (a `grpo.batch.TrainBatch`) rows as they go over the bridge.

            >>> r = ScoreRequest.of(ScoreRequest(torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]),
            ...                                  torch.tensor([[0, 1, 0]])))
            >>> r.input_ids_bt.tolist(), r.media
            ([[5, 6]], None)
        """
        from grpo.system.media import pack_media

        mask_bt = batch.attention_mask_bt
        T = max(int(mask_bt.sum(dim=1).max().item()), 1) if mask_bt.shape[0] else 1
        return cls(batch.input_ids_bt[:, :T].contiguous(), mask_bt[:, :T].contiguous(),
                   batch.token_mask_bt[:, :T].contiguous(), pack_media(batch.media))

    def rows(self) -> "ScoreRequest":
        """The request as a batch `gather_logprobs` reads (its media one entry per row again)."""
        from grpo.system.media import unpack_media

        return ScoreRequest(self.input_ids_bt, self.attention_mask_bt, self.token_mask_bt,
                            unpack_media(self.media, self.input_ids_bt.shape[0]))


def build_teachers(cfg, rank: int, world_size: int, build=None, aliases=None) -> dict[str, object]:
    """On-policy distillation's frozen teachers over ``world_size`` ranks, by primary alias: one per checkpoint under
    ``on_policy_distillation.deduplicate_shared_teacher_checkpoints`` (`grpo.config.loaded_teachers`), else one
    per alias; only ``aliases`` of them when given (a teacher rank's block builds its own); {} without distillation.
    Each is built as the reference is (``build``, by default `grpo.system.engines.build_reference_engine`: a plain
    copy per rank where it fits, else a ZeRO-3 inference engine) and shares the policy's tokenizer; it is another
    checkpoint, so its own config is taken as is (``policy.hf_config_overrides`` is the policy's). A collective of
    those ranks (a ``toy:`` model is built by their rank 0)."""
    from grpo.config import loaded_teachers
    from grpo.distillation import teacher_models
    from grpo.system.engines import build_reference_engine
    from grpo.tasks.catalogue import resolve_model_name

    build = build or build_reference_engine
    opd = cfg.on_policy_distillation
    models = teacher_models(opd)
    teachers: dict[str, object] = {}
    for alias in (loaded_teachers(opd) if aliases is None else aliases):
        name = resolve_model_name(models[alias], rank)
        teachers[alias] = build(cfg.policy.model_copy(update={"model_name": name, "hf_config_overrides": {}}),
                                world_size)
    return teachers


def build_teacher(cfg, rank: int, world_size: int, alias: str | None = None):
    """One teacher, ``alias`` (by default the first loaded, `grpo.config.loaded_teachers`), over ``world_size`` ranks
    (`build_teachers`): what a teacher rank's block runs."""
    from grpo.config import loaded_teachers

    alias = alias or loaded_teachers(cfg.on_policy_distillation)[0]
    return build_teachers(cfg, rank, world_size, aliases=[alias])[alias]


def teacher_model_key(opd, alias: str) -> str:
    """The config key that names teacher ``alias``'s checkpoint.

        >>> from grpo.config import OnPolicyDistillationConfig
        >>> teacher_model_key(OnPolicyDistillationConfig(teacher_model_by_agent_name={"math": "m"}), "math")
        'on_policy_distillation.teacher_model_by_agent_name.math'
    """
    key = "on_policy_distillation.teacher_model_"
    return f"{key}by_agent_name.{alias}" if opd.teacher_model_by_agent_name else f"{key}name"


# ------------------------------------------------------------------------------------------------ trainers' side
class RemoteTeacher:
    """The trainers' handle on the teacher ranks. Built on every trainer (a collective of the trainers: their gloo
    group); ``bridge``: trainer 0's end (None on the other trainers, and on trainer 0 when it did not form:
    ``bridge_error`` says why, and every trainer raises it). Waits until every teacher rank has loaded its teacher;
    raises `TeacherError` on every trainer when one could not.

    ``aliases``: the loaded teachers (`grpo.config.loaded_teachers`); teacher ``g`` runs on teacher ranks
    ``[g * per, (g + 1) * per)`` (bridge ranks one more)."""

    def __init__(self, cfg, layout, bridge: Bridge | None, bridge_error: str | None = None):
        import torch.distributed as dist

        from grpo.config import loaded_teachers

        self.opd, self.layout, self.bridge = cfg.on_policy_distillation, layout, bridge
        self.num_ranks = layout.num_teacher
        self.aliases = loaded_teachers(self.opd)
        self.per = self.num_ranks // len(self.aliases)
        self.group = dist.new_group(backend="gloo") if layout.world_size > 1 else None
        self.pending, self.sent = False, {}
        error = bridge_error
        if bridge is not None:
            timeout = max(START_TIMEOUT_S, bridge.timeout_s)
            error = joined(self._answers(g, timeout)[1] for g in range(len(self.aliases)))
        self._agree(error, "starting the teacher ranks")

    def bridge_ranks(self, teacher: int) -> range:
        """The bridge ranks of teacher ``teacher``'s block."""
        return range(1 + teacher * self.per, 1 + (teacher + 1) * self.per)

    def route(self, batch) -> dict[int, list[int] | None]:
        """Teacher -> the rows of ``batch`` it scores (`grpo.distillation.rows_by_teacher`, by each row's agent or
        task); one teacher scores the whole batch (None: every row, as it is)."""
        if len(self.aliases) == 1:
            return {0: None}
        from grpo.distillation import rows_by_teacher, trajectory_teacher_key

        rows = rows_by_teacher([trajectory_teacher_key(t) for t in batch.trajectories], self.opd)
        return {self.aliases.index(alias): index for alias, index in rows.items()}

    def submit(self, batch) -> None:
        """Trainer 0 sends each teacher its rows of ``batch`` (`route`, as a `ScoreRequest`) on every rank of its block,
        which start scoring them (the trainers go on with their own logprobs meanwhile); the other trainers do nothing.
        A routing or send failure is kept for `result` to raise on every trainer."""
        self.pending, self.send_error, self.sent, self.num_rows = True, None, {}, len(batch.input_ids_bt)
        if self.bridge is None:
            return
        try:
            self.sent = self.route(batch)
            for g, index in self.sent.items():
                request = ScoreRequest.of(batch if index is None else batch.select(index))
                for r in self.bridge_ranks(g):
                    self._send(("score", request), r)
        except (BridgeError, ValueError) as err:  # ValueError: a row without a teacher (strict_agent_name_match)
            self.send_error = str(err)

    def result(self, train_T: int) -> torch.Tensor:
        """The submitted batch's teacher logprobs ``[B, train_T]`` in row order on every trainer (a collective of
        the trainers), or `TeacherError` on every trainer."""
        if not self.pending:
            raise RuntimeError("RemoteTeacher.result without a submitted batch")
        self.pending = False
        logprobs_bt, error = None, None
        if self.bridge is not None:
            logprobs_bt, error = self._gather(train_T)
        logprobs_bt, error = self._broadcast((logprobs_bt, error))
        if error is not None:
            raise TeacherError(f"teacher logprobs: {error}")
        return logprobs_bt

    def _gather(self, train_T: int) -> tuple[torch.Tensor | None, str | None]:
        """Trainer 0: every teacher's answer, each padded to ``train_T`` and put at its rows: ``([B, train_T], None)``
        or ``(None, the errors)``."""
        if self.send_error is not None:
            return None, self.send_error
        out_bt, errors = torch.zeros(self.num_rows, train_T), []
        for g, index in self.sent.items():
            lp_bt, error = self._answers(g)
            if error is not None:
                errors.append(error)
                continue
            lp_bt = pad_teacher_logprobs(lp_bt, train_T)
            if index is None:
                out_bt = lp_bt
            else:
                out_bt[index] = lp_bt
        return (None, joined(errors)) if errors else (out_bt, None)

    def close(self) -> None:
        """Tell the teacher ranks to exit (trainer 0; nothing when the bridge already failed)."""
        if self.bridge is not None and self.bridge.broken is None:
            for r in range(1, 1 + self.num_ranks):
                try:
                    self.bridge.send(("close", None), r)
                except BridgeError:
                    break
            self.bridge.broken = "closed: the run is over"

    def name(self, bridge_rank: int) -> str:
        """A teacher rank as errors name it: ``teacher rank i``, with its teacher's alias when there are several
        (``teacher rank 2 ('code')``)."""
        alias = f" ({self.aliases[(bridge_rank - 1) // self.per]!r})" if len(self.aliases) > 1 else ""
        return f"teacher rank {bridge_rank - 1}{alias}"

    def named(self, err: BridgeError) -> str:
        """The bridge's message with each teacher rank it names given its teacher's alias (`name`): the rank that
        broke the bridge may be another than the one just called."""
        return re.sub(r"teacher rank (\d+)", lambda m: self.name(1 + int(m.group(1))), str(err))

    def _send(self, message, bridge_rank: int) -> None:
        try:
            self.bridge.send(message, bridge_rank)
        except BridgeError as err:
            raise BridgeError(self.named(err)) from None

    def _answers(self, teacher: int, timeout_s: float | None = None) -> tuple[object, str | None]:
        """Trainer 0: every answer ``(kind, result)`` of teacher ``teacher``'s ranks; returns its block's rank 0's
        result and the error answers as one message (``teacher rank i ('alias'): message``), or None. A rank that
        is gone or hung (`BridgeError`) is an error answer naming it."""
        replies = []
        for r in self.bridge_ranks(teacher):
            try:
                replies.append(self.bridge.recv(r, timeout_s=timeout_s))
            except BridgeError as err:
                return None, self.named(err)
        errors = "; ".join(f"{self.name(r)}: {msg}" for r, (kind, msg) in zip(self.bridge_ranks(teacher), replies)
                           if kind == "error")
        return replies[0][1], errors or None

    def _broadcast(self, item):
        return broadcast_object(item, self.group)

    def _agree(self, error: str | None, doing: str) -> None:
        """Trainer 0's ``error`` on every trainer, raised as `TeacherError` (a collective)."""
        raise_agreed(error, doing, TeacherError, self.group)


def joined(errors) -> str | None:
    """The teachers' error messages as one, each once (a broken bridge answers every later call alike), or None.

        >>> joined(["a", None, "b", "a"]), joined([None])
        ('a; b', None)
    """
    return "; ".join(dict.fromkeys(e for e in errors if e)) or None


def connect_teacher(cfg, layout) -> RemoteTeacher:
    """The trainers' `RemoteTeacher` (a collective of the trainers): trainer 0 joins the teacher bridge, all wait
    until the teacher ranks are ready. Raises `TeacherError` on every trainer when they are not."""
    timeout = cfg.on_policy_distillation.non_colocated_teachers.timeout_s
    bridge, error = None, None
    if layout.rank == 0:
        try:
            bridge = Bridge(layout.store, 0, 1 + layout.num_teacher, timeout, torch.device("cpu"), prefix=PREFIX,
                            peers=PEERS)
        except BridgeError as err:  # a teacher rank never joined: every trainer stops with it
            error = str(err)
    return RemoteTeacher(cfg, layout, bridge, bridge_error=error)


# ------------------------------------------------------------------------------------------------ teacher ranks
def serve_teacher(cfg, layout, device: torch.device) -> None:
    """A teacher rank's life: join the teacher bridge, build its teacher (`grpo.config.loaded_teachers`' entry
    ``layout.teacher_group``, over its block's own group), say ready (or the error, and raise it), then score batches
    until trainer 0 says close. Raises `BridgeError` when trainer 0 is gone. SIGTERM / SIGINT are ignored, as on the
    generation ranks (the trainers' answer to them needs the teacher until they close the bridge)."""
    import signal

    from grpo.config import loaded_teachers
    from grpo.distillation import teacher_models
    from grpo.system.generation.server import SERVER_TIMEOUT_S

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    opd = cfg.on_policy_distillation
    alias = loaded_teachers(opd)[layout.teacher_group]
    bridge = Bridge(layout.store, 1 + layout.teacher_index, 1 + layout.num_teacher, SERVER_TIMEOUT_S,
                    torch.device("cpu"), prefix=PREFIX, peers=PEERS)
    try:
        engine = build_teacher(cfg, layout.rank, layout.world_size, alias)
        policy_cfg = teacher_settings(cfg, engine)
    except Exception as err:  # noqa: BLE001 - said to trainer 0, which stops the run with it
        bridge.send(("error", f"could not load {teacher_model_key(opd, alias)}={teacher_models(opd)[alias]!r}: "
                              f"{type(err).__name__}: {err}"), 0)
        raise
    bridge.send(("ready", None), 0)
    while True:
        kind, arg = bridge.recv(0)
        if kind == "close":
            return
        if kind != "score":
            raise BridgeError(f"unknown command {kind!r} from trainer 0")
        bridge.send(_run_score(cfg, policy_cfg, engine, arg, layout), 0)


def teacher_settings(cfg, engine):
    """The ``policy`` settings the teacher ranks score with: the run's, with sequence packing off where the teacher
    cannot run packed and packing is on by default (ValueError where it was asked for), as on the training ranks
    (`grpo.system.packed.settle_packing`), and ``default_teacher_cfg.micro_batch_size`` rows per forward when set."""
    from grpo.system.packed import settle_packing

    p = cfg.policy.model_copy(deep=True)
    settle_packing(p, engine.module)
    mbs = cfg.on_policy_distillation.non_colocated_teachers.default_teacher_cfg.micro_batch_size
    if mbs is not None:
        p.logprob_batch_size = mbs
    return p


def _run_score(cfg, policy_cfg, engine, request: ScoreRequest, layout) -> tuple[str, object]:
    """One score command: every rank of the teacher's block scores its share (a collective of the block); the
    block's rank 0 answers ``("ok", logprobs [b, T'])``, the others ``("ok", None)``; a failure answers
    ``("error", message)``."""
    from grpo.system.training import frozen_logprobs

    try:
        lp_bt = frozen_logprobs(cfg.model_copy(update={"policy": policy_cfg}), request.rows(), engine, layout.rank,
                                 layout.world_size)
        return "ok", lp_bt if layout.rank == 0 else None
    except Exception as err:  # noqa: BLE001 - the trainers stop the run with it
        logger.exception("teacher scoring failed")
        return "error", f"{type(err).__name__}: {err}"
