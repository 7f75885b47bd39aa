"""Storage for checkpoints: a local folder or an s3:// prefix; on S3 the bytes go through smart_open.

Every object is written whole: locally by nanoflow.io.files (a temporary name, flushed, fsynced and renamed;
never through a link below the root); on S3 as one PUT, or one multipart upload for a big object,
which lands entirely or not at all. Endpoint and credentials come from the standard AWS environment
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID …), read into one boto3 client that smart_open is given too.

Every S3 request — reads, writes, listings, deletes — is retried on a transient error (throttling, a
5xx, a dropped connection) within the bound `Retries` sets; any other error, or one still there after
the last try, is a StoreError that names the path and the cause (no credentials, no such bucket,
endpoint unreachable …). A smart_open read or write is retried whole: a write that failed is begun
again (its multipart upload aborted first), a read asks again. smart_open's own write retries are
switched off (`_smart_open`); its read retry is not configurable and stays inside one try: a
download that breaks off is asked again from where it stopped, after waits of 1, 2, 4, 8, 16 s
(back to 1 s after a GET that brought bytes); `_GetBudget` ends the read at its GETS_PER_READth GET. So
one read makes at most Retries.attempts × GETS_PER_READ GETs; the longest it can wait follows from these
constants, and tests/unit/test_store_bounds.py derives it and checks the figure docs/s3.md gives.
"""

from __future__ import annotations

import email.utils
import itertools
import os
import random
import re
import threading
import time

import attrs
import numpy

from nanoflow.errors import StoreError, without_credentials  # noqa: F401 - also this module's API
from nanoflow.io.files import _as_chunks, _write_chunks, write_atomically


@attrs.frozen
class Retries:
    """How each S3 request is retried on a transient error: at most `attempts` tries, the waits between them
    starting at `first_wait` seconds and doubling up to `max_wait` (each drawn between half and all of
    that, so that many ranks do not retry in step): at most the sum of `wait(a)` over the attempts a that are
    followed by another."""

    attempts: int = 8
    first_wait: float = 0.25
    max_wait: float = 8.0

    def wait(self, attempt: int) -> float:
        return min(self.max_wait, self.first_wait * 2 ** attempt)


ATTEMPTS_VARIABLE = "NANOFLOW_S3_ATTEMPTS"   # overrides Retries.attempts (1: no retries)
CONNECT_TIMEOUT, READ_TIMEOUT = 10, 60       # seconds, per try


def retries() -> Retries:
    value = os.environ.get(ATTEMPTS_VARIABLE)
    if value is None:
        return Retries()
    if not re.fullmatch(r"[1-9][0-9]{0,3}", value.strip()):
        raise StoreError(f"{ATTEMPTS_VARIABLE}={value!r}: expected a whole number of tries from 1 to 9999")
    return Retries(attempts=int(value))


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/")


def check_root(root: str) -> None:
    """A local path or s3://bucket[/prefix]; anything else that looks like a URL is an error, never a local folder."""
    if root.startswith("s3://"):
        if not root[len("s3://"):].partition("/")[0]:
            raise StoreError(f"{root}: no bucket named; write s3://bucket/prefix")
        return
    scheme = _SCHEME.match(root)
    if root.lower().startswith("s3:"):
        raise StoreError(f"{root} is not an S3 URL nanoflow reads: write s3://bucket/prefix (lower case, two slashes)")
    if scheme is not None:
        raise StoreError(f"{root}: nanoflow does not support {scheme.group(1)}:// storage; use a local folder "
                         "or s3://bucket/prefix (for S3-compatible stores, set AWS_ENDPOINT_URL)")


def is_remote(path: str) -> bool:
    """Whether `path` names a place by URL (s3://bucket/prefix), not a local file or folder: the one spelling
    of that question, so that every layer asks it alike."""
    return "://" in path


