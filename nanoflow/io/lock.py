"""One writer per run folder: the lock a training run holds on its checkpoints_path.

The lock is one small JSON record, `<run>/nanoflow.lock`, naming its holder (host, pid, start
time, run) and carrying a lease the holder renews from a background thread. How it is taken:

- local folder: `fcntl.flock` on the file, held for the whole run. The kernel drops it when the
  holder dies (kill -9 included), so on one host a dead holder never blocks the next launch. On
  NFS, Linux turns flock into a lock the server arbitrates, and a lost client's lock lapses with
  its NFS lease; for a mount that does not arbitrate (`nolock`) the record's own lease still
  stops a launch from another host while the holder keeps renewing it. The file is never deleted
  (deleting a flocked file lets a second writer lock a new file of the same name): released, it
  is emptied.
- S3: conditional writes, which S3 itself serialises. `PutObject If-None-Match: *` creates the
  lock only if there is none; renewals and the takeover of a stale lock are `If-Match: <ETag>`,
  and the release a `DeleteObject If-Match: <ETag>`, so a lock this process does not hold is
  never overwritten or deleted. There is no listing and no read-then-write race.

A record left by a holder that died is stale when its process is provably gone (same host, same
boot, same pid namespace, and no process with that pid and start time), or else when its lease
was not renewed for `lease_seconds` (measured by the store's clock where it has one: S3's Date
against the object's Last-Modified). A stale lock is taken over, and the takeover is announced.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import logging
import os
import secrets
import socket
import threading

from nanoflow.errors import LockLostError, RunLockedError
from nanoflow.io.checkpoint import CheckpointError
from nanoflow.io.store import Store, StoreError

log = logging.getLogger(__name__)

LOCK = "nanoflow.lock"
FORMAT = "nanoflow-lock/1"
LEASE_ENV = "NANOFLOW_LOCK_LEASE_SECONDS"
DEFAULT_LEASE_SECONDS = 120.0  # renewed every quarter of it: a holder may miss three renewals before it is stale


def lease_seconds() -> float:
    text = os.environ.get(LEASE_ENV)
    if text is None:
        return DEFAULT_LEASE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise CheckpointError(f"{LEASE_ENV} = {text!r}: expected a positive number of seconds")
    return value


class RunLock:
    """The lock on one run folder, held by this process from `acquire` to `release`."""

    def __init__(self, store: Store, record: dict, tag, lease: float):
        self.store, self.record, self.lease = store, record, lease
        self.path = store.url(LOCK)
        self._tag = tag                 # S3: the ETag of our record; local: the open, flocked file
        self._guard = threading.Lock()  # the heartbeat and the main thread both renew
        self._lost: str | None = None
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name=f"lock {self.path}", daemon=True)
        self._heartbeat.start()
        _HELD[store.root] = self

    @classmethod
    def acquire(cls, root: str, *, run: str) -> RunLock:
        """Take the lock on `root` or raise RunLockedError naming its holder; a takeover is logged as a warning."""
        store, lease = Store(root), lease_seconds()
        record = {"format": FORMAT, "run": run, **_identity(), "started": _now(), "renewed": _now(),
                  "lease_seconds": lease, "token": secrets.token_hex(8)}
        acquire = _acquire_s3 if store.is_s3 else _acquire_local
        tag = acquire(store, record)
        return cls(store, record, tag, lease)

    def confirm(self) -> None:
        """Renew the lease now and raise LockLostError if another run has taken the lock: call before writing."""
        self._renew()
        if self._lost:
            raise LockLostError(self._lost)

    def release(self) -> str | None:
        """Give the lock up: the record goes only if it is still ours. Returns why it was not ours, if it was not."""
        if self._stopped.is_set():  # released already
            return self._lost
        self._stopped.set()
        self._heartbeat.join()
        _HELD.pop(self.store.root, None)
        with self._guard:
            if self.store.is_s3:
                try:
                    if not self._lost and not self.store.delete_conditional(LOCK, self._tag):
                        self._lost = f"{self.path} was replaced by another run meanwhile: left as it is"
                except StoreError as e:   # storage gone (the error that ended the run, likely): said, not raised over it
                    return f"{e}; the lock is left as it is: another run may take it once its lease ({self.lease:g} s) lapses"
            elif not _release_local(self._tag, self.record["token"]):
                self._lost = self._lost or f"{self.path} was replaced by another run meanwhile: left as it is"
        return self._lost

    def _beat(self) -> None:
        while not self._stopped.wait(self.lease / 4):
            try:
                self._renew()
            except (OSError, StoreError):  # a blip: the next beat (or the save's confirm) tries again
                pass

    def _renew(self) -> None:
        with self._guard:
            if self._lost or self._stopped.is_set() and threading.current_thread() is self._heartbeat:
                return
            self.record = {**self.record, "renewed": _now()}
            if self.store.is_s3:
                tag = self.store.put_conditional(LOCK, _encode(self.record), etag=self._tag)
                if tag is None:
                    self._lost = _lost_message(self.path, _read_s3(self.store))
                else:
                    self._tag = tag
            else:
                current = _read_file(self._tag)
                if current is not None and current.get("token") != self.record["token"]:
                    self._lost = _lost_message(self.path, (current, 0.0))
                else:
                    _write_file(self._tag, self.record)


_HELD: dict[str, RunLock] = {}


@atexit.register
def _release_all() -> None:
    """A process that ends normally without releasing (a library user's script) still lets go."""
    for lock in list(_HELD.values()):
        lock.release()


def confirm_held(root: str) -> None:
    """Renew this process's lock on `root`, if it holds one, and raise LockLostError if it was taken over."""
    lock = _HELD.get(Store(root).root)
    if lock is not None:
        lock.confirm()


# -- local: flock, and the record in the same file ----------------------------------------------

def _acquire_local(store: Store, record: dict):
    path = store.url(LOCK)
    try:
        os.makedirs(store.root, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the run folder {store.root}: {e.strerror or e}") from e
    if os.path.islink(path):  # never written through: its target lies wherever the link points
        raise CheckpointError(f"{path} is a symlink (to {os.readlink(path)}), not a lock nanoflow made; nanoflow "
                              "writes no file through a link: remove the link and run again")
    try:
        # O_NOFOLLOW: a link put there after the check above is refused too (ELOOP), never written through
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+b")
    except OSError as e:
        why = "a symlink, not a lock nanoflow made" if e.errno == errno.ELOOP else e.strerror
        raise CheckpointError(f"cannot create the run lock {path}: {why}") from e
    try:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a live process (on this host, or one the file system arbitrates for) holds it
        holder = _read_file(f)
        f.close()
        raise RunLockedError(_held_message(path, holder, None)) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            f.close()
            raise CheckpointError(f"cannot lock {path}: {e.strerror}") from e
        log.warning(f"{path}: this file system has no locks ({e.strerror}); relying on the lease alone")
    previous = _read_file(f)
    try:
        age = datetime.datetime.now().timestamp() - os.fstat(f.fileno()).st_mtime
        _take_over_if_stale(path, previous, age, locked=True)
        _write_file(f, record)
    except OSError as e:  # a full disk, a file system turned read-only: nothing trained, nothing else written
        with contextlib.suppress(OSError):  # closing flushes what could not be written: the same error again
            f.close()
        raise CheckpointError(f"cannot write the run lock {path}: {e.strerror or e}") from e
    except BaseException:
        f.close()
        raise
    return f


def _read_file(f) -> dict | None:
    """The record in the open lock file; None when it is empty (released); {} when unreadable."""
    f.seek(0)
    data = f.read()
    return _decode(data) if data.strip() else None


def _write_file(f, record: dict) -> None:
    f.seek(0)
    f.write(_encode(record))
    f.truncate()
    f.flush()
    os.fsync(f.fileno())


def _release_local(f, token: str) -> bool:
    try:
        if (_read_file(f) or {}).get("token") != token:
            return False
        f.seek(0)
        f.truncate()  # emptied, not deleted (see the module's docstring)
        f.flush()
        return True
    finally:
        f.close()  # and with it the flock


# -- S3: conditional writes --------------------------------------------------------------------

def _acquire_s3(store: Store, record: dict) -> str:
    path = store.url(LOCK)
    for _ in range(8):  # each round ends only when another launcher changed the lock under us
        tag = store.put_conditional(LOCK, _encode(record), etag=None)
        if tag is not None:
            return tag
        found = _read_s3(store)
        if found is None:
            continue  # released meanwhile: try to create it again
        holder, age, etag = found
        _take_over_if_stale(path, holder, age, announce=False)
        tag = store.put_conditional(LOCK, _encode(record), etag=etag)
        if tag is not None:
            _take_over_if_stale(path, holder, age)  # now that it is ours: say so
            return tag
    raise RunLockedError(f"{path}: other launches keep changing the lock; is this run being started twice?")


def _read_s3(store: Store):
    """(record, age in seconds by the server's clock, ETag) of the lock object; None when there is none."""
    found = store.read_tagged(LOCK)
    if found is None:
        return None
    data, etag, age = found
    return _decode(data), age, etag


# -- the rule, shared ----------------------------------------------------------------------------

def _take_over_if_stale(path: str, holder: dict | None, age: float, announce: bool = True,
                        locked: bool = False) -> None:
    """Return if the lock is free or its holder is gone (announcing the takeover); else raise RunLockedError.

    `locked`: this process holds the local file's flock, so no live process on a host sharing its locks holds it."""
    if holder is None:
        return
    if holder == {}:
        if not locked:  # an object nanoflow did not write: never replaced on a guess
            raise RunLockedError(f"{path} exists but is not a nanoflow lock record; move it away if no run uses it")
        log.warning(f"taking over {path}: its record is unreadable (a holder killed while writing it)")
        return
    wrong = _wrong_field(holder)
    if wrong is not None:  # not a record nanoflow wrote: its holder cannot be judged, only the flock proves it gone
        if not locked:
            raise RunLockedError(f"{path}: {wrong}, so it is no record nanoflow wrote and its holder cannot be "
                                 "told; move it away if no run uses it")
        log.warning(f"taking over {path}: {wrong} (no nanoflow record), and no process holds its lock")
        return
    alive = _alive_here(holder)
    lease = float(holder.get("lease_seconds", DEFAULT_LEASE_SECONDS))
    if alive is None and age < lease:
        raise RunLockedError(_held_message(path, holder, (age, lease)))
    if alive:
        raise RunLockedError(_held_message(path, holder, None))
    if announce:
        why = ("its process is gone" if alive is False else
               f"its lease was not renewed for {age:.0f}s (lease {lease:g}s): the holder is presumed dead")
        log.warning(f"taking over {path} from {_describe(holder)}: {why}")


# The type each field of a record must have: anything else is no record nanoflow wrote,
# and is refused rather than trusted (a lock file of someone else's, or one damaged on disk).
_FIELDS = {"run": (str,), "host": (str, type(None)), "pid": (int,), "process_start": (int, type(None)),
           "boot_id": (str, type(None)), "pid_namespace": (str, type(None)), "started": (str,), "renewed": (str,),
           "lease_seconds": (int, float), "token": (str,)}


def _wrong_field(holder: dict) -> str | None:
    """What is wrong with the first field of `holder` of the wrong type (or a lease that is no positive number)."""
    for key, types in _FIELDS.items():
        value = holder.get(key)
        if key in holder and (not isinstance(value, types) or isinstance(value, bool)):
            return f"its field {key} = {json.dumps(value)} is not of the type nanoflow writes"
    lease = holder.get("lease_seconds", DEFAULT_LEASE_SECONDS)
    if not 0 < lease < float("inf"):
        return f"its field lease_seconds = {json.dumps(lease)} is no positive number of seconds"
    return None


def _alive_here(holder: dict) -> bool | None:
    """Whether the holder's process still runs, when it ran on this very kernel and pid namespace; else None."""
    me = _identity()
    if any(holder.get(k) != me[k] or me[k] is None for k in ("host", "boot_id", "pid_namespace")):
        return None
    start = _process_start(holder.get("pid"))
    return start is not None and start == holder.get("process_start")


def _identity() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "process_start": _process_start(pid),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_namespace": _pid_namespace()}


def _process_start(pid) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): a pid with it is that process."""
    text = _read_text(f"/proc/{pid}/stat") if isinstance(pid, int) else None
    try:
        return int(text.rpartition(")")[2].split()[19])
    except (AttributeError, IndexError, ValueError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _held_message(path: str, holder: dict | None, lease) -> str:
    if not holder:
        return f"{path} is held by another run (its record is being written); wait for it, or stop it"
    text = f"{path} is held by {_describe(holder)}"
    if lease is not None:
        age, seconds = lease
        text += (f"; its lease was renewed {age:.0f}s ago and lapses after {seconds:g}s without renewal: "
                 f"if that process is gone (a lost node), launch again in {max(seconds - age, 0):.0f}s")
    return text + "; one run writes a run folder at a time: wait for it to finish, or stop it"


def _lost_message(path: str, found) -> str:
    holder = found[0] if found else None
    who = _describe(holder) if holder else "nobody (it was deleted)"
    return (f"{path} was taken over by {who} while this run held it (its lease lapsed): this run stops "
            "without writing anything more")


def _describe(holder: dict) -> str:
    return (f"run {holder.get('run')!r}, pid {holder.get('pid')} on host {holder.get('host')} "
            f"(started {holder.get('started')})")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _encode(record: dict) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode()


def _decode(data: bytes) -> dict:
    try:
        record = json.loads(data)
    except ValueError:
        return {}
    return record if isinstance(record, dict) and record.get("format") == FORMAT else {}
