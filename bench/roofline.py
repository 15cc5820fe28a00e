#!/usr/bin/env python
"""How close each phase of a GRPO step runs to this machine's bound, and which bound it is (issue 50).

    python bench/roofline.py                         # the bench workload (WORKLOAD.md), bench model, 4 steps
    python bench/roofline.py --model tiny --steps 2
    python bench/roofline.py --config configs/cpu_demo.yaml grpo.num_prompts_per_step=4   # any config

Builds the run as train_grpo.py does (`grpo.run.run_setup.setup`, one process; by default the bench workload's
settings, bench/bench_step.py's) and measures the machine with ``--threads`` threads: the fp32 matmul peak (square
sgemms, 512 to 2048) and the memory bandwidth (a large copy and a triad, the better of the two), each the best rate
seen in probes before and after the steps (other jobs slow a probe down, never up). Then plays the step's phases one
by one, each under its own clock: generation (each generate call timed; its prefill timed again afterwards as a call
of one new token on the same prompts, outside the step's time; decode = the rest), environment steps, the
previous-policy, reference (and teacher) logprob passes apart, advantages, training (the DeepSpeed engine's
``step``, the optimizer, timed inside it; forward and backward = the rest), refit. For each phase it counts the
FLOPs and bytes the phase must do from the model's config and the step's batch (`grpo.tools.roofline`) and prints
the time, the work, whether compute or memory bounds it, and the fraction of that bound achieved: the bound's time
over the measured time, over the steps after the first (a warm-up). Checkpoints, validation and logging are off;
nothing is written but a temporary log directory. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_step import build_workload, trainer_env, trainer_overrides  # noqa: E402  (beside this file)

# The phases, in step order; "other" is the step's time outside them (rollout bookkeeping, scoring, advantages).
PHASES = ("prefill", "decode", "environment", "logprob_prev", "logprob_reference", "logprob_teacher",
          "train_fwd_bwd", "optimizer", "refit", "other")


# --------------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------------
def best_rate(op, amount: float, seconds: float) -> float:
    """``amount`` / the fastest run of ``op()`` over about ``seconds`` (one warm-up run first)."""
    op()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - t0)
    return amount / best


def matmul_peak(seconds: float, sizes: tuple[int, ...] = (512, 1024, 2048)) -> tuple[float, int, str]:
    """(FLOP/s, n, kernel): the best rate of an ``n x n`` fp32 matmul (``2 n^3`` FLOPs) over ``seconds`` shared by
    the ``sizes`` and by the kernels torch has: ``torch.mm`` (MKL's sgemm) and, where this torch has it, oneDNN's
    (`grpo.system.cpu_linear`; on an AMD CPU MKL runs AVX2 and oneDNN AVX-512, about twice the rate). The small
    sizes take a millisecond or so: on a loaded machine they still find moments when both threads run; the large
    ones are the kernel's rate on a quiet machine."""
    import torch

    from grpo.system.cpu_linear import onednn_available, onednn_matmul

    rates = []
    for n in sizes:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        kernels = {"torch.mm": lambda: torch.mm(a, b, out=c)}
        if onednn_available():
            kernels["onednn"] = lambda: onednn_matmul(a, b)
        for kernel, op in kernels.items():
            share = seconds / len(sizes) / len(kernels)
            rates.append((best_rate(op, 2.0 * n ** 3, share), n, kernel))
    return max(rates)


def memory_bandwidth(seconds: float, numel: int = 1 << 25) -> dict:
    """Bytes/s of a copy (reads and writes ``numel`` fp32) and of a triad ``a = b + 3 c`` (reads two, writes one),
    each the best over half of ``seconds``; 128 MiB arrays, far larger than any cache."""
    import torch

    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)
    size = 4.0 * numel
    copy = best_rate(lambda: a.copy_(b), 2 * size, seconds / 2)
    triad = best_rate(lambda: torch.add(b, c, alpha=3.0, out=a), 3 * size, seconds / 2)
    return {"copy": copy, "triad": triad}


# --------------------------------------------------------------------------------------------------
# Clocks on the run's pieces
# --------------------------------------------------------------------------------------------------
@dataclass
class GenerateCall:
    prompts: list[list[int]]
    seeds: list[int]
    keywords: dict
    completion_lens: list[int]


