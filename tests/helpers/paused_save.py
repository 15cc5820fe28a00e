"""Run a training script with one checkpoint save paused halfway, deterministically (issue 37's export-during-a-save
test): ``PAUSE_DIR=<dir> PAUSE_STEP=<N> python tests/helpers/paused_save.py train_grpo.py --config ...``.

When the save of step N has written its DeepSpeed files and RNG states into ``step_N.tmp`` (before the loop state
and the manifest), the trainer writes ``<dir>/save_paused`` (holding the ``.tmp`` path) and waits until the test
creates ``<dir>/save_go``; the save then goes on as usual."""

import os
import runpy
import sys
import time
from pathlib import Path

import grpo.system.checkpoint as checkpoint


def main() -> None:
    flags, step = Path(os.environ["PAUSE_DIR"]), int(os.environ["PAUSE_STEP"])
    write_json = checkpoint._atomic_write_json

    def paused(path: Path, obj: dict) -> None:
        if path.name == "train_state.json" and path.parent.name == f"step_{step:06d}.tmp":
            (flags / "save_paused").write_text(str(path.parent))
            while not (flags / "save_go").exists():
                time.sleep(0.05)
        write_json(path, obj)

    checkpoint._atomic_write_json = paused
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":  # pytest's doctest collection imports this file: nothing runs then
    main()
