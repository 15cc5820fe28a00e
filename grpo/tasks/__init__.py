"""Tasks: what the policy talks to and what scores it. Nothing here knows how the policy is trained.

- `grpo.tasks.interface`   the environment interface (NeMo-RL's ``step(message_logs, metadata)``)
- `grpo.tasks.router`      `Environments`: the run's environments by task name, each step in a thread with a timeout
- `grpo.tasks.factory`     environments from the ``env`` config section
- `grpo.tasks.reward`      single-turn environments over a reward function (`grpo.tasks.function`, `grpo.tasks.pool`)
- `grpo.tasks.tools`       tool calls (`grpo.tasks.tool_calls`) in worker processes, the final answer verified
- `grpo.tasks.catalogue`   the built-in tasks by name, one module each: `arithmetic`, `math`, `reasoning_gym`,
  `guess_number`, `calculator` (rows, environment, demo model; `grpo.tasks.rows`, `grpo.tasks.toy`)
"""