class Store:
    """Objects under one root (a local folder or s3://bucket/prefix), addressed by relative POSIX paths."""

    def __init__(self, root: str):
        check_root(root)
        self.root = root.rstrip("/")
        self.is_s3 = self.root.startswith("s3://")

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def write(self, relative: str, chunks) -> int:
        """Write one object whole — it is either absent or complete, never partial — from `chunks`
        (bytes, or a list of buffers written one after the other). Returns the number of bytes written."""
        chunks = _as_chunks(chunks)
        if self.is_s3:
            return self._write_s3(relative, chunks)
        path = self.url(relative)
        try:   # never through a link: not the root's own (the folder the user named), but any below it
            return write_atomically(path, chunks, root=self.root, crash_point=True)
        except OSError as e:
            raise StoreError(f"cannot write {path}: {e}") from e

    def read(self, relative: str) -> bytearray:
        """The whole object, in one writable buffer (tensors can be views of it)."""
        if self.is_s3:
            def read(client) -> bytes:
                with _smart_open().open(self.url(relative), "rb", compression="disable",
                                        transport_params={"client": _GetBudget(client)}) as f:
                    return f.read()
            return bytearray(self._s3(f"read {self.url(relative)}", read))
        try:
            with open(self.url(relative), "rb") as f:
                buffer = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(buffer)
                return buffer
        except OSError as e:
            raise StoreError(f"cannot read {self.url(relative)}: {e}") from e

    def read_range(self, relative: str, start: int, length: int) -> numpy.ndarray:
        """Bytes [start, start + length) of an object, in one writable uint8 array; on S3 ranged GETs for just them."""
        # Not bytearray(length), which first writes zeros over it all, nor numpy.empty, which asks for huge
        # pages, whose compaction slowed loads (BENCHMARKS.md, "Checkpoint IO"): torch's own allocation, seen as a
        # numpy array.
        # Imported here so that this module, and is_remote with it, loads without torch.
        import torch
        buffer = torch.empty(length, dtype=torch.uint8).numpy()
        if self.is_s3:
            view, got = buffer.data, 0   # memoryview(buffer): numpy declares the buffer protocol for Python >= 3.12
            for at in range(0, length, _CHUNK):
                got += self._read_s3_range(relative, start + at, view[at:at + _CHUNK])
        else:
            try:
                with open(self.url(relative), "rb") as f:
                    f.seek(start)
                    got = f.readinto(buffer.data)
            except OSError as e:
                raise StoreError(f"cannot read {self.url(relative)}: {e}") from e
        if got != length:
            raise StoreError(f"cannot read {self.url(relative)}: bytes {start}–{start + length} asked, "
                             f"the object ends {length - got} bytes short of them")
        return buffer

    def read_into(self, relative: str, pieces: list[tuple[int, memoryview]]) -> None:
        """Bytes [start, start + len(view)) of a local file straight into each (start, view): the caller's own
        memory (a tensor's), so no buffer is filled and then copied. One open for all of them."""
        try:
            with open(self.url(relative), "rb") as f:
                for start, view in pieces:
                    f.seek(start)
                    got = f.readinto(view)
                    if got != len(view):
                        raise StoreError(f"cannot read {self.url(relative)}: bytes {start}–{start + len(view)} "
                                         f"asked, the file ends {len(view) - got} bytes short of them")
        except OSError as e:
            raise StoreError(f"cannot read {self.url(relative)}: {e}") from e

    def _read_s3_range(self, relative: str, start: int, into: memoryview) -> int:
        # One GET whose closed Range header asks for exactly these bytes: no GET before the seek, and a
        # read-ahead buffer no bigger than the range (smart_open would otherwise fill it from the next one).
        size = len(into)
        params = {"defer_seek": True, "range_chunk_size": size, "buffer_size": size}

        def get(client) -> bytes:  # opened and read inside the try: a reset mid-body is retried too
            with _smart_open().open(self.url(relative), "rb", compression="disable",
                                    transport_params={**params, "client": _GetBudget(client)}) as f:
                f.seek(start)
                return f.read(size)

        data = self._s3(f"read {self.url(relative)}", get)[:size]
        into[:len(data)] = data
        return len(data)

    def exists(self, relative: str) -> bool:
        return self.size(relative) is not None

    def size(self, relative: str) -> int | None:
        if not self.is_s3:
            try:
                return os.path.getsize(self.url(relative))
            except OSError:
                return None
        bucket, key = self._bucket_key(relative)
        # The key itself sorts first among the keys it prefixes: one key of listing answers.
        found = self._s3(f"list {self.url(relative)}", lambda c: c.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1))
        return next((o["Size"] for o in found.get("Contents", []) if o["Key"] == key), None)

    def objects(self) -> dict[str, tuple[int, str]]:
        """Every object under the root: {relative path: (size, a stamp that changes when it is rewritten)} — on
        S3 one listing (a request per 1,000 objects)."""
        if not self.is_s3:
            found = {}
            # A step folder of the root's that is a symlink (moved to another disk and linked back) is listed too;
            # a link of another name (a data folder of the user's) is not walked, nor any link deeper down.
            top = next(os.walk(self.root), (self.root, [], []))
            linked = [os.path.join(self.root, d) for d in top[1]
                      if d.isascii() and d.isdigit() and os.path.islink(os.path.join(self.root, d))]
            for directory, _, names in itertools.chain(os.walk(self.root), *map(os.walk, linked)):
                for name in names:
                    path = os.path.join(directory, name)
                    try:
                        stat = os.stat(path)
                    except FileNotFoundError:
                        continue
                    relative = os.path.relpath(path, self.root).replace(os.sep, "/")
                    found[relative] = (stat.st_size, f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}")
            return found
        return {relative: (o["Size"], o.get("ETag", "")) for relative, o in self._listing("")}

    def is_link(self, relative: str) -> bool:
        """Whether the local path is a symlink (nanoflow makes none: it never writes or deletes through one)."""
        return not self.is_s3 and os.path.islink(self.url(relative))

    def written_stamp(self, relative: str, data: bytes) -> str:
        """The stamp `objects()` will show for the object just written with `data` (on S3 the ETag of a
        single PUT, the MD5 of its bytes: nothing to ask)."""
        if self.is_s3:
            import hashlib
            return f'"{hashlib.md5(data).hexdigest()}"' if len(data) <= _PART else ""
        stat = os.stat(self.url(relative))
        return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"

    def delete(self, relatives: list[str]) -> None:
        """Delete these objects (one that is already gone is no error); on S3 in batches of 1,000 a request."""
        if not self.is_s3:
            for relative in relatives:
                try:
                    os.remove(self.url(relative))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise StoreError(f"cannot delete {self.url(relative)}: {e}") from e
            return
        for at in range(0, len(relatives), 1000):
            batch = relatives[at:at + 1000]
            bucket, _ = self._bucket_key("")
            keys = [{"Key": self._bucket_key(r)[1]} for r in batch]
            answer = self._s3(f"delete under {self.root}", lambda c: c.delete_objects(  # noqa: B023 - called now
                Bucket=bucket, Delete={"Objects": keys, "Quiet": True}))  # noqa: B023
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise StoreError(f"cannot delete s3://{bucket}/{first.get('Key')}: {first.get('Code')}: "
                                 f"{first.get('Message')} ({len(answer['Errors'])} objects not deleted)")

    def abort_unfinished_uploads(self, ours) -> list[str]:
        """S3: abort the multipart uploads under the root that never completed and whose path relative
        to the root satisfies `ours` — left by a writer that was killed; never visible as objects, but
        S3 keeps (and bills) their parts. Returns their paths. Only call it when no writer of those
        paths is still uploading. Nothing to do locally: a killed local write leaves a temporary file."""
        if not self.is_s3:
            return []
        bucket, prefix = self._bucket_key("")
        start = len(prefix) + 1 if prefix else 0
        aborted: list[str] = []
        marker: dict[str, str] = {}
        while True:
            page = self._s3(f"list the unfinished uploads under {self.root}", lambda c: c.list_multipart_uploads(
                Bucket=bucket, Prefix=prefix + "/" if prefix else "", **marker))  # noqa: B023 - called now
            for upload in page.get("Uploads", []):
                if ours(upload["Key"][start:]):
                    self._s3(f"abort the upload of s3://{bucket}/{upload['Key']}", lambda c: c.abort_multipart_upload(
                        Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]))  # noqa: B023
                    aborted.append(upload["Key"][start:])
            if not page.get("IsTruncated"):
                return aborted
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def remove_empty_folder(self, folder: str) -> None:
        if not self.is_s3:
            for directory, _, _ in sorted(os.walk(self.url(folder)), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass

    # -----------------------------------------------------------------------------------------
    # S3 conditional requests (the run lock, io/lock.py): what S3 itself guarantees, never a listing race

    def put_conditional(self, relative: str, data: bytes, *, etag: str | None) -> str | None:
        """S3: write the object only if there is none (`etag` None: If-None-Match *) or it is still the
        version `etag` (If-Match). Returns the new ETag, or None when the condition failed."""
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        return self._conditional("write", relative, lambda client, bucket, key: client.put_object(
            Bucket=bucket, Key=key, Body=data, **condition)["ETag"])

    def read_tagged(self, relative: str) -> tuple[bytes, str, float] | None:
        """S3: (bytes, ETag, seconds since it was last written by the server's clock), or None when absent."""
        def get(client, bucket, key):
            response = client.get_object(Bucket=bucket, Key=key)
            now = email.utils.parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
            return response["Body"].read(), response["ETag"], (now - response["LastModified"]).total_seconds()
        return self._conditional("read", relative, get)

    def delete_conditional(self, relative: str, etag: str) -> bool:
        """S3: delete the object only if it is still the version `etag`; False when it is not (or is gone)."""
        return self._conditional("delete", relative, lambda client, bucket, key: client.delete_object(
            Bucket=bucket, Key=key, IfMatch=etag)) is not None

    def _conditional(self, what: str, relative: str, call):
        """call(client, bucket, key) with the retries of every S3 request; None when its condition failed."""
        from botocore.exceptions import ClientError

        bucket, key = self._bucket_key(relative)

        def request(client):
            try:
                return call(client, bucket, key)
            except ClientError as e:
                # 412: the condition failed; 409: a racing conditional request on the same key won; 404: absent.
                if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                               "NoSuchKey", "404"):
                    return None
                raise

        return self._s3(f"{what} {self.url(relative)}", request)

    # -----------------------------------------------------------------------------------------
    # S3

    def _bucket_key(self, relative: str) -> tuple[str, str]:
        bucket, _, prefix = self.root[len("s3://"):].partition("/")
        key = "/".join(p for p in (prefix, relative) if p)
        return bucket, key

    def _listing(self, under: str):
        """(path relative to the root, object) of each object whose relative path starts with `under`."""
        bucket, prefix = self._bucket_key("")
        start = len(prefix) + 1 if prefix else 0
        asked = {"Bucket": bucket, "Prefix": (prefix + "/" if prefix else "") + under}
        while True:
            page = self._s3(f"list {self.url(under)}", lambda c: c.list_objects_v2(**asked))  # noqa: B023
            for obj in page.get("Contents", []):
                yield obj["Key"][start:], obj
            if not page.get("IsTruncated"):
                return
            asked["ContinuationToken"] = page["NextContinuationToken"]

    def _write_s3(self, relative: str, chunks) -> int:
        chunks = list(chunks)   # a failed try writes them all again
        size = sum(memoryview(c).nbytes for c in chunks)
        # Up to _PART one PUT; above, a multipart upload in parts of _PART, completed only at close.
        params = {"multipart_upload": size > _PART, "min_part_size": _PART}

        def put(client) -> None:
            f = _smart_open().open(self.url(relative), "wb", compression="disable",
                                   transport_params={**params, "client": client})
            try:
                _write_chunks(f, chunks)   # (bytes counted for the kill tests: killed here, nothing lands)
                f.close()
            except BaseException:
                try:  # abort the upload: its parts would be kept, and billed; the next save aborts any this misses
                    f.terminate()
                except Exception:  # noqa: BLE001, S110 - the write's own error is the one to tell
                    pass
                raise

        self._s3(f"write {self.url(relative)}", put)
        return size

    def _s3(self, what: str, request):
        """request(client), tried again after a transient error within `retries()`; a StoreError otherwise."""
        policy = retries()
        attempts = policy.attempts
        started = time.monotonic()
        client = _s3_client()
        for attempt in range(attempts):
            try:
                return request(client)
            except Exception as e:  # noqa: PERF203 - botocore's and urllib3's errors, sorted by _transient
                if not _transient(e) or attempt == attempts - 1:
                    tried = f" (tried {attempt + 1} times over {time.monotonic() - started:.1f} s)" if attempt else ""
                    # botocore names the endpoint URL, user:password included: never shown
                    raise StoreError(without_credentials(f"cannot {what}: {_explain(e, self, client)}{tried}")) from e
            time.sleep(policy.wait(attempt) * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")


_THROTTLING = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
               "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"}


