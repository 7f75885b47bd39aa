"""One writer per run folder (nanoflow/io/lock.py), locally and on S3, with real processes.

A second process really tries to take a lock a first one holds; holders really die by SIGKILL; a
busy holder is a real bin/train held still by SIGSTOP (so the second launch meets it mid-run on a
loaded machine, not by luck of timing). S3 is each of two real servers on loopback, moto's (s3_server.py)
and SeaweedFS's (seaweedfs_server.py), whose conditional writes (If-None-Match, If-Match) answer 412 as S3
does — the first test checks that.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, TRAIN_STEPS
from log_helpers import logged
from process_helpers import assert_every_rank_reports, bin_command, run_command, run_layout, train_args
from run_helpers import assert_same
from s3_helpers import split

from nanoflow.io import CheckpointError, LockLostError, RunLock, RunLockedError, confirm_held, read_checkpoint
from nanoflow.io.lock import LEASE_ENV, LOCK

HOST = socket.gethostname()


def acquire_in_child(root: str, *, then: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    """Another process tries to take the lock on `root`; prints OK <pid> or the error's class and message."""
    code = f"""
import os, signal, sys
from nanoflow.io import RunLock, CheckpointError
try:
    lock = RunLock.acquire({root!r}, run="child")
except CheckpointError as e:
    print(type(e).__name__, e)
    sys.exit(2)
print("OK", os.getpid(), flush=True)
{then}
"""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                          **(env or {})}, capture_output=True, text=True, timeout=600)


def killed_holder(root: str) -> int:
    """The pid of a process that took the lock on `root` and was then killed by SIGKILL, holding it."""
    result = acquire_in_child(root, then="os.kill(os.getpid(), signal.SIGKILL)")
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    return int(result.stdout.split()[1])


def read_lock(root: str, endpoint=None) -> dict | None:
    if endpoint is None:
        text = Path(root, LOCK).read_text()
        return json.loads(text) if text else None
    bucket, prefix = split(root)
    try:
        return json.loads(endpoint.client().get_object(Bucket=bucket, Key=f"{prefix}/{LOCK}")["Body"].read())
    except endpoint.client().exceptions.NoSuchKey:
        return None


