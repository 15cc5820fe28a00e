"""grpo-ds: a GRPO trainer on DeepSpeed, in three layers whose imports run one way (down).

Layers, bottom to top. A module imports only from its own layer (without an import cycle) and from the
layers below it; `tests/unit/test_layers.py` reads this table, parses every module's imports (those inside
functions, ``importlib`` / ``__import__`` calls and ``"package.module:name"`` specs included) and fails on an
import that runs up a layer, on any import cycle, and on a module that no layer claims:

    1. leaves       grpo.trajectory
    2. tasks        grpo.tasks
    3. config       grpo.config
    4. algorithm    grpo.advantages grpo.registry grpo.loss grpo.rewards grpo.gym_rewards grpo.logprobs grpo.batch grpo.packing grpo.step grpo.dynamic_sampling grpo.metrics grpo.rollout_metrics
    5. system       grpo.system
    6. composition  grpo.config_load grpo.nemo_rl_rules grpo.nemo_rl_gym_rules grpo.nemo_rl_recipe grpo.cli grpo.run grpo.validation grpo.serving grpo.export grpo.run_setup grpo.step_end grpo.producer grpo.plot grpo.inspect

1. leaves: the typed data of a rollout (`grpo.trajectory`: Message, Trajectory, Rollout); it imports nothing of grpo.
2. tasks (`grpo.tasks`): what the policy talks to and what scores it: the environment interface, the router
   that runs environments in threads with timeouts, the reward and tool environments, the tools' sandbox, and
   one module per built-in task, found through `grpo.tasks.catalogue`. Nothing here knows how the policy is trained.
3. config (`grpo.config`): the typed configuration; it reads the task catalogue for the task names.
4. algorithm (grpo's top-level modules above): pure functions on tensors and the config: the batch, the
   step phases, advantages and their registry, the loss, rewards, dynamic sampling, logprobs, metrics, and
   which samples share a micro-batch (`grpo.packing`: bin packing, token budgets, the packed-row layout).
   The place a research fork edits.
5. system (`grpo.system`): what runs the algorithm: DeepSpeed engines, the training forward
   (`grpo.system.training`), generation backends, weights, offload, checkpoints, run directories, data,
   rollouts, tracking, the startup line (`grpo.system.banner`), dumps.
6. composition: loading the config (`grpo.config_load`; NeMo-RL's recipes: `grpo.nemo_rl_recipe` loads them and
   `grpo.nemo_rl_rules` translates them key by key), the scripts' command line (`grpo.cli`), the `Run` and its
   per-step calls and teardown (`grpo.run`), validation (`grpo.validation`), where generation runs and is served
   (`grpo.serving`), ``--export-hf`` / ``--export-adapter`` (`grpo.export`), a run's setup (`grpo.run_setup`), the
   end of a step that both loops share (`grpo.step_end`), the async loop's producer thread, and the command-line
   tools (`grpo.plot`, `grpo.inspect`); the loops themselves are the scripts ``train_grpo.py`` and
   ``train_async_grpo.py``.
"""
