"""Stopping on a signal without losing work (child processes that never outlive the trainer:
`grpo.tasks.pool.set_parent_death_signal`).

SIGTERM (what schedulers send before they kill: SLURM, Kubernetes, ``docker stop``), SIGINT (Ctrl-C), SIGHUP (the
ssh session or terminal closed), SIGUSR1 and SIGUSR2 (SLURM's ``--signal=USR1@120`` warning before the time limit)
only set a flag (`STOP_SIGNALS`). The loop checks it on every rank at each safe point of a step
(``any_rank(stop.requested())``: torchrun forwards a signal to all ranks, but one rank may see it a
phase earlier): before training, a step in progress is abandoned and the last finished step is saved (its
rollout is played again on resume, with the same seeds); during training, the step finishes and is saved.
Then the reward workers and the generation engine close and the process exits with `exit_status`. A second
Ctrl-C exits at once (status 130) for someone who does not want to wait for the save. A SIGHUP that was
ignored when the process started (``nohup``) stays ignored: the run goes on after the session closes.

Exit status of a stop by signal: 128 + the signal number, as a shell reports a process killed by it (143 for
SIGTERM, 130 for SIGINT), although the checkpoint is saved. Why not 0: the run has not finished (no final
export was written) and a scheduler or a ``train && evaluate`` chain must not take it for a finished run;
schedulers requeue or report a job stopped this way like one they killed, which is what it is. Rerunning the
same command resumes from the checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys

# Signals that stop the run with a checkpoint. SIGQUIT keeps Python's default (quit with a core dump: someone
# who sends it wants the process gone now); SIGKILL cannot be caught.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum`` (after its checkpoint): 128 + signum.

    >>> exit_status(signal.SIGTERM), exit_status(signal.SIGINT)
    (143, 130)
    """
    return 128 + int(signum)


class StopRequest:
    """Installs handlers of ``signals`` (`STOP_SIGNALS`) that set a flag (main thread only, as Python's `signal`
    requires); `close` puts the previous handlers back. A second SIGINT while a stop is pending exits at once
    with 130 (``os._exit``: no cleanup; child processes die with the trainer, see
    `grpo.tasks.pool.set_parent_death_signal`). A SIGHUP already ignored (``nohup``) is left ignored."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signum: int | None = None
        self._previous = {}
        for s in signals:
            if s == signal.SIGHUP and signal.getsignal(s) is signal.SIG_IGN:
                continue  # nohup: the user asked for the run to outlive the session
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            print("\nsecond Ctrl-C: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(exit_status(signal.SIGINT))
        if self.signum is None:
            self.signum = signum
            print(f"\nreceived {signal.Signals(signum).name}: stopping with a checkpoint at the next safe point "
                  "(before training: the last finished step; during training: this step) "
                  "(Ctrl-C again to exit at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def exit_status(self) -> int | None:
        """`exit_status` of the signal received, or None when none was."""
        return None if self.signum is None else exit_status(self.signum)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
