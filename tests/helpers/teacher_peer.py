"""A teacher rank for tests/unit/test_teacher_ranks.py: ``python -m tests.helpers.teacher_peer PORT MODE MODEL
[POLICY]`` (POLICY: the run's policy, toy:tiny by default).

serve: a teacher rank's whole life (`grpo.system.teacher.serve_teacher`) with teacher MODEL, until trainer 0 says
close; die / hang: join the teacher bridge, say ready, receive one score command, then exit without a word / sleep.
``python -m tests.helpers.teacher_peer PORT mark I K``: teacher rank I of K that answers every score command with
`mark` of its rows (no model: what the trainers' routing sent it, and in which order, is in the numbers).
"""

import datetime
import os
import sys
import time

import torch.distributed as dist

from grpo.config import MasterConfig
from grpo.system.dist import Layout
from grpo.system.teacher import PEERS, PREFIX, serve_teacher


def teacher_config(model: str, policy: str = "toy:tiny") -> MasterConfig:
    """The run config both sides of the test use: ``policy``, and ``model`` the teacher on one rank of its own."""
    return MasterConfig.model_validate({
        "policy": {"model_name": policy, "logprob_batch_size": 3},
        "on_policy_distillation": {"enabled": True, "teacher_model_name": model,
                                   "non_colocated_teachers": {"enabled": True,
                                                              "default_teacher_cfg": {"gpus_per_node": 1}}}})


def mark(teacher_rank: int, request):
    """The logprobs teacher rank ``teacher_rank`` answers in ``mark`` mode: ``-(1 + teacher_rank) - id / 1000`` at
    every attended token of the request's ``[b, T']`` rows (so each value says who scored it and which token)."""
    ids_bt = request.input_ids_bt.float()
    return (-(1.0 + teacher_rank) - ids_bt / 1000) * request.attention_mask_bt


def serve_marks(store, teacher_rank: int, num_teacher: int) -> None:
    from grpo.system.bridge import Bridge

    bridge = Bridge(store, 1 + teacher_rank, 1 + num_teacher, 60.0, prefix=PREFIX, peers=PEERS)
    bridge.send(("ready", None), 0)
    while (command := bridge.recv(0))[0] == "score":
        bridge.send(("ok", mark(teacher_rank, command[1])), 0)


if __name__ == "__main__":
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "mark":
        i, k = int(sys.argv[3]), int(sys.argv[4])
        store = dist.TCPStore("127.0.0.1", port, 1 + k, False, timeout=datetime.timedelta(seconds=60))
        store.set(f"peer_up{i}", "1")
        serve_marks(store, i, k)
        os._exit(0)
    model = sys.argv[3]
    policy = sys.argv[4] if len(sys.argv) > 4 else "toy:tiny"
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    store.set("peer_up", "1")  # imports done: the test may start its side with a short timeout
    layout = Layout("teach", 0, 1, 1, 2, 0, store, num_teacher=1)
    if mode == "serve":
        try:
            serve_teacher(teacher_config(model, policy), layout, None)
        except Exception as err:  # noqa: BLE001 - what the rank's log would say
            print(f"teacher peer: {type(err).__name__}: {err}", flush=True)
        sys.stdout.flush()
        os._exit(0)  # no interpreter teardown of a gloo group whose threads still run
    from grpo.system.bridge import Bridge

    bridge = Bridge(store, 1, 2, 60.0, prefix=PREFIX, peers=PEERS)
    bridge.send(("ready", None), 0)
    bridge.recv(0)
    if mode == "die":
        os._exit(3)
    time.sleep(120)
