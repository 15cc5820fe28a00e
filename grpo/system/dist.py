"""The process group: start it, and the few collectives the system uses.

Which rows a rank holds (`grpo.batch.rank_slice`) is plain arithmetic and lives with the batch, below this layer.
Every function here is a no-op or an identity on one process without a process group, except
`init_distributed`, which makes one.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def init_distributed(local_rank: int | None = None) -> tuple[int, int, int, torch.device]:
    """Start (or join) the process group; return ``(rank, local_rank, world_size, device)``.

    Launchers: torchrun, the ``deepspeed`` launcher and ``accelerate launch`` set RANK / LOCAL_RANK /
    WORLD_SIZE / MASTER_ADDR / MASTER_PORT; a plain ``python script.py`` sets none, and we fill in a
    one-process launch. A one-process group rendezvouses in memory (a ``HashStore``), not over a TCP port: a port
    picked free and bound later could be taken meanwhile by another process on the machine (runs side by side). ``local_rank`` is the ``--local_rank=N`` argument the deepspeed
    launcher appends (it also sets LOCAL_RANK). Backend: nccl with CUDA, gloo without. Idempotent.
    """
    import deepspeed
    import torch.distributed as dist

    local_rank, device, backend = _launch_settings(local_rank)
    if not dist.is_initialized():
        if os.environ["WORLD_SIZE"] == "1":  # one process: an in-memory store, no port another process can take
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)  # joins a group made here, else makes it
    return dist.get_rank(), local_rank, dist.get_world_size(), device


def _launch_settings(local_rank: int | None) -> tuple[int, torch.device, str]:
    """What every process does before it joins a group: fill in a one-process launch when no launcher set
    RANK / WORLD_SIZE (a free port), apply the deepspeed launcher's ``--local_rank``, and pick this rank's device
    and backend (nccl with CUDA, gloo without). Returns ``(local_rank, device, backend)``."""
    import deepspeed.ops
    import torch

    # ZeRO never uses the shm comm op, and its first use JIT-compiles C++ for minutes.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return local_rank, torch.device("cuda", local_rank), "nccl"
    return local_rank, torch.device("cpu"), "gloo"


@dataclass
class Layout:
    """This process's place in a launch whose last ``num_generation`` ranks only generate
    (``policy.generation.colocated.enabled=false``) and whose ``num_teacher`` ranks before them only score with the
    distillation teacher (``on_policy_distillation.non_colocated_teachers.enabled=true``).

    ``role``: "train", "teach" or "generate"; ``rank`` / ``world_size``: within its side's own process group (what
    DeepSpeed or vLLM sees); ``global_rank`` / ``global_world_size``: the launcher's; ``store``: the launch's
    rendezvous store, from which the bridges (`grpo.system.bridge`) build their groups; ``bridge_rank``: on the
    generation bridge, 0 for trainer 0, 1 + i for generation rank i, None for the other ranks (the teacher bridge
    numbers its ranks the same way: `grpo.system.teacher`). With several teachers on ranks of their own
    (``num_teacher`` = ``teacher_groups`` blocks of equal size), a teacher rank's side is its teacher's block:
    ``teacher_group`` says which (`teacher_block`), ``teacher_index`` its place among all the teacher ranks.
    """

    role: str
    rank: int
    world_size: int
    global_rank: int
    global_world_size: int
    num_generation: int
    store: object = None
    num_teacher: int = 0
    teacher_group: int = 0

    @property
    def teacher_index(self) -> int:
        """A teacher rank's number among all the teacher ranks (its teacher bridge rank - 1)."""
        return self.teacher_group * self.world_size + self.rank

    @property
    def bridge_rank(self) -> int | None:
        if self.role == "generate":
            return 1 + self.rank
        return 0 if self.role == "train" and self.rank == 0 else None


def split_ranks(global_rank: int, global_world_size: int, num_generation: int, num_teacher: int = 0
                ) -> tuple[str, int, int]:
    """``(role, rank, world_size)`` of a launcher's rank when its last ``num_generation`` ranks generate and the
    ``num_teacher`` ranks before them run the teacher: ranks [0, W - R - K) train (rank 0 stays a trainer),
    [W - R - K, W - R) teach, [W - R, W) generate, each side numbered from 0.

        >>> [split_ranks(r, 8, 4) for r in (0, 3, 4, 7)]
        [('train', 0, 4), ('train', 3, 4), ('generate', 0, 4), ('generate', 3, 4)]
        >>> [split_ranks(r, 4, 1, 2) for r in (0, 1, 2, 3)]
        [('train', 0, 1), ('teach', 0, 2), ('teach', 1, 2), ('generate', 0, 1)]
    """
    n_train = global_world_size - num_generation - num_teacher
    if n_train < 1 or num_generation < 0 or num_teacher < 0:
        raise ValueError(f"{num_generation} generation and {num_teacher} teacher ranks of {global_world_size} leave "
                         "none to train")
    if global_rank < n_train:
        return "train", global_rank, n_train
    if global_rank < n_train + num_teacher:
        return "teach", global_rank - n_train, num_teacher
    return "generate", global_rank - n_train - num_teacher, num_generation


