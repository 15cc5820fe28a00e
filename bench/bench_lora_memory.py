#!/usr/bin/env python
"""Memory ledger: the bytes full fine-tuning and LoRA hold, by kind of state, per phase and at the peak (issue 51).

    python bench/bench_lora_memory.py                          # 3 pairs (full, LoRA, full, ...), bench model, 2 steps
    python bench/bench_lora_memory.py --pairs 1 --steps 3 --model tiny
    python bench/bench_lora_memory.py --cases lora --json      # one LoRA run; its whole ledger as JSON
    python bench/bench_lora_memory.py --pairs 1 -- policy.generation.hf_drop_finished_rows=false   # more overrides

Each case is train_grpo.py on the bench workload exactly as ``bench/bench_step.py`` runs it (the same overrides;
``lora`` adds its ``LORA_OVERRIDES``), in a fresh process (peak RSS only grows), with the loop instrumented from
outside (`Ledger`): nothing in the trainer changes. At the end of each loop phase (rollout, logprobs, train, refit),
at the end of every forward of the policy's module, and after each backward and optimizer step, it counts the
tensors the process holds, each storage once (by its address), in the first kind (column) that claims it:

    weights    the policy module's parameters and buffers (with LoRA: the frozen base), ZeRO-3 partitions too
    adapters   with LoRA: the adapters (parameters named ``.lora_``)
    grads      ``.grad`` of the policy's parameters, and the tensors of DeepSpeed's optimizer named for gradients
    optimizer  the optimizer's states (Adam's moments) and DeepSpeed's other tensors (fp32 masters, flat buffers)
    reference  a separate reference model's parameters and buffers (with LoRA: none, it is the adapters-off pass)
    gen copy   the hf generation backend's own model, when it is not the policy's module (an in-process vLLM
               engine's weights are not walked: they count as "tensors")
    kv cache   tensors held by transformers' Cache objects (generation, shared-prompt forwards)
    activs     tensors autograd saved for a backward (``torch.autograd.graph.saved_tensors_hooks``), still held
    tensors    every other tensor the garbage collector reaches (batches, logits, ...)
    rest       RSS minus all of the above: the interpreter, libraries, and memory freed to malloc but not
               returned to the system
    (mfree)    part of rest: what glibc's malloc holds free in its arenas (``mallinfo2().fordblks``)

Per case and phase (setup, rollout, logprobs, train, refit) it prints the peak RSS within the phase (VmHWM, reset
at each phase start through ``/proc/self/clear_refs``) and the ledger of the phase's largest snapshot; then the
ledger at the run's highest RSS (PEAK) and where it held the most weight state (MOST STATE: weights to gen copy,
what scales with the model); at the end, the peak RSS of every run, LoRA / full per pair, and the weight state in
bytes per base parameter with what it projects for larger models (``--project``). ``--trim`` calls glibc's
``malloc_trim(0)`` at every phase end and reports the RSS after it (how much of "rest" is freed memory the allocator
kept); allocator settings (``MALLOC_MMAP_THRESHOLD_``, ``LD_PRELOAD`` of another malloc) pass through the environment.
A CPU run's setup has malloc map every block of 1 MiB or more (`grpo.system.host_memory.map_large_allocations`), so
"rest" is the process's own memory; ``MALLOC_MMAP_THRESHOLD_=33554432`` shows glibc's default behaviour after warm-up.
A bench-model case takes 3-5 minutes (the snapshots walk the garbage collector's objects at every forward).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import weakref
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

KINDS = ("policy weights", "adapters", "gradients", "optimizer", "reference", "generation copy", "kv cache",
         "activations", "other tensors")
STATE = KINDS[:6]  # what scales with the model's parameters (activations and caches scale with the batch)
MB = 2**20


# --------------------------------------------------------------------------------------------------
# Reading the process
# --------------------------------------------------------------------------------------------------
def proc_status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (VmRSS: resident now; VmHWM: the peak since start or the last reset)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


def reset_peak_rss() -> None:
    """Restart VmHWM from the current RSS (Linux >= 4.0: writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def malloc_trim() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def malloc_free_bytes() -> int:
    """Bytes glibc's malloc holds free in its arenas (``mallinfo2().fordblks``, all arenas): memory the program
    freed that the allocator kept (resident unless trimmed or never touched)."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = Mallinfo2
    return fn().fordblks


def _tensors_in(obj, depth: int = 3):
    """Tensors in ``obj``: itself, or inside its lists / tuples / dicts / ``__dict__`` (to ``depth`` levels)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or isinstance(obj, (str, bytes, int, float, type)) or obj is None:
        return
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        yield from _tensors_in(item, depth - 1)


class Counted:
    """Bytes per kind, each storage counted once (its first kind wins)."""

    def __init__(self):
        self.bytes, self._seen = Counter(), set()

    def add(self, kind: str, tensors) -> None:
        for t in tensors:
            if t is None or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = (t.device.type, storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes[kind] += storage.nbytes()

    def __contains__(self, t) -> bool:
        return (t.device.type, t.untyped_storage().data_ptr()) in self._seen


def _module_tensors(module):
    """A module's parameters and buffers, with ZeRO-3's partitions (``ds_tensor``)."""
    for p in module.parameters():
        yield p
        if getattr(p, "ds_tensor", None) is not None:
            yield p.ds_tensor
    yield from module.buffers()


def optimizer_tensors(engine) -> tuple[list, list]:
    """(gradient buffers, optimizer states) of a DeepSpeed engine's optimizer: the torch optimizer's states, and
    every tensor a ZeRO / BF16 wrapper holds in its attributes (those named for gradients are gradients)."""
    opt = engine.optimizer
    if opt is None:
        return [], []
    inner = getattr(opt, "optimizer", opt)
    states = [t for s in inner.state.values() for t in _tensors_in(s)]
    grads = []
    if inner is not opt:  # DeepSpeed's wrapper: master partitions, flat buffers, gradient partitions
        for name, value in vars(opt).items():
            if name in ("optimizer", "module") or name.startswith("_hooks"):
                continue
            (grads if "grad" in name else states).extend(_tensors_in(value))
    return grads, states


class Ledger:
    """Snapshots of what the process holds (`Ledger.snapshot`), keyed by the loop's phases."""

    def __init__(self, trim: bool = False):
        self.trim = trim
        self.run = None                  # the grpo.run.Run, once setup returns
        self.phase = "setup"
        self.phases: dict[str, dict] = {}  # phase -> {"peak_rss_mb", "ledger" (its largest snapshot)}
        self.peak: dict | None = None    # the snapshot with the highest RSS
        self.most_state: dict | None = None  # the snapshot with the most weight state (STATE) held at once
        self.params = (0, 0)             # (base, adapter) parameters of the policy
        self._saved: list = []           # weakrefs to what autograd saved for backward
        self._peak_rss = 0               # VmHWM before each reset: the run's peak (a reset lowers ru_maxrss too)
        self._reset_peak()

    def _reset_peak(self) -> None:
        self._peak_rss = max(self._peak_rss, proc_status_kb("VmHWM") * 1024)
        reset_peak_rss()

    # ---- what autograd saves: activations ----
    def pack(self, t):
        d = t.detach()  # the same storage; no reference cycle with the node that saves it
        self._saved.append(weakref.ref(d))
        return d

    @staticmethod
    def unpack(t):
        return t

    def activations(self) -> list:
        self._saved = [r for r in self._saved if r() is not None]
        return [r() for r in self._saved]

    # ---- one snapshot ----
    def count(self) -> Counted:
        from grpo.system.engines import is_lora

        c = Counted()
        run = self.run
        if run is not None:
            policy = run.policy
            lora = is_lora(policy.module)
            params = list(policy.module.parameters())
            # by name: peft's disable_adapter (the reference pass) turns the adapters' requires_grad off meanwhile
            c.add("adapters", [p for n, p in policy.module.named_parameters() if lora and ".lora_" in n])
            c.add("policy weights", _module_tensors(policy.module))
            c.add("gradients", [p.grad for p in params])
            grads, states = optimizer_tensors(policy)
            c.add("gradients", grads)
            c.add("optimizer", states)
            ref = run.logprob_engines.reference
            if ref is not None and getattr(ref, "module", None) is not policy.module:
                c.add("reference", _module_tensors(ref.module))
            gen_model = getattr(run.generator, "model", None)
            if isinstance(gen_model, __import__("torch").nn.Module) and gen_model is not policy.module:
                c.add("generation copy", _module_tensors(gen_model))
        c.add("activations", self.activations())
        from transformers.cache_utils import Cache

        gc_objects = gc.get_objects()
        c.add("kv cache", [t for o in gc_objects if isinstance(o, Cache) for t in _tensors_in(o, 4)])
        import torch

        c.add("other tensors", [o for o in gc_objects if isinstance(o, torch.Tensor)])
        return c

    def snapshot(self, point: str) -> None:
        counted = self.count()
        rss = proc_status_kb("VmRSS") * 1024
        snap = {"phase": self.phase, "point": point, "rss": rss,
                **{k: counted.bytes.get(k, 0) for k in KINDS}}
        snap["rest"] = rss - sum(counted.bytes.values())
        snap["malloc free"] = malloc_free_bytes()
        entry = self.phases.setdefault(self.phase, {"ledger": snap})
        if sum(snap[k] for k in KINDS) >= sum(entry["ledger"][k] for k in KINDS):
            entry["ledger"] = snap
        if self.peak is None or rss >= self.peak["rss"]:
            self.peak = snap
        if self.most_state is None or sum(snap[k] for k in STATE) > sum(self.most_state[k] for k in STATE):
            self.most_state = snap

    def end_phase(self) -> None:
        self.snapshot("end")
        entry = self.phases[self.phase]
        entry["peak_rss"] = max(entry.get("peak_rss", 0), proc_status_kb("VmHWM") * 1024)
        if self.trim:
            malloc_trim()
            entry["rss_after_trim"] = proc_status_kb("VmRSS") * 1024

    def start_phase(self, phase: str) -> None:
        self.phase = phase
        self._reset_peak()

    def result(self) -> dict:
        return {"peak_rss": max(self._peak_rss, proc_status_kb("VmHWM") * 1024), "phases": self.phases,
                "peak": self.peak, "most_state": self.most_state, "base_params": self.params[0],
                "adapter_params": self.params[1]}


# --------------------------------------------------------------------------------------------------
# The instrumented run (one case, in this process)
# --------------------------------------------------------------------------------------------------
def run_case(argv: list[str], out_path: str, trim: bool) -> None:
    """train_grpo.main(argv) with a `Ledger` around its phases; the ledger as JSON into ``out_path``."""
    from contextlib import contextmanager

    import torch

    import grpo.system.tracking as tracking
    import train_grpo

    ledger = Ledger(trim)
    torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack).__enter__()  # for the whole run
    timed = tracking.timed

    @contextmanager
    def timed_with_ledger(metrics, phase):
        ledger.start_phase(phase)
        with timed(metrics, phase):
            yield
        ledger.end_phase()

    tracking.timed = timed_with_ledger
    setup = train_grpo.setup

    def setup_with_ledger(*args, **kwargs):
        run = setup(*args, **kwargs)
        ledger.run = run
        named = [(n, getattr(p, "ds_numel", p.numel())) for n, p in run.policy.module.named_parameters()]
        adapters = sum(k for n, k in named if ".lora_" in n)
        ledger.params = (sum(k for _, k in named) - adapters, adapters)
        ledger.end_phase()
        run.policy.module.register_forward_hook(lambda *_: ledger.snapshot("forward"))
        gen = getattr(run.generator, "model", None)
        if isinstance(gen, torch.nn.Module) and gen is not run.policy.module:
            gen.register_forward_hook(lambda *_: ledger.snapshot("forward"))
        engine_cls = type(run.policy)
        backward, step, refit = engine_cls.backward, engine_cls.step, type(run.generator).refit

        def backward_with_ledger(self, *a, **kw):
            out = backward(self, *a, **kw)
            ledger.snapshot("after backward")
            return out

        def step_with_ledger(self, *a, **kw):
            out = step(self, *a, **kw)
            ledger.snapshot("after optimizer step")
            return out

        def refit_with_ledger(self, *a, **kw):
            ledger.start_phase("refit")
            out = refit(self, *a, **kw)
            ledger.end_phase()
            return out

        engine_cls.backward, engine_cls.step = backward_with_ledger, step_with_ledger
        type(run.generator).refit = refit_with_ledger
        return run

    train_grpo.setup = setup_with_ledger
    status = train_grpo.main(argv)
    if status:
        raise SystemExit(f"the trainer stopped with {status}")
    Path(out_path).write_text(json.dumps(ledger.result()))


# --------------------------------------------------------------------------------------------------
# The cases side by side
# --------------------------------------------------------------------------------------------------
def case_command(case: str, workload: Path, model: str, steps: int, extra: list[str]) -> list[str]:
    """train_grpo.py's argv for a case, as bench_step.py builds it."""
    from bench_step import LORA_OVERRIDES, trainer_overrides

    log_dir = tempfile.mkdtemp(prefix="grpo_ledger_")
    return ["--config", "configs/cpu_demo.yaml", *trainer_overrides(workload, model, steps, log_dir),
            *(LORA_OVERRIDES if case == "lora" else []), *extra]


def measure(case: str, args, extra: list[str]) -> dict:
    from bench_step import trainer_env

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv = case_command(case, Path(args.workload).resolve(), args.model, args.steps, extra)
    cmd = [sys.executable, __file__, "--worker", out, *(["--trim"] if args.trim else []), "--", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(args.threads), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"{case}: the instrumented trainer exited {proc.returncode}")
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return {"case": case, "command": "python train_grpo.py " + " ".join(argv), **result}


def _mb(n: int) -> str:
    return f"{n / MB:9.1f}"


COLUMNS = {"policy weights": "weights", "adapters": "adapters", "gradients": "grads", "optimizer": "optimizer",
           "reference": "reference", "generation copy": "gen copy", "kv cache": "kv cache", "activations": "activs",
           "other tensors": "tensors", "rest": "rest", "malloc free": "(mfree)", "rss": "rss"}


def table(results: list[dict]) -> str:
    """Per case, in MB: each phase's peak RSS and its largest snapshot by kind; then the ledgers of the run's peak
    RSS and of its most weight state held at once."""
    lines = []
    head = f"{'':24}" + "".join(f"{label:>10}" for label in COLUMNS.values())
    for r in results:
        lines.append(f"== {r['case']}: peak RSS {r['peak_rss'] / MB:.1f} MB")
        lines.append(head)
        rows = [(f"{phase} (peak {e['peak_rss'] / MB:.0f})", e["ledger"]) for phase, e in r["phases"].items()]
        rows.append((f"PEAK @ {r['peak']['phase']}/{r['peak']['point']}", r["peak"]))
        rows.append((f"MOST STATE @ {r['most_state']['phase']}", r["most_state"]))
        for label, snap in rows:
            lines.append(f"{label[:24]:24}" + "".join(f" {_mb(snap[k])}" for k in COLUMNS))
        trimmed = {p: e["rss_after_trim"] for p, e in r["phases"].items() if "rss_after_trim" in e}
        if trimmed:
            lines.append("rss after malloc_trim: " + ", ".join(f"{p} {v / MB:.0f}" for p, v in trimmed.items()))
    return "\n".join(lines)


def per_parameter_bytes(result: dict) -> dict[str, float]:
    """The most weight state the run held at once (`STATE`), in bytes per base parameter: what scales with the
    model (activations and KV caches scale with the batch and the sequence instead)."""
    return {k: result["most_state"][k] / result["base_params"] for k in STATE}


def projections(results: list[dict], sizes: list[float]) -> list[str]:
    """Weight state per case for models of ``sizes`` base parameters: the median bytes per base parameter of its
    runs (`per_parameter_bytes`; the adapters keep the bench model's share of the parameters)."""
    import statistics

    lines = []
    for case in dict.fromkeys(r["case"] for r in results):
        per_kind = [per_parameter_bytes(r) for r in results if r["case"] == case]
        median = {k: statistics.median(b[k] for b in per_kind) for k in STATE}
        total = sum(median.values())
        parts = ", ".join(f"{k} {v:.2f}" for k, v in median.items() if v >= 0.005)
        lines.append(f"{case}: {total:.2f} bytes of weight state per base parameter ({parts}); "
                     + ", ".join(f"{n / 1e9:g}B -> {total * n / 2**30:.1f} GiB" for n in sizes))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(REPO / "bench_workload"))
    ap.add_argument("--model", default="bench", choices=["bench", "tiny"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3, help="alternating runs of each case")
    ap.add_argument("--cases", default="full,lora", help="comma-separated: full, lora")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) at each phase end, RSS after it reported")
    ap.add_argument("--json", action="store_true", help="print every ledger as JSON lines too")
    ap.add_argument("--project", default="1.5e9,7e9", help="base parameter counts to project the weight state to")
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="more dotted overrides for both cases")
    args = ap.parse_args()
    if args.worker:
        run_case(args.overrides, args.worker, args.trim)
        os._exit(0)  # as run_script: no interpreter finalization with DeepSpeed's engines alive

    from bench_step import build_workload

    build_workload(Path(args.workload).resolve())
    cases = args.cases.split(",")
    results = []
    for _ in range(args.pairs):
        for case in cases:
            results.append(measure(case, args, args.overrides))
            print(table(results[-1:]), flush=True)
            if args.json:
                print(json.dumps(results[-1]), flush=True)
    peaks = {case: [r["peak_rss"] / MB for r in results if r["case"] == case] for case in cases}
    print("peak RSS MB: " + "; ".join(f"{c} " + " ".join(f"{v:.1f}" for v in vs) for c, vs in peaks.items()))
    if {"full", "lora"} <= set(cases):
        ratios = [lo / fu for fu, lo in zip(peaks["full"], peaks["lora"])]
        print("LoRA / full peak RSS per pair: " + " ".join(f"{r:.3f}" for r in ratios)
              + f"; worst of the runs (max LoRA / min full) {max(peaks['lora']) / min(peaks['full']):.3f}")
    print("\n".join(projections(results, [float(n) for n in args.project.split(",")])))


if __name__ == "__main__":
    main()
