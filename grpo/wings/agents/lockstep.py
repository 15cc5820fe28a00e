"""Several trainers' endpoints over the generation ranks (`LockstepGeneration`).

With generation on ranks of its own, every generation is a collective of the trainers
(`grpo.system.generation.remote.RemoteGeneration`: each trainer makes the same calls, together). A trainer's loop
keeps that rule (its rollout's generate and lockstep_max calls, the refit, the async producer's weight loads are the
same on every trainer), but its endpoint cannot: each trainer's agents call their own endpoint when they like, so
one trainer may have a batch to generate while the others have none. `LockstepGeneration` wraps the trainers'
`RemoteGeneration` so that they agree: a driver thread on every trainer meets the others each round (an all_gather
over a gloo group of their own; every `POLL_S` while nothing new is waiting) and, all having seen the same, they do
one of:

- a **section**: the next call of one thread (by its name: the main thread, the async producer) that is waiting on
  every trainer; the drivers stand still while those threads make it, exactly as they would without the endpoint;
- a **solo round**: the endpoints' batches of one sampling profile ("train" or "val", `generate_solo`), each
  trainer's own or none: one `RemoteGeneration.generate` on every trainer, made by the drivers.

A round with both kinds waiting alternates them (neither starves); a call made from inside a section or a solo round
(the async producer's in-flight weight load, inside a generate) runs at once. So no two threads of a trainer use the
trainers' group or the bridge at the same time, and every trainer makes the same calls in the same order. A trainer
that closes (the run ends) stops every driver at the next round; later calls raise
`grpo.system.rollout.RolloutError`, as they do when a trainer's driver fails (a trainer died).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from grpo.system.dist import all_gather_objects
from grpo.system.generation.base import GenerationBackend, GenerationOutput

# How long a driver waits for something new of its own before it meets the others for a round anyway (another
# trainer may have an endpoint batch to generate).
POLL_S = 0.02
PROFILES = ("train", "val")


@dataclass
class _Section:
    stream: str  # the calling thread's name: sections of one thread are matched across trainers in order
    granted: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass
class _Solo:
    profile: str
    prompts: list[list[int]]
    seeds: list[int]
    max_new_tokens: list[int]
    stop_strings: list
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def pick_round(states: list[tuple[bool, list[str], list[str]]], round_no: int, last_was_section: bool):
    """What every trainer does this round from every trainer's ``(closing, waiting sections' threads, waiting solo
    profiles)``: ``("stop", None)``, ``("section", thread name)``, ``("solo", profile)`` or ``("idle", None)``. A section
    needs its thread waiting on every trainer (several: taken in turn by ``round_no``); a solo round runs when any
    trainer has a batch (both profiles: in turn); with both kinds, they alternate (``last_was_section``).

        >>> pick_round([(False, ["MainThread"], []), (False, [], ["val"])], 0, False)
        ('solo', 'val')
        >>> pick_round([(False, ["MainThread"], ["train"]), (False, ["MainThread"], [])], 0, False)
        ('section', 'MainThread')
        >>> pick_round([(False, ["MainThread"], ["train"]), (False, ["MainThread"], [])], 1, True)
        ('solo', 'train')
        >>> pick_round([(False, [], []), (True, [], [])], 0, False)
        ('stop', None)
    """
    if any(closing for closing, _, _ in states):
        return "stop", None
    common = sorted(set.intersection(*(set(heads) for _, heads, _ in states)))
    profiles = [p for p in PROFILES if any(p in solo for _, _, solo in states)]
    if common and not (profiles and last_was_section):
        return "section", common[round_no % len(common)]
    if profiles:
        return "solo", profiles[round_no % len(profiles)]
    return "idle", None


class LockstepGeneration(GenerationBackend):
    """``inner`` (the trainers' `RemoteGeneration`) shared by the loop and the endpoint of every trainer (module
    docstring); built on every trainer at the same point (a collective: the drivers' gloo group). ``gen_cfg``:
    ``policy.generation``, whose ``profiles()`` are the solo rounds' "train" and "val" profiles."""

    def __init__(self, inner: GenerationBackend, gen_cfg, poll_s: float = POLL_S):
        import torch.distributed as dist

        self.inner, self.poll_s = inner, poll_s
        self._profiles = gen_cfg.profiles()
        self.group = dist.new_group(backend="gloo")
        self._cond = threading.Condition()
        self._sections: list[_Section] = []
        self._solos: list[_Solo] = []
        self._changed = False
        self._closing = False
        self._stopped: str | None = None  # why the drivers stopped: every later call raises it
        self._owner: int | None = None  # the thread that may call ``inner`` now (a granted section, a solo round)
        self._driver = threading.Thread(target=self._drive, daemon=True, name="grpo-generation-lockstep")
        self._driver.start()

    # ---------------------------------------------------------------- GenerationBackend
    def generate(self, prompt_ids, seeds, *, greedy=False, max_new_tokens=None, stop_strings=None, sampling=None):
        return self._section(lambda: self.inner.generate(prompt_ids, seeds, greedy=greedy,
                                                         max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                                                         sampling=sampling))

    def lockstep_max(self, n_local: int) -> int:
        return self._section(lambda: self.inner.lockstep_max(n_local))

    def refit(self, engine) -> float:
        return self._section(lambda: self.inner.refit(engine))

    def load_staged(self, stage, mid_request: bool = False) -> int:
        return self._section(lambda: self.inner.load_staged(stage, mid_request))

    def generate_solo(self, profile: str, prompt_ids: list[list[int]], seeds: list[int], max_new_tokens: list[int],
                      stop_strings: list) -> list[GenerationOutput]:
        """An endpoint's batch (this trainer's only), generated in the next solo round of ``profile`` ("train" or
        "val") with whatever the other trainers' endpoints have of it."""
        solo = _Solo(profile, prompt_ids, seeds, max_new_tokens, stop_strings)
        with self._cond:
            self._raise_if_stopped()
            self._solos.append(solo)
            self._changed = True
            self._cond.notify_all()
        return solo.future.result()

    def close(self) -> None:
        """Stop every trainer's driver (at the next round), then close ``inner`` (trainer 0 tells the generation
        ranks to exit)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._driver is not threading.current_thread():
            self._driver.join(timeout=60)
        self.inner.close()

    def sleep(self) -> None:
        self.inner.sleep()

    def wake_up(self) -> None:
        self.inner.wake_up()

    # the rest is ``inner``'s (the base class's defaults would shadow it)
    loads_staged_weights = property(lambda self: self.inner.loads_staged_weights)
    broken = property(lambda self: self.inner.broken or self._stopped)
    stats = property(lambda self: self.inner.stats)
    memory = property(lambda self: self.inner.memory)
    device = property(lambda self: self.inner.device)
    stream = property(lambda self: self.inner.stream)

    @property
    def in_flight(self):
        return self.inner.in_flight

    @in_flight.setter
    def in_flight(self, fn) -> None:
        self.inner.in_flight = fn

    def __getattr__(self, name):
        if name == "inner":  # not set yet (a failed __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---------------------------------------------------------------- the calling threads' side
    def _section(self, call: Callable):
        """``call()`` (which uses ``inner``) in a section of this thread, once every trainer's same thread waits."""
        if self._owner == threading.get_ident():  # inside a section or a solo round: at once
            return call()
        section = _Section(threading.current_thread().name)
        with self._cond:
            self._raise_if_stopped()
            self._sections.append(section)
            self._changed = True
            self._cond.notify_all()
        section.granted.wait()
        if section.error is not None:
            from grpo.system.rollout import RolloutError

            raise RolloutError(section.error)
        self._owner = threading.get_ident()
        try:
            return call()
        finally:
            self._owner = None
            section.done.set()

    def _raise_if_stopped(self) -> None:
        if self._stopped is not None:
            from grpo.system.rollout import RolloutError

            raise RolloutError(self._stopped)

    # ---------------------------------------------------------------- the driver
    def _drive(self) -> None:
        with self.inner.device_context():  # the current device is per thread (a solo round's NCCL)
            self._rounds()

    def _rounds(self) -> None:
        round_no, last_was_section, why = 0, False, "the run is ending: no generation any more"
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._changed or self._closing, timeout=self.poll_s)
                    self._changed = False
                    state = (self._closing, sorted({s.stream for s in self._sections}),
                             sorted({s.profile for s in self._solos}))
                kind, what = pick_round(all_gather_objects([state], self.group), round_no, last_was_section)
                round_no += 1
                if kind == "stop":
                    break
                if kind == "section":
                    self._grant(what)
                elif kind == "solo":
                    self._solo_round(what)
                last_was_section = kind == "section"
        except Exception as err:  # a trainer is gone (its end of the group closed): nothing can generate any more
            why = f"the trainers' generation lockstep failed: {type(err).__name__}: {err}"
        finally:
            self._stop_all(why)

    def _grant(self, stream: str) -> None:
        with self._cond:
            section = next(s for s in self._sections if s.stream == stream)
            self._sections.remove(section)
        section.granted.set()
        section.done.wait()

    def _solo_round(self, profile: str) -> None:
        with self._cond:
            mine = [s for s in self._solos if s.profile == profile]
            self._solos = [s for s in self._solos if s.profile != profile]
        self._owner = threading.get_ident()
        try:
            outs = self.inner.generate([p for s in mine for p in s.prompts], [x for s in mine for x in s.seeds],
                                       max_new_tokens=[x for s in mine for x in s.max_new_tokens],
                                       stop_strings=[x for s in mine for x in s.stop_strings],
                                       sampling=self._profiles[profile])
        except Exception as err:  # the same error on every trainer (RemoteGeneration agrees on it): rounds go on
            for s in mine:
                s.future.set_exception(err)
            return
        finally:
            self._owner = None
        start = 0
        for s in mine:
            s.future.set_result(outs[start:start + len(s.prompts)])
            start += len(s.prompts)

    def _stop_all(self, why: str) -> None:
        """Fail everything waiting and every later call with ``why``."""
        from grpo.system.rollout import RolloutError

        with self._cond:
            self._stopped = why
            sections, solos = self._sections, self._solos
            self._sections, self._solos = [], []
        for s in sections:
            s.error = why
            s.granted.set()
        for s in solos:
            s.future.set_exception(RolloutError(why))
