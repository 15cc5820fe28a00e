"""Async GRPO's generation thread: `RolloutProducer` plays prompt batches into the replay deque.

    prompts -> G conversations each (its own weight copy) -> scored groups, tagged with the weight version
            -> ReplayBuffer (meant for step t) ... the trainer takes them at step t

Prompt batch i of the run is meant for training step i + 1, exactly as in the synchronous loop. Bounded
staleness: before generating for step t the producer waits until weights of version
``t - 1 - max_trajectory_age_steps`` or newer are published (`grpo.system.replay.WeightStage`), and loads the
newest ones; with ``in_flight_weight_updates`` it also loads newer weights between generation chunks.
Each rank runs one producer; they agree over their own gloo process group (the default group belongs to
the main thread), so every rank puts the same groups in the same order.

A deferred scorer (`grpo.system.deferred`: a ZeRO-3 reward model) scores with collectives on the default group, which
belongs to
the trainer thread, and an offloaded copy moves onto the device to score (``offload`` ``move``), which must not
happen while the trainer trains: the producer hands their scoring to the trainer through a `TrainerDesk` and waits;
the trainer runs it while it waits for the groups of the step the rollout is for (`RolloutProducer.take`), so on
every rank the same scoring passes run at the same point between two training steps.

Samples whose environment or reward failed (`grpo.trajectory.Trajectory.failure`) enter the deque as they came
back, failed and without a made-up reward: the trainer masks them and applies the step budget
(``grpo.rollout_failure``). A rollout that fails as a whole (`grpo.system.rollout.RolloutError`) is retried on the
next prompt batch; more than
``grpo.async_grpo.max_generation_failures`` consecutive failures (NeMo-RL counts consecutive ones: a
success resets the count) close the buffer with `StopKind.FAILURES`, and the trainer stops.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from grpo.system.replay import (
    GroupInfo, ReplayBuffer, ReplayClosed, ReplayEntry, StopKind, WeightStage, groups_from_trajectories,
)


class RolloutProducer:
    """The generation thread and its state. ``prompts``: a `grpo.system.data.PromptStream` positioned at the next
    batch to generate; ``first_target``: the step that batch is for; ``generator``: the thread's own
    `grpo.system.generation.hf.HFGeneration` (a plain weight copy); ``envs``: the thread's environments.

    Attributes the trainer reads: ``failures`` (consecutive), ``total_failures``, ``busy_s`` (seconds spent
    generating and scoring), ``version`` (the weight version the copy holds).
    """

    def __init__(self, run, stage: WeightStage, buffer: ReplayBuffer, generator, envs, prompts, first_target: int,
                 group=None, threads: int = 1):
        self.run, self.stage, self.buffer = run, stage, buffer
        self.generator, self.envs, self.prompts = generator, envs, prompts
        self.target, self.group, self.threads = first_target, group, threads
        self.failures = self.total_failures = 0
        self.busy_s = 0.0
        self.version = -1
        self._busy_mark = (0.0, time.perf_counter())
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="grpo-generation", daemon=True)
        deferred = run.deferred
        if deferred:  # the thread's weight copy exists now: the scorers go where memory is left (setup's, if built)
            deferred.place(run.logger.write)
        self.desk = TrainerDesk() if deferred and deferred.on_trainer_thread else None  # scored in the trainer thread
        a = run.cfg.grpo.async_grpo
        if a.in_flight_weight_updates and generator.loads_staged_weights:  # generation ranks: mid-request too
            generator.in_flight = self._load_mid_request

    def start(self) -> None:
        """Start the thread; returns once it has set up its device and threads."""
        self._thread.start()
        self._ready.wait()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (the trainer is done: a hand-over still waiting fails, ending the thread)."""
        if self.desk is not None:
            self.desk.close()
        self._thread.join(timeout)

    def take(self, step: int, n: int) -> tuple[list, float]:
        """The trainer's `ReplayBuffer.take` of step ``step``'s ``n`` groups; with a `TrainerDesk`, the scoring handed
        over for rollouts meant for ``step`` or before runs here while it waits (the groups cannot come before); the
        seconds returned (``async/trainer_wait_s``) include that scoring."""
        if self.desk is None:
            return self.buffer.take(step, n)
        start = time.perf_counter()
        while True:
            self.desk.serve(step)
            try:
                entries, _ = self.buffer.take(step, n, timeout=TrainerDesk.POLL_S)
                return entries, time.perf_counter() - start
            except TimeoutError:
                continue

    def settle(self, version: int, before_wait: Callable[[int], None] | None = None) -> int | None:
        """A checkpoint's wait (trainer thread; ``version``: the weights it saves, the newest published): the prompt
        batch in flight, when it started with older weights, is waited for until it is in the deque (or the thread
        stopped), so that the checkpoint holds it: a resume has only the newest weights and would generate it again
        with them, unlike the run it resumes. A batch started with ``version`` is not waited for: a resume generates
        it again, the same (its prompts after the last buffered ones, seeds by step, these weights). Trainers agree
        on the step waited for (a collective): a `TrainerDesk`'s scoring for it runs here, on every rank.
        ``before_wait(step)`` is called before waiting. Returns that step, or None (nothing waited for: no cost)."""
        import torch

        from grpo.system.dist import all_reduce, comm_device

        target = self.buffer.in_flight(older_than=version) or 0
        if self.run.world_size > 1:
            target = int(all_reduce(torch.tensor([target], device=comm_device()), op="max").item())
        if not target:
            return None
        if before_wait is not None:
            before_wait(target)
        while not self.buffer.wait_put(target, timeout=0 if self.desk else None):
            self.desk.serve(target)  # waits up to POLL_S for work
        return target

    def step_metrics(self, step: int, entries: list[ReplayEntry], wait_s: float) -> dict:
        """The ``async/*`` metrics of a trainer step that took ``entries`` (replay entries) after waiting
        ``wait_s``: trajectory ages (age = step - 1 - generation version), the deque, failures, and
        ``generation_busy_frac``, the share of wall time since the last call that the thread spent
        generating and scoring."""
        from grpo.system.replay import trajectory_age

        ages = [trajectory_age(step, e.generation_version) for e in entries]
        info = entries[0].group.info
        busy, wall = self.busy_s, time.perf_counter()
        busy_frac = min(1.0, (busy - self._busy_mark[0]) / max(wall - self._busy_mark[1], 1e-9))
        self._busy_mark = (busy, wall)
        return {
            "async/trajectory_age_hist": ages, "async/trajectory_age_mean": sum(ages) / len(ages),
            "async/trajectory_age_max": max(ages), "async/buffer_size": len(self.buffer),
            "async/trainer_wait_s": wait_s, "async/generation_busy_frac": busy_frac,
            "async/evicted_groups": self.buffer.num_evicted, "async/generation_failures": self.total_failures,
            "async/gen_start_time": info.gen_start_time, "async/gen_end_time": info.gen_end_time,
            **{f"async/{k}": v for k, v in self.generator.stats.items()},  # generation ranks: totals
        }

    def load_newest(self) -> int:
        """A safe point: load the newest published weights into the copy, or into the generation ranks
        (``policy.generation.colocated.enabled=false``: `RemoteGeneration.load_staged`, a collective of the
        trainers); returns the version it holds. With a player serving this backend (``run.player``), the
        load waits for its batch in flight and its later answers record the new version."""
        def load() -> int:
            if self.generator.loads_staged_weights:
                return self.generator.load_staged(self.stage)
            return self.stage.load_into(self.generator.model, self.version)

        self.version = self.run.player.load_weights(load) if self.run.player is not None else load()
        return self.version

    def _score_in_trainer(self, target: int) -> Callable[[list], float]:
        """The deferred scoring point of a rollout for step ``target``, run by the trainer thread."""
        return lambda trajectories: self.desk.run(target, self.run.deferred.score_pending, trajectories)

    def _load_mid_request(self) -> int:
        """The generation ranks' safe point between two rounds of unfinished requests (in-flight updates; inside a
        `generate` call, the endpoint's batch or the rollout's own)."""
        self.version = self.generator.load_staged(self.stage, mid_request=True)
        if self.run.player is not None:  # the batch in flight keeps the version it started with (the oldest)
            self.run.player.hold_version(self.version)
        return self.version

    # ---------------------------------------------------------------- the thread
    def _main(self) -> None:
        import torch

        from grpo.system.generation import base

        device = self.run.device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # generation kernels overlap training's
        with base.on_device(device, stream):  # the current device and stream are per thread
            torch.set_num_threads(self.threads)  # OpenMP threads are per thread: the trainer keeps its own
            self._ready.set()
            try:
                self._loop()
            except BaseException as err:
                self.buffer.close(StopKind.CRASHED, f"{type(err).__name__}: {err}")
                raise
            finally:  # a step whose groups will never come must not wait forever
                self.buffer.close(StopKind.ENDED, f"the generation thread ended before step {self.target}")

    def _loop(self) -> None:
        from grpo.run.run import run_rollout
        from grpo.system.dist import all_gather_objects
        from grpo.system.rollout import FixedWeights, RolloutError

        a = self.run.cfg.grpo.async_grpo
        while self.target <= self.run.total_steps:
            # ---- bounded staleness: step t may use weights of version t - 1 - max_age or newer
            alive = self.stage.wait_for(self.target - 1 - a.max_trajectory_age_steps)
            if not all(all_gather_objects([alive], self.group)):  # the run ends on every rank at once
                return
            self.buffer.expect(self.target)  # before the load: a checkpoint's `settle` waits for what it loads
            self.buffer.expect(self.target, self.load_newest())

            # ---- the next prompt batch (a new epoch when the loader runs out)
            rows = self.prompts.next()
            if rows is None:
                self.buffer.close(StopKind.OUT_OF_DATA)
                return
            mark = self.prompts.mark()

            # ---- generate and score; a failure is retried on the next prompts, up to the limit
            t0, wall0 = time.perf_counter(), time.time()
            try:
                r = run_rollout(self.run, self.generator, self.envs, rows, self.target, 0, group=self.group,
                                weights=self if a.in_flight_weight_updates else FixedWeights(self.version),
                                score_pending=self._score_in_trainer(self.target) if self.desk else None)
            except RolloutError as err:
                self.busy_s += time.perf_counter() - t0
                self.failures += 1
                self.total_failures += 1
                broken = self.generator.broken  # generation ranks gone: no retry can help
                if broken is not None:
                    self.buffer.close(StopKind.FAILURES, f"the generation ranks cannot generate any more (step "
                                      f"{self.target}): {broken}")
                    return
                if self.failures > a.max_generation_failures:
                    self.buffer.close(StopKind.FAILURES, f"{self.failures} consecutive failures > "
                                      f"grpo.async_grpo.max_generation_failures={a.max_generation_failures} "
                                      f"(last, for step {self.target}: {err})")
                    return
                self.run.logger.write(f"generation failure {self.failures} of {a.max_generation_failures} tolerated "
                                      f"(step {self.target}): {err}; retrying on the next prompts")
                continue
            self.failures = 0
            self.busy_s += time.perf_counter() - t0
            info = GroupInfo(loader_mark=mark, metrics=r.metrics, timing=r.timing, gen_start_time=wall0,
                             gen_end_time=time.time())
            groups = groups_from_trajectories(r.trajectories, info)
            try:
                self.buffer.put(groups, [g.version for g in groups], target_version=self.target)
            except ReplayClosed:  # the trainer stopped (end of run, early stop)
                return
            self.target += 1


