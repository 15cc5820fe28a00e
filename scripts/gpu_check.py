#!/usr/bin/env python
"""The checks of the GPU check (issues 15, 21); scripts/gpu_check.sh installs what the device lacks and calls
this. One line per check, in order of value (CHECKS), then ``PEAK_MEMORY {json}`` (GiB per phase, the most over
steps), <out>/gpu_check.json (the verdict), and "GPU CHECK: PASS" (exit 0) or "GPU CHECK: FAIL" (exit 1).

  1. one pytest process over tests/gpu (NCCL, one GPU, a ~9M Llama built locally): ZeRO-3 bf16 with fp32
     gradient accumulation (buffer dtype), optimizer offload on ZeRO-1 (BF16_Optimizer) / 2 / 3 with training
     equal to an untouched twin, the ZeRO-3 refit gather equal to the HF export bit for bit, mem_get_info
     metrics, grpo's collectives and the tensor-parallel lockstep on NCCL, bf16 vs fp32 on fixed batches; the
     vLLM tests on CUDA only where vllm is installed (else the check says so);
  2. train_grpo.py on tests/configs/tiny.yaml (toy:demo built locally, arithmetic env, hf backend, reference
     on) with ZeRO-3 forced on one GPU, bf16: 2 steps with a checkpoint at step 2, logger.monitor_gpus=true,
     advantages on the GPU (startup line, token_mult_prob_error, gpu/* and memory/* plausible); then the same
     command to step 3 resumes from step 2;
  3. the same run with deepspeed_config auto (one GPU in bf16: ZeRO-1): step-1 loss equal to ZeRO-3's;
  4. 2 processes (ZeRO-3) when the device has 2 GPUs: step-1 loss equal to 1 process;
  5. (in the pytest process of 1, where vllm is installed) the agentic paths of issue 52 with colocated vLLM: endpoint
     answers equal the engine's own tokens, a chat request to local rank 1's endpoint (2 GPUs), the reward model's
     free-memory reading taken after vLLM's reservation (printed: INFO reward model placed with ...).

Tolerances. Step 1 of every run generates from the same checkpoint with the same seeds, so its samples are the
same unless rounding (another ZeRO stage, another GPU count) flips a sampled token: step-1 losses must agree
within LOSS_TOL. Later steps and the resumed step only warn beyond LATER_TOL / RESUME_TOL (their samples may
differ by one flipped token). token_mult_prob_error (generation vs training logprobs of the same weights) must
stay under MULT_PROB_MAX[precision].

    python scripts/gpu_check.py --out DIR [--budget-s 480]
    python scripts/gpu_check.py --cpu --out DIR      # the same logic on the CPU (gloo, fp32; tests/gpu skipped)
    python scripts/gpu_check.py --skip-all REASON    # list every check as skipped (no CUDA): stdlib only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TINY = str(REPO / "tests" / "configs" / "tiny.yaml")
LOSS_TOL = 0.01
LATER_TOL = 0.05
RESUME_TOL = 1e-3
MULT_PROB_MAX = {"bfloat16": 1.05, "float32": 1.01}
PHASES = ("rollout", "logprobs", "train")
GPU_KEYS = ("gpu/memory_allocated_gib", "gpu/memory_reserved_gib", "gpu/peak_memory_allocated_gib",
            "gpu/device_used_gib", "gpu/device_free_gib")


# (name, what it checks) in order of value; `--skip-all` lists them, the verdict has one entry each.
CHECKS = (
    ("zero3_bf16_fp32_accumulation", "tests/gpu: ZeRO-3 in bf16 sums gradients in an fp32 buffer on the GPU"),
    ("optimizer_offload", "tests/gpu: optimizer offload on ZeRO-1 (BF16_Optimizer), 2, 3 frees the GPU; "
                          "training equals an untouched twin"),
    ("refit_gather_equals_export", "tests/gpu: the ZeRO-3 refit gather equals the HF export bit for bit"),
    ("memory_metrics", "tests/gpu: mem_get_info, phase peaks, gpu/* metrics"),
    ("loop_zero3_one_gpu", "train_grpo.py, ZeRO-3 on one GPU, bf16, reference on: 2 steps, checkpoint, metrics"),
    ("resume", "the same command to step 3 resumes from the step-2 checkpoint"),
    ("nccl_collectives_tp_lockstep", "tests/gpu: grpo's collectives and the vLLM TP group's lockstep on NCCL"),
    ("auto_config", "train_grpo.py with deepspeed_config auto: step-1 loss equals ZeRO-3's"),
    ("bf16_vs_fp32", "tests/gpu: bf16 and fp32 agree on fixed batches"),
    ("two_processes", "2 processes (ZeRO-3): step-1 loss equals 1 process"),
    ("vllm", "the vLLM tests on CUDA (only where vllm is installed)"),
    ("packing_canary", "tests/gpu: packed logprobs equal padded, one packed sample's change leaves the others "
                       "(sdpa; flash-attention 2 where flash_attn is installed)"),
    ("lora_zero3", "train_grpo.py with LoRA on ZeRO-3: 2 steps, checkpoint, resume to step 3, --export-adapter"),
    ("bridge_nccl", "tests/gpu: the weight bridge's NCCL group in one process: broadcast, acknowledgment, abort"),
    ("endpoint_token_exact", "tests/gpu: endpoint answers over colocated vLLM are the engine's own tokens (the "
                             "batcher thread on the engine's device and stream; only where vllm is installed)"),
    ("endpoint_local_rank_1", "tests/gpu: a chat request to the endpoint of local rank 1 with colocated vLLM is "
                              "answered with that engine's tokens (2 GPUs, vllm installed)"),
    ("reward_model_after_vllm", "tests/gpu: the reward model's free-memory reading, logged when it is placed, is "
                                "taken after vLLM's reservation (vllm installed)"),
)
PYTEST_CHECKS = {  # check -> pytest node ids (prefixes) that make it
    "zero3_bf16_fp32_accumulation": ["tests/gpu/test_gpu_engines.py::test_bf16_zero3_engine_accumulates_gradients"],
    "optimizer_offload": ["tests/gpu/test_gpu_engines.py::test_optimizer_offload_frees_the_gpu"],
    "refit_gather_equals_export": ["tests/gpu/test_gpu_engines.py::test_zero3_refit_gather_equals_the_export"],
    "memory_metrics": ["tests/gpu/test_gpu_memory.py"],
    "nccl_collectives_tp_lockstep": ["tests/gpu/test_gpu_collectives.py"],
    "bf16_vs_fp32": ["tests/gpu/test_gpu_engines.py::test_bf16_and_fp32_agree"],
    "packing_canary": ["tests/gpu/test_gpu_packing.py"],
    "bridge_nccl": ["tests/gpu/test_gpu_bridge.py"],
    "vllm": ["tests/integration/test_generation_vllm.py", "tests/integration/test_generation_vllm_qwen2.py"],
    "endpoint_token_exact": ["tests/gpu/test_gpu_agentic.py::test_endpoint_answers_are_the_engines_own_tokens"],
    "endpoint_local_rank_1": ["tests/gpu/test_gpu_agentic.py::test_a_chat_request_to_local_rank_1s_endpoint"],
    "reward_model_after_vllm": ["tests/gpu/test_gpu_agentic.py::test_the_reward_model_is_placed_by_the_memory_vllm_left"],
}
ZERO3 = "ds_configs/zero3.json"
NOT_COVERED = "NOT COVERED"  # a check that did not run here, with why (no CUDA, one GPU, no vLLM wheel, ...)


# --------------------------------------------------------------------------------------------------
# What runs print and write, and checks on metrics rows: pure functions (tests/e2e/test_gpu_check.py)
# --------------------------------------------------------------------------------------------------
def parse_startup(text: str) -> dict:
    """The facts of train_grpo.py's startup line ("grpo-ds: N rank(s), ..., reference X, ..., DeepSpeed PATH
    (why), ..."): {"ranks": N, "reference": X ("skipped" when off), "deepspeed": PATH}; {} without the line."""
    import re

    line = next((l for l in text.splitlines() if l.startswith("grpo-ds: ")), None)
    if line is None:
        return {}
    out: dict = {}
    for key, pattern, cast in (("ranks", r"grpo-ds: (\d+) rank", int), ("reference", r", reference (\S+?),", str),
                               ("deepspeed", r", DeepSpeed (\S+)", str)):
        m = re.search(pattern, line)
        if m:
            out[key] = cast(m.group(1))
    return out


