"""A generation-side bridge peer for tests/unit/test_bridge.py: ``python -m tests.helpers.bridge_peer PORT MODE``.

echo: receive an object and send it back with a mark, then receive one broadcast tensor and send back its sum;
die: receive one object, then exit without a word; hang: receive one object, then sleep; stall: sleep before it
joins the bridge (a generation rank stuck in its start);
load: serve one weight load as a generation rank does (`grpo.system.generation.server`), then send back the
received tensors' sums; load-die-N / load-hang-N: the same, but exit / sleep in the middle of the N-th tensor
broadcast (0-based), before it arrives.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from grpo.system.bridge import Bridge


def serve_one_load(bridge: Bridge, mode: str) -> None:
    from grpo.system.generation.server import _run_load

    if mode != "load":
        _, fail, n = mode.split("-")
        broadcast, seen = bridge.broadcast, []

        def broadcast_until(tensor):
            if len(seen) == int(n):
                os._exit(3) if fail == "die" else time.sleep(120)
            seen.append(tensor)
            return broadcast(tensor)

        bridge.broadcast = broadcast_until

    class Backend:
        device = torch.device("cpu")

        def load_buckets(self, buckets, expected, reset_cache=True):
            self.sums = {name: float(t.sum()) for bucket in buckets for name, t in bucket}

    backend = Backend()
    kind, arg = bridge.recv(0)
    assert kind == "load", kind
    bridge.send(_run_load(backend, bridge, arg), 0)
    bridge.send(backend.sums, 0)


if __name__ == "__main__":
    port, mode = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    store.set("peer_up", "1")  # imports done: the test may start its side with a short timeout
    if mode == "stall":
        time.sleep(120)
    bridge = Bridge(store, 1, 2, timeout_s=60)
    if mode.startswith("load"):
        serve_one_load(bridge, mode)
        # os._exit, not sys.exit: the sends are done, and the interpreter's teardown of a process group whose gloo
        # threads still run can abort ("terminate called without an active exception", exit -6: a CI flake)
        sys.stdout.flush()
        os._exit(0)
    obj = bridge.recv(0)
    if mode == "die":
        os._exit(3)
    if mode == "hang":
        time.sleep(120)
    bridge.send({"echo": obj}, 0)
    t = bridge.broadcast(torch.zeros(4, 3))
    bridge.send(float(t.sum()), 0)
    bridge.recv(0)  # the test's goodbye
