"""The bridge between trainer rank 0 and the generation ranks (``policy.generation.colocated.enabled=false``).

    bridge rank 0 = trainer rank 0        bridge rank 1 + i = generation rank i

Two raw process groups over a prefix of the launch's rendezvous store (`grpo.system.dist.init_split`), outside
both sides' default groups, so neither DeepSpeed nor vLLM sees them:

- ``objects``: a ``ProcessGroupGloo`` for Python objects (commands, prompts, trajectories' completions), pickled
  into a uint8 tensor sent after its int64 length;
- ``tensors``: weights, broadcast from trainer 0 to every generation rank: ``ProcessGroupNCCL`` on GPUs (device
  tensors), the gloo group itself on CPUs.

Errors name the peer: a generation rank that died (gloo: "Connection closed by peer") or did not answer within
``timeout_s`` raises `BridgeError` on trainer 0. Each side sets its own timeout (gloo's is local): trainer 0
waits ``policy.generation.colocated.bridge_timeout_s`` for an answer; generation ranks wait for the next command
much longer (a training step), and still stop at once when trainer 0's process is gone.
"""

from __future__ import annotations

import datetime
import pickle
import sys

import torch
import torch.distributed as dist


def _weights_group():
    return sys.modules[__name__].weights_group  # looked up at call time: the device-rule harness replaces it


class BridgeError(RuntimeError):
    """A bridge transfer failed; the message names the peer and what to look at."""