def junit_outcomes(xml_text: str) -> dict[str, tuple[str, str]]:
    """pytest's --junitxml report -> {node id: (outcome, message)}, outcome passed / failed / skipped."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                lines = (el.get("message") or el.text or "").strip().splitlines()
                outcome, message = name, (lines[0][:300] if lines else "")
                break
        out[node] = (outcome, message)
    return out


def pytest_check(outcomes: dict[str, tuple[str, str]], prefixes: list[str]) -> tuple[str, str]:
    """(level, message) of one check from the outcomes of its tests: FAIL if one failed or none ran, NOT COVERED if
    all skipped (the skip's reason), else PASS (naming what was skipped)."""
    mine = {n: o for n, o in outcomes.items() if any(n.startswith(p) for p in prefixes)}
    if not mine:
        return "FAIL", f"no test collected for {prefixes}"
    failed = [f"{n.split('::')[-1]}: {m}" for n, (o, m) in mine.items() if o == "failed"]
    if failed:
        return "FAIL", "; ".join(failed)
    if all(o == "skipped" for o, _ in mine.values()):
        return NOT_COVERED, next(iter(mine.values()))[1]
    passed = sum(o == "passed" for o, _ in mine.values())
    skipped = sorted({m for o, m in mine.values() if o == "skipped"})
    return "PASS", f"{passed} passed" + (f", {len(mine) - passed} not covered ({'; '.join(skipped)})"
                                         if passed < len(mine) else "")


def worst(levels: list[str]) -> str:
    for level in ("FAIL", "WARN"):
        if level in levels:
            return level
    return "PASS"


def train_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if "train/loss" in r}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def compare_losses(a: dict[int, dict], b: dict[int, dict], label: str) -> list[tuple[str, str]]:
    """(level, message) pairs: FAIL when step 1 differs by more than LOSS_TOL or a loss is missing or not
    finite; WARN when a later step differs by more than LATER_TOL."""
    out = []
    for step in sorted(a):
        la, lb = a[step].get("train/loss"), (b.get(step) or {}).get("train/loss")
        if not (finite(la) and finite(lb)):
            out.append(("FAIL", f"{label}: step {step} loss {la} vs {lb}"))
            continue
        tol, level = (LOSS_TOL, "FAIL") if step == 1 else (LATER_TOL, "WARN")
        ok = abs(la - lb) <= tol
        out.append(("PASS" if ok else level, f"{label}: step {step} loss {la:.6f} vs {lb:.6f} "
                                           f"(|diff| {abs(la - lb):.2e}, tolerance {tol})"))
    return out


