"""tests/unit trains no whole run: a guard fails a unit test that does, so the quick tree stays quick.

A unit test may build a tiny model and call nanoflow.train_step itself; what it may not do, in its setup (the
session and module fixtures it sets up included), its call or its teardown, is run the training loop (nanoflow's
loop calls `nanoflow.training.loop.train_step`, which this conftest wraps: bin/train, verify-resume and sweep
run in this process all go through it) or start bin/train, bin/verify-resume, bin/sweep or torchrun as a process
(an audit hook on subprocess.Popen). Such a test belongs in tests/e2e (docs/design.md, "Testing").

pytest calls the runtest hooks below only for the items of this folder, so tests/e2e, run in the same process,
is not guarded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import nanoflow.training.loop as loop

# Started as a process, these train a whole run (or several): the e2e tree's. bin/NAME, its installed script, torchrun.
_TRAINING_COMMANDS = ("train", "verify-resume", "sweep")
_LAUNCHERS = ("torchrun", *(f"nanoflow-{name}" for name in _TRAINING_COMMANDS))


class _Guard:
    test: str | None = None          # the unit test whose setup, call or teardown runs now
    seen: list[str] = []             # what it did that a unit test may not, even if the error was caught


def _refuse(what: str) -> None:
    if _Guard.test is not None:
        _Guard.seen.append(what)
        raise AssertionError(f"{_Guard.test} {what}: a test that trains a whole run belongs in tests/e2e "
                             "(tests/unit/conftest.py)")


# The loop's step, wrapped once for the session; a rename in loop.py must fail here loudly, not switch the guard off.
assert callable(getattr(loop, "train_step", None)), \
    "nanoflow.training.loop no longer calls train_step by that name: point tests/unit/conftest.py's guard at the loop"
_loop_step = loop.train_step


def _guarded_step(*args, **kwargs):
    _refuse("ran the training loop")
    return _loop_step(*args, **kwargs)


loop.train_step = _guarded_step


def _trains(argv) -> bool:
    if not isinstance(argv, list | tuple):   # a shell command line: not how the tests start bin/*
        return False
    paths = [Path(os.fsdecode(a)) for a in argv]
    return any(p.name in _LAUNCHERS or (p.name in _TRAINING_COMMANDS and p.parent.name == "bin") for p in paths) \
        or "torch.distributed.run" in [p.name for p in paths]


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and _Guard.test is not None and _trains(args[1]):
        _refuse(f"started {' '.join(map(os.fsdecode, args[1]))}")


sys.addaudithook(_audit)   # a hook cannot be removed: outside a unit test's phases it lets everything pass


def _phase(item):
    _Guard.test, _Guard.seen = item.nodeid, []
    try:
        result = yield
    finally:
        seen, _Guard.test = _Guard.seen, None
    if seen:   # raised inside the test and caught there: still a whole run trained, or begun
        pytest.fail(f"{item.nodeid}: {'; '.join(seen)}: a test that trains a whole run belongs in tests/e2e "
                    "(tests/unit/conftest.py)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _phase(item))
