"""A generation-side bridge peer for tests/unit/test_bridge.py: ``python -m tests.helpers.bridge_peer PORT MODE``.

echo: receive an object and send it back with a mark, then receive one broadcast tensor and send back its sum;
die: receive one object, then exit without a word; hang: receive one object, then sleep; stall: sleep before it
joins the bridge (a generation rank stuck in its start).
"""

import datetime
import os
import sys
import time

import torch.distributed as dist

from grpo.system.bridge import Bridge

if __name__ == "__main__":
    port, mode = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    if mode == "stall":
        time.sleep(120)
    bridge = Bridge(store, 1, 2, timeout_s=60)
    obj = bridge.recv(0)
    if mode == "die":
        os._exit(3)
    if mode == "hang":
        time.sleep(120)
    bridge.send({"echo": obj}, 0)
    import torch

    t = bridge.broadcast(torch.zeros(4, 3))
    bridge.send(float(t.sum()), 0)
    bridge.recv(0)  # the test's goodbye
