"""NCCL's rules enforced on gloo, so the CPU suite catches code that only works because everything is gloo here.

On GPUs the default process group (and every group made without ``backend="gloo"``) is NCCL, and NCCL
communicates device tensors only; on the CPU every group is gloo and takes anything. Inside
``with nccl_rules() as rules:`` (in a process whose default group is already initialised):

- the default group and every group created without an explicit ``backend="gloo"`` count as *device groups*:
  ``torch.distributed.get_backend`` answers "nccl" for them (code takes its NCCL branches);
- a tensor collective (all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter, ...) over a
  device group raises `DeviceRuleError` unless every tensor it is given is on the simulated accelerator;
- an object collective (all_gather_object, broadcast_object_list, ...) over a device group raises unless the
  calling thread has set its device (NCCL pickles into ``cuda:current_device()``, and the current device is
  per thread: a thread that never called ``torch.cuda.set_device`` talks from cuda:0 on every rank);
- ``monitored_barrier`` (gloo only) over a device group raises;
- a thread that calls a generation backend (`grpo.system.generation.base.GenerationBackend`'s ``BACKEND_CALLS`` of
  every backend class, the tests' included) raises unless it has set its device: ``torch.cuda.set_device``, or the
  backend's device context (`grpo.system.generation.base.on_device`, which `GenerationBackend.device_context`
  enters). On GPUs a thread that never did launches the engine's kernels on cuda:0 with cuda:k pointers (vLLM sets
  its device only on the thread that built it).

The simulated accelerator is ``rules.device``: a CPU device object that the harness recognises by identity.
``grpo.system.dist.comm_device()`` returns it (where grpo's collectives put their tensors); a tensor made with ``device=rules.device``, moved with
``.to(rules.device)`` or ``.cuda()``, or computed from such tensors is "on the accelerator"; a tensor made
without a device (or with "cpu") is a host tensor, and ``.cpu()`` makes one. ``rules.set_device()`` is
``torch.cuda.set_device`` for the calling thread (``activate`` does it for the thread that enters, as
`grpo.system.dist.init_distributed` does on GPUs); ``torch.cuda.set_device`` itself is recorded too, and so is the
block of `grpo.system.generation.base.on_device` (a no-op on the CPU).
Host groups (``backend="gloo"``) take CPU tensors, as on GPUs.

Only collectives called through the ``torch.distributed`` namespace are checked (torch's own object
collectives call the c10d functions underneath and are checked as object collectives), and only when called
from code outside the libraries in ``LIBRARIES``: DeepSpeed's engines make their tensors on
``get_accelerator()``'s device, which this harness does not simulate, so the collectives inside a ZeRO engine
pass unchecked while grpo's own around it (loss totals, forward counts, flags, object gathers) are checked.

Whole runs: ``python tests/helpers/device_rules.py SCRIPT ARGS...`` (or under torchrun) runs SCRIPT as ``__main__``
inside ``nccl_rules()``; with ``DEVICE_RULES_LOG=FILE`` each checked collective appends a line to FILE.
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
                      "scatter", "send", "recv", "isend", "irecv", "all_reduce_coalesced")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")
GLOO_ONLY = ("monitored_barrier",)
# The generation backends' calls that run on the device (a thread that makes them must have set its device).
BACKEND_CALLS = ("generate", "refit", "wake_up", "sleep", "load_staged", "load_buckets")
LIBRARIES = ("deepspeed", "torch", "transformers", "accelerate", "vllm")  # their collectives are not checked
_MARK = "_device_rules_on_accelerator"


class DeviceRuleError(RuntimeError):
    """A collective that NCCL would reject (or hang on)."""


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def on_accelerator(t: torch.Tensor) -> bool:
    return bool(getattr(t, _MARK, False))


def _mark(x) -> None:
    for t in _tensors(x):
        setattr(t, _MARK, True)


class _Tracker(TorchFunctionMode):
    """Follows which tensors live on the simulated accelerator (see the module docstring)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # a copy on the accelerator
            out = args[0].clone()
            _mark(out)
            return out
        to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(
            (isinstance(a, torch.device) and a is not self.device and a.type == "cpu") or a == "cpu"
            for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str))))
        out = func(*args, **kwargs)
        if to_host:
            if isinstance(out, torch.Tensor) and out is args[0]:
                out = out.view_as(out)  # a new host tensor, as .cpu() of a device tensor gives
            return out
        placed = any(a is self.device for a in (*args, *kwargs.values()))
        if placed or any(on_accelerator(t) for t in _tensors(list(args)) + _tensors(kwargs)):
            _mark(out)
        return out


