"""Storage for checkpoints: a local folder or an s3:// prefix, written through smart_open.

Every object is written whole: locally to a temporary name, flushed, fsynced and renamed; on S3
as one PUT or multipart upload, which lands entirely or not at all. Endpoint and credentials come
from the standard AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID …).
"""

from __future__ import annotations

import os


class StoreError(OSError):
    """An object that cannot be read."""


class Store:
    """Objects under one root (a local folder or s3://bucket/prefix), addressed by relative POSIX paths."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self.is_s3 = self.root.startswith("s3://")

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def write(self, relative: str, chunks, checksum=None) -> int:
        """Write one object whole — it is either absent or complete, never partial — from `chunks`
        (bytes, or a list of buffers written one after the other). Feeds every byte to `checksum`
        as it goes. Returns the number of bytes written."""
        chunks = [chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks
        try:
            if self.is_s3:
                import smart_open  # only for S3: importing it (boto3 and all) costs a local run 0.2 s

                with smart_open.open(self.url(relative), "wb") as f:
                    return _write_chunks(f, chunks, checksum)
            path = self.url(relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temporary = f"{path}.tmp-{os.getpid()}"
            with open(temporary, "wb") as f:
                size = _write_chunks(f, chunks, checksum)
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

    def remove_empty_folder(self, folder: str) -> None:
        if not self.is_s3:
            for directory, _, _ in sorted(os.walk(self.url(folder)), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass

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


_CHUNK = 64 << 20


def _write_chunks(f, chunks, checksum) -> int:
    size = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), _CHUNK):
            piece = view[start:start + _CHUNK]
            _crash_point(f, piece)
            f.write(piece)
            if checksum is not None:
                checksum.update(piece)
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
