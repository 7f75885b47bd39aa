"""Storage for checkpoints: a local folder or an s3:// prefix, written through smart_open.

Every object is written whole: locally to a temporary name, flushed, fsynced and renamed; on S3
as one PUT or multipart upload, which lands entirely or not at all. Endpoint and credentials come
from the standard AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID …).
"""

from __future__ import annotations

import email.utils
import os
import threading

import numpy
import torch

from nanoflow.errors import NanoflowError


class StoreError(NanoflowError, OSError):
    """An object that cannot be read."""


class Store:
    """Objects under one root (a local folder or s3://bucket/prefix), addressed by relative POSIX paths."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self.is_s3 = self.root.startswith("s3://")

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def write(self, relative: str, chunks) -> int:
        """Write one object whole — it is either absent or complete, never partial — from `chunks`
        (bytes, or a list of buffers written one after the other). Returns the number of bytes written."""
        chunks = [chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks
        try:
            if self.is_s3:
                import smart_open  # only for S3: importing it (boto3 and all) costs a local run 0.2 s

                with smart_open.open(self.url(relative), "wb") as f:
                    return _write_chunks(f, chunks)
            path = self.url(relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temporary = f"{path}.tmp-{os.getpid()}"
            with open(temporary, "wb") as f:
                size = _write_chunks(f, chunks)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
            return size
        except Exception as e:  # OSError locally; botocore's errors, or smart_open's give-up, on S3
            raise StoreError(f"cannot write {self.url(relative)}: {e}") from e

    def read(self, relative: str) -> bytearray:
        """The whole object, in one writable buffer (tensors can be views of it)."""
        try:
            if not self.is_s3:
                with open(self.url(relative), "rb") as f:
                    buffer = bytearray(os.fstat(f.fileno()).st_size)
                    f.readinto(buffer)
                    return buffer
            import smart_open

            with smart_open.open(self.url(relative), "rb") as f:
                return bytearray(f.read())
        except Exception as e:  # OSError locally; botocore's NoSuchKey and friends on S3
            raise StoreError(f"cannot read {self.url(relative)}: {e}") from e

    def read_range(self, relative: str, start: int, length: int) -> numpy.ndarray:
        """Bytes [start, start + length) of an object, in one writable uint8 array; on S3 ranged GETs for just them."""
        # Not bytearray(length), which first writes zeros over it all, nor numpy.empty, which asks for huge
        # pages (their compaction made loads 4× slower here): torch's own allocation, seen as a numpy array.
        buffer = torch.empty(length, dtype=torch.uint8).numpy()
        try:
            if not self.is_s3:
                with open(self.url(relative), "rb") as f:
                    f.seek(start)
                    got = f.readinto(buffer)
            else:
                view, got = memoryview(buffer), 0
                for at in range(0, length, _CHUNK):
                    got += self._read_s3_range(relative, start + at, view[at:at + _CHUNK])
        except Exception as e:  # OSError locally; botocore's errors on S3
            raise StoreError(f"cannot read {self.url(relative)}: {e}") from e
        if got != length:
            raise StoreError(f"cannot read {self.url(relative)}: bytes {start}–{start + length} asked, "
                             f"the object ends {length - got} bytes short of them")
        return buffer

    def _read_s3_range(self, relative: str, start: int, into: memoryview) -> int:
        import smart_open

        # One GET whose closed Range header asks for exactly these bytes: no GET before the seek, and a
        # read-ahead buffer no bigger than the range (smart_open would otherwise fill it from the next one).
        size = len(into)
        params = {"defer_seek": True, "range_chunk_size": size, "buffer_size": size}
        with smart_open.open(self.url(relative), "rb", transport_params=params) as f:
            f.seek(start)
            data = f.read(size)
        into[:len(data)] = data
        return len(data)

    def exists(self, relative: str) -> bool:
        if not self.is_s3:
            return os.path.exists(self.url(relative))
        bucket, key = self._bucket_key(relative)
        return any(obj["Key"] == key for obj in self._list(bucket, key))

    def size(self, relative: str) -> int | None:
        if not self.is_s3:
            try:
                return os.path.getsize(self.url(relative))
            except OSError:
                return None
        bucket, key = self._bucket_key(relative)
        return next((obj["Size"] for obj in self._list(bucket, key) if obj["Key"] == key), None)

    def folders(self) -> list[str]:
        """Names of the immediate sub-folders of the root."""
        if not self.is_s3:
            try:
                return [e.name for e in os.scandir(self.root) if e.is_dir()]
            except FileNotFoundError:
                return []
        return sorted({key.split("/", 1)[0] for key in self._keys() if "/" in key})

    def files(self, folder: str) -> list[str]:
        """Every object under `folder`, as paths relative to the root."""
        if not self.is_s3:
            found = []
            for directory, _, names in os.walk(self.url(folder)):
                found += [os.path.relpath(os.path.join(directory, n), self.root).replace(os.sep, "/") for n in names]
            return found
        return list(self._keys(folder + "/"))

    def root_files(self) -> list[str]:
        """Names of the objects directly under the root."""
        if not self.is_s3:
            try:
                return [e.name for e in os.scandir(self.root) if e.is_file()]
            except FileNotFoundError:
                return []
        return [key for key in self._keys() if "/" not in key]

    def _keys(self, under: str = ""):
        """S3: the keys of every object whose path relative to the root starts with `under`, relative to the root."""
        bucket, prefix = self._bucket_key("")
        start = len(prefix) + 1 if prefix else 0
        for obj in self._list(bucket, (prefix + "/" if prefix else "") + under):
            yield obj["Key"][start:]

    def delete(self, relatives: list[str]) -> None:
        if not self.is_s3:
            for relative in relatives:
                try:
                    os.remove(self.url(relative))
                except FileNotFoundError:
                    pass
            return
        client = _s3_client()
        for relative in relatives:
            bucket, key = self._bucket_key(relative)
            client.delete_object(Bucket=bucket, Key=key)

    def abort_unfinished_uploads(self, ours) -> list[str]:
        """S3: abort the multipart uploads under the root that never completed and whose path relative
        to the root satisfies `ours` — left by a writer that was killed; never visible as objects, but
        S3 keeps (and bills) their parts. Returns their paths. Only call it when no writer of those
        paths is still uploading. Nothing to do locally: a killed local write leaves a temporary file."""
        if not self.is_s3:
            return []
        bucket, prefix = self._bucket_key("")
        start = len(prefix) + 1 if prefix else 0
        aborted = []
        try:
            client = _s3_client()
            for page in client.get_paginator("list_multipart_uploads").paginate(
                    Bucket=bucket, Prefix=prefix + "/" if prefix else ""):
                for upload in page.get("Uploads", []):
                    if ours(upload["Key"][start:]):
                        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        aborted.append(upload["Key"][start:])
        except Exception as e:  # botocore's errors: no permission to list uploads, one aborted meanwhile …
            raise StoreError(f"cannot abort the unfinished uploads under {self.root}: {e}") from e
        return aborted

    def remove_empty_folder(self, folder: str) -> None:
        if not self.is_s3:
            for directory, _, _ in sorted(os.walk(self.url(folder)), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass

    # S3's conditional writes (for io/lock.py): S3 itself decides which of two racing requests wins.

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
        from botocore.exceptions import ClientError

        bucket, key = self._bucket_key(relative)
        try:
            return call(_conditional_client(), bucket, key)
        except ClientError as e:
            # 412: the condition failed; 409: a racing conditional request on the same key won; 404: absent.
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                           "NoSuchKey", "404"):
                return None
            raise StoreError(f"cannot {what} {self.url(relative)}: {e}") from e
        except Exception as e:  # botocore's connection errors
            raise StoreError(f"cannot {what} {self.url(relative)}: {e}") from e

    def _bucket_key(self, relative: str) -> tuple[str, str]:
        bucket, _, prefix = self.root[len("s3://"):].partition("/")
        key = "/".join(p for p in (prefix, relative) if p)
        return bucket, key

    @staticmethod
    def _list(bucket: str, prefix: str):
        paginator = _s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            yield from page.get("Contents", [])


def _s3_client():
    import boto3  # smart_open[s3] brings it; it reads AWS_ENDPOINT_URL and credentials from the environment

    return boto3.client("s3")


_conditional_clients: dict = {}
_conditional_guard = threading.Lock()


def _conditional_client():
    """One client from its own boto3 Session: the lock's heartbeat thread uses it beside the main thread
    (boto3's default session, which _s3_client builds clients from, is not thread-safe)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    with _conditional_guard:
        if endpoint not in _conditional_clients:
            import boto3

            _conditional_clients[endpoint] = boto3.session.Session().client("s3")
        return _conditional_clients[endpoint]


_CHUNK = 64 << 20


def _write_chunks(f, chunks) -> int:
    size = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), _CHUNK):
            piece = view[start:start + _CHUNK]
            _crash_point(f, piece)
            f.write(piece)
        size += len(view)
    return size


_bytes_written = 0


def _crash_point(f, chunk: memoryview) -> None:
    """Fault injection for the kill -9 tests: with NANOFLOW_KILL_AFTER_BYTES=N, the process writes
    exactly N checkpoint bytes (counted across files) and then kills itself with SIGKILL."""
    global _bytes_written
    limit = os.environ.get("NANOFLOW_KILL_AFTER_BYTES")
    if limit is None:
        return
    allowed = int(limit) - _bytes_written
    if allowed < len(chunk):
        import signal
        f.write(chunk[:max(allowed, 0)])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    _bytes_written += len(chunk)
