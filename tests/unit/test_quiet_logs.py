"""No library progress bar in a log: with stdout a pipe the toy model's build (transformers' "Writing model shards"
bar) and the run print plain lines only; on a terminal (a pseudo-terminal here) the bars are there."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from tests.helpers.e2e import REPO, child_env

BUILD = ("from grpo.system.tracking import quiet_library_progress_bars, MetricsLogger\n"
         "from grpo.config import LoggerConfig\n"
         "import sys, tempfile\n"
         "quiet_library_progress_bars()\n"
         "from grpo.tasks.toy import save_tiny_model\n"
         "d = tempfile.mkdtemp()\n"
         "save_tiny_model(d)\n"
         "log = MetricsLogger(LoggerConfig(log_dir=d), total_steps=20)\n"
         "for step in range(1, 21):\n"
         "    log.progress(step, {'train/mean_total_reward': step / 20})\n"
         "log.close()\n")


def run(on_terminal: bool) -> str:
    env = {k: v for k, v in child_env(1).items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    if not on_terminal:
        p = subprocess.run([sys.executable, "-c", BUILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout + p.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a width for the bars
    p = subprocess.Popen([sys.executable, "-c", BUILD], cwd=REPO, env=env, stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(timeout=120) == 0, out[-2000:]
    os.close(leader)
    return out.decode(errors="replace")


def test_a_log_gets_plain_lines_and_a_terminal_gets_bars():
    logged = run(on_terminal=False)
    assert "\r" not in logged and "Writing model shards" not in logged and "it/s" not in logged, logged[-2000:]
    assert [line for line in logged.splitlines() if line.startswith("step ")] == [
        f"step {n}/20: reward {n / 20:.3g}" for n in range(2, 21, 2)], logged
    shown = run(on_terminal=True)
    assert "Writing model shards" in shown and "grpo:" in shown and "\r" in shown, shown[-2000:]
