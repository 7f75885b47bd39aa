"""Stopping on request: Ctrl-C, SIGTERM (a scheduler's preemption) or SIGUSR1 ask the loop to stop after the
current step and save; a second Ctrl-C stops at once. Its own module because it is neither display
(observe/progress.py) nor the loop's order of work: it owns the signal handlers and the ranks' agreement.

The rule for the whole process (docs/resume.md, "Signals"):
- during start-up (imports, config, data, restore: before the loop) Ctrl-C stops at once (130), SIGTERM
  and SIGUSR1 too, with 75: nothing was trained since the last committed checkpoint, so requeue;
- in the loop, the first signal stops after the current step and saves (75), a second Ctrl-C at once (130);
- once the last step's checkpoint is committed, nothing stops the run any more: it ends with 0;
- a signal the process inherited as ignored (SIG_IGN: a background job of a non-interactive shell ignores
  SIGINT, `nohup` SIGHUP) stays ignored for the whole run: the parent said it is not for this process.

No torch at import: bin/* install the start-up handlers before torch is imported.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

# The stop signals this process was started with ignored, once a command installed its start-up handlers (None: none
# did, a library user's process). A fact of the process, not of a run: a signal's disposition is the process's, and
# it was the parent's to give; bin/sweep's runs, one after another in one process, all keep it. Whether a run is
# finished is its StopRequest's (`finished`), never a module's.
_inherited_ignored: set | None = None


class StoppedAtStartUp(BaseException):
    """SIGTERM or SIGUSR1 before the loop began: stop at once (a BaseException, like KeyboardInterrupt, so
    that no `except Exception` on the way takes it for an error)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def install_start_up_handlers() -> None:
    """For a process that runs one command (bin/*): Ctrl-C, SIGTERM and SIGUSR1 stop its start-up at once
    (KeyboardInterrupt, StoppedAtStartUp), and nothing once the run is finished; a signal inherited as
    ignored is left ignored. Installed for the process's life: the loop's own handlers sit on top. Called again
    (bin/sweep, before and after each of its runs: a finished run ignores every signal from then on), it installs
    them anew, over a finished run's ignore, but never over a signal the process inherited as ignored."""
    global _inherited_ignored
    pid = os.getpid()
    if _inherited_ignored is None:
        _inherited_ignored = {s for s in STOP_SIGNALS if signal.getsignal(s) == signal.SIG_IGN}

    def at_start_up(signum, _frame):
        if os.getpid() != pid:  # a forked worker (datasets' map): the signal's usual end, not ours
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise StoppedAtStartUp(signal.Signals(signum).name)

    for s in STOP_SIGNALS:
        if s not in _inherited_ignored:
            signal.signal(s, at_start_up)


def reinstall_start_up_handlers() -> None:
    """install_start_up_handlers again, in a process that installed them (a command: bin/sweep between its runs);
    nothing elsewhere (a library user's process, a test's)."""
    if _inherited_ignored is not None:
        install_start_up_handlers()


def mark_finished() -> None:
    """The run's last checkpoint is committed (or its --until-step one): in a process that runs a command (its
    start-up handlers installed) no stop signal stops it from now on — ignored until it exits, or until bin/sweep
    installs the start-up handlers again for its next run. A library user's handlers are left as they are (the
    loop's own handler answers nothing once its StopRequest is finished)."""
    if _inherited_ignored is not None:
        ignore_from_now()


def ignore_from_now() -> None:
    """For a process whose run is finished: ignore every stop signal until it exits (its teardown included)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class StopRequest:
    """Why the run stops after a step: the planned stop (`until_step`: stop there, the schedule unchanged) or a
    signal; and what it says when it does. Under torchrun the ranks may see a signal at different steps, so
    they agree each step (one tiny all-reduce) and all stop, and save, after the same one.
    """

    def __init__(self, topology=None, *, until_step: int | None = None, train_steps: int | None = None):
        from nanoflow.parallel.mesh import SINGLE
        self.requested: str | None = None
        self.topology = SINGLE if topology is None else topology
        self.until_step, self.train_steps = until_step, train_steps
        self.finished = False   # the run's last checkpoint (or its until_step one) is committed: no signal stops it

    def nothing_to_do(self, completed: int) -> bool:
        """Whether a run whose `completed` steps are done has nothing left to train (said, for a planned stop
        already passed; a finished run's restore has said so already)."""
        if self.train_steps is not None and completed >= self.train_steps:
            return True
        if self._planned(completed):
            log.info(f"nothing to do: step {completed} is done, at or after until_step = {self.until_step}")
            return True
        return False

    def after(self, step: int) -> str | None:
        """Why every rank stops after `step` (the planned stop, or a signal to any of them); None to go on."""
        if self._planned(step):
            self.requested = self.requested or f"until_step = {self.until_step} (a planned stop, not a signal)"
        return self.agreed()

    def agreed(self) -> str | None:
        """The stop asked for, agreed by every rank: this rank's reason, or another's signal."""
        from nanoflow.parallel.agree import any_rank
        return (self.requested or "a signal to another rank") if any_rank(bool(self.requested), self.topology) else None

    def saved(self, step: int, folder: str | None) -> None:
        """The checkpoint of `step` is committed (`folder`): when that is the run's last step or its planned stop,
        no signal stops the run from now on."""
        if folder is not None and (step == self.train_steps or self._planned(step)):
            self.finished = True
            mark_finished()

    def message(self, step: int) -> str:
        """What the run says when it stops after `step`."""
        if self._planned(step):
            return (f"stopped after step {step} of {self.train_steps} as asked (until_step = {self.until_step}), "
                    "schedule unchanged; run again without it, or with a later one, to go on from the checkpoint "
                    "just saved")
        return (f"stopped by {self.requested or 'a signal to another rank'} after step {step} of {self.train_steps}; "
                "run the same command again to resume from the checkpoint just saved")

    def _planned(self, step: int) -> bool:
        return self.until_step is not None and step >= self.until_step

    def _handle(self, signum, _frame):
        if self.finished:
            return
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def installed(self):
        """The loop's handlers inside the block, for every stop signal not inherited as ignored."""
        stop = self

        class _Installed:
            def __enter__(self):
                self.previous = {s: signal.signal(s, stop._handle) for s in STOP_SIGNALS
                                 if signal.getsignal(s) != signal.SIG_IGN}

            def __exit__(self, *exc):
                for s, handler in self.previous.items():
                    signal.signal(s, handler)
                if stop.finished:   # the start-up handlers just restored would stop a finished run: ignored again
                    mark_finished()

        return _Installed()