def check_gpu_metrics(rows: list[dict], total_gib: float, phases: tuple = PHASES) -> list[str]:
    """What is missing or implausible in the gpu/* and memory/* columns (empty: all good): every row has
    GPU_KEYS with 0 < allocated <= reserved <= device used, device used + free = total (1%), peak >=
    allocated, utilisation in [0, 100] if present; every step row has memory/<phase>_peak_gb and
    _used_gb with 0 < value <= total."""
    problems = []
    for r in rows:
        where = f"step {r.get('step')}"
        missing = [k for k in GPU_KEYS if not finite(r.get(k))]
        if missing:
            problems.append(f"{where}: missing {missing}")
            continue
        alloc, res = r["gpu/memory_allocated_gib"], r["gpu/memory_reserved_gib"]
        used, free = r["gpu/device_used_gib"], r["gpu/device_free_gib"]
        if not 0 < alloc <= res <= used * 1.01:
            problems.append(f"{where}: expected 0 < allocated {alloc:.3f} <= reserved {res:.3f} <= used {used:.3f}")
        if abs(used + free - total_gib) > 0.01 * total_gib:
            problems.append(f"{where}: used {used:.2f} + free {free:.2f} != total {total_gib:.2f} GiB")
        if r["gpu/peak_memory_allocated_gib"] < alloc:
            problems.append(f"{where}: peak {r['gpu/peak_memory_allocated_gib']:.3f} < allocated {alloc:.3f}")
        util = r.get("gpu/utilization_pct")
        if util is not None and not 0 <= util <= 100:
            problems.append(f"{where}: utilization {util}")
        if "train/loss" in r:
            for phase in phases:
                for key in (f"memory/{phase}_peak_gb", f"memory/{phase}_used_gb"):
                    v = r.get(key)
                    if not (finite(v) and 0 < v <= total_gib):
                        problems.append(f"{where}: {key} = {v}")
    return problems