def teacher_block(teacher_rank: int, num_teacher: int, teacher_groups: int) -> tuple[int, int, int]:
    """``(teacher, rank, world_size)`` of teacher rank ``teacher_rank`` when ``num_teacher`` ranks run
    ``teacher_groups`` teachers, each on a block of its own (NeMo-RL's worker group per teacher).

        >>> [teacher_block(i, 4, 2) for i in range(4)]
        [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    """
    if teacher_groups < 1 or num_teacher % teacher_groups:
        raise ValueError(f"{num_teacher} teacher ranks do not split into {teacher_groups} equal teachers' blocks")
    per = num_teacher // teacher_groups
    return teacher_rank // per, teacher_rank % per, per


def init_split(num_generation: int, local_rank: int | None = None, timeout_s: float = 1800.0, num_teacher: int = 0,
               teacher_groups: int = 1) -> tuple[Layout, torch.device]:
    """Two (three, with teacher ranks) process groups in one launch, no Ray: rendezvous once over the launcher's store
    (``torch.distributed.rendezvous("env://")``: torchrun's agent store, the deepspeed launcher's and
    accelerate's MASTER_ADDR / MASTER_PORT), then each side starts its own default group over a prefix of that
    store (``PrefixStore("train" | "teach" | "generate", store)``) with its own rank and size. RANK / WORLD_SIZE (and
    LOCAL_WORLD_SIZE on one node) are rewritten to the side's (a teacher rank's side: its teacher's block,
    `teacher_block`, over ``PrefixStore("teach<i>", store)``), so DeepSpeed on the trainers and vLLM's
    ``external_launcher`` on the generation ranks each see an ordinary world; LOCAL_RANK (the device) stays.
    Backend: nccl with CUDA, gloo without. Returns the `Layout` and this rank's device.
    """
    import datetime

    import deepspeed
    import torch.distributed as dist

    _, device, backend = _launch_settings(local_rank)
    global_rank, global_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    role, rank, world_size = split_ranks(global_rank, global_world, num_generation, num_teacher)
    group, prefix = 0, role
    if role == "teach":
        group, rank, world_size = teacher_block(rank, num_teacher, teacher_groups)
        prefix = f"teach{group}"
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", global_rank, global_world, timeout=timeout))
    check_env_agrees(store, global_rank, global_world)  # before any NCCL: a mismatch would hang, not fail
    if num_generation:
        pin_batch_invariant_nccl()
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world and int(local_world) == global_world:  # one node: each side's ranks on it
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                            timeout=timeout)
    if role in ("train", "teach"):  # (a teacher that does not fit one rank runs as a ZeRO-3 inference engine)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)  # joins the group just made
    return Layout(role, rank, world_size, global_rank, global_world, num_generation, store, num_teacher, group), device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_gather_objects(local: list, group=None) -> list:
    """Concatenate every rank's list, in rank order (identity without torch.distributed).

    ``group``: the process group (None: the default one). A second thread that needs collectives
    (async GRPO's generation thread) passes its own: the default group belongs to the main thread.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(local)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return [x for part in gathered for x in part]


def broadcast_object(item, group=None):
    """Rank 0's ``item`` (any picklable object) on every rank of ``group``; ``item`` itself where ``group`` is None
    (one rank: nothing to agree with). The trainers' own gloo group carries what trainer 0 heard over a bridge."""
    if group is None:
        return item
    import torch.distributed as dist

    box = [item]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def raise_agreed(error: str | None, doing: str, error_type: type[Exception], group=None) -> None:
    """Rank 0's ``error`` (what it heard over a bridge, or None) on every rank of ``group`` (`broadcast_object`),
    raised there as ``error_type("<doing>: <error>")``: every rank stops with the same line, none waits in a later
    collective. A collective of ``group``."""
    error = broadcast_object(error, group)
    if error is not None:
        raise error_type(f"{doing}: {error}")


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (a collective)."""
    import torch

    return bool(all_reduce(torch.tensor([float(flag)], device=comm_device()), op="max").item())


def all_reduce(t, op: str = "sum"):
    """``t`` summed (``op="sum"``) or maxed (``"max"``) over ranks, in place (identity on one process)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def comm_device():
    """Where collectives' tensors live: the current CUDA device, else the CPU (gloo)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# Variables every rank of a launch must agree on: NCCL reads them per process and never reconciles them across the
# ranks of a communicator (a different protocol, algorithm or channel count on one side hangs the collective), and
# VLLM_BATCH_INVARIANT makes vLLM set those NCCL variables on the ranks that run it.
RANK_AGREED_ENV = ("VLLM_BATCH_INVARIANT", "NCCL_LAUNCH_MODE", "NCCL_PROTO", "NCCL_ALGO", "NCCL_MIN_NCHANNELS",
                   "NCCL_MAX_NCHANNELS", "NCCL_NTHREADS", "NCCL_SOCKET_NTHREADS", "NCCL_COLLNET_ENABLE",
                   "NCCL_NVLS_ENABLE", "NCCL_P2P_NET_DISABLE", "NCCL_NO_CACHE")


class EnvMismatch(RuntimeError):
    """The ranks of a launch disagree on a variable of RANK_AGREED_ENV (the message names it and the ranks)."""


def env_disagreement(per_rank: list[dict[str, str]]) -> str | None:
    """What the ranks disagree on among their RANK_AGREED_ENV values (unset: absent from a rank's dict), or None.

        >>> env_disagreement([{"VLLM_BATCH_INVARIANT": "1"}, {}, {"VLLM_BATCH_INVARIANT": "1"}])
        'VLLM_BATCH_INVARIANT differs between ranks: 1 on ranks [0, 2], unset on ranks [1]'
        >>> env_disagreement([{"NCCL_PROTO": "Simple"}] * 2) is None
        True
    """
    problems = []
    for name in RANK_AGREED_ENV:
        values: dict[str, list[int]] = {}
        for rank, env in enumerate(per_rank):
            values.setdefault(env.get(name, "unset"), []).append(rank)
        if len(values) > 1:
            problems.append(f"{name} differs between ranks: "
                            + ", ".join(f"{value} on ranks {ranks}" for value, ranks in values.items()))
    return "; ".join(problems) or None


def check_env_agrees(store, rank: int, world_size: int) -> None:
    """Every rank's RANK_AGREED_ENV through the launch's store; raises `EnvMismatch` on every rank when they differ
    (set them the same on every node: a launcher passes this shell's environment only to its own node's ranks)."""
    import json

    mine = {name: os.environ[name] for name in RANK_AGREED_ENV if name in os.environ}
    store.set(f"grpo_agreed_env/{rank}", json.dumps(mine))
    per_rank = [json.loads(store.get(f"grpo_agreed_env/{r}")) for r in range(world_size)]
    store.set(f"grpo_agreed_env_read/{rank}", "1")
    if rank == 0:  # rank 0 may host the store: it leaves only once every rank has read it
        store.wait([f"grpo_agreed_env_read/{r}" for r in range(world_size)])
    problem = env_disagreement(per_rank)
    if problem is not None:
        raise EnvMismatch(f"{problem}: NCCL would hang on a collective between them; set them the same on every "
                          "rank (every node's environment)")


def pin_batch_invariant_nccl() -> None:
    """With ``VLLM_BATCH_INVARIANT=1`` and CUDA, every rank sets the NCCL variables vLLM sets for batch invariance
    (``override_envs_for_invariance``), before its first NCCL call. vLLM sets them only in the processes that run an
    engine: with generation ranks of their own, the trainers' side of the bridge's weight broadcast would otherwise
    run other NCCL settings than the generation ranks' side, and hang (colocated, every rank runs vLLM: already the
    same). Raises `EnvMismatch` when vLLM cannot be imported here to say which."""
    import torch

    if os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("", "0", "false") or not torch.cuda.is_available():
        return
    try:
        from vllm.model_executor.determinism.batch_invariant import override_envs_for_invariance
    except ImportError as err:
        raise EnvMismatch(f"VLLM_BATCH_INVARIANT={os.environ['VLLM_BATCH_INVARIANT']} with generation ranks of their "
                          "own: the trainers must set the NCCL variables vLLM sets on the generation ranks, and vLLM "
                          f"cannot be imported here to say which ({err}); install requirements-vllm.txt on every "
                          "node, or unset VLLM_BATCH_INVARIANT") from None
    override_envs_for_invariance()
