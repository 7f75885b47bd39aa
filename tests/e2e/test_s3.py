"""Checkpoints on S3 behave as they do locally, against a real S3 endpoint on loopback (moto's server, see s3_server.py).

Nothing of nanoflow is mocked: io/store.py talks to the endpoint through boto3, configured only by the
standard AWS environment the `s3_endpoint` fixture sets. The tests look at the bucket with their own boto3
client, bound to the endpoint explicitly.

Every run is compared, bit for bit, with one uninterrupted local run of schedules/tiny.toml (its data is generated
and committed, so it is the same for every run compared).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import time
import warnings
from pathlib import Path

import helpers
import pytest
import torch
from helpers import TRAIN_STEPS
from log_helpers import logged
from process_helpers import run_command, sets, train_args
from run_helpers import assert_same, groups_of
from s3_helpers import copy_run, get, keys, split, step_folders

from nanoflow.io import CheckpointError, latest, read_checkpoint, read_metadata, read_model, save_checkpoint
from nanoflow.io.store import Store, StoreError
from nanoflow.parallel.shards import MOMENTS, STEP
from nanoflow.training.loop import train

FILES = ("checkpoint_metadata.json", "model/rank00000.safetensors", "optimizer/rank00000.safetensors")


def tiny(tiny_toml: Path, checkpoints_path: str, *overrides: str):
    return helpers.tiny(checkpoints_path, *overrides, schedule=tiny_toml)


def run(config, **kwargs):
    """train() in this process; returns (state, printed output)."""
    out = io.StringIO()
    state = train(config, out=out, **kwargs)
    return state, out.getvalue()


# ---------------------------------------------------------------------------------------------
# Shared runs (the uninterrupted `reference` and the `tiny_toml` snapshot are conftest.py's)

@pytest.fixture(scope="module")
def s3_run(s3_endpoint, tmp_path_factory, tiny_toml, reference):
    """tiny on S3, saving every 4 steps, stopped after step 6 and resumed: commits 4, 6, 8, 12.

    Returns (run url, state groups after the first part, state groups at the end, output of the resume)."""
    url = s3_endpoint.make_bucket()
    config = tiny(tiny_toml, url, "checkpoints.checkpoint_interval=4")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("s3_run"))  # metrics.jsonl of an s3:// run goes to ./runs/s3/<bucket>/<prefix>
        first, _ = run(config, until_step=6)
        assert first.step == 6
        final, out = run(config)
    return url, groups_of(final), out


# ---------------------------------------------------------------------------------------------
# In-process tests

def test_the_endpoint_is_the_local_server(s3_endpoint, s3_bucket):
    import boto3

    assert os.environ["AWS_ENDPOINT_URL"] == s3_endpoint.url and s3_endpoint.url.startswith("http://127.0.0.1:")
    assert boto3.client("s3").meta.endpoint_url == s3_endpoint.url  # what io.py's own client uses
    Store(s3_bucket).write("probe/object.bin", b"local")  # through nanoflow's store
    assert keys(s3_endpoint, s3_bucket) == {"probe/object.bin": 5}  # seen by a client bound to the endpoint
    assert Store(s3_bucket).read("probe/object.bin") == b"local"


def test_save_and_resume_on_s3_equals_an_uninterrupted_local_run(s3_run, reference):
    url, final, out = s3_run
    assert f"resuming from {url}/6: step 6 done, next step 7" in out
    assert_same(final, reference)
    names = {name.split(".", 1)[1] for name in final["optimizer"]}
    assert names == set(final["model"])  # every parameter has its moments …
    assert {name.split(".", 1)[0] for name in final["optimizer"]} == {*MOMENTS, STEP}  # … all three of them
    assert len(final["optimizer"]) == 3 * len(final["model"])


def test_layout_and_readers_on_s3(s3_endpoint, s3_run, reference):
    url, _, _ = s3_run
    objects = keys(s3_endpoint, url)
    assert get(s3_endpoint, url, "latest.txt").decode().strip() == "12"
    for step in (4, 6, 8, 12):
        for name in FILES:
            assert f"{step}/{name}" in objects, (step, name, sorted(objects))
        meta = json.loads(get(s3_endpoint, url, f"{step}/checkpoint_metadata.json"))
        assert meta["step"] == step
        assert {f"{step}/{name}" for name in meta["files"]} | {f"{step}/checkpoint_metadata.json",
                                                               f"{step}/.nanoflow-save"} == \
            {k for k in objects if k.startswith(f"{step}/")}  # nothing missing, nothing stray
        for name, entry in meta["files"].items():  # the sizes recorded are the sizes stored
            assert objects[f"{step}/{name}"] == entry["bytes"], name
    assert not [k for k in objects if ".tmp" in k]  # no local-style temporaries on S3

    assert latest(url) == f"{url}/12"
    assert latest(f"{url}/8") == f"{url}/8"
    assert latest(f"{url}/8/") == f"{url}/8"
    assert read_metadata(url)["step"] == 12
    assert read_metadata(f"{url}/8")["step"] == 8
    assert read_metadata(f"{url}/8")["training"]["completed"] == 8
    assert_same({"model": read_model(url)}, reference, groups=("model",))
    assert_same(read_checkpoint(url).groups, reference)
    eight = read_model(f"{url}/8")
    assert eight.keys() == reference["model"].keys()
    assert any(not torch.equal(eight[n], reference["model"][n]) for n in eight)  # really step 8, not 12
    assert read_checkpoint(f"{url}/6").metadata["step"] == 6


def test_no_credentials_or_endpoint_in_checkpoints(s3_endpoint, s3_run):
    url, _, _ = s3_run
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    endpoint = s3_endpoint.url.encode()
    host_port = f"127.0.0.1:{s3_endpoint.port}".encode()
    for relative in keys(s3_endpoint, url):
        data = get(s3_endpoint, url, relative)
        for needle in (secret, endpoint, host_port):
            assert needle not in data, (relative, needle)
    meta = read_metadata(url)
    assert meta["config"]["checkpoints"]["checkpoints_path"] == url
    text = json.dumps(meta)
    assert "AWS_" not in text and "aws_secret" not in text.lower()


@pytest.mark.parametrize("damage", ["delete newest metadata", "flip bytes in newest model file"])
def test_damaged_newest_checkpoint_falls_back_on_s3(s3_endpoint, s3_run, s3_bucket, tiny_toml, reference, damage,
                                                    monkeypatch, tmp_path):
    source, _, _ = s3_run
    url = s3_bucket
    copy_run(s3_endpoint, source, url)
    bucket, prefix = split(url)
    client = s3_endpoint.client()
    if damage == "delete newest metadata":
        client.delete_object(Bucket=bucket, Key=f"{prefix}/12/checkpoint_metadata.json")
        reason = rf"{url}/12 is incomplete \(no checkpoint_metadata.json\)"
        with logged() as warned:
            assert latest(url) == f"{url}/8"
        assert any(re.search(reason, w) for w in warned), warned
    else:
        name = "12/model/rank00000.safetensors"
        data = bytearray(get(s3_endpoint, url, name))
        data[-64:] = bytes(b ^ 0xFF for b in data[-64:])  # same size: only the checksum can tell
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=bytes(data))
        reason = rf"{url}/12/model/rank00000.safetensors is damaged"
        with pytest.raises(CheckpointError, match=reason):  # an explicit step folder never falls back
            read_model(f"{url}/12")

    with logged() as warned:
        checkpoint = read_checkpoint(url)
    assert checkpoint.path == f"{url}/8" and checkpoint.metadata["step"] == 8
    assert any(re.search(reason, w) for w in warned), warned
    assert any(f"using {url}/8" in w for w in warned), warned

    # Resuming the run falls back the same way, says so, and ends where the uninterrupted run ends.
    monkeypatch.chdir(tmp_path)
    state, out = run(tiny(tiny_toml, url, "checkpoints.checkpoint_interval=4"))
    assert "warning:" in out and f"{url}/12" in out, out
    assert f"resuming from {url}/8: step 8 done" in out, out
    assert_same(groups_of(state), reference)
    assert_same(read_checkpoint(url).groups, reference)  # and the rewritten step 12 is intact
    assert get(s3_endpoint, url, "latest.txt").decode().strip() == "12"


def test_retention_on_s3_keeps_the_newest_committed_steps(s3_endpoint, s3_bucket, tiny_toml, reference, monkeypatch,
                                                         tmp_path):
    monkeypatch.chdir(tmp_path)
    url = s3_bucket
    state, out = run(tiny(tiny_toml, url, "checkpoints.checkpoint_interval=2", "checkpoints.keep=2"))
    assert state.step == TRAIN_STEPS
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("saved step")] == \
        [f"saved step {s}" for s in range(2, 13, 2)]
    assert step_folders(s3_endpoint, url) == {"10", "12"}
    objects = keys(s3_endpoint, url)
    assert {k.split("/", 1)[0] for k in objects} == {"10", "12", "latest.txt"}
    assert all(f"{s}/{name}" in objects for s in (10, 12) for name in FILES)
    assert get(s3_endpoint, url, "latest.txt").decode().strip() == "12"
    assert_same(read_checkpoint(url).groups, reference)


# ---------------------------------------------------------------------------------------------
# bin/train as a subprocess, against an endpoint that goes away / a trainer that is killed

def bin_train(tiny_toml: Path, url: str, cwd: Path, *, fail_fast: bool = False, env: dict | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    # The AWS_* variables the s3_endpoint fixture set are inherited; fail_fast: one try per S3 request.
    fast = {"NANOFLOW_S3_ATTEMPTS": "1"} if fail_fast else {}
    return run_command("train", *train_args(url, "checkpoints.checkpoint_interval=2", config=tiny_toml), cwd=cwd,
                       env={**fast, **(env or {})}, timeout=timeout)


def assert_committed_state_is_loadable(endpoint, url: str) -> int:
    """Whatever latest.txt names loads (or an older intact step does, with a warning); returns its step."""
    named = int(get(endpoint, url, "latest.txt").decode().strip())
    with warnings.catch_warnings(record=True) as caught, logged() as warned:
        warnings.simplefilter("always")
        checkpoint = read_checkpoint(url)
    step = checkpoint.metadata["step"]
    if step != named:
        assert any(f"{url}/{named}" in w for w in warned), warned
    assert not caught, [str(w.message) for w in caught]   # nanoflow's warnings are logged, never Python warnings
    return step


@pytest.mark.slow
def test_endpoint_stopped_mid_save_then_resume(s3_endpoint, s3_bucket, tiny_toml, reference, tmp_path):
    url = s3_bucket
    # The server dies as the trainer starts uploading step 4's optimizer file: step 2 is committed,
    # step 4's model file has landed, its optimizer file and metadata never will.
    s3_endpoint.stop_when(lambda method, path: method == "PUT" and path.endswith("/4/optimizer/rank00000.safetensors"))
    started = time.monotonic()
    result = bin_train(tiny_toml, url, tmp_path, fail_fast=True)
    assert result.returncode != 0, result.stdout + result.stderr
    assert s3_endpoint.stopped_by is not None and not s3_endpoint.running
    assert "saved step 2:" in result.stdout and "saved step 4:" not in result.stdout, result.stdout
    assert time.monotonic() - started < 60  # failed, did not hang

    s3_endpoint.start()  # same port, same objects
    objects = keys(s3_endpoint, url)
    assert "2/checkpoint_metadata.json" in objects
    assert "4/model/rank00000.safetensors" in objects and "4/checkpoint_metadata.json" not in objects
    assert assert_committed_state_is_loadable(s3_endpoint, url) == 2
    assert latest(url) == f"{url}/2"

    result = bin_train(tiny_toml, url, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resuming from {url}/2: step 2 done" in result.stdout, result.stdout
    checkpoint = read_checkpoint(url)
    assert checkpoint.metadata["step"] == TRAIN_STEPS
    assert_same({"model": read_model(f"{url}/12")}, reference, groups=("model",))
    assert_same(checkpoint.groups, reference)
    assert "4/checkpoint_metadata.json" in keys(s3_endpoint, url)


@pytest.mark.slow
def test_trainer_killed_mid_upload_then_resume(s3_server, s3_server_bucket, tiny_toml, reference, monkeypatch,
                                               tmp_path):
    url, s3_endpoint = s3_server_bucket, s3_server
    monkeypatch.chdir(tmp_path)
    run(tiny(tiny_toml, url, "checkpoints.checkpoint_interval=2"), until_step=2)  # step 2 committed
    assert get(s3_endpoint, url, "latest.txt").decode().strip() == "2"

    # Killed (SIGKILL) 100 bytes into the upload of step 4's optimizer file, its model file having landed:
    # NANOFLOW_KILL_AFTER_BYTES counts the checkpoint bytes the process writes, across files.
    model_bytes = read_metadata(url)["files"]["model/rank00000.safetensors"]["bytes"]
    result = bin_train(tiny_toml, url, tmp_path, env={"NANOFLOW_KILL_AFTER_BYTES": str(model_bytes + 100)})
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    assert "resuming from" in result.stdout and "saved step 4" not in result.stdout
    objects = keys(s3_endpoint, url)
    assert objects.get("4/model/rank00000.safetensors") == model_bytes
    assert "4/optimizer/rank00000.safetensors" not in objects and "4/checkpoint_metadata.json" not in objects
    bucket, prefix = split(url)
    # A file this small goes up in one PUT, which the kill cut before it was sent; a big one's multipart upload
    # would be left open, never visible as an object: leave such uploads, this run's and another's.
    client = s3_endpoint.client()
    client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/4/optimizer/rank00000.safetensors")
    client.create_multipart_upload(Bucket=bucket, Key="another/run/4/optimizer/rank00000.safetensors")
    assert assert_committed_state_is_loadable(s3_endpoint, url) == 2

    result = bin_train(tiny_toml, url, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resuming from {url}/2: step 2 done" in result.stdout, result.stdout
    assert_same({"model": read_model(url)}, reference, groups=("model",))
    assert_same(read_checkpoint(url).groups, reference)
    # The first save after the kill aborted the run's unfinished upload, and only that one.
    assert [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == \
        ["another/run/4/optimizer/rank00000.safetensors"]


# ---------------------------------------------------------------------------------------------
# Storage errors, throttling, and what a save costs

def small_groups(step: int) -> dict:
    return {"model": {"w": torch.arange(64, dtype=torch.float32) * step, "b": torch.full((3,), float(step))}}


def small_info(step: int) -> dict:
    return {"training": {"completed": step}}


REQUESTS = {  # a kind of S3 request, by what the endpoint sees
    "PUT (write)": lambda method, path, query: method == "PUT",
    "GET (read)": lambda method, path, query: method == "GET" and "list-type" not in query and "uploads" not in query,
    "ListObjectsV2": lambda method, path, query: method == "GET" and "list-type=2" in query,
    "DeleteObjects": lambda method, path, query: method == "POST" and "delete" in query,
    "ListMultipartUploads": lambda method, path, query: method == "GET" and "uploads" in query,
}


def test_every_kind_of_s3_request_is_retried_through_throttling(s3_endpoint, s3_bucket, monkeypatch):
    monkeypatch.setenv("NANOFLOW_S3_ATTEMPTS", "4")
    url = s3_bucket
    for step in (1, 2):
        save_checkpoint(url, step, small_groups(step), small_info(step))
    for predicate in REQUESTS.values():                      # 3 × 503 SlowDown for each kind, in every save call
        s3_endpoint.fail(3, predicate)
    faulted = s3_endpoint.faulted
    save_checkpoint(url, 3, small_groups(3), small_info(3), keep=1)   # writes, lists, deletes 1 and 2
    restored = read_checkpoint(url, groups=("model",))                 # lists, reads
    assert s3_endpoint.faulted - faulted == 3 * len(REQUESTS)          # each kind was refused, and retried
    assert restored.metadata["step"] == 3
    assert all(torch.equal(restored.groups["model"][n], t) for n, t in small_groups(3)["model"].items())
    assert step_folders(s3_endpoint, url) == {"3"}


def test_retries_are_bounded_and_the_error_names_the_cause(s3_endpoint, s3_bucket, monkeypatch):
    monkeypatch.setenv("NANOFLOW_S3_ATTEMPTS", "3")
    url = s3_bucket
    save_checkpoint(url, 1, small_groups(1), small_info(1))
    s3_endpoint.fail(100, REQUESTS["ListObjectsV2"])
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"cannot list {url}.*SlowDown.*tried 3 times"):
        latest(url)
    assert time.monotonic() - started < 5                    # 2 waits of at most 0.25 s and 0.5 s
    s3_endpoint._faults.clear()
    # After the commit, a delete that keeps failing is a warning that says the commit stands.
    s3_endpoint.fail(100, REQUESTS["DeleteObjects"])
    with logged() as warned:
        save_checkpoint(url, 2, small_groups(2), small_info(2), keep=1)
    assert any(w.startswith("step 2 is committed, and stands; but cleaning up after it failed") for w in warned), warned
    s3_endpoint._faults.clear()
    assert read_metadata(url)["step"] == 2 and step_folders(s3_endpoint, url) == {"1", "2"}
    save_checkpoint(url, 3, small_groups(3), small_info(3), keep=1)    # the next save deletes what is due
    assert step_folders(s3_endpoint, url) == {"3"}


def test_a_save_costs_the_same_requests_at_the_first_and_the_twentieth(s3_endpoint, s3_bucket):
    for keep, steady in ((None, 1), (3, 4)):    # all kept; three kept (deleting from the fourth save on)
        url = f"{s3_bucket}/keep-{keep}"
        counts = []
        for step in range(1, 21):
            before = len(s3_endpoint.requests)
            save_checkpoint(url, step, small_groups(step), small_info(step), keep=keep)
            counts.append(len(s3_endpoint.requests) - before)
        assert counts[steady - 1] == counts[19] and len(set(counts[steady - 1:])) == 1, (keep, counts)
        assert len(step_folders(s3_endpoint, url)) == (keep or 20)


def test_big_objects_go_up_in_parts_and_a_failed_upload_is_aborted(s3_endpoint, s3_bucket, monkeypatch):
    from nanoflow.io import store

    monkeypatch.setattr(store, "_PART", 5 << 20)            # S3's smallest part
    monkeypatch.setenv("NANOFLOW_S3_ATTEMPTS", "2")
    data = torch.randint(0, 256, (11 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    before = len(s3_endpoint.requests)
    Store(s3_bucket).write("big.bin", [data.numpy()[:7 << 20], data.numpy()[7 << 20:]])
    parts = [r for r in s3_endpoint.requests[before:] if r[0] == "PUT"]
    assert len(parts) == 3                                   # 5 + 5 + 1 MiB
    assert bytes(Store(s3_bucket).read("big.bin")) == data.numpy().tobytes()
    before = len(s3_endpoint.requests)
    Store(s3_bucket).write("whole.bin", data.numpy())        # one buffer, not a list of them: the same parts
    assert len([r for r in s3_endpoint.requests[before:] if r[0] == "PUT"]) == 3
    assert bytes(Store(s3_bucket).read("whole.bin")) == data.numpy().tobytes()
    s3_endpoint.fail(100, lambda method, path, query: method == "PUT" and "partNumber=2" in query)
    with pytest.raises(StoreError, match=rf"cannot write {s3_bucket}/other.bin: .*tried 2 times"):
        Store(s3_bucket).write("other.bin", data.numpy())
    bucket, _ = split(s3_bucket)
    assert s3_endpoint.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []   # aborted
    assert "other.bin" not in keys(s3_endpoint, s3_bucket)


def test_missing_bucket_and_dead_endpoint_are_clear_errors(s3_endpoint, monkeypatch):
    monkeypatch.setenv("NANOFLOW_S3_ATTEMPTS", "2")
    with pytest.raises(CheckpointError, match="the bucket 'nanoflow-no-such-bucket' does not exist"):
        latest("s3://nanoflow-no-such-bucket/run")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")      # nothing listens there
    with pytest.raises(CheckpointError, match=rf"the S3 endpoint http://127.0.0.1:{port} cannot be reached"):
        latest("s3://any-bucket/run")


PASSWORD = "s3cr3t-pa55"


def test_a_password_in_the_endpoint_url_is_in_no_message_log_or_record(s3_endpoint, s3_bucket, tiny_toml, tmp_path):
    # AWS_ENDPOINT_URL=http://user:pass@host works (botocore sends to the host); the password must never be shown.
    endpoint = {"AWS_ENDPOINT_URL": f"http://nanoflow:{PASSWORD}@127.0.0.1:{s3_endpoint.port}"}
    s3_endpoint.stop_when(lambda method, path: method == "PUT" and path.endswith("/4/optimizer/rank00000.safetensors"))
    stopped_mid_run = bin_train(tiny_toml, s3_bucket, tmp_path, fail_fast=True, env=endpoint)
    assert "saved step 2:" in stopped_mid_run.stdout and stopped_mid_run.returncode == 4, stopped_mid_run.stderr
    at_start_up = bin_train(tiny_toml, s3_bucket, tmp_path, fail_fast=True, env=endpoint)   # still down
    assert at_start_up.returncode == 2 and "cannot be reached" in at_start_up.stderr, at_start_up.stderr
    assert "Traceback" not in stopped_mid_run.stderr + at_start_up.stderr
    for result in (stopped_mid_run, at_start_up):
        assert "127.0.0.1" in result.stderr and PASSWORD not in result.stdout + result.stderr, result.stderr
    s3_endpoint.start()
    records = [p for p in tmp_path.rglob("*") if p.is_file()]   # metrics.jsonl and the rest, runs/s3/<bucket>/…
    assert any(p.name == "metrics.jsonl" for p in records), records
    assert not [p for p in records if PASSWORD.encode() in p.read_bytes()]
    objects = keys(s3_endpoint, s3_bucket)   # the markers, latest.txt, the lock
    assert "2/checkpoint_metadata.json" in objects and "nanoflow.lock" in objects, objects
    assert not [name for name in objects if PASSWORD.encode() in get(s3_endpoint, s3_bucket, name)]


@pytest.mark.parametrize("url", ["s3:/bucket/run", "S3://bucket/run", "s3://", "gs://bucket/run", "hdfs:/run"])
def test_an_unsupported_url_is_an_error_never_a_local_folder(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match="s3://bucket/prefix"):
        Store(url)
    with pytest.raises(CheckpointError, match="s3://bucket/prefix"):
        latest(url)
    assert list(tmp_path.iterdir()) == []


def test_bin_train_storage_errors_at_start_up_exit_2_without_a_traceback(s3_endpoint, s3_bucket, tiny_toml, tmp_path):
    save_checkpoint(s3_bucket, 1, small_groups(1), small_info(1))
    no_credentials = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
    cases = [  # (the --set, the environment, what the error says)
        (f"checkpoints.resume_checkpoint_path={json.dumps(s3_bucket)}", no_credentials, "no AWS credentials found"),
        ('checkpoints.checkpoints_path="s3://nanoflow-no-such-bucket/run"', {}, "does not exist"),
        ('checkpoints.checkpoints_path="s3:/bucket/run"', {}, "is not an S3 URL"),
    ]
    own_folder = f"checkpoints.checkpoints_path={json.dumps(str(tmp_path / 'run'))}"   # not the checkout's runs/tiny
    for override, env, message in cases:
        result = run_command("train", tiny_toml, *sets(own_folder, override), cwd=tmp_path,
                             env={**env, "NANOFLOW_S3_ATTEMPTS": "1"}, timeout=600)
        assert result.returncode == 2, (override, result.stdout + result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert not (tmp_path / "s3:").exists()


def test_ranged_reads_ask_for_exactly_their_bytes_and_are_retried(s3_endpoint, s3_bucket, monkeypatch):
    from nanoflow.io import store

    monkeypatch.setattr(store, "_CHUNK", 1 << 20)            # the most one GET asks for
    monkeypatch.setenv("NANOFLOW_S3_ATTEMPTS", "3")
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    Store(s3_bucket).write("blob.bin", data.numpy())
    start, length = 1000, (2 << 20) + 10
    s3_endpoint.fail(2, lambda method, path, query: method == "GET" and path.endswith("/blob.bin"))
    before = len(s3_endpoint.requests)
    got = Store(s3_bucket).read_range("blob.bin", start, length)
    assert got.tobytes() == data.numpy()[start:start + length].tobytes()
    gets = [r[2] for r in s3_endpoint.requests[before:] if r[0] == "GET"]
    # Two refused (503) and asked again, then one closed range per 1 MiB: never an open-ended one.
    closed = [f"bytes={start}-{start + (1 << 20) - 1}", f"bytes={start + (1 << 20)}-{start + (2 << 20) - 1}",
              f"bytes={start + (2 << 20)}-{start + length - 1}"]
    assert gets == [closed[0]] * 3 + closed[1:], gets
    with pytest.raises(StoreError, match=rf"cannot read {s3_bucket}/blob.bin: .*ends 10 bytes short"):
        Store(s3_bucket).read_range("blob.bin", (3 << 20) - 5, 15)


def test_a_multipart_write_to_a_dead_endpoint_fails_at_once_with_the_cause(s3_endpoint, s3_bucket, monkeypatch):
    # smart_open would retry a lost connection itself, 6 tries 10 s apart, and then hide the cause.
    from nanoflow.io import store

    monkeypatch.setattr(store, "_PART", 5 << 20)
    monkeypatch.setenv("NANOFLOW_S3_ATTEMPTS", "2")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")      # nothing listens there
    started = time.monotonic()
    with pytest.raises(StoreError, match=rf"cannot write {s3_bucket}/big.bin: the S3 endpoint .* cannot be "
                                         r"reached .*tried 2 times"):
        Store(s3_bucket).write("big.bin", bytes(11 << 20))
    assert time.monotonic() - started < 5                     # one wait of at most 0.25 s


def test_a_download_that_breaks_off_is_asked_again_within_the_documented_bound(s3_endpoint, s3_bucket, monkeypatch):
    # smart_open asks again itself (docs/s3.md): 1, 2, 4, 8, 16 s apart, back to 1 s after a GET that
    # brought bytes; nanoflow allows one read 5 GETs and does not try it again. Waits recorded, not slept.
    import types

    import smart_open.s3

    from nanoflow.io import store

    waits = {"smart_open": [], "nanoflow": []}
    for module, name in ((smart_open.s3, "smart_open"), (store, "nanoflow")):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(sleep=waits[name].append, monotonic=time.monotonic))
    monkeypatch.setenv("NANOFLOW_S3_ATTEMPTS", "3")
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    Store(s3_bucket).write("blob.bin", data.numpy())
    blob = lambda method, path, query: method == "GET" and path.endswith("/blob.bin")  # noqa: E731

    def gets_of(read):
        before = len(s3_endpoint.requests)
        waits["smart_open"].clear()
        read()
        return [r[2] for r in s3_endpoint.requests[before:] if r[0] == "GET"]

    # Broken off twice after 100 bytes: asked again from there (closed ranges still), the bytes exact.
    s3_endpoint.drop_mid_body(2, blob, sent=100)
    got = {}
    gets = gets_of(lambda: got.update(bytes=Store(s3_bucket).read_range("blob.bin", 10, 1000).tobytes()))
    assert got["bytes"] == data.numpy()[10:1010].tobytes()
    assert gets == ["bytes=10-1009", "bytes=110-1109", "bytes=210-1209"] and waits["smart_open"] == [1, 1], gets
    s3_endpoint.drop_mid_body(1, blob, sent=1000)             # a whole read is asked again whole
    assert gets_of(lambda: got.update(bytes=Store(s3_bucket).read("blob.bin"))) == ["bytes=0-", "bytes=0-"]
    assert got["bytes"] == data.numpy().tobytes()

    # Each GET brings bytes, so smart_open would go on for the whole MiB: the fifth GET ends the read.
    s3_endpoint.drop_mid_body(100, blob, sent=100)
    before = len(s3_endpoint.requests)
    with pytest.raises(StoreError, match=rf"cannot read {s3_bucket}/blob.bin: the download broke off 5 times$"):
        gets_of(lambda: Store(s3_bucket).read_range("blob.bin", 0, 1 << 20))
    assert len([r for r in s3_endpoint.requests[before:] if r[0] == "GET"]) == 5
    assert waits == {"smart_open": [1, 1, 1, 1, 1], "nanoflow": []}
    # No GET brings a byte: smart_open gives up after its fifth, 31 s of waiting.
    s3_endpoint._drops.clear()
    s3_endpoint.drop_mid_body(100, blob, sent=0)
    before = len(s3_endpoint.requests)
    with pytest.raises(StoreError, match=rf"cannot read {s3_bucket}/blob.bin: OSError: .*failed to read"):
        gets_of(lambda: Store(s3_bucket).read_range("blob.bin", 0, 1 << 20))
    assert len([r for r in s3_endpoint.requests[before:] if r[0] == "GET"]) == 5
    assert waits == {"smart_open": [1, 2, 4, 8, 16], "nanoflow": []}


def test_two_runs_of_one_name_on_two_s3_prefixes_keep_two_local_records(s3_endpoint, s3_bucket, tiny_toml, tmp_path,
                                                                       monkeypatch):
    """The same general.run (tiny.toml's), two S3 places: each run's metrics.jsonl is its own, keyed by its
    checkpoints' place, and the second run neither erases nor mixes into the first's."""
    monkeypatch.chdir(tmp_path)
    first_url, second_url = f"{s3_bucket}/first", f"{s3_bucket}/second"
    run(tiny(tiny_toml, first_url, "tokens.train_steps=3"))
    first_record = tmp_path / "runs" / "s3" / first_url[len("s3://"):] / "metrics.jsonl"
    rows = first_record.read_text()
    assert [json.loads(line)["step"] for line in rows.splitlines()] == [1, 2, 3]
    _, out = run(tiny(tiny_toml, second_url, "tokens.train_steps=2"))
    second_record = tmp_path / "runs" / "s3" / second_url[len("s3://"):] / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in second_record.read_text().splitlines()] == [1, 2]
    assert first_record.read_text() == rows  # untouched by the second run
    assert f"metrics in {Path('runs', 's3', second_url[len('s3://'):], 'metrics.jsonl')}" in out, out