class NcclRules:
    """The active harness: ``device`` (the simulated accelerator), ``set_device()``, ``violations``."""

    def __init__(self):
        self.device = torch.device("cpu")  # recognised by identity
        self.host_groups: list = []  # groups created with backend="gloo"
        self.violations: list[str] = []
        self.checked: list[str] = []  # "<collective> from <caller module>", in order
        self._local = threading.local()

    def set_device(self, index: int | torch.device | None = 0) -> None:
        self._local.device_set = True

    def device_set(self) -> bool:
        return getattr(self._local, "device_set", False)

    def is_device_group(self, group) -> bool:
        return not any(group is g for g in self.host_groups)

    def _fail(self, msg: str) -> None:
        self.violations.append(msg)
        raise DeviceRuleError(msg)

    def check_tensors(self, name: str, group, tensors: list[torch.Tensor]) -> None:
        if not self.is_device_group(group):
            return
        host = [tuple(t.shape) for t in tensors if not on_accelerator(t)]
        if host:
            self._fail(f"{name} over a group that is NCCL on GPUs got host (CPU) tensors of shapes {host}: "
                       "NCCL communicates device tensors only (use the rank's device, or a gloo group)")

    def check_backend_call(self, backend, name: str) -> None:
        if not self.device_set():
            self._fail(f"{type(backend).__name__}.{name} from thread {threading.current_thread().name!r}, which never "
                       "set its CUDA device: on GPUs its kernels would launch on cuda:0 (enter the backend's "
                       "device_context)")

    def check_object(self, name: str, group) -> None:
        if self.is_device_group(group) and not self.device_set():
            self._fail(f"{name} over a group that is NCCL on GPUs from thread {threading.current_thread().name!r}, "
                       "which never set its CUDA device: NCCL would pickle into cuda:0 on every rank")


def _group_of(func, args, kwargs):
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return kwargs.get("group")
    return bound.arguments.get("group")


class _DeviceOnlyGroup:
    """The bridge's weight group (`grpo.system.bridge.weights_group`, a raw ProcessGroupNCCL on GPUs) under NCCL's
    rule: every tensor it broadcasts is on the accelerator."""

    def __init__(self, group, rules: NcclRules, log: str | None):
        self.group, self.rules, self.log = group, rules, log

    def broadcast(self, tensors, opts):
        if self.log:
            with open(self.log, "a") as f:
                f.write("broadcast grpo.system.bridge device\n")
        if not all(on_accelerator(t) for t in _tensors(tensors)):
            self.rules._fail("broadcast over the bridge's weight group (ProcessGroupNCCL on GPUs) of a host tensor")
        return self.group.broadcast(tensors, opts)

    def __getattr__(self, name):
        return getattr(self.group, name)


