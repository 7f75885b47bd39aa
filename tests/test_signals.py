"""The signal rule of the whole process (nanoflow/signals.py, docs/resume.md "Signals"), in torch-free child
interpreters (nanoflow.signals imports no torch), each started with the disposition it means to test."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from helpers import REPO
from process_helpers import with_dispositions

_CHILD = """
import os, signal, sys
from nanoflow import signals
signals.install_start_up_handlers()
what = sys.argv[1]
try:
    if what == "loop":
        with signals.StopRequest().installed():
            request = signals.StopRequest()
        stop = signals.StopRequest()
        with stop.installed():
            os.kill(os.getpid(), signal.SIGINT)
        print("loop request:", stop.requested)
    if what == "finished":
        signals.mark_finished()
        for s in signals.STOP_SIGNALS:
            os.kill(os.getpid(), s)
        signals.ignore_from_now()
        for s in signals.STOP_SIGNALS:
            os.kill(os.getpid(), s)
    if what == "start-up":
        os.kill(os.getpid(), int(sys.argv[2]))
    print("went on")
except KeyboardInterrupt:
    print("KeyboardInterrupt")
except signals.StoppedAtStartUp as e:
    print("stopped at start-up by", e.name)
"""


def _child(*args, ignored=()):
    result = subprocess.run([sys.executable, "-c", _CHILD, *map(str, args)], cwd=REPO, capture_output=True,
                            text=True, timeout=30, preexec_fn=with_dispositions(ignored))
    assert result.returncode == 0 and not result.stderr, result
    return result.stdout.strip().splitlines()


@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "KeyboardInterrupt"),
                                          (signal.SIGTERM, "stopped at start-up by SIGTERM"),
                                          (signal.SIGUSR1, "stopped at start-up by SIGUSR1")])
def test_a_stop_signal_at_start_up_stops_at_once(signum, said):
    assert _child("start-up", int(signum)) == [said]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_inherited_as_ignored_is_ignored_at_start_up(signum):
    assert _child("start-up", int(signum), ignored=[signum]) == ["went on"]


def test_the_loop_handles_sigint_by_default_and_leaves_an_inherited_ignore_alone():
    assert _child("loop") == ["loop request: SIGINT", "went on"]
    assert _child("loop", ignored=[signal.SIGINT]) == ["loop request: None", "went on"]


def test_a_finished_run_is_stopped_by_no_signal():
    assert _child("finished") == ["went on"]
