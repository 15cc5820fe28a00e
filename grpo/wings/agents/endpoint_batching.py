"""The endpoint's generation windows and batcher (`Batching`, mixed into
`grpo.wings.agents.endpoint.Endpoint`).

Handlers put their prompts on a queue (`_Pending`); one batcher thread takes them while they keep coming (until none
has come for ``http_server.batch_window_s`` while the server reads or answers no other, or a full
``policy.generation_batch_size``: `Batching._gather`) and generates them in one `GenerationBackend.generate` call. It
generates only while the endpoint is open (`Batching.serving`: a rollout opens it; the synchronous loop changes the
weights while it is closed); a request no window takes within ``http_server.max_wait_s`` is answered 503
(`Batching.unavailable`). While the rollout's own samples generate, `Batching.shared` makes them and the batches take
turns on the backend.

Weight versions: a batch records the version the backend held when it started (``weight_version``); the async loop's
generation thread changes the weights through `Batching.load_weights`, which waits for the batch in flight, so no
batch generates while weights change and an answer is never labelled newer than the oldest weights that made it.
Windows nest and overlap (the generation thread's rollout and the trainer's validation in the async loop): the
endpoint is open while any window is.

Closing (`Batching.stop_batching`): no batch starts any more; the batch in flight ends on the backend (its requests
answered), or, past ``CLOSE_WAIT_S``, its requests are answered 503 while the backend call is still waited for: the
run closes the backend after the endpoint, never under a running batch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from grpo.wings.agents.lockstep import LockstepGeneration
from grpo.wings.agents.openai_chat import RequestError

logger = logging.getLogger(__name__)

# A batch waits for the requests the server is still reading or answering this long at most (`Batching._gather`).
BUSY_WAIT_S = 1.0
# How long `Batching.stop_batching` (the endpoint's close) waits for the batch in flight before it answers that
# batch's requests 503; it still waits for the backend call itself to return (the backend is closed after it).
CLOSE_WAIT_S = 60.0


@dataclass
class _Pending:
    prompt_ids: list[int]
    seed: int
    max_new_tokens: int
    stops: list[str]
    profile: str
    future: concurrent.futures.Future
    deadline: float  # time.monotonic() by which a window must have taken it, else 503
    media: dict | None = None  # its images as the model's tensors (a vision-language policy's), None without any


class _Shared:
    """``backend`` whose ``generate`` takes the endpoint's generation lock, so the rollout's own samples and the
    endpoint's batches take turns on one backend (`Endpoint.shared`); everything else is ``backend``'s."""

    def __init__(self, backend, lock: threading.Lock):
        self._backend, self._lock = backend, lock

    def generate(self, *args, **kwargs):
        with self._lock:
            return self._backend.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


class Batching:
    """The windows and the batcher of `grpo.wings.agents.endpoint.Endpoint` (its state: ``cfg``, ``_queue``,
    ``_inflight``, ``_open``, ``_windows`` and ``_window_lock``, ``_generating``, ``_closed_at``, ``_last_pause_s``,
    ``_stop``, ``_batcher``, ``backend``, ``profiles``, ``settings``, ``weight_version``)."""

    _running: list[_Pending] = []  # the batch the backend is generating now (set under ``_generating``)

    @contextmanager
    def serving(self, weight_version: int | None = None):
        """Generation open for the block (a rollout); closed again after the last open window ends, once the batch
        in flight is done, so the weights can change. ``weight_version``: the version the backend holds (its answers
        record it); None: unchanged (a window over weights someone else versions, `load_weights`)."""
        with self._window_lock:
            if weight_version is not None:
                with self._generating:  # never relabel a batch in flight
                    self.weight_version = int(weight_version)
            if self._windows == 0 and self._closed_at is not None:
                self._last_pause_s = time.monotonic() - self._closed_at
            self._windows += 1
            self._open.set()
        try:
            yield self
        finally:
            with self._window_lock:
                self._windows -= 1
                last = self._windows == 0
                if last:
                    self._open.clear()
            if last:
                with self._generating:  # the batch in flight finishes on these weights
                    self._closed_at = time.monotonic()

    def load_weights(self, load) -> int:
        """Change the served backend's weights: ``load()`` runs while no batch generates (it waits for the one in
        flight) and returns the version it loaded, which later answers record. The async loop's generation thread
        loads through this (`grpo.run.producer.RolloutProducer.load_newest`), inside a window or not."""
        with self._generating:
            self.weight_version = int(load())
            return self.weight_version

    def shared(self, backend):
        """``backend`` (the one the endpoint serves) for the rollout's own generation while the endpoint is open:
        its ``generate`` calls and the endpoint's batches take turns (`_Shared`)."""
        return _Shared(backend, self._generating)

    def unavailable(self) -> RequestError:
        """The 503 of a request that no generation window took within ``http_server.max_wait_s``; Retry-After is the
        last pause between two windows (rounded up), or max_wait_s before any pause was seen."""
        retry = math.ceil(max(1.0, self._last_pause_s if self._last_pause_s is not None else self.settings.max_wait_s))
        return RequestError(503, f"the run is not generating now (training, checkpointing or between rollouts): no "
                                 f"generation window opened within policy.generation.http_server.max_wait_s="
                                 f"{self.settings.max_wait_s:g} s; retry after {retry} s", kind="server_error",
                            code="generation_paused", headers={"Retry-After": str(retry)})

    def stop_batching(self) -> None:
        """The end of the endpoint's generation (its close): no batch starts any more, and this returns once none
        generates, so the backend can be closed after it. The batch in flight ends and is answered; one still
        generating after `CLOSE_WAIT_S` gets its requests answered 503 ``shutting_down`` (their clients need not
        wait), and its backend call is still waited for."""
        self._stop.set()
        self._open.set()  # let the batcher see the stop
        waited = 0.0
        while not self._generating.acquire(timeout=CLOSE_WAIT_S):  # a batch (or the rollout's own call) generates
            waited += CLOSE_WAIT_S
            running = list(self._running)
            logger.warning("endpoint: closing, the backend still generates after %g s (%d request(s) of the batch in "
                           "flight answered 503); it is not closed under that call: waiting for it", waited,
                           len(running))
            self._shut(running)
        self._generating.release()  # from here on the batcher sees the stop before it could generate
        if self._batcher is not None:
            self._batcher.join()

    # ---------------------------------------------------------------- the batcher
    def _drain(self) -> list[_Pending]:
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _expire(self, batch: list[_Pending]) -> list[_Pending]:
        """``batch`` less the requests past their deadline (answered 503, `unavailable`)."""
        now, keep = time.monotonic(), []
        for item in batch:
            if now >= item.deadline:
                _answer(item.future, error=self.unavailable())
            else:
                keep.append(item)
        return keep

    def _gather(self, batch: list[_Pending]) -> list[_Pending]:
        """``batch`` and the requests that keep coming: it closes once none has come for ``http_server.batch_window_s``
        while the server handles no other request (`_busy`; for `BUSY_WAIT_S` at most: a client that sends its body
        slowly cannot hold the others back), or once it holds ``policy.generation_batch_size`` (a
        full generation chunk: waiting gains nothing; it bounds the wait under a steady stream). Agents whose
        answers came back together send their next calls one by one while the server still writes the others'
        answers, over more than one window: a window counted from the first request split each turn of 64 agents
        into two batches ([1, 63], [14, 50]), each decoding in full (bench/bench_agents.py)."""
        http_server = self.settings  # policy.generation.http_server
        busy_until = time.monotonic() + BUSY_WAIT_S
        while len(batch) < self.cfg.policy.generation_batch_size:
            try:
                batch.append(self._queue.get(timeout=http_server.batch_window_s))
            except queue.Empty:
                if not self._busy(len(batch)) or time.monotonic() >= busy_until:
                    break
        return batch

    def _busy(self, gathered: int) -> bool:
        """Whether the server is handling a request that is not in the batch being gathered nor queued: one being
        read and rendered (it is coming) or an answer being written (its agent's next call likely is)."""
        return self._inflight > gathered + self._queue.qsize()

    def _batch_loop(self) -> None:
        with self.backend.device_context():  # the backend's device and stream (this thread's own start as cuda:0's)
            self._batches()

    def _batches(self) -> None:
        batch: list[_Pending] = []
        while not self._stop.is_set():
            if not batch:
                try:
                    batch.append(self._queue.get(timeout=0.2))
                except queue.Empty:
                    continue
            first_deadline_s = max(0.0, min(b.deadline for b in batch) - time.monotonic())
            if not self._open.wait(timeout=min(0.2, first_deadline_s)):  # no window by then: deadlines are checked
                batch = self._expire(batch + self._drain())
                continue
            batch = self._gather(batch)
            with self._generating:
                if self._stop.is_set():
                    break
                if not self._open.is_set():  # closed meanwhile (weights may change): the batch waits
                    batch = self._expire(batch)
                    continue
                self._running = batch
                for profile in ("train", "val"):
                    items = [b for b in batch if b.profile == profile]
                    if items:
                        self._generate(items, profile)
                batch = self._running = []
        self._shut(batch + self._drain())

    def _shut(self, items: list[_Pending]) -> None:
        """Answer ``items`` 503 ``shutting_down`` (the run is ending)."""
        for item in items:
            _answer(item.future, error=shutting_down())

    def _generate(self, items: list[_Pending], profile: str) -> None:
        version = self.weight_version  # (an in-flight update may raise it meanwhile)
        prompts, seeds = [i.prompt_ids for i in items], [i.seed for i in items]
        caps, stops = [i.max_new_tokens for i in items], [i.stops or None for i in items]
        media = [i.media for i in items]
        try:
            if isinstance(self.backend, LockstepGeneration):  # several trainers' endpoints: in the next solo round
                outs = self.backend.generate_solo(profile, prompts, seeds, caps, stops)
            else:
                outs = self._generate_profile(profile, prompts, seeds, caps, stops, media)
        except Exception as err:  # this batch's requests answer 500; the server goes on
            logger.warning("endpoint: generation failed: %s", err, exc_info=True)
            for i in items:
                _answer(i.future, error=err)
            return
        for i, out in zip(items, outs):
            _answer(i.future, (out, version))

    def _generate_profile(self, profile: str, prompts, seeds, caps, stops, media=None):
        """``backend.generate`` with the request's own sampling profile ("train" or "val"); ``media``: each prompt's
        images (None entries: text prompts), passed only when one has any (a backend that takes images: hf)."""
        with_images = {"media": media} if media and any(m is not None for m in media) else {}
        return self.backend.generate(prompts, seeds, max_new_tokens=caps, stop_strings=stops,
                                     sampling=self.profiles[profile], **with_images)


def shutting_down() -> RequestError:
    """The 503 of a request the endpoint cannot answer because the run is ending."""
    return RequestError(503, "the run is ending: its endpoint is shutting down", kind="server_error",
                        code="shutting_down")


def _answer(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Set ``future``'s result or error, unless its request is gone (cancelled): the batcher must outlive any
    request."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