def _smart_open():
    """smart_open, with its own retries of multipart requests (6 tries, 10 s apart, on a lost connection)
    switched off through its public `smart_open.s3.RETRY`: Store._s3 retries every write, within `retries()`."""
    import smart_open  # only for S3: a local run does not wait for it and boto3 to import (BENCHMARKS.md, "Resume")
    import smart_open.s3

    policy = smart_open.s3.RETRY
    policy.attempts, policy.sleep_seconds, policy.exceptions, policy.client_error_codes = 1, 0, [], []
    return smart_open


GETS_PER_READ = 5   # GETs one smart_open read may make: the first, and 4 after a download broke off


class _GetBudget:
    """Our client, for one smart_open read: at most GETS_PER_READ GETs. smart_open asks again, from where it
    stopped, when a download breaks off — 5 times if none brings a byte, but without end while each does."""

    def __init__(self, client):
        self._client, self._left = client, GETS_PER_READ

    def get_object(self, **asked):
        if self._left == 0:
            raise StoreError(f"the download broke off {GETS_PER_READ} times")
        self._left -= 1
        return self._client.get_object(**asked)

    def __getattr__(self, name):   # any other request smart_open may make goes to the client as it is
        return getattr(self._client, name)


def _unwrapped(error: BaseException) -> BaseException:
    """botocore's error itself: smart_open raises its own OSError or ValueError `from` it."""
    while error.__cause__ is not None and not type(error).__module__.startswith(("botocore", "urllib3")):
        error = error.__cause__
    return error


