"""The system: what runs the algorithm (`grpo`'s top-level modules) on DeepSpeed, beneath it in the layer order
of `grpo/__init__.py`.

- `grpo.system.dist`        the process group and the collectives every layer uses (a leaf)
- `grpo.system.engines`     DeepSpeed policy and reference engines, the learning-rate schedule
- `grpo.system.training`    the training forward: logprobs on an engine, the optimizer step, and the step phases
  that run them (`step_logprobs`, `train_step`)
- `grpo.system.rollout`     multi-turn rollouts over the environments (`grpo.tasks`); `grpo.system.generation`
- `grpo.system.data`        prompt rows and the resumable loader; `grpo.system.chat` for chat templates
- `grpo.system.packed`      the packed forward (sequence packing): samples back to back, positions restarting
- weights, offload, checkpoint, rundir, replay, health, signals, tracking, dumps, shared_prefix, ds_config
"""
