"""Helpers of the end-to-end tests: run a training script as a subprocess and read its metrics."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "tests" / "configs" / "tiny.yaml")


def launcher(name: str) -> list[str]:
    """The command of a launcher installed with this python (no activated virtual environment needed):
    torchrun as ``python -m torch.distributed.run``, deepspeed / accelerate from this python's bin directory."""
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"]
    return [os.path.join(os.path.dirname(sys.executable), name)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int | None = 2) -> dict:
    """This environment without any launcher variables, CPU-only and offline, ``threads`` torch threads
    (None: the library's choice). Python tracebacks of every thread are printed on a fatal signal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
               PYTHONFAULTHANDLER="1", PYTHONPATH=str(REPO))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run(cmd: list[str], timeout: int = 300, threads: int | None = 2, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=REPO, env=child_env(threads), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nSTDOUT:\n{p.stdout[-4000:]}\n"
                             f"STDERR:\n{p.stderr[-6000:]}")
    return p


def paths(tmp: Path, *extra: str) -> list[str]:
    """Overrides that put a run's logs and checkpoints under ``tmp``."""
    return [f"logger.log_dir={tmp}/logs", f"checkpointing.checkpoint_dir={tmp}/ckpt", *extra]


def metrics(tmp: Path) -> list[dict]:
    with open(tmp / "logs" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_rows(tmp: Path) -> dict[int, dict]:
    """The train rows of metrics.jsonl by step."""
    return {r["step"]: r for r in metrics(tmp) if "train/loss" in r}


def addition_jsonl(tmp: Path) -> Path:
    """A local training file in NeMo-RL's ResponseDataset form: 64 rows ``{"input": "a+b=", "output": "a+b"}``."""
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps({"input": f"{a}+{b}=", "output": str(a + b)}) + "\n"
                            for a in range(8) for b in range(8)))
    return path


def kill_at_random_points(command: list[str], points: int, max_sleep: float, seed: int) -> None:
    """Start ``command`` ``points`` times and kill -9 each after a random 3 to ``max_sleep`` seconds (steps,
    saves, anything in between); the caller reruns it to the end and compares with an uninterrupted run."""
    import random

    rng = random.Random(seed)
    for _ in range(points):
        proc = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(3.0, max_sleep))
        proc.kill()
        proc.wait()


def half_reward(question, completion, answer, meta) -> float:
    """An env.name=function reward of 0.5 whatever the completion: which environment scored a row shows in it."""
    return 0.5