class TrainerDesk:
    """Work the generation thread hands to the trainer thread: collectives on the default group (a ZeRO-3 reward
    model's forwards), which only the trainer thread may issue, and an offloaded reward model's trip to the device.

    ``run(target, fn, *args)`` (generation thread) queues ``fn(*args)`` for step ``target`` and blocks until the
    trainer has run it: its result, or its exception raised here. ``serve(step)`` (trainer thread) runs, in order,
    the queued work for ``step`` or earlier, waiting up to `POLL_S` for some to come. Work for a later step waits
    for that step: every rank's trainer runs the same work between the same two steps, whatever its timing.
    ``close()``: nothing will be served any more; waiting and later `run` calls raise `RuntimeError`."""

    POLL_S = 0.05

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._closed = False

    def run(self, target: int, fn: Callable, *args):
        job = {"target": target, "call": (fn, args), "done": False}
        with self._cond:
            if self._closed:
                raise RuntimeError("the trainer has stopped: no reward-model scoring any more")
            self._queue.append(job)
            self._cond.notify_all()
            self._cond.wait_for(lambda: job["done"] or self._closed)
            if not job["done"]:
                raise RuntimeError("the trainer stopped before this rollout's reward-model scoring")
        if "error" in job:
            raise job["error"]
        return job["result"]

    def serve(self, step: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._due(step), self.POLL_S)
        while True:
            with self._cond:
                if not self._due(step):
                    return
                job = self._queue.popleft()
            fn, args = job["call"]
            try:
                job["result"] = fn(*args)
            except Exception as err:  # raised in the generation thread, which reports it as a rollout failure
                job["error"] = err
            with self._cond:
                job["done"] = True
                self._cond.notify_all()

    def _due(self, step: int) -> bool:
        return bool(self._queue) and self._queue[0]["target"] <= step

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def weight_copy(run, stage: WeightStage):
    """A plain transformers copy of the policy holding the staged weights, as an hf generation backend (the
    generation thread's, and the async loop's validation)."""
    from grpo.system.engines import DTYPES
    from grpo.system.generation.hf import HFGeneration
    from grpo.system.vision import auto_model_class, prepare_model

    p = run.cfg.policy
    config = run.policy.module.config  # a vision-language policy's copy is one too (grpo/system/vision.py)
    model = prepare_model(auto_model_class(config).from_config(config, dtype=DTYPES[p.precision],
                                                               trust_remote_code=p.trust_remote_code),
                          linear_kernel=p.cpu_linear_kernel)
    if p.lora.enabled:  # the policy's peft layout (the staged names); generates with the adapters on
        from grpo.system.engines import apply_lora

        model = apply_lora(model, p.lora, vision_tower=p.vision.lora_vision_tower)
    stage.load_into(model)
    return HFGeneration(p, run.tokenizer, run.policy.module.config, run.device, model=model)
