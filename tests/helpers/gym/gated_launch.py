"""A launcher that waits for a go-ahead before it runs the real one, so a test can bind the head server's port in the
window between grpo-ds picking it and the launcher binding it (the race of a decoy, or of another run's Gym):

    python gated_launch.py <global_config.yaml> <launcher argv...>

waits until ``<global_config.yaml>.<launch key>.go`` exists (the key of this launch, read from the file grpo-ds
wrote), then becomes ``python <launcher argv...>``."""

from __future__ import annotations

import os
import sys
import time

import yaml


def main(config_file: str, launcher: list[str]) -> None:
    with open(config_file) as f:
        key = yaml.safe_load(f)["grpo_ds_launch_key"]
    go = f"{config_file}.{key}.go"
    deadline = time.monotonic() + 120
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            sys.exit(f"gated_launch.py: no {go} within 120 s")
        time.sleep(0.02)
    os.execv(sys.executable, [sys.executable, *launcher])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