def _transient(error: BaseException) -> bool:
    import botocore.exceptions as be
    import urllib3.exceptions

    error = _unwrapped(error)
    if isinstance(error, be.ClientError):
        answer = error.response
        status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return answer.get("Error", {}).get("Code") in _THROTTLING or status >= 500 or status == 429
    return isinstance(error, (be.ConnectionError, be.HTTPClientError, be.IncompleteReadError, ConnectionError,
                              urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError))


def _explain(error: BaseException, store: Store, client) -> str:
    import botocore.exceptions as be

    bucket, _ = store._bucket_key("")
    error = _unwrapped(error)
    if isinstance(error, StoreError):
        return str(error)
    if isinstance(error, (be.NoCredentialsError, be.PartialCredentialsError)):
        return ("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the "
                "environment")
    if isinstance(error, be.EndpointConnectionError):
        return f"the S3 endpoint {client.meta.endpoint_url} cannot be reached (check AWS_ENDPOINT_URL)"
    if isinstance(error, be.ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        message = error.response.get("Error", {}).get("Message", "")
        if code == "NoSuchBucket":
            return f"the bucket {bucket!r} does not exist at {client.meta.endpoint_url}"
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "AllAccessDisabled"):
            return f"access denied ({code}): check the credentials and the permissions on bucket {bucket!r}"
        if code in ("NoSuchKey", "404"):
            return "no such object"
        return f"{code}: {message}" if message else code
    return f"{type(error).__name__}: {error}"


