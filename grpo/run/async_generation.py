"""What the async loop runs beside its trainer: the replay deque, the weight stage and the generation thread
(`start_async_generation`), and the async loop's own phases on them: take a step's rollouts (`take_rollouts`),
sync weights (`AsyncGeneration.publish`), validate on the staged weights (`AsyncGeneration.validate`), stop
(`AsyncGeneration.stop`).

    gen = start_async_generation(run)
    took = take_rollouts(run, gen, step)        # took.batch, took.metrics; ReplayClosed: the end
    gen.publish(step, trained=True)
    gen.stop()
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.run.phases import score_rollouts
from grpo.run.producer import RolloutProducer, weight_copy
from grpo.run.run import Run
from grpo.run.step_end import StepEnd
from grpo.system.data import LoaderMark
from grpo.system.health import HealthStop
from grpo.system.replay import ReplayBuffer, ReplayClosed, StopKind, WeightStage


@dataclass
class AsyncGeneration:
    """The async loop's generation side. Two loader positions matter: after the last TRAINED prompt batch
    (``trained_mark``, saved as dataloader.pt) and after the last BUFFERED one (kept in each group); the thread goes
    on from the second, a checkpoint records the first. ``val_generator``: validation's weight copy, built at the
    first validation."""

    run: Run
    buffer: ReplayBuffer
    stage: WeightStage
    producer: RolloutProducer
    trained_mark: LoaderMark
    val_generator: object = None

    def validate(self, step: int) -> dict:
        """Validation (`grpo.run.validation.validate`) on a copy of the newest published (staged) weights."""
        from grpo.run.validation import validate

        if self.val_generator is None:
            self.val_generator = weight_copy(self.run, self.stage)
            self.run.closables.append(self.val_generator)
        self.stage.load_into(self.val_generator.model)
        return validate(self.run, self.val_generator, self.run.val_envs, step)

    def publish(self, step: int, trained: bool) -> float:
        """Sync weights: publish the weights after step ``step`` as version ``step`` to the generation thread; a
        skipped step (``trained=False``) publishes the same weights under the new version (staleness counts steps).
        LoRA: only the adapters change; the stage keeps the base weights published at the start. Returns seconds."""
        from grpo.system import weights

        if not trained:
            return self.stage.publish([], version=step)
        cfg = self.run.cfg
        return self.stage.publish(weights.iter_gathered_params(
            self.run.policy, cfg.policy.generation.refit_bucket_numel, trainable_only=cfg.policy.lora.enabled),
            version=step)

    def replay_extra(self) -> dict:
        """What a checkpoint saves beside the engine: the replay deque, once the prompt batch in flight with older
        weights than the checkpoint's is in it (`RolloutProducer.settle`), so that a resume trains what the run
        would have trained."""
        import time

        def before_wait(target: int) -> None:  # a stop signal's save waits too: say why nothing happens meanwhile
            self.run.logger.write(f"checkpoint of step {self.stage.version}: waiting for the prompt batch of step "
                                  f"{target} in flight (generated with older weights) to save it with the replay deque")

        t0 = time.perf_counter()
        if self.producer.settle(self.stage.version, before_wait) is not None:
            self.run.logger.write(f"checkpoint: waited {time.perf_counter() - t0:.2f} s")
        return {"replay_buffer": self.buffer.state_dict()}

    def ending(self, end: StepEnd, closed: ReplayClosed | None) -> tuple[str | None, str | None]:
        """(stop, failure) of the run: the last step's ``end``, unless the thread closed the replay deque
        (``closed``): its failure (too many failed rollouts) exits 1, the end of the data is a normal stop."""
        if closed is None:
            return end.stop, end.failure
        cfg = self.run.cfg
        message = closed.stop_message(cfg.checkpointing.enabled and cfg.checkpointing.checkpoint_dir,
                                      self.run.state.current_step)
        return (end.stop, message) if closed.failed else (message, end.failure)

    def stop(self) -> dict:
        """Stop the thread (a thread waiting for weights returns; one mid-batch finishes it first) and return the
        replay deque's state for the last save: emptied after an outage (``rollouts`` stop: the buffered groups
        failed too; they are regenerated on resume)."""
        self.stage.close()
        self.buffer.close(StopKind.ENDED)
        self.producer.join(timeout=600)
        if self.producer.generator is not self.run.generator:  # the generation ranks' backend: finish closes it
            self.run.closables += [self.producer.generator]
        replay = self.buffer.state_dict()
        if self.run.checks.stop_kind is HealthStop.ROLLOUTS:
            replay["entries"] = []
        return {"replay_buffer": replay}


def start_async_generation(run: Run) -> AsyncGeneration:
    """The replay deque restored from the checkpoint (`grpo.system.replay.replay_resume`), the weight stage with
    the current weights as version ``current_step``, the generation thread's backend (the generation ranks'
    engines with ``colocated.enabled=false``: the producer pushes the staged weights to them and only it uses the
    bridge; else a transformers copy of the weights in the thread), the endpoint over it (env.name=agent /
    expose_http_server), and the thread started with ``grpo.async_grpo.generation_threads`` torch threads."""
    import torch

    from grpo.run.serving import start_async_player
    from grpo.system import weights
    from grpo.system.data import PromptStream
    from grpo.system.replay import replay_resume

    cfg, g = run.cfg, run.cfg.grpo
    start = replay_resume(run)
    buffer = start.buffer
    if run.resume is not None:
        run.logger.write(f"{len(buffer)} replay groups restored")
    stage = WeightStage()
    stage.publish(weights.iter_gathered_params(run.policy, cfg.policy.generation.refit_bucket_numel),
                  version=run.state.current_step)
    group = torch.distributed.new_group(backend="gloo") if run.world_size > 1 else None
    trainer_threads = torch.get_num_threads()
    generator = run.generator if run.generator is not None else weight_copy(run, stage)
    start_async_player(run, generator)
    producer = RolloutProducer(run, stage, buffer, generator, run.envs,
                               PromptStream(run.loader, g.max_num_epochs, start.gen_mark.epoch, start.gen_mark.loader),
                               start.first_target, group, g.async_grpo.generation_threads or max(1, trainer_threads // 2))
    producer.start()
    torch.set_num_threads(trainer_threads)
    return AsyncGeneration(run, buffer, stage, producer, start.trained_mark)


@dataclass
class Taken:
    """A step's rollouts as the trainer took them: the replay ``entries`` (their prompt groups), the seconds it
    waited for them, when training started (``time.time()``), the scored ``batch``, the step's row so far and its
    ``timing/train/`` seconds (the thread's generation and environment time)."""

    entries: list
    wait_s: float
    train_start: float
    batch: object  # grpo.batch.TrainBatch
    metrics: dict
    timing: dict


def take_rollouts(run: Run, gen: AsyncGeneration, step: int) -> Taken:
    """Generate and score, the async way: the thread generated; the trainer takes step ``step``'s prompt groups
    from the replay deque (`RolloutProducer.take`: a ZeRO-3 reward model scores here; raises
    `grpo.system.replay.ReplayClosed` when the thread stopped) and scores them (`grpo.run.phases.score_rollouts`:
    the failed samples are in the deque as they came back, failed, without a reward). The prompts are consumed,
    trained or skipped: ``gen.trained_mark`` moves past them."""
    import time

    from grpo.system.replay import trajectories_from_groups

    entries, wait_s = gen.producer.take(step, run.cfg.grpo.num_prompts_per_step)
    train_start = time.time()
    info = entries[0].group.info  # what the prompt batch's groups share
    batch, counts, metrics = score_rollouts(run, trajectories_from_groups([e.group for e in entries]), info.metrics)
    gen.trained_mark = info.loader_mark
    return Taken(entries, wait_s, train_start, batch, {**{f"train/{k}": v for k, v in metrics.items()}, **counts},
                 {f"timing/train/{k}": v for k, v in info.timing.items()})
