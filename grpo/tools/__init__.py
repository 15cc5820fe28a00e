"""Command-line tools over a run's output: ``python -m grpo.tools.inspect`` (rollout dumps in a terminal) and
``python -m grpo.tools.plot`` (curves from metrics.jsonl)."""