_CLIENT: dict = {}
_CLIENT_LOCK = threading.Lock()   # boto3's default session, which builds clients, is not thread-safe


def _s3_client():
    """One boto3 client per process and AWS environment; it does not retry (Store._s3 does, within `retries()`)."""
    key = (os.getpid(), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _CLIENT_LOCK:
        return _CLIENT["client"] if _CLIENT.get("key") == key else _new_client(key)


def _new_client(key):
    import boto3  # reads AWS_ENDPOINT_URL and the credentials from the environment
    from botocore.config import Config

    # botocore's own retry modes ("standard", "adaptive") are switched off, not used, because they retry one
    # HTTP request: a GET whose body breaks off after the response began, or a multipart upload whose part
    # failed (which must be aborted and begun again), reaches the caller as an error all the same, so nanoflow
    # must retry whole reads and writes itself; stacked on that, botocore's tries would multiply the bound on
    # waiting that tests/unit/test_store_bounds.py derives and docs/s3.md states (attempts x GETS_PER_READ).
    config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=CONNECT_TIMEOUT,
                    read_timeout=READ_TIMEOUT, max_pool_connections=32)
    _CLIENT.update(key=key, client=boto3.client("s3", config=config))
    return _CLIENT["client"]


_CHUNK = 64 << 20   # the most one GET asks for
_PART = 64 << 20    # objects up to this size are one PUT; bigger ones go up in parts of this size