@contextmanager
def nccl_rules() -> Iterator[NcclRules]:
    """Enforce NCCL's rules on this process's collectives until the block ends (see the module docstring)."""
    import grpo.system.dist
    import grpo.system.engines
    import grpo.system.training

    rules = NcclRules()
    log = os.environ.get("DEVICE_RULES_LOG")  # a file that gets one line per checked collective
    rules.set_device()  # the entering thread, as init_distributed does on GPUs
    saved: dict[tuple[object, str], object] = {}

    def patch(owner, name, value):
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    original_new_group = c10d.new_group

    def new_group(*args, **kwargs):
        group = original_new_group(*args, **kwargs)
        backend = inspect.signature(original_new_group).bind(*args, **kwargs).arguments.get("backend")
        if backend is not None and str(backend).lower() in ("gloo", "cpu:gloo"):
            rules.host_groups.append(group)
        return group

    patch(c10d, "new_group", new_group)
    patch(dist, "new_group", new_group)
    original_get_backend = dist.get_backend
    patch(dist, "get_backend", lambda group=None: "nccl" if rules.is_device_group(group)
          else original_get_backend(group))
    for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES + GLOO_ONLY:
        func = getattr(dist, name, None)
        if func is None:
            continue

        def checked(*args, _func=func, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.split(".")[0] in LIBRARIES:
                return _func(*args, **kwargs)
            group = _group_of(_func, args, kwargs)
            rules.checked.append(f"{_name} from {caller}")
            if log:
                with open(log, "a") as f:
                    f.write(f"{_name} {caller} {'device' if rules.is_device_group(group) else 'host'}\n")
            if _name in TENSOR_COLLECTIVES:
                rules.check_tensors(_name, group, _tensors(list(args)) + _tensors(kwargs))
            elif _name in OBJECT_COLLECTIVES:
                rules.check_object(_name, group)
            elif rules.is_device_group(group):
                rules._fail(f"{_name} over a group that is NCCL on GPUs: gloo only")
            return _func(*args, **kwargs)

        patch(dist, name, checked)
    import grpo.system.bridge

    original_weights_group = grpo.system.bridge.weights_group

    def weights_group(*args, **kwargs):  # the bridge's weight broadcast: NCCL on GPUs, device tensors only
        return _DeviceOnlyGroup(original_weights_group(*args, **kwargs), rules, log)

    patch(grpo.system.bridge, "weights_group", weights_group)
    # A torch function mode is per thread, a GPU is not: threads started inside the block (the async producer)
    # follow the accelerator's tensors too.
    original_run = threading.Thread.run

    def run_tracked(self, *args, **kwargs):
        with _Tracker(rules.device):
            return original_run(self, *args, **kwargs)

    patch(threading.Thread, "run", run_tracked)
    patch(torch.cuda, "set_device", rules.set_device)
    _check_backends(rules, patch)
    for module in (grpo.system.dist, grpo.system.engines, grpo.system.training):  # each holds the name
        patch(module, "comm_device", lambda: rules.device)
    tracker = _Tracker(rules.device)
    try:
        with tracker:
            yield rules
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def _backend_classes() -> list[type]:
    """Every generation backend class defined so far (grpo's own imported first)."""
    import grpo.system.generation.hf  # noqa: F401
    import grpo.wings.agents.lockstep  # noqa: F401
    import grpo.system.generation.remote  # noqa: F401
    import grpo.system.generation.vllm  # noqa: F401
    from grpo.system.generation.base import GenerationBackend

    out, todo = [], [GenerationBackend]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def _check_backends(rules: NcclRules, patch) -> None:
    """The backends' device rule: their calls checked (`NcclRules.check_backend_call`), their device context
    recorded as the calling thread's device for its block."""
    import grpo.system.generation.base as base

    for cls in _backend_classes():
        for name in BACKEND_CALLS:
            method = cls.__dict__.get(name)
            if method is None:
                continue

            def checked(self, *args, _method=method, _name=name, **kwargs):
                rules.check_backend_call(self, _name)
                return _method(self, *args, **kwargs)

            patch(cls, name, checked)
    original_on_device = base.on_device

    @contextmanager
    def on_device(device, stream=None):
        before = rules.device_set()
        rules.set_device()
        try:
            with original_on_device(device, stream):
                yield
        finally:
            rules._local.device_set = before

    patch(base, "on_device", on_device)


if __name__ == "__main__":  # python tests/helpers/device_rules.py SCRIPT ARGS...: SCRIPT under NCCL's rules
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # the repo
    with nccl_rules():
        runpy.run_path(sys.argv[0], run_name="__main__")