@pytest.fixture(params=["local", "moto", "seaweedfs"])
def root(request, tmp_path):
    """A run folder: a local one, or an s3:// prefix on each real S3 server (conftest.py's s3_server)."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    endpoint = request.getfixturevalue("seaweedfs_endpoint" if request.param == "seaweedfs" else "s3_endpoint")
    if request.param == "seaweedfs":
        request.getfixturevalue("monkeypatch").setenv("AWS_ENDPOINT_URL", endpoint.url)
        return endpoint.make_bucket(), endpoint
    return request.getfixturevalue("s3_bucket"), endpoint


# ---------------------------------------------------------------------------------------------
# The lock itself

def test_the_s3_server_honours_conditional_writes(s3_server, s3_server_bucket):
    """What the lock needs of a server (docs/s3.md): PUT with If-None-Match: * and with If-Match, DELETE with
    If-Match, each answered 412 PreconditionFailed when its condition fails. moto and SeaweedFS both do."""
    from botocore.exceptions import ClientError

    client = s3_server.client()
    bucket, prefix = split(s3_server_bucket)
    key = f"{prefix}/probe"
    first = client.put_object(Bucket=bucket, Key=key, Body=b"1", IfNoneMatch="*")["ETag"]
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"0123"'}):
        with pytest.raises(ClientError) as caught:
            client.put_object(Bucket=bucket, Key=key, Body=b"2", **condition)
        assert caught.value.response["Error"]["Code"] == "PreconditionFailed"
    with pytest.raises(ClientError, match="PreconditionFailed"):
        client.delete_object(Bucket=bucket, Key=key, IfMatch='"0123"')
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"1"
    client.delete_object(Bucket=bucket, Key=key, IfMatch=first)
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix=key)


def test_a_second_process_is_refused_and_named_the_holder(root):
    root, endpoint = root
    lock = RunLock.acquire(root, run="first")
    try:
        record = read_lock(root, endpoint)
        assert (record["pid"], record["host"], record["run"]) == (os.getpid(), HOST, "first")
        result = acquire_in_child(root)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stdout.startswith("RunLockedError ")
        for part in (f"{root}/{LOCK}", f"pid {os.getpid()}", f"host {HOST}", "run 'first'", record["started"]):
            assert part in result.stdout, (part, result.stdout)
        # In this process too (a second train() beside the first): flock and If-None-Match are per holder.
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock.acquire(root, run="again")
    finally:
        assert lock.release() is None
    assert read_lock(root, endpoint) is None  # released: emptied locally, deleted on S3
    result = acquire_in_child(root)
    assert result.returncode == 0 and result.stdout.startswith("OK"), result.stdout + result.stderr
    assert read_lock(root, endpoint) is None  # a process that ends without releasing lets go at exit


def test_a_lock_whose_holder_was_killed_is_taken_over_at_once_and_said(root):
    root, endpoint = root
    dead = killed_holder(root)
    assert read_lock(root, endpoint)["pid"] == dead  # left behind: kill -9 runs no clean-up
    with logged() as said:
        lock = RunLock.acquire(root, run="next")
    try:
        assert len(said) == 1 and f"taking over {root}/{LOCK}" in said[0], said
        assert f"pid {dead} on host {HOST}" in said[0] and "its process is gone" in said[0]
        assert read_lock(root, endpoint)["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_lock_from_another_host_blocks_until_its_lease_lapses(root):
    """A lost node: its process cannot be checked from here, so only the lease tells that it is gone."""
    root, endpoint = root
    record = {"format": "nanoflow-lock/1", "run": "elsewhere", "host": "lost-node", "pid": 4242,
              "process_start": 1, "boot_id": "x", "pid_namespace": "pid:[1]", "started": "2026-01-01T00:00:00+00:00",
              "renewed": "2026-01-01T00:00:00+00:00", "token": "feed"}

    def renewed_by_the_lost_node(lease: float) -> None:
        data = json.dumps({**record, "lease_seconds": lease})
        if endpoint is None:
            Path(root).mkdir(parents=True, exist_ok=True)
            Path(root, LOCK).write_text(data)
        else:
            bucket, prefix = split(root)
            endpoint.client().put_object(Bucket=bucket, Key=f"{prefix}/{LOCK}", Body=data.encode())

    renewed_by_the_lost_node(lease=120)
    result = acquire_in_child(root)  # another process, while the lease runs
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pid 4242 on host lost-node" in result.stdout and "launch again in 1" in result.stdout, result.stdout
    renewed_by_the_lost_node(lease=1)  # its last renewal, and then the node is gone
    # Stale once the store's clock has moved a lease past the record's date (S3's in one-second steps): taken then,
    # refused until then - waited for by trying, not by a guess of how long it takes.
    deadline = time.monotonic() + 120
    with logged() as said:
        while True:
            try:
                lock = RunLock.acquire(root, run="next")
                break
            except RunLockedError as e:
                assert "lapses after 1s" in str(e) and time.monotonic() < deadline, e
                time.sleep(0.1)
    try:
        assert len(said) == 1 and "pid 4242 on host lost-node" in said[0] and "lease was not renewed" in said[0], said
    finally:
        lock.release()
    assert read_lock(root, endpoint) is None


def test_the_holder_renews_its_lease_and_a_lost_lock_is_never_released(root, monkeypatch):
    root, endpoint = root
    # Renewed every quarter of its lease: short enough to see renewals soon, long enough that a busy machine which
    # leaves the heartbeat waiting a few seconds does not let the lease lapse (that would be another test's case).
    monkeypatch.setenv(LEASE_ENV, "8")
    lock = RunLock.acquire(root, run="first")
    first = read_lock(root, endpoint)
    deadline = time.monotonic() + 120
    while (renewed := read_lock(root, endpoint))["renewed"] == first["renewed"]:   # the heartbeat's own renewal
        assert time.monotonic() < deadline, "the holder did not renew its lease"
        time.sleep(0.05)
    assert renewed["token"] == first["token"] and renewed["renewed"] > first["renewed"]
    confirm_held(root)  # still ours
    assert acquire_in_child(root).returncode == 2  # renewed: never stale, although the lease is short
    # Another run takes the lock over behind our back (as one would after our lease lapsed):
    stolen = {**renewed, "pid": 1, "run": "thief", "token": "0000"}
    if endpoint is None:
        Path(root, LOCK).write_text(json.dumps(stolen))
    else:
        bucket, prefix = split(root)
        endpoint.client().put_object(Bucket=bucket, Key=f"{prefix}/{LOCK}", Body=json.dumps(stolen).encode())
    with pytest.raises(LockLostError, match="taken over by run 'thief', pid 1"):
        confirm_held(root)
    assert "taken over by run 'thief'" in lock.release()
    assert read_lock(root, endpoint)["run"] == "thief"  # not deleted, not emptied: it is not ours


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_lease_setting_is_an_error(tmp_path, monkeypatch, value):
    monkeypatch.setenv(LEASE_ENV, value)
    with pytest.raises(CheckpointError, match=f"{LEASE_ENV} = '{value}'"):
        RunLock.acquire(str(tmp_path / "run"), run="x")


# ---------------------------------------------------------------------------------------------
# bin/train: the lock around a real run

def lock_args(tiny_toml: Path, url: str, *extra: str) -> list[str]:
    return [*train_args(url, "checkpoints.checkpoint_interval=2", config=tiny_toml), *extra]


def start_holder(tiny_toml: Path, url: str, cwd: Path, endpoint=None) -> subprocess.Popen:
    """bin/train on `url`, returned once it holds the lock (its record names its pid)."""
    process = subprocess.Popen(bin_command("train", *lock_args(tiny_toml, url)), cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if (read_lock(url, endpoint) or {}).get("pid") == process.pid:
                return process
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"bin/train never took the lock: {process.communicate()}")


def metrics_steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_launches_on_one_run_folder(root, tiny_toml, reference, tmp_path):
    url, endpoint = root
    first = start_holder(tiny_toml, url, tmp_path, endpoint)
    os.kill(first.pid, signal.SIGSTOP)  # busy mid-run, whatever the machine's load
    try:
        # A double submit, with another config: refused at once, naming the holder, writing nothing.
        second = run_command("train", *lock_args(tiny_toml, url, "--set", "general.seed=3"), cwd=tmp_path, timeout=600)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2, second.stdout + second.stderr
    for part in (f"{url}/{LOCK}", f"pid {first.pid} on host {HOST}", "run 'tiny'"):
        assert part in second.stderr, (part, second.stderr)
    assert "Traceback" not in second.stderr and "step" not in second.stdout
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out + err
    assert f"done: {TRAIN_STEPS} steps" in out
    # The first run's results are whole: one metrics line per step, in order, and the straight run's state.
    assert metrics_steps(Path(url) if endpoint is None else tmp_path / "runs" / "s3" / url[len("s3://"):]) == \
        list(range(1, TRAIN_STEPS + 1))
    assert_same(read_checkpoint(url).groups, reference)
    assert read_lock(url, endpoint) is None  # released at the end


@pytest.mark.slow
def test_a_killed_run_does_not_block_the_next_launch(root, tiny_toml, reference, tmp_path):
    url, endpoint = root
    first = start_holder(tiny_toml, url, tmp_path, endpoint)
    first.kill()  # SIGKILL: no clean-up at all
    first.communicate()
    assert read_lock(url, endpoint)["pid"] == first.pid
    again = run_command("train", *lock_args(tiny_toml, url), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"warning: taking over {url}/{LOCK} from run 'tiny', pid {first.pid} on host {HOST}" in again.stdout
    assert "its process is gone" in again.stdout
    assert_same(read_checkpoint(url).groups, reference)
    assert read_lock(url, endpoint) is None


@pytest.mark.slow
def test_plan_takes_no_lock_and_a_resume_only_reads_the_run_it_starts_from(tiny_toml, tmp_path):
    source = tmp_path / "source"
    done = run_command("train", *lock_args(tiny_toml, str(source), "--set", "tokens.train_steps=2"), cwd=tmp_path,
                       timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lock = RunLock.acquire(str(source), run="busy")  # the source run is being written by someone else
    try:
        plan = run_command("train", *lock_args(tiny_toml, str(source), "--plan"), timeout=600)
        assert plan.returncode == 0 and "pretrain" in plan.stdout, plan.stdout + plan.stderr
        branch = run_command("train", *lock_args(tiny_toml, str(tmp_path / "branch"), "--set", "tokens.train_steps=4",
                                                 "--set", f"checkpoints.resume_checkpoint_path={json.dumps(str(source))}"),
                             cwd=tmp_path, timeout=600)
        assert branch.returncode == 0, branch.stdout + branch.stderr
        assert f"resuming from {source}/2" in branch.stdout
        assert read_lock(str(source))["run"] == "busy"  # untouched
    finally:
        lock.release()


@pytest.mark.slow
def test_under_torchrun_every_rank_fails_with_the_holders_name(tmp_path):
    url = tmp_path / "run"
    lock = RunLock.acquire(str(url), run="holder")
    try:
        result = run_layout("dp2", url, timeout=600)
    finally:
        lock.release()
    assert result.returncode != 0
    assert_every_rank_reports(result.stderr, f"{url}/{LOCK} is held by run 'holder', pid {os.getpid()}")
    assert "]: Traceback" not in result.stderr
    assert not (url / "metrics.jsonl").exists() and not [p for p in url.iterdir() if p.name != LOCK]


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_releases_the_lock(tiny_toml, tmp_path):
    url = tmp_path / "run"
    first = start_holder(tiny_toml, str(url), tmp_path)
    deadline = time.monotonic() + 90
    while not (url / "metrics.jsonl").exists() or not (url / "metrics.jsonl").read_text():  # in the loop
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=600)
    assert "stopped by SIGTERM" in out, out + err
    assert read_lock(str(url)) is None
    again = run_command("train", *lock_args(tiny_toml, str(url)), cwd=tmp_path, timeout=600)
    assert again.returncode == 0 and "taking over" not in again.stdout, again.stdout + again.stderr


# ---------------------------------------------------------------------------------------------
# Records and files nanoflow did not write: refused or left alone, never trusted or deleted

@pytest.mark.parametrize("field, value", [("lease_seconds", "abc"), ("lease_seconds", None), ("pid", "12"),
                                          ("token", 7), ("host", ["x"])])
def test_a_lock_record_with_a_field_of_the_wrong_type_never_tracebacks(root, field, value):
    """Locally the flock proves nobody holds it: taken over, naming the field; on S3 nothing proves that, so
    the launch is refused, naming the lock and the field, and the object is left as it is."""
    root, endpoint = root
    record = {"format": "nanoflow-lock/1", "run": "odd", "host": "lost-node", "pid": 4242, "process_start": 1,
              "boot_id": "x", "pid_namespace": "pid:[1]", "started": "2026-01-01T00:00:00+00:00",
              "renewed": "2026-01-01T00:00:00+00:00", "token": "feed", "lease_seconds": 120.0, field: value}
    data = json.dumps(record).encode()
    if endpoint is None:
        Path(root).mkdir(parents=True)
        Path(root, LOCK).write_bytes(data)
        with logged() as said:
            lock = RunLock.acquire(root, run="next")
        lock.release()
        assert len(said) == 1 and f"taking over {root}/{LOCK}" in said[0] and f"field {field} = " in said[0], said
    else:
        bucket, prefix = split(root)
        endpoint.client().put_object(Bucket=bucket, Key=f"{prefix}/{LOCK}", Body=data)
        with pytest.raises(RunLockedError) as refused:
            RunLock.acquire(root, run="next")
        assert f"{root}/{LOCK}" in str(refused.value) and f"field {field} = " in str(refused.value), refused.value
        assert read_lock(root, endpoint) == record


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "precious.txt"
    run.mkdir()
    elsewhere.write_text("not nanoflow's\n")
    (run / LOCK).symlink_to(elsewhere)
    with pytest.raises(CheckpointError) as refused:
        RunLock.acquire(str(run), run="next")
    assert f"{run}/{LOCK}" in str(refused.value) and "symlink" in str(refused.value), refused.value
    assert elsewhere.read_text() == "not nanoflow's\n"
    (run / LOCK).unlink()
    (run / LOCK).symlink_to(tmp_path / "missing")  # a dangling one: nothing is created through it either
    with pytest.raises(CheckpointError):
        RunLock.acquire(str(run), run="next")
    assert not (tmp_path / "missing").exists()
