"""Running bin/* as a real process and signalling it at a moment the test chooses."""

from __future__ import annotations

import signal
import subprocess
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def with_dispositions(ignored=()):
    """A preexec_fn that starts the child with every stop signal at its default disposition but those in
    `ignored` (SIG_IGN): what a test means to test, not whatever pytest inherited (a background job of a
    non-interactive shell ignores SIGINT)."""
    def preexec():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN if s in ignored else signal.SIG_DFL)
    return preexec


def signal_when_ready(command: list[str], ready, signum: int, *, cwd, env=None, timeout: float = 60, ignored=()):
    """Start `command` (its stop signals at their default disposition, but `ignored`), poll ready(process)
    until it is true (the process still running, within `timeout` seconds), send `signum`, and wait for the
    end: (returncode, stdout, stderr). Never leaves it running."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=with_dispositions(ignored))
    try:
        deadline = time.monotonic() + timeout
        while not ready(process):
            assert process.poll() is None, f"{command[1]} exited early: {process.communicate()}"
            assert time.monotonic() < deadline, f"{command[1]} was not ready within {timeout} s"
            time.sleep(0.02)
        # Popen.send_signal does nothing to a process that has ended: say so, rather than assert on a run
        # that never got the signal
        assert process.poll() is None, f"{command[1]} ended before the signal was sent: {process.communicate()}"
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, stdout, stderr
