"""grpo-ds: a GRPO trainer on DeepSpeed; its folders are its layers, and imports run one way (down).

Layers, bottom to top, one folder each (the root folder holds the algorithm, and the typed leaf it and every
other layer reads). A module imports only from its own layer (without an import cycle) and from the layers
below it; `tests/unit/test_layers.py` reads this table (the longest prefix that names a module wins), parses
every module's imports (those inside functions, ``importlib`` / ``__import__`` calls and ``"package.module:name"``
specs included) and fails on an import that runs up a layer, on any import cycle, and on a row that names no
module or folder:

    1. leaves       grpo.trajectory
    2. tasks        grpo.tasks
    3. config       grpo.config
    4. algorithm    grpo
    5. system       grpo.system
    6. loading      grpo.config.load grpo.config.nemo_rl
    7. wings        grpo.wings
    8. run          grpo.run
    9. tools        grpo.tools

1. leaves: the typed data of a rollout (`grpo.trajectory`: Message, Trajectory, Rollout); it imports nothing of grpo.
2. tasks (`grpo.tasks`): what the policy talks to and what scores it: the environment interface, the router
   that runs environments in threads with timeouts, the reward and tool environments, the tools' sandbox, and
   one module per built-in task, found through `grpo.tasks.catalogue`. Nothing here knows how the policy is trained.
3. config (`grpo.config`): the typed configuration, one module per section as NeMo-RL's MasterConfig has them
   (`algorithm`: grpo, loss_fn, reward penalties, distillation; `policy`; `data`; `env`; `run`: logger, cluster,
   checkpointing; `master`: the whole config and the rules across sections), every public name re-exported by
   `grpo.config`. It reads the task catalogue for the task names.
4. algorithm (grpo's root modules): pure functions on tensors and the config: the batch, the step phases,
   advantages and their registry, the loss, rewards, dynamic sampling, logprobs, metrics, and which samples
   share a micro-batch (`grpo.packing`: bin packing, token budgets, the packed-row layout). The place a research
   fork edits.
5. system (`grpo.system`): what runs the algorithm: the process group (`grpo.system.dist`), POSIX signals,
   DeepSpeed engines, the training forward (`grpo.system.training`), generation backends, weights, offload,
   checkpoints, run directories, data, rollouts, tracking, the startup line (`grpo.system.banner`), dumps.
6. loading: a YAML recipe with ``defaults:`` and dotted overrides to a validated config (`grpo.config.load`), and
   NeMo-RL's recipes (`grpo.config.nemo_rl`: `recipe` loads them, `rules` translates them key by key). It lives
   in config/ and sits above the algorithm and the system because it checks names they register (the advantage
   estimators of `grpo.registry`) before any model loads.
7. wings (`grpo.wings`): features that plug into the core's seams, a folder each, and that no other layer imports
   (the run loads them all through `grpo.wings.load`, naming none): reward models (`grpo.wings.reward_model`),
   agents over the OpenAI-compatible endpoint (`grpo.wings.agents`), NeMo-Gym (`grpo.wings.gym`). The seams: the
   environment catalogue (`grpo.tasks.factory.register_environment`), who plays a sample
   (`grpo.system.players.register_player`), the deferred scoring point
   (`grpo.system.deferred.register_deferred_scorer`) and the reward transforms
   (`grpo.rewards.register_reward_transform`); a wing may offer its own to another (the endpoint's games and
   services, `grpo.wings.agents`, which NeMo-Gym uses).
8. run (`grpo.run`): composition: a run's setup (`grpo.run.run_setup`), the scripts' command line
   (`grpo.run.cli`), the `Run` and its per-step calls and teardown (`grpo.run.run`), validation, where generation
   runs and is served (`grpo.run.serving`), ``--export-hf`` / ``--export-adapter`` (`grpo.run.export`), the phases
   before training (`grpo.run.phases`: scoring, the sync loop's rollout collection and weight sync), the end of a
   step that both loops share (`grpo.run.step_end`: log, validate, checkpoint), the async loop's generation side
   (`grpo.run.async_generation`) and its producer thread (`grpo.run.producer`); the loops themselves are the
   scripts ``train_grpo.py`` and ``train_async_grpo.py``.
9. tools (`grpo.tools`): ``python -m grpo.tools.inspect`` (rollout dumps), ``python -m grpo.tools.plot`` (curves)
   and the work each phase of a step must do (`grpo.tools.roofline`, which bench/roofline.py prints).
"""
