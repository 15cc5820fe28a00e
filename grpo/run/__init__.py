"""Composition: what the two training scripts call to set a run up, step it and end it.

`run_setup` (a run's setup), `run` (the `Run`, its per-step calls and teardown), `cli` (the scripts' command
line), `step_end` (the end of a step both loops share), `validation`, `serving` (where generation runs and is
served), `export` (``--export-hf`` / ``--export-adapter``), `producer` (the async loop's generation thread). The
loops themselves are ``train_grpo.py`` and ``train_async_grpo.py``.
"""