class RecordedGenerate:
    """Stands in for a backend's ``generate``: the same call, its prompts and completion lengths recorded in
    ``calls``. `prefill_seconds` replays a call with one new token (the prefill and one sampling step)."""

    def __init__(self, backend):
        self.backend, self.inner, self.calls = backend, backend.generate, []
        backend.generate = self

    def __call__(self, prompt_ids, seeds, **keywords):
        out = self.inner(prompt_ids, seeds, **keywords)
        self.calls.append(GenerateCall([list(p) for p in prompt_ids], list(seeds), keywords,
                                       [len(o.completion_ids) for o in out]))
        return out

    def prefill_seconds(self, call: GenerateCall) -> float:
        self.backend.reset_prefix_cache()  # vLLM: the prompts' KV blocks are cached from the call itself
        t0 = time.perf_counter()
        self.inner(call.prompts, call.seeds, **{**call.keywords, "max_new_tokens": 1})
        return time.perf_counter() - t0


class TimedStep:
    """Stands in for a DeepSpeed engine's ``step`` (the optimizer's, with gradient clipping and the scheduler):
    the same call, its seconds added to ``seconds``."""

    def __init__(self, engine):
        self.inner, self.seconds = engine.step, 0.0
        engine.step = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


@contextmanager
def clock(times: dict, phase: str):
    t0 = time.perf_counter()
    yield
    times[phase] = times.get(phase, 0.0) + time.perf_counter() - t0


@dataclass
class StepRecord:
    seconds: dict = field(default_factory=dict)  # phase -> seconds
    work: dict = field(default_factory=dict)     # phase -> grpo.tools.roofline.Work
    total_s: float = 0.0
    completion_tokens: int = 0


# --------------------------------------------------------------------------------------------------
# One step, phase by phase (train_grpo.py's step without logging, validation and checkpoints)
# --------------------------------------------------------------------------------------------------
def batch_groups(batch):
    """The batch's rows grouped by prompt (`grpo.tools.roofline.Group`): a row's prompt is what precedes its first
    trained token; its completion everything after (a multi-turn row's observations included)."""
    from grpo.system.shared_prefix import prompt_lengths
    from grpo.tools.roofline import groups_of

    prompt_b = prompt_lengths(batch.token_mask_bt, batch.attention_mask_bt).tolist()
    len_b = batch.attention_mask_bt.sum(dim=1).tolist()
    prompts = [batch.input_ids_bt[b, :p].tolist() for b, p in enumerate(prompt_b)]
    return groups_of(prompts, [n - p for n, p in zip(len_b, prompt_b)])


def engine_shape(engine, bytes_per_param: int):
    """The `grpo.tools.roofline.ModelShape` of an engine's module (a DeepSpeed engine, the frozen reference)."""
    from grpo.tools.roofline import ModelShape

    return ModelShape.from_config(engine.module.config, bytes_per_param)


def param_counts(module) -> tuple[int, int]:
    """(all parameters, trainable ones); a ZeRO-3 partition counts whole (``ds_numel``)."""
    numel = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in module.parameters()]
    return sum(n for n, _ in numel), sum(n for n, trains in numel if trains)


def run_step(run, prompts, step: int, generate: RecordedGenerate, optimizer: TimedStep) -> StepRecord | None:
    """One step of ``run`` (train_grpo.py's phases 1-9), each phase under its own clock, then its work counted
    (`step_work`); None where the step trains nothing (a skipped step, the data used up)."""
    from grpo.loss import clipped_pg_loss_fn
    from grpo.run.phases import Outcome, collect_rollouts, sync_weights
    from grpo.step import initial_sample_mask, step_advantages
    from grpo.system.training import LogprobEngines, step_logprobs, train_step

    cfg, seconds = run.cfg, {}
    timing = {"timing/train/generate_s": 0.0, "timing/train/env_step_s": 0.0}
    generate.calls.clear()
    optimizer.seconds = 0.0
    t_step = time.perf_counter()

    got = collect_rollouts(run, prompts, step, timing)  # generation and environment steps
    if got.outcome is not Outcome.TRAIN:
        return None
    batch = got.batch.replace(sample_mask_b=initial_sample_mask(cfg, got.batch))
    scored = {}  # each logprob pass alone
    engines = run.logprob_engines
    for name, key, alone in (
            ("prev", "prev_logprobs_bt", LogprobEngines(engines.prev, None)),
            ("reference", "ref_logprobs_bt", LogprobEngines(None, engines.reference)),
            ("teacher", "teacher_logprobs_bt", LogprobEngines(None, None, engines.teachers, engines.teacher_ranks))):
        if alone == LogprobEngines(None, None):  # skipped (grpo.skip_*), or no distillation
            continue
        with clock(seconds, f"logprob_{name}"):
            scored[key] = getattr(step_logprobs(cfg, batch, alone, run.rank, run.world_size), key)
    batch, _ = step_advantages(cfg, batch.replace(**scored))
    with clock(seconds, "train"):
        updates = train_step(cfg, run.policy, batch, run.rank, run.world_size, loss_fn=clipped_pg_loss_fn)
    sync_weights(run, step, timing)
    total_s = time.perf_counter() - t_step

    generate_s = timing["timing/train/generate_s"]
    prefill_s = sum(generate.prefill_seconds(call) for call in generate.calls)  # outside the step's time
    seconds.update(prefill=prefill_s, decode=max(generate_s - prefill_s, 0.0),
                   environment=timing["timing/train/env_step_s"], optimizer=optimizer.seconds,
                   train_fwd_bwd=seconds.pop("train") - optimizer.seconds,
                   refit=timing["timing/train/prepare_for_generation/total"])
    # The step's time outside the phases: the rollout's bookkeeping and scoring, the advantages.
    seconds["other"] = total_s - generate_s - sum(s for p, s in seconds.items() if p not in ("prefill", "decode"))
    return StepRecord(seconds, step_work(run, batch, generate.calls, len(updates), refitted=seconds["refit"] > 0),
                      total_s,
                      int(batch.token_mask_bt.sum().item()))


