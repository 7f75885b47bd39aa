"""The tests' fixtures: a real S3 endpoint on loopback, and a snapshot of tiny.toml with its uninterrupted run.

A real S3 endpoint on loopback for the S3 tests: moto in server mode, in this process.

`s3_endpoint` (session) starts moto's ThreadedMotoServer on 127.0.0.1 and a free port and points the
standard AWS environment at it (AWS_ENDPOINT_URL, dummy credentials, region), so boto3 —
in this process and in any bin/train subprocess, which inherits the environment — talk to it and to
nothing else. Everything is restored when the session ends. `s3_bucket` (function) creates a fresh
bucket and yields an s3:// prefix inside it.

moto keeps its data in this process's memory, so the server can be stopped and started again on the
same port with its objects intact: that is how the tests simulate an outage in the middle of a save.

`tiny_toml` (module) is schedules/tiny.toml (it trains on the committed generated corpus, fixed under every test), and
`reference` (module) the uninterrupted run of it: what the S3 and lock tests compare their runs with, bit for bit.

`checkout_guard` (session, autouse) fails any test that reads the checkout's runs/ or hf/ or writes anywhere in it,
and the session when its files changed (tests/checkout_guard.py).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import uuid

import pytest

import checkout_guard as guard
from helpers import REPO, TINY, TRAIN_STEPS, quiet, tiny
from nanoflow.training.loop import train
from run_helpers import groups_of

SECRET_ACCESS_KEY = "testing"
AWS_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
    # Nothing from the developer's own AWS setup may leak in, and nothing may be looked up elsewhere.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    # boto3 clients built from the environment do not retry; nanoflow's own client never does (its store
    # retries each request itself, within a bound), so this concerns only the tests' other clients.
    "AWS_MAX_ATTEMPTS": "1",
    "AWS_RETRY_MODE": "standard",
}
AWS_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN",
             "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE")


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Endpoint:
    """moto's server on 127.0.0.1:port, which can be stopped (really: no new connections, none kept alive)
    and started again with its data, and told to stop itself when a given request arrives."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._server = None
        self._lock = threading.Lock()
        self._stop_when = None
        self.stopped_by: str | None = None   # "METHOD PATH" of the request that stopped the server
        self.requests: list[tuple[str, str, str | None]] = []   # (method, path, Range header) of each request
        self._faults: list[list] = []   # [predicate(method, path, query), answers left, status, S3 error code]
        self.faulted = 0                # requests answered with an injected error so far
        self._drops: list[list] = []    # [predicate(method, path, query), answers left, bytes sent]

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        assert self._server is None, "already running"
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        werkzeug_server = server._server  # the werkzeug server ThreadedMotoServer runs: wrap its WSGI app
        werkzeug_server.app = self._middleware(werkzeug_server.app)
        self._server = server

    def stop(self) -> None:
        """Stop serving: close the listening socket too (ThreadedMotoServer.stop alone leaves it bound, so new
        connections would hang instead of being refused, and the port could not be bound again)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()
            server._server.server_close()

    def stop_when(self, predicate) -> None:
        """Stop the server when a request with predicate(method, path) arrives; that request's connection is
        reset, unanswered, as if the server had died while it was in flight. None clears it."""
        self._stop_when = predicate
        self.stopped_by = None

    def fail(self, times: int, predicate=lambda method, path, query: True, status: int = 503,
             code: str = "SlowDown") -> None:
        """Answer the next `times` requests with predicate(method, path, query) with an S3 error (by default
        503 SlowDown, S3's throttling), as a real endpoint under load does; then serve normally again."""
        self._faults.append([predicate, times, status, code])

    def drop_mid_body(self, times: int, predicate=lambda method, path, query: True, *, sent: int = 0) -> None:
        """Answer the next `times` requests with predicate(method, path, query) with their real headers and
        only the first `sent` bytes of their body, then close the connection: a download that breaks off."""
        self._drops.append([predicate, times, sent])

    def _dropping(self, method: str, path: str, query: str) -> int | None:
        for drop in self._drops:
            if drop[1] > 0 and drop[0](method, path, query):
                drop[1] -= 1
                return drop[2]
        return None

    def _fault(self, method: str, path: str, query: str):
        for fault in self._faults:
            if fault[1] > 0 and fault[0](method, path, query):
                fault[1] -= 1
                self.faulted += 1
                return fault[2], fault[3]
        return None

    def _middleware(self, app):
        endpoint = self

        def wrapped(environ, start_response):
            predicate = endpoint._stop_when
            method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
            endpoint.requests.append((method, path, environ.get("HTTP_RANGE")))
            if endpoint._server is None or (predicate is not None and predicate(method, path)):
                if endpoint._server is not None:
                    endpoint._stop_when = None
                    endpoint.stopped_by = f"{method} {path}"
                    endpoint.stop()
                # A connection kept alive from before the stop, or the triggering request: reset it.
                connection = environ["werkzeug.socket"]
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                connection.shutdown(socket.SHUT_RDWR)
                raise ConnectionAbortedError("S3 test endpoint stopped")
            fault = endpoint._fault(method, path, environ.get("QUERY_STRING", ""))
            if fault is not None:
                status, code = fault
                body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected by '
                        f'the test</Message><RequestId>0</RequestId></Error>').encode()
                environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # the request whole, then answer
                start_response(f"{status} {code}", [("Content-Type", "application/xml"),
                                                    ("Content-Length", str(len(body)))])
                return [body]
            sent = endpoint._dropping(method, path, environ.get("QUERY_STRING", ""))
            if sent is not None:
                body = b"".join(app(environ, start_response))   # headers as they are, Content-Length whole

                def broken_off():
                    yield body[:sent]
                    connection = environ["werkzeug.socket"]
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    connection.shutdown(socket.SHUT_RDWR)
                    raise ConnectionAbortedError("S3 test endpoint dropped the connection mid-body")

                return broken_off()
            return app(environ, start_response)

        return wrapped

    def client(self):
        """A boto3 S3 client bound to this endpoint explicitly (not through the environment)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key=SECRET_ACCESS_KEY,
                            config=Config(retries={"total_max_attempts": 2, "mode": "standard"}, connect_timeout=5,
                                          read_timeout=30))

    def make_bucket(self, prefix: str = "runs/s3") -> str:
        bucket = f"nanoflow-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=bucket)
        return f"s3://{bucket}/{prefix}"


@pytest.fixture(scope="session")
def s3_endpoint():
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    saved = {k: os.environ.get(k) for k in (*AWS_ENVIRONMENT, *AWS_UNSET, "AWS_ENDPOINT_URL")}
    endpoint = S3Endpoint(_free_port())
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


@pytest.fixture(scope="module")
def tiny_toml():
    return TINY


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_toml):
    """The uninterrupted run: schedules/tiny.toml, 12 steps, locally, saved only at the end."""
    run_folder = tmp_path_factory.mktemp("reference") / "run"
    state = train(tiny(run_folder, "checkpoints.checkpoint_interval=100", schedule=tiny_toml), out=quiet(), fresh=True)
    assert state.step == TRAIN_STEPS
    return groups_of(state)
