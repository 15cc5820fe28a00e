"""The CPU side of the GPU check (scripts/gpu_check.sh, scripts/gpu_check.py) and the per-phase memory metrics:
the skip without CUDA, the wheel folder, the checks on metrics rows, the phase instrumentation, and the
whole run sequence on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def sh(*args, timeout=120, **env):
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **env})


NOT_COVERED = "no CUDA device: no GPU check ran\n" + "".join(
    f"NOT COVERED {name}: no CUDA device ({what})\n" for name, what in gpu_check.CHECKS)
VERDICT = f"GPU CHECK: NOT COVERED: no CUDA device, none of the {len(gpu_check.CHECKS)} checks ran"


@no_cuda
def test_without_cuda_every_check_is_not_covered_and_the_check_fails_unless_that_is_expected():
    """It used to list every check as skipped and exit 0, which read as a pass on a machine that checked nothing."""
    p = sh()
    assert p.returncode == 2 and p.stdout == NOT_COVERED + VERDICT + "\n", p.stdout + p.stderr
    assert len(gpu_check.CHECKS) == 17 and set(gpu_check.PYTEST_CHECKS) <= {n for n, _ in gpu_check.CHECKS}
    expected = NOT_COVERED + VERDICT + " (expected: --expect-no-cuda)\n"
    assert (p := sh("--expect-no-cuda")).returncode == 0 and p.stdout == expected, p.stdout
    assert (p := sh(GPU_CHECK_EXPECT_NO_CUDA="1")).returncode == 0 and p.stdout == expected, p.stdout
    # an interpreter without torch at all counts as no CUDA device too (the list needs only the stdlib)
    p = sh(PYTHON="/nonexistent/python")
    assert p.returncode == 2 and p.stdout == NOT_COVERED + VERDICT + "\n"
    assert sh("--what").returncode == 2 and "usage" in sh("--what").stderr


def test_the_verdict_names_what_was_not_covered():
    ok, gap, bad = ("PASS", "2 passed"), (gpu_check.NOT_COVERED, "one GPU: needs two"), ("FAIL", "loss differs")
    assert gpu_check.verdict_line({"a": ok, "b": gap}) == (
        "GPU CHECK: PASS (1 passed, 0 warnings; NOT COVERED: b: one GPU: needs two)", 0)
    assert gpu_check.verdict_line({"a": ok, "b": gap, "c": bad}) == (
        "GPU CHECK: FAIL (1 failed: c; 1 passed, 0 warnings; NOT COVERED: b: one GPU: needs two)", 1)
    assert gpu_check.verdict_line({"b": gap})[1] == 2
    assert gpu_check.verdict_line({"a": ok}) == ("GPU CHECK: PASS (1 passed, 0 warnings)", 0)


@no_cuda
def test_a_gpu_that_torch_cannot_see_is_a_failure_not_a_skip(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    p = sh(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert p.returncode == 1 and "sees no CUDA device" in p.stdout and p.stdout.endswith("GPU CHECK: FAIL\n")


@no_cuda
def test_pytest_tests_gpu_skips_everything_with_the_reason():
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:]
    skipped = [line for line in p.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all(line.endswith("no CUDA device") for line in skipped), skipped
    assert " passed" not in p.stdout and "skipped" in p.stdout.splitlines()[-1]


# --------------------------------------------------------------------------------------------------
# checks on metrics rows
# --------------------------------------------------------------------------------------------------
def row(step, loss=0.1, **extra):
    r = {"step": step, "train/loss": loss, "gpu/memory_allocated_gib": 2.0, "gpu/memory_reserved_gib": 3.0,
         "gpu/peak_memory_allocated_gib": 2.5, "gpu/device_used_gib": 5.0, "gpu/device_free_gib": 75.0,
         "gpu/utilization_pct": 40.0}
    for phase in gpu_check.PHASES:
        r[f"memory/{phase}_peak_gb"], r[f"memory/{phase}_used_gb"] = 1.0 + step, 4.0
    r.update(extra)
    return r


def test_compare_losses_fails_step_1_and_warns_later():
    a = {1: {"train/loss": 0.10}, 2: {"train/loss": 0.20}, 3: {"train/loss": 0.30}}
    same = gpu_check.compare_losses(a, {1: {"train/loss": 0.105}, 2: {"train/loss": 0.24}, 3: {"train/loss": 0.3}}, "x")
    assert [level for level, _ in same] == ["PASS", "PASS", "PASS"]
    off = gpu_check.compare_losses(a, {1: {"train/loss": 0.2}, 2: {"train/loss": 0.4}, 3: {"train/loss": None}}, "x")
    assert [level for level, _ in off] == ["FAIL", "WARN", "FAIL"]
    assert "step 1 loss 0.100000 vs 0.200000" in off[0][1]


def test_check_gpu_metrics_accepts_plausible_rows_and_names_the_rest():
    val_row = {k: v for k, v in row(3).items() if not k.startswith(("train/", "memory/"))}
    assert gpu_check.check_gpu_metrics([row(1), row(2), val_row], total_gib=80.0) == []
    bad = [row(1, **{"gpu/device_used_gib": 1.0, "gpu/device_free_gib": 79.0}),  # less than torch reserved
           row(2, **{"gpu/device_free_gib": 10.0}),                 # used + free != total
           row(3, **{"memory/train_peak_gb": None}),                # a phase not measured
           {"step": 4, "train/loss": 0.1}]                          # no gpu/* at all
    problems = gpu_check.check_gpu_metrics(bad, total_gib=80.0)
    assert len(problems) == 4, problems
    assert "step 1: expected 0 < allocated" in problems[0] and "!= total" in problems[1]
    assert "memory/train_peak_gb = None" in problems[2] and "missing" in problems[3]


def test_peak_memory_report_takes_the_most_over_steps():
    report = gpu_check.peak_memory_report([row(1), row(2), {"step": 2, "val/reward_mean": 0.5}])
    assert report == {p: {"peak_allocated": 3.0, "used_at_end": 4.0} for p in gpu_check.PHASES}
    assert json.loads(json.dumps(report)) == report


# --------------------------------------------------------------------------------------------------
# scripts/train_with_phase_memory.py
# --------------------------------------------------------------------------------------------------
def test_timed_phases_put_their_time_and_peak_memory_in_the_step_metrics(monkeypatch):
    from grpo.system.tracking import timed

    peak = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: peak.update(bytes=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peak["bytes"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * 2**30, 80 * 2**30))
    metrics: dict = {}
    for phase, gib in (("rollout", 3), ("logprobs", 1), ("train", 2)):
        with timed(metrics, phase):
            peak.update(bytes=gib * 2**30)
    assert {k: v for k, v in metrics.items() if k.startswith("memory/")} == {
        "memory/rollout_peak_gb": 3.0, "memory/rollout_used_gb": 10.0, "memory/logprobs_peak_gb": 1.0,
        "memory/logprobs_used_gb": 10.0, "memory/train_peak_gb": 2.0, "memory/train_used_gb": 10.0}
    assert {k for k in metrics if k.startswith("timing/")} == {  # NeMo-RL's Timer labels
        "timing/train/generation", "timing/train/policy_and_reference_logprobs", "timing/train/policy_training"}

@pytest.mark.slow  # 30 s of wheel building; the skip-without-CUDA checks stay in the default suite
def test_prepare_builds_a_small_wheel_folder_that_provides_the_missing_packages(tmp_path):
    wheels = tmp_path / "wheels"
    p = sh("--prepare", str(wheels), timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    size = sum(f.stat().st_size for f in wheels.iterdir())
    assert size < 32 * 2**20 and f"wheel folder {wheels}:" in p.stdout
    names = sorted(f.name for f in wheels.glob("*.whl"))
    assert all(n.endswith("-none-any.whl") or n.startswith("pydantic_core-") for n in names), names
    for want in ("deepspeed-0.19.8-", "pydantic-2.", "torchdata-", "hjson-", "typing_inspection-"):
        assert any(n.startswith(want) for n in names), want
    # what the GPU image has is not carried: our pytest would shadow the one its plugins were installed for
    assert not any(n.startswith(("pytest-", "pluggy-", "msgpack-", "py_cpuinfo-", "einops-")) for n in names), names
    assert any(n.startswith(f"pydantic_core-") and f"cp3{sys.version_info.minor}-" in n for n in names)
    site = tmp_path / "site"
    for w in wheels.glob("*.whl"):
        zipfile.ZipFile(w).extractall(site)
    code = ("import deepspeed, pydantic, pydantic_core, torchdata, hjson\n"
            "mods = (deepspeed, pydantic, pydantic_core, torchdata, hjson)\n"
            f"print([m.__name__ for m in mods if not m.__file__.startswith({str(site)!r})])")
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(site), "DS_ACCELERATOR": "cpu"})
    assert q.returncode == 0 and q.stdout.strip().endswith("[]"), q.stdout + q.stderr[-2000:]


def _check_on_the_cpu(tmp_path, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu", "--out", str(tmp_path), "--budget-s", "900",
                        *extra], cwd=REPO, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert p.returncode == 0 and "GPU CHECK: PASS" in p.stdout, p.stdout[-4000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    return p, summary


@pytest.mark.slow  # default-suite twin: test_without_cuda_every_check_is_not_covered_and_the_check_fails_unless_that_is_expected
def test_the_check_sequence_passes_on_the_cpu(tmp_path):
    """scripts/gpu_check.py end to end on the CPU (fp32, gloo; about a minute): the runs, the startup line it
    parses (ZeRO-3 forced on one rank, reference on), the resume, the auto config, one line per check and the
    verdict. It looked for "reference on", which run.py no longer printed, and only `-m slow` ran it."""
    p, summary = _check_on_the_cpu(tmp_path)
    status = {c["name"]: c["status"] for c in summary["checks"]}
    assert list(status) == [n for n, _ in gpu_check.CHECKS]
    assert {n for n, s in status.items() if s == "PASS"} == {"loop_zero3_one_gpu", "resume", "auto_config",
                                                             "lora_zero3"}, status
    assert {n for n, s in status.items() if s != "PASS"} == set(gpu_check.PYTEST_CHECKS) | {"two_processes"}
    assert all(s == gpu_check.NOT_COVERED for n, s in status.items() if s != "PASS")
    assert set(summary["not_covered"]) == set(gpu_check.PYTEST_CHECKS) | {"two_processes"}
    assert {"zero3_first_2_steps", "zero3_resume_to_step_3", "auto", "lora_zero3_first_2_steps",
            "lora_zero3_resume_to_step_3"} <= set(summary["losses"])
    lines = [line for line in p.stdout.splitlines() if line.startswith(("PASS ", "FAIL ", "WARN ", "NOT COVERED "))]
    assert [line.split(":")[0].split()[-1] for line in lines] == [n for n in gpu_check.PYTEST_CHECKS] + [
        "loop_zero3_one_gpu", "resume", "auto_config", "lora_zero3", "two_processes"]
    verdict = p.stdout.strip().splitlines()[-1]
    assert verdict.startswith("GPU CHECK: PASS (") and "NOT COVERED: " in verdict and "two_processes: --cpu" in verdict
    assert "DeepSpeed ds_configs/zero3.json; reference FrozenModel" in p.stdout
    assert any(line.startswith("PEAK_MEMORY {") for line in p.stdout.splitlines())


@pytest.mark.slow
def test_the_check_with_two_processes_passes_on_the_cpu(tmp_path):
    _, summary = _check_on_the_cpu(tmp_path, "--two-process")
    assert {c["name"]: c["status"] for c in summary["checks"]}["two_processes"] == "PASS"


STARTUP = ("grpo-ds: 1 rank(s), 64 train / 8 val prompts (0 over data.max_input_seq_length filtered, 0 with no "
           "room under policy.max_total_sequence_length skipped, 0 malformed rows skipped), 3 steps, reference "
           "FrozenModel, previous-policy logprobs from the training forward, DeepSpeed ds_configs/zero3.json "
           "(policy.deepspeed_config), tasks ['arithmetic'], up to 1 turn(s) per rollout")


def test_parse_startup_reads_ranks_reference_and_deepspeed_config():
    assert gpu_check.parse_startup("noise\n" + STARTUP + "\ndone") == {
        "ranks": 1, "reference": "FrozenModel", "deepspeed": "ds_configs/zero3.json"}
    assert gpu_check.parse_startup(STARTUP.replace("reference FrozenModel", "reference skipped"))["reference"] \
        == "skipped"
    assert gpu_check.parse_startup("no such line") == {}


def test_pytest_checks_come_from_the_junit_report():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.gpu.test_gpu_engines" name="test_optimizer_offload_frees_the_gpu_and_training[zero2]"/>
      <testcase classname="tests.gpu.test_gpu_engines" name="test_optimizer_offload_frees_the_gpu_and_training[zero3]">
        <failure message="AssertionError: freed 0">trace</failure></testcase>
      <testcase classname="tests.gpu.test_gpu_memory" name="test_a"><skipped message="no CUDA device"/></testcase>
    </testsuite></testsuites>"""
    outcomes = gpu_check.junit_outcomes(xml)
    assert outcomes["tests/gpu/test_gpu_memory.py::test_a"] == ("skipped", "no CUDA device")
    level, msg = gpu_check.pytest_check(outcomes, gpu_check.PYTEST_CHECKS["optimizer_offload"])
    assert level == "FAIL" and "[zero3]: AssertionError: freed 0" in msg
    assert gpu_check.pytest_check(outcomes, gpu_check.PYTEST_CHECKS["memory_metrics"]) == (gpu_check.NOT_COVERED, "no CUDA device")
    assert gpu_check.pytest_check(outcomes, ["tests/gpu/test_nothing.py"])[0] == "FAIL"
    ok = gpu_check.junit_outcomes(xml.replace('<failure message="AssertionError: freed 0">trace</failure>', ""))
    assert gpu_check.pytest_check(ok, gpu_check.PYTEST_CHECKS["optimizer_offload"]) == ("PASS", "2 passed")


# --------------------------------------------------------------------------------------------------
# the GPU-only tests' own logic, on the CPU (so tests/gpu cannot rot unseen: issue 21)
# --------------------------------------------------------------------------------------------------
def test_the_gpu_zero3_check_runs_on_the_cpu(tiny_model_dir):
    """tests/gpu/test_gpu_engines.py's ZeRO-3 bf16 check (field names, the forced ZeRO-3 config, DeepSpeed's
    fp32 accumulation buffer) on a tiny model and gloo: it read batch["token_mask"] and expected ZeRO-3
    internals from the one-GPU auto config, and no CPU test ran it."""
    from grpo.system.dist import init_distributed
    from tests.gpu.test_gpu_engines import check_zero3_bf16_accumulates_in_fp32

    init_distributed()
    check_zero3_bf16_accumulates_in_fp32(tiny_model_dir)


def test_the_gpu_refit_gather_check_runs_on_the_cpu(tiny_model_dir, tmp_path):
    from grpo.system.dist import init_distributed
    from tests.gpu.test_gpu_engines import check_zero3_refit_gather_equals_the_export

    init_distributed()
    check_zero3_refit_gather_equals_the_export(tiny_model_dir, str(tmp_path / "export"))