def step_work(run, batch, calls: list[GenerateCall], updates: int, refitted: bool) -> dict:
    """Each phase's `grpo.tools.roofline.Work` for a step that generated with ``calls`` and trained on ``batch``
    in ``updates`` optimizer updates.
    A refit that took no time copied nothing (``refitted`` False: the hf backend generating on the policy's own
    module); with LoRA a refit moves the adapters only."""
    from grpo.tools.roofline import (
        DTYPE_BYTES, Work, decode_work, forward_work, groups_of, optimizer_work, prefill_work, refit_work, train_work,
    )

    cfg = run.cfg
    nbytes = DTYPE_BYTES[cfg.policy.precision]
    shape, groups = engine_shape(run.policy, nbytes), batch_groups(batch)
    gen_groups = [groups_of(c.prompts, c.completion_lens) for c in calls]
    all_params, trainable = param_counts(run.policy.module)
    work = {"prefill": sum((prefill_work(shape, g) for g in gen_groups), Work()),
            "decode": sum((decode_work(shape, g) for g in gen_groups), Work()),
            "train_fwd_bwd": train_work(shape, groups, trainable, not cfg.policy.lora.enabled, updates),
            "optimizer": optimizer_work(trainable, nbytes, updates),
            "refit": refit_work(trainable if cfg.policy.lora.enabled else all_params, nbytes) if refitted else Work()}
    engines = run.logprob_engines
    # One teacher on the training ranks scores every row; several split the rows by task or agent, and teacher ranks
    # of their own run outside this process: their work is not counted (the phase shows its time only).
    teacher = next(iter(engines.teachers.values())) if len(engines.teachers) == 1 else None
    for name, engine in (("prev", engines.prev), ("reference", engines.reference), ("teacher", teacher)):
        if engine is not None:
            work[f"logprob_{name}"] = forward_work(engine_shape(engine, nbytes), groups)
    return work


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------
def figure(x: float) -> float:
    """``x`` to 4 significant digits (a small fraction stays above 0)."""
    return float(f"{x:.4g}")


def summarize(records: list[StepRecord], peak_flops: float, bandwidth: float) -> dict:
    """Per phase over the records: mean seconds, GFLOP and GB per step, the bound and the fraction of it achieved
    (the summed work's bound time over the summed seconds); phases no record has are left out."""
    from grpo.tools.roofline import Work, achieved

    out = {}
    for phase in PHASES:
        rows = [(r.seconds[phase], r.work.get(phase, Work())) for r in records if phase in r.seconds]
        if not rows:
            continue
        seconds = sum(s for s, _ in rows)
        work = sum((w for _, w in rows), Work())
        a = achieved(work, seconds, peak_flops, bandwidth)
        n = len(rows)
        out[phase] = {"s": figure(seconds / n), "gflop": figure(work.flops / n / 1e9),
                      "gbyte": figure(work.bytes / n / 1e9), "bound": a.bound,
                      "fraction": figure(a.fraction) if a.fraction is not None else None}
    return out


def table(phases: dict) -> str:
    lines = [f"{'phase':<18}{'s/step':>9}{'GFLOP':>10}{'GB':>9}  {'bound':<8}{'of bound':>9}"]
    for phase, p in phases.items():
        frac = f"{p['fraction']:.1%}" if p["fraction"] is not None else "-"
        lines.append(f"{phase:<18}{p['s']:>9.3f}{p['gflop']:>10.2f}{p['gbyte']:>9.3f}  {p['bound'] or '-':<8}{frac:>9}")
    return "\n".join(lines)