def peak_memory_report(rows: list[dict], phases: tuple = PHASES) -> dict:
    """GiB per phase, the most over the step rows: {"rollout": {"peak_allocated": .., "used_at_end": ..}, ...}."""
    steps = list(train_rows(rows).values())
    report = {}
    for phase in phases:
        peaks = [r[f"memory/{phase}_peak_gb"] for r in steps if finite(r.get(f"memory/{phase}_peak_gb"))]
        used = [r[f"memory/{phase}_used_gb"] for r in steps if finite(r.get(f"memory/{phase}_used_gb"))]
        report[phase] = {"peak_allocated": round(max(peaks), 4) if peaks else None,
                         "used_at_end": round(max(used), 4) if used else None}
    return report


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------
def read_rows(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def child_env(cpu: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline", PYTHONFAULTHANDLER="1",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"))
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH"), str(REPO)) if p])
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def train(out: Path, name: str, overrides: list[str], *, nproc: int, cpu: bool, timeout: float,
          log_name: str | None = None) -> dict:
    """One train_grpo.py run (which records memory/<phase>_* on CUDA) into out/name;
    its output goes to out/<log_name or name>.log."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]
    run_dir = out / name
    cmd = [*launcher, "train_grpo.py", "--config", TINY, f"logger.log_dir={run_dir}/logs",
           f"checkpointing.checkpoint_dir={run_dir}/ckpt", *overrides]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=child_env(cpu), capture_output=True, text=True, timeout=max(timeout, 1))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
    (out / f"{log_name or name}.log").write_text(" ".join(cmd) + "\n" + text)
    return {"rc": rc, "seconds": time.monotonic() - t0, "rows": read_rows(run_dir / "logs"), "text": text,
            "startup": parse_startup(text)}


def skip_all(reason: str, expected: bool = False) -> int:
    """Every check NOT COVERED with ``reason`` and a verdict that says nothing ran: exit 2, or 0 when ``expected``
    (--expect-no-cuda, GPU_CHECK_EXPECT_NO_CUDA=1: a machine without CUDA on purpose, such as CI)."""
    for name, what in CHECKS:
        print(f"{NOT_COVERED} {name}: {reason} ({what})")
    print(f"GPU CHECK: {NOT_COVERED}: {reason}, none of the {len(CHECKS)} checks ran"
          + (" (expected: --expect-no-cuda)" if expected else ""))
    return 0 if expected else 2


def verdict_line(verdict: dict[str, tuple[str, str]]) -> tuple[str, int]:
    """The last line and the exit status: FAIL (1) when a check failed; NOT COVERED (2) when none ran; else PASS (0),
    naming every check that was not covered and why.

        >>> verdict_line({"a": ("PASS", ""), "b": (NOT_COVERED, "one GPU: needs two")})
        ('GPU CHECK: PASS (1 passed, 0 warnings; NOT COVERED: b: one GPU: needs two)', 0)
    """
    failed = [n for n, (level, _) in verdict.items() if level == "FAIL"]
    gaps = [f"{n}: {m}" for n, (level, m) in verdict.items() if level == NOT_COVERED]
    ran = len(verdict) - len(gaps)
    counts = (f"{sum(level == 'PASS' for level, _ in verdict.values())} passed, "
              f"{sum(level == 'WARN' for level, _ in verdict.values())} warnings")
    gap_text = f"; NOT COVERED: {'; '.join(gaps)}" if gaps else ""
    if failed:
        return f"GPU CHECK: FAIL ({len(failed)} failed: {', '.join(failed)}; {counts}{gap_text})", 1
    if ran == 0:
        return f"GPU CHECK: {NOT_COVERED} (none of the checks ran{gap_text})", 2
    return f"GPU CHECK: PASS ({counts}{gap_text})", 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for logs, metrics and gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of all runs (default 8 min)")
    ap.add_argument("--cpu", action="store_true", help="the same logic on the CPU (gloo, fp32; tests/gpu skipped)")
    ap.add_argument("--two-process", action="store_true", help="with --cpu: also the 2-process run")
    ap.add_argument("--skip-all", metavar="REASON", help="list every check as NOT COVERED with REASON; exit 2")
    ap.add_argument("--expect-no-cuda", action="store_true",
                    help="with --skip-all: exit 0 (nothing covered is expected here)")
    args = ap.parse_args(argv)
    if args.skip_all:
        return skip_all(args.skip_all, args.expect_no_cuda or os.environ.get("GPU_CHECK_EXPECT_NO_CUDA") == "1")
    if not args.out:
        ap.error("--out is required")
    import torch

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    verdict: dict[str, tuple[str, str]] = {}
    runs: dict[str, dict] = {}
    peaks: dict = {}

    def say(name: str, level: str, msg: str) -> None:
        verdict[name] = (level, msg)
        print(f"{level} {name}: {msg}", flush=True)

    def left() -> float:
        return deadline - time.monotonic()

    n_gpus = 0 if args.cpu else torch.cuda.device_count()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if n_gpus else 0.0
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    precision = "float32" if args.cpu else "bfloat16"  # bf16 is 5-30x slower on the CPU; its logic is the same
    import deepspeed
    import transformers

    print(f"INFO {device} x{max(n_gpus, 1)}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
          f"{transformers.__version__}, deepspeed {deepspeed.__version__}, python {sys.version.split()[0]}", flush=True)

    # ---- 1. tests/gpu in one pytest process (highest value first), the vLLM tests where vllm is installed
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    pytest_names = [n for n in PYTEST_CHECKS if n != "vllm" or has_vllm]
    if args.cpu:
        for name in pytest_names:
            say(name, NOT_COVERED, "--cpu: needs CUDA (its CPU twin is in the default suite: tests/e2e/test_gpu_check.py, "
                              "tests/integration/test_offload.py, tests/integration/test_device_rules.py, "
                              "tests/integration/test_reward_model_placement.py)")
    else:
        nodes = [n for name in pytest_names for n in PYTEST_CHECKS[name]]
        junit = out / "pytest_gpu.xml"
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                f"--junitxml={junit}", *dict.fromkeys(n.split("::")[0] for n in nodes)],
                               cwd=REPO, env=child_env(False), capture_output=True, text=True,
                               timeout=max(min(left() - 120, 300), 30))
            text = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            text = f"timeout after {time.monotonic() - t0:.0f} s\n{e.stdout or ''}"
        (out / "pytest_gpu.log").write_text(text if isinstance(text, str) else text.decode(errors="replace"))
        outcomes = junit_outcomes(junit.read_text()) if junit.exists() else {}
        for name in pytest_names:
            level, msg = pytest_check(outcomes, PYTEST_CHECKS[name]) if outcomes else \
                ("FAIL", f"pytest gave no report ({out / 'pytest_gpu.log'}): {text.strip().splitlines()[-1:]}")
            say(name, level, msg)
        print(f"INFO pytest tests/gpu took {time.monotonic() - t0:.0f} s (log: {out / 'pytest_gpu.log'})", flush=True)
    if not has_vllm:
        say("vllm", NOT_COVERED, "no vLLM wheel: vllm is not installed here, the vLLM tests did not run")

    # ---- 2. the loop: ZeRO-3 on one device, checkpoint at step 2, then resume to step 3
    common = ["logger.monitor_gpus=true", "checkpointing.save_period=2", f"policy.precision={precision}"]

    def start(name: str, overrides: list[str], steps: list[int], nproc: int = 1, log_name: str | None = None):
        label = log_name or name
        if left() < 30:
            return None, f"{label}: not run, the {args.budget_s:.0f} s budget is spent"
        r = train(out, name, overrides, nproc=nproc, cpu=args.cpu, timeout=min(left(), 240), log_name=label)
        runs[label] = r
        got = sorted(train_rows(r["rows"]))  # a resumed run appends to the rows of the run it resumes
        if r["rc"] != 0 or not set(steps) <= set(got) or max(got) != steps[-1]:
            tail = [line for line in r["text"].splitlines() if line.strip()][-3:]
            return None, f"{label}: exit {r['rc']} in {r['seconds']:.0f} s, steps {got} (log {out / label}.log): {tail}"
        return r, f"{label}: {len(steps)} steps in {r['seconds']:.0f} s"

    def mult_prob(r: dict) -> tuple[str, str]:
        rows = train_rows(r["rows"])
        w = max((x.get("train/token_mult_prob_error") or float("inf") for x in rows.values()), default=float("inf"))
        return ("PASS" if w <= MULT_PROB_MAX[precision] else "FAIL"), f"token_mult_prob_error max {w:.5f}"

    zero3, msg = start("zero3", [*common, f"policy.deepspeed_config={ZERO3}", "grpo.max_num_steps=2",
                                 "grpo.calculate_advantages_on_gpu=true"], [1, 2], log_name="zero3_first_2_steps")
    if zero3 is None:
        say("loop_zero3_one_gpu", "FAIL", msg)
    else:
        st = zero3["startup"]
        parts = [("PASS", msg),
                 ("PASS" if st.get("deepspeed") == ZERO3 else "FAIL", f"DeepSpeed {st.get('deepspeed')}"),
                 ("PASS" if st.get("reference") not in (None, "skipped") else "FAIL", f"reference {st.get('reference')}"),
                 mult_prob(zero3)]
        if not args.cpu:
            problems = check_gpu_metrics(zero3["rows"], total_gib)
            parts.append(("FAIL", "; ".join(problems[:4])) if problems else ("PASS", "gpu/* and memory/* plausible"))
        say("loop_zero3_one_gpu", worst([lv for lv, _ in parts]), "; ".join(m for _, m in parts))
        peaks = peak_memory_report(zero3["rows"])
        print("PEAK_MEMORY " + json.dumps({"run": "zero3, 1 process", "device": device, "gib": peaks}), flush=True)
    resumed = None
    if zero3 is None:
        say("resume", "FAIL", "not run: the first two steps failed")
    else:
        resumed, msg = start("zero3", [*common, f"policy.deepspeed_config={ZERO3}", "grpo.max_num_steps=3",
                                       "grpo.calculate_advantages_on_gpu=true"], [3], log_name="zero3_resume_to_step_3")
        if resumed is None:
            say("resume", "FAIL", msg)
        else:
            ok = "resumed from" in resumed["text"] and "(step 2," in resumed["text"]
            say("resume", "PASS" if ok else "FAIL", f"{msg}; " + ("resumed from the step-2 checkpoint" if ok else
                                                               "no 'resumed from ... (step 2, ...' line"))

    def zero3_rows() -> dict[int, dict]:
        """Steps 1-2 of the ZeRO-3 run and step 3 of its resume."""
        return {**train_rows(zero3["rows"]), **train_rows((resumed or {}).get("rows", []))}

    # ---- 3. deepspeed_config auto (one device: ZeRO-1 in bf16, no ZeRO in fp32) against ZeRO-3
    auto, msg = start("auto", [*common, "checkpointing.enabled=false", "grpo.max_num_steps=3"], [1, 2, 3])
    if auto is None:
        say("auto_config", "FAIL", msg)
    else:
        parts = [("PASS", f"{msg}, DeepSpeed {auto['startup'].get('deepspeed')}"), mult_prob(auto)]
        if zero3 is not None:
            parts += compare_losses(train_rows(auto["rows"]), zero3_rows(), "auto vs ZeRO-3")
        say("auto_config", worst([lv for lv, _ in parts]), "; ".join(m for _, m in parts))

    # ---- 4. LoRA on ZeRO-3: two steps and a checkpoint, a resume to step 3, the adapter exported
    lora_args = [*common, f"policy.deepspeed_config={ZERO3}", "policy.lora.enabled=true", "policy.lora.dim=8"]
    lora, msg = start("lora", [*lora_args, "grpo.max_num_steps=2"], [1, 2], log_name="lora_zero3_first_2_steps")
    if lora is not None:
        lora, msg2 = start("lora", [*lora_args, "grpo.max_num_steps=3"], [3], log_name="lora_zero3_resume_to_step_3")
        msg = f"{msg}; {msg2}"
    if lora is None:
        say("lora_zero3", "FAIL", msg)
    elif "resumed from" not in lora["text"]:
        say("lora_zero3", "FAIL", f"{msg}; no 'resumed from' line")
    else:
        adapter = out / "lora_adapter"
        r = train(out, "lora", [*lora_args, "grpo.max_num_steps=3", "--export-adapter", str(adapter)], nproc=1,
                  cpu=args.cpu, timeout=min(max(left(), 1), 180), log_name="lora_zero3_export_adapter")
        files = {"adapter_config.json", "adapter_model.safetensors"}
        ok = r["rc"] == 0 and files <= {p.name for p in adapter.glob("*")}
        say("lora_zero3", "PASS" if ok else "FAIL", f"{msg}; --export-adapter: exit {r['rc']}, "
            + ("adapter_config.json + adapter_model.safetensors" if ok else f"missing {sorted(files)} in {adapter}"))

    # ---- 5. two processes
    if n_gpus >= 2 or (args.cpu and args.two_process):
        two, msg = start("two", [*common, "checkpointing.enabled=false", "grpo.max_num_steps=3"], [1, 2, 3], nproc=2)
        if two is None:
            say("two_processes", "FAIL", msg)
        elif zero3 is not None:
            parts = [("PASS", f"{msg}, DeepSpeed {two['startup'].get('deepspeed')}")]
            parts += compare_losses(train_rows(two["rows"]), zero3_rows(), "2 vs 1 process")
            say("two_processes", worst([lv for lv, _ in parts]), "; ".join(m for _, m in parts))
        else:
            say("two_processes", "PASS", msg)
    else:
        say("two_processes", NOT_COVERED, "one GPU: needs two" if not args.cpu else "--cpu without --two-process")

    line, status = verdict_line({n: verdict.get(n, ("FAIL", "not run")) for n, _ in CHECKS})
    summary = {"pass": status == 0, "not_covered": [n for n, (lv, _) in verdict.items() if lv == NOT_COVERED], "device": device, "gpus": n_gpus, "precision": precision,
               "checks": [{"name": n, "status": verdict.get(n, ("FAIL", "not run"))[0],
                           "message": verdict.get(n, ("FAIL", "not run"))[1]} for n, _ in CHECKS],
               "peak_memory_gib": peaks,
               "losses": {name: {s: r.get("train/loss") for s, r in train_rows(run["rows"]).items()}
                          for name, run in runs.items()}}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print(f"{line} [{out / 'gpu_check.json'}]", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
