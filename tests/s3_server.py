"""A real S3 endpoint on loopback for the S3 tests: moto in server mode, in this process.

moto keeps its data in this process's memory, so the server can be stopped and started again on the same port
with its objects intact: that is how the tests simulate an outage in the middle of a save. The fixtures that start
it and point the AWS environment at it are conftest.py's (s3_endpoint, s3_bucket).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import uuid

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Client:
    """What the tests do with an S3 server on loopback (moto's here, SeaweedFS's in seaweedfs_server.py) through
    their own client: `url` is its endpoint."""

    url: str

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


class S3Endpoint(S3Client):
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