def measure(args, log_dir: str) -> tuple[list[StepRecord], list[tuple]]:
    """Set the run up (its log in ``log_dir``), probe the machine, run ``args.steps`` steps phase by phase, probe
    again; returns the steps' records and the two probes ``((peak FLOP/s, n), {"copy": B/s, "triad": B/s})``."""
    if args.config is None:
        workload = Path(args.workload).resolve()
        build_workload(workload)
        argv = ["--config", str(REPO / "configs" / "cpu_demo.yaml"),
                *trainer_overrides(workload, args.model, args.steps, log_dir)]
    else:
        argv = ["--config", args.config]
    argv += [*args.overrides, "checkpointing.enabled=false", f"logger.log_dir={log_dir}", "logger.progress_bar=false"]

    from grpo.run.run import finish
    from grpo.run.run_setup import setup
    from grpo.system.data import PromptStream

    run = setup(argv, str(REPO / "configs" / "cpu_demo.yaml"), asynchronous=False, description=__doc__)
    if run is None or run.generator is None:
        raise SystemExit("roofline: this config generates on ranks of its own; run it with the colocated generation")
    try:
        # The machine, before and after the steps (the better of the two: other jobs slow a probe down, never up).
        probes = [(matmul_peak(args.probe_seconds), memory_bandwidth(args.probe_seconds / 2))]
        generate, optimizer = RecordedGenerate(run.generator), TimedStep(run.policy)
        prompts = PromptStream(run.loader, run.cfg.grpo.max_num_epochs, run.state.current_epoch)
        records = []
        for step in range(1, args.steps + 1):
            rec = run_step(run, prompts, step, generate, optimizer)
            if rec is None:
                break
            records.append(rec)
            run.state.current_step = step
        probes.append((matmul_peak(args.probe_seconds), memory_bandwidth(args.probe_seconds / 2)))
    finally:
        finish(run)
    return records, probes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a run config instead of the bench workload (with the overrides)")
    ap.add_argument("--workload", default=str(REPO / "bench_workload"), help="the bench workload's directory")
    ap.add_argument("--model", default="bench", choices=["bench", "tiny"], help="the bench workload's model")
    ap.add_argument("--steps", type=int, default=4, help="steps run; the first is a warm-up, left out of the figures")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-seconds", type=float, default=2.0,
                    help="seconds of the peak probe before the steps and again after (the bandwidth's: half that)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.num_generations_per_prompt=16")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: at least 1 (2 or more: the first is a warm-up)")
    os.environ.update(trainer_env(args.threads))  # before torch loads: its thread pool reads them once

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="grpo_roofline_", ignore_cleanup_errors=True) as log_dir:
        records, probes = measure(args, log_dir)
    if not records:
        raise SystemExit("roofline: no step trained (the data ran out, or every step was skipped)")
    peak, peak_n, peak_kernel = max(p for p, _ in probes)
    bw = {kind: max(b[kind] for _, b in probes) for kind in ("copy", "triad")}
    bandwidth = max(bw.values())

    timed = records[1:] or records
    phases = summarize(timed, peak, bandwidth)
    print(f"peak {peak / 1e9:.1f} GFLOP/s fp32 matmul (n={peak_n}, {peak_kernel}), {bandwidth / 1e9:.2f} GB/s memory "
          f"(copy {bw['copy'] / 1e9:.2f}, triad {bw['triad'] / 1e9:.2f}), {args.threads} threads; "
          f"ridge {peak / bandwidth:.1f} FLOP/byte; per step, over {len(timed)} step(s) after the first; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(table(phases))
    print(json.dumps({
        "benchmark": "roofline",
        "config": args.config or f"bench workload, {args.model} model",
        "steps": len(records),
        "timed_steps": len(timed),
        "threads": args.threads,
        "peak_gflops": round(peak / 1e9, 2),
        "peak_matmul_n": peak_n,
        "peak_matmul_kernel": peak_kernel,
        "bandwidth_gbs": round(bandwidth / 1e9, 3),
        "copy_gbs": round(bw["copy"] / 1e9, 3),
        "triad_gbs": round(bw["triad"] / 1e9, 3),
        "ridge_flop_per_byte": round(peak / bandwidth, 2),
        "median_step_s": round(statistics.median(r.total_s for r in timed), 3),
        "completion_tokens_per_step": [r.completion_tokens for r in records],
        "phases": phases,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(sys.argv[1:]),
    }))


if __name__ == "__main__":
    from grpo.run.run import run_script

    run_script(main)  # a bad config or data: one `error:` line
