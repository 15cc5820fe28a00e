#!/usr/bin/env python
"""train_grpo.py with the peak memory of each phase in every step's metrics row (used by scripts/gpu_check.py).

    python scripts/train_with_phase_memory.py --config X.yaml dotted.key=value ...
    torchrun --nproc_per_node 2 scripts/train_with_phase_memory.py --config X.yaml ...

Same command line and behaviour as train_grpo.py; in addition, on CUDA, ``memory/<phase>_peak_gb`` and
``memory/<phase>_used_gb`` (`grpo.logging.phase_memory`) for the phases generation
(`grpo.phases.generate_and_score`), logprobs (`grpo.update.step_logprobs`) and train
(`grpo.update.train_step`) go into the step's row of metrics.jsonl. It wraps those functions rather than
editing the loop; once train_grpo.py wraps its phases in `phase_memory` itself, this script is
train_grpo.py plus nothing. A renamed phase function fails here at start, naming it.
"""

from __future__ import annotations

import functools
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PHASES = (("grpo.phases", "generate_and_score", "generation"),
          ("grpo.update", "step_logprobs", "logprobs"),
          ("grpo.update", "train_step", "train"))


def instrument(phase_metrics: dict) -> None:
    """Wrap each phase function in `phase_memory` (results into ``phase_metrics``) and merge
    ``phase_metrics`` into every step row `MetricsLogger.log` writes."""
    import importlib

    from grpo import logging as grpo_logging

    for module_name, fn_name, phase in PHASES:
        module = importlib.import_module(module_name)
        fn = getattr(module, fn_name, None)
        if fn is None:
            raise SystemExit(f"{__file__}: {module_name}.{fn_name} no longer exists: update PHASES")

        @functools.wraps(fn)
        def wrapped(*args, _fn=fn, _phase=phase, **kwargs):
            with grpo_logging.phase_memory(_phase, phase_metrics):
                return _fn(*args, **kwargs)

        setattr(module, fn_name, wrapped)

    log = grpo_logging.MetricsLogger.log

    @functools.wraps(log)
    def log_with_phases(self, metrics: dict, step: int) -> None:
        if "train/loss" in metrics:  # a step row (validation rows have val/* only)
            metrics = {**phase_metrics, **metrics}
            phase_metrics.clear()
        log(self, metrics, step)

    grpo_logging.MetricsLogger.log = log_with_phases


if __name__ == "__main__":
    import train_grpo
    from grpo.engines import exit_process

    instrument({})
    exit_process(train_grpo.main(sys.argv[1:]))