def to_bytes_tensor(obj) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor.

        >>> from_bytes_tensor(to_bytes_tensor({"a": [1, 2]}))
        {'a': [1, 2]}
    """
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def from_bytes_tensor(t: torch.Tensor):
    return pickle.loads(t.numpy().tobytes())


GENERATION_PEERS = ("generation rank", "policy.generation.colocated.bridge_timeout_s")


def peer_name(bridge_rank: int, peer: str = GENERATION_PEERS[0]) -> str:
    """How messages name a bridge rank (``peer``: what the ranks beside trainer 0 are called).

        >>> peer_name(0), peer_name(3), peer_name(1, "teacher rank")
        ('trainer rank 0', 'generation rank 2', 'teacher rank 0')
    """
    return "trainer rank 0" if bridge_rank == 0 else f"{peer} {bridge_rank - 1}"


def weights_group(store, rank: int, size: int, timeout: datetime.timedelta, device: torch.device, objects,
                  prefix: str = "bridge"):
    """The group weights travel over: ``ProcessGroupNCCL`` when ``device`` is a CUDA device (device tensors
    only), else the gloo ``objects`` group. (tests/helpers/device_rules.py wraps it to enforce NCCL's rules.)"""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/tensors", store), rank, size, options)
    return objects


def wait_for_peers(store, rank: int, size: int, timeout_s: float, prefix: str = "bridge",
                   peers: tuple[str, str] = GENERATION_PEERS) -> None:
    """Join the bridge: each rank marks itself present in the store; trainer 0 (bridge rank 0) waits up to
    ``timeout_s`` for every generation rank and raises `BridgeError` naming those that never came (a process that
    stalls or dies before it serves), instead of the store's bare ``DistStoreError`` deep in the gloo group's set-up.
    ``peers``: what the other ranks are called and the key of ``timeout_s`` (the teacher bridge's differ)."""
    joined = dist.PrefixStore(f"{prefix}/joined", store)
    joined.set(str(rank), "1")
    if rank != 0:
        return
    try:
        joined.wait([str(r) for r in range(1, size)], datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # torch's DistStoreError: wait timeout
        missing = [r for r in range(1, size) if not joined.check([str(r)])]
        if not missing:
            return
        who = ", ".join(peer_name(r, peers[0]) for r in missing)
        raise BridgeError(
            f"{who} did not join the bridge within {timeout_s:g} s ({peers[1]}): "
            f"check {'its' if len(missing) == 1 else 'their'} log (the last ranks of the launch) for an error or a "
            "stall before it starts serving (imports, a full disk, a device it waits for), that the launcher "
            f"started every rank, or raise {peers[1].rsplit('.', 1)[-1]} if its start is just slow") from None


class Bridge:
    """This process's end of the bridge. ``store``: the launch's rendezvous store; ``rank`` / ``size``: bridge
    rank and 1 + number of generation ranks; ``device``: where weights travel (CUDA: NCCL, else gloo);
    ``timeout_s``: how long this side waits for one transfer; ``prefix``: the store prefix of its groups (one per
    bridge); ``peers``: what its messages call the ranks beside trainer 0, and the key of ``timeout_s``."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, device: torch.device | None = None,
                 prefix: str = "bridge", peers: tuple[str, str] = GENERATION_PEERS):
        self.rank, self.size, self.timeout_s, self.peers = rank, size, timeout_s, peers
        timeout = datetime.timedelta(seconds=timeout_s)
        wait_for_peers(store, rank, size, timeout_s, prefix, peers)
        self.objects = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/objects", store), rank, size, timeout)
        self.device = torch.device("cpu") if device is None else device
        self.tensors = _weights_group()(store, rank, size, timeout, self.device, self.objects, prefix)
        self.broken: str | None = None  # the first failure: every later transfer fails at once with it

    # ---------------------------------------------------------------- objects
    def send(self, obj, dst: int) -> None:
        """Send a picklable object to bridge rank ``dst``."""
        payload = to_bytes_tensor(obj)
        self._run(lambda: (self.objects.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, 0).wait(),
                           self.objects.send([payload], dst, 1).wait()), dst, "sending to")

    def recv(self, src: int, timeout_s: float | None = None):
        """Receive the next object from bridge rank ``src``; ``timeout_s``: this wait's limit (None: the
        bridge's)."""
        wait = datetime.timedelta(seconds=timeout_s if timeout_s is not None else self.timeout_s)
        n = torch.zeros(1, dtype=torch.int64)
        self._run(lambda: self.objects.recv([n], src, 0).wait(wait), src, "waiting for", timeout_s)
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        self._run(lambda: self.objects.recv([payload], src, 1).wait(), src, "waiting for")
        return from_bytes_tensor(payload)

    # ---------------------------------------------------------------- tensors
    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` from bridge rank 0 to every other bridge rank, in place (contiguous, on
        ``device``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._run(lambda: self.tensors.broadcast([tensor], opts).wait(), None, "broadcasting weights with")
        return tensor

    def acknowledge(self) -> None:
        """Generation rank: the tensors broadcast since the last acknowledgment are here (their device work is
        done): say so to trainer 0 over gloo."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.send("received", 0)

    def wait_acknowledged(self) -> None:
        """Trainer 0: every generation rank's `acknowledge` of the tensors broadcast since the last one.

        A weight broadcast over NCCL returns before its peers received anything, and a peer that died mid-way
        leaves it waiting on the device until NCCL's watchdog kills this process (no checkpoint). Over gloo a dead
        peer answers at once (connection closed) and a hung one within ``timeout_s``: `BridgeError` naming it (the
        weight group aborted: `_abort_tensors`)."""
        for r in range(1, self.size):
            answer = self.recv(r)
            if answer != "received":
                self.broken = f"bridge: {peer_name(r, self.peers[0])} answered {answer!r} to a weight broadcast"
                self._abort_tensors()
                raise BridgeError(self.broken)

    def _abort_tensors(self) -> None:
        """Abort a weight group of its own (NCCL) once the bridge failed: a broadcast a dead peer never joined ends
        instead of blocking this device's stream (and the checkpoint's copies queued behind it) until NCCL's
        watchdog kills the process."""
        if self.tensors is not self.objects and hasattr(self.tensors, "abort"):
            try:
                self.tensors.abort()
            except Exception:  # noqa: BLE001 - already torn down by its watchdog: nothing left to end
                pass

    def _run(self, op, peer: int | None, doing: str, timeout_s: float | None = None):
        if self.broken is not None:
            raise BridgeError(self.broken)
        try:
            return op()
        except RuntimeError as err:
            if peer is not None:
                who = peer_name(peer, self.peers[0])
            elif self.rank != 0:
                who = "trainer rank 0"
            else:  # a broadcast does not say which peer failed
                who = peer_name(1, self.peers[0]) if self.size == 2 else f"one of the {self.size - 1} {self.peers[0]}s"
            text = str(err)
            if "Timed out" in text or "timed out" in text or "Timeout" in text:
                limit = self.timeout_s if timeout_s is None else timeout_s
                why = (f"no answer from {who} within {limit:g} s"
                       + (f" ({self.peers[1]})" if timeout_s is None else "")
                       + ": it hangs or is far slower than expected")
            elif "closed" in text or "reset" in text or "Broken pipe" in text or "Connection" in text:
                why = f"{who} is gone (its process died or exited: see its log)"
            else:
                why = f"{who}: {type(err).__name__}: {text.splitlines()[0] if text else ''}"
            self.broken = f"bridge {doing} {who}: {why}"
            self._abort_tensors()
            raise BridgeError(self.broken) from err

    def close(self) -> None:
        """Leave the groups (nothing waits for the peers)."""
        for group in {id(g): g for g in (self.objects, self.tensors)}.values():
            try:
                if hasattr(group, "shutdown"):
                    group.shutdown()
            except Exception:  # noqa: BLE001 - a dead peer's group may refuse; the process ends anyway
                pass
