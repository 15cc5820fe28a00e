"""grpo.system.signals: SIGTERM / SIGINT / SIGHUP / SIGUSR1 / SIGUSR2 set a flag, a second Ctrl-C exits at once with 130, the old handlers come back;
reward workers die with the trainer, even under kill -9 and in the middle of a reward that hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from grpo.system.signals import STOP_SIGNALS, StopRequest, exit_status
from grpo.tasks.pool import set_parent_death_signal
from tests.helpers.e2e import REPO, child_env


def test_signals_set_a_flag_and_close_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with StopRequest() as stop:
        assert not stop.requested() and stop.signal_name is None and stop.exit_status() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.signal_name == "SIGTERM" and stop.exit_status() == 143
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM changes nothing
        assert stop.signal_name == "SIGTERM"
    for sig, status in ((signal.SIGHUP, 129), (signal.SIGUSR1, 138), (signal.SIGUSR2, 140)):
        with StopRequest() as stop:
            os.kill(os.getpid(), sig)
            assert stop.signal_name == signal.Signals(sig).name and stop.exit_status() == status
    assert {s: signal.getsignal(s) for s in before} == before
    assert exit_status(signal.SIGINT) == 130


_LOOP = """
import sys, time
from grpo.system.signals import StopRequest
stop = StopRequest()
print("ready", flush=True)
step = 0
while not stop.requested():          # a training loop: finish the step, then look at the flag
    time.sleep(0.05)
    step += 1
print(f"stopping after step {step} on {stop.signal_name}: saving", flush=True)
time.sleep(float(sys.argv[1]))      # the checkpoint save
stop.close()
sys.exit(stop.exit_status())
"""


def _loop(save_s: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _LOOP, str(save_s)], cwd=REPO, env=child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    return p


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129),
                                         (signal.SIGUSR1, 138), (signal.SIGUSR2, 140)])
def test_a_signal_stops_the_loop_after_the_step_with_the_documented_status(sig, status):
    # SIGHUP: a closed ssh session; SIGUSR1 / SIGUSR2: SLURM's --signal=USR1@120 before the time limit.
    # Without a handler each of these three kills the process at once, without a checkpoint.
    p = _loop(save_s=0.2)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == status, err
    assert f"on {signal.Signals(sig).name}: saving" in out and "stopping with a checkpoint" in err


def test_a_sighup_ignored_at_start_stays_ignored_under_nohup():
    code = ("import os, signal; signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "from grpo.system.signals import StopRequest\n"
            "stop = StopRequest(); os.kill(os.getpid(), signal.SIGHUP)\n"
            "assert not stop.requested() and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN\n"
            "os.kill(os.getpid(), signal.SIGUSR1); assert stop.signal_name == 'SIGUSR1'; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr


def test_a_second_ctrl_c_exits_at_once_with_130():
    p = _loop(save_s=60)
    p.send_signal(signal.SIGINT)
    assert "saving" in p.stdout.readline()
    start = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and time.monotonic() - start < 10 and "exiting now" in err


def test_parent_death_signal_is_set():
    assert set_parent_death_signal(signal.SIGKILL) is True  # on this (Linux) process: reset below
    import ctypes

    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)


_TRAINER = """
import sys
from grpo.tasks.pool import ScoringPool
pool = ScoringPool("tests.helpers.reward_fns_for_tests:sleepy", num_workers=2, timeout_s=600)
pool.start(wait=True)
print(" ".join(map(str, pool.pids())), flush=True)
pool.run([{"question": "q", "completion": "c", "answer": "a", "meta": {"sleep": 600}}] * 2)  # both busy
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited: only its parent's wait is missing
        return f.read().split(")")[-1].split()[0] != "Z"


def test_reward_workers_die_with_a_trainer_killed_by_sigkill_mid_reward():
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                               text=True)
    try:
        pids = [int(x) for x in trainer.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(1.0)  # both workers are inside the 600 s reward now
    finally:
        trainer.kill()
        trainer.wait(timeout=60)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if _alive(p)]
    for p in survivors:  # do not leave them behind when the test fails
        os.kill(p, signal.SIGKILL)
    assert survivors == []
