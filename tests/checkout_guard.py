"""The check that no test touches the user's checkout: its runs/ and hf/ are the user's, not the tests'.

A test may read the checkout's committed files (the code, schedules/, the generated corpus) and nothing else of it:
it writes nothing anywhere in the checkout and reads nothing under runs/ or hf/, where the README's own commands put
their runs and exports — a test that read those would pass or fail by what the user ran before. One exception, read
only: READS_ALLOWED (test_curriculum_skill reuses the Quickstart's finished run when it is this checkout's).

Two nets, because neither alone sees everything:
- a Python audit hook (sys.addaudithook) in the pytest process and, through tests/guard_site/sitecustomize.py on
  PYTHONPATH, in every Python subprocess it starts (bin/*, torchrun and its workers), sees each open, listing, mkdir,
  rename and removal; what it finds is charged to the test that was running (PYTEST_CURRENT_TEST) and fails it;
- a walk of the checkout at the start and end of the session (size and mtime of every file) catches what no Python
  process did (a docs page's shell commands), and fails the session, naming the paths.
Python's own caches (__pycache__, .pytest_cache, .hypothesis) are not the user's, and are let be.
"""

from __future__ import annotations

import os
import sys

CHECKOUT_VARIABLE = "NANOFLOW_TEST_CHECKOUT"    # the checkout's real path, for the subprocesses' hook
LOG_VARIABLE = "NANOFLOW_TEST_GUARD_LOG"        # where the subprocesses' hooks write what they saw
USERS = ("runs", "hf")                          # the checkout's folders the README's commands write into
CACHES = {"__pycache__", ".pytest_cache", ".hypothesis"}
NOT_WALKED = {".git", ".venv", *CACHES}
READS_ALLOWED = {("tests/e2e/test_curriculum_skill.py", os.path.join("runs", "curriculum"))}

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_WRITES = {  # audit event -> the positions of its path arguments (all of them written)
    "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1),
    "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,),
    "shutil.move": (0, 1), "os.mkfifo": (0,), "os.mknod": (0,),
}
_PATH_READS = {"os.listdir": 0, "os.scandir": 0}
# event -> {position of a path argument: position of the dir_fd it is relative to}: shutil.rmtree (and anything
# else walking by descriptors) names each entry relative to its folder's descriptor, not to the working directory
_DIR_FDS = {
    "os.mkdir": {0: 2}, "os.remove": {0: 1}, "os.rmdir": {0: 1}, "os.rename": {0: 2, 1: 3}, "os.replace": {0: 2, 1: 3},
    "os.symlink": {1: 2}, "os.link": {0: 2, 1: 3}, "os.chmod": {0: 2}, "os.chown": {0: 3}, "os.utime": {0: 3},
    "shutil.rmtree": {0: 1},
}


class Guard:
    """What a process's hook saw: `found` holds (test, "wrote"/"read", path inside the checkout)."""

    def __init__(self, checkout: str, log: str | None = None):
        self.checkout = checkout
        self.log = log
        self.found: list[tuple[str, str, str]] = []
        self._busy = False
        self._folders: dict[str, str] = {}   # a folder as named -> its real path (a symlink may lead into the checkout)

    def inside(self, path, dir_fd: int | None = None) -> str | None:
        """`path` (relative to the folder open as `dir_fd`, when given) relative to the checkout, or None when it
        lies outside (or is not a path)."""
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        elif isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            return None
        if isinstance(dir_fd, int) and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        path = os.path.abspath(path)
        folder, name = os.path.split(path)
        real = self._folders.get(folder)
        if real is None:
            real = self._folders[folder] = os.path.realpath(folder)
        if os.path.islink(path):    # the entry itself is a link: what it names is what is touched
            real_path = os.path.realpath(path)
        else:
            real_path = os.path.join(real, name)
        if real_path != self.checkout and not real_path.startswith(self.checkout + os.sep):
            return None
        return os.path.relpath(real_path, self.checkout)

    def hook(self, event: str, args: tuple) -> None:
        if self._busy or not (event == "open" or event in _PATH_WRITES or event in _PATH_READS):
            return
        self._busy = True
        try:
            if event == "open":
                path, mode, flags = (tuple(args) + (None, None))[:3]
                written = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    mode is None and isinstance(flags, int) and bool(flags & _WRITE_FLAGS))
                self._check(path, written)
            elif event in _PATH_READS:
                self._check(args[_PATH_READS[event]] if args else None, False)
            else:
                dir_fds = _DIR_FDS.get(event, {})
                for position in _PATH_WRITES[event]:
                    if position < len(args):
                        at = dir_fds.get(position)
                        self._check(args[position], True, args[at] if at is not None and at < len(args) else None)
        except Exception:   # a check that breaks must not break the test's own code; the session walk remains
            pass
        finally:
            self._busy = False

    def _check(self, path, written: bool, dir_fd: int | None = None) -> None:
        relative = self.inside(path, dir_fd)
        if relative is None or relative == "." and not written:
            return
        parts = relative.split(os.sep)
        if CACHES.intersection(parts):
            return
        if not written and parts[0] not in USERS:
            return
        test = os.environ.get("PYTEST_CURRENT_TEST", "(no test)").split("::")[0]
        if not written and any(test == t and (relative + os.sep).startswith(p + os.sep) for t, p in READS_ALLOWED):
            return
        record = (os.environ.get("PYTEST_CURRENT_TEST", "(no test)"), "wrote" if written else "read", relative)
        if self.log is None:
            self.found.append(record)
        else:
            with open(self.log, "a") as log:
                log.write("\t".join(record) + "\n")


def install_in_subprocess() -> None:
    """Called by tests/guard_site/sitecustomize.py in every Python process a test starts."""
    checkout, log = os.environ.get(CHECKOUT_VARIABLE), os.environ.get(LOG_VARIABLE)
    if checkout and log:
        sys.addaudithook(Guard(checkout, log).hook)


def walk(checkout: str) -> dict[str, tuple[int, int]]:
    """Every file and link of the checkout (but git's and Python's own) with its size and mtime."""
    seen = {}
    for folder, folders, files in os.walk(checkout):
        folders[:] = [f for f in folders if f not in NOT_WALKED]
        for name in files + [f for f in folders if os.path.islink(os.path.join(folder, f))]:
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            seen[os.path.relpath(path, checkout)] = (info.st_size, info.st_mtime_ns)
    return seen


def changed(before: dict, after: dict) -> list[str]:
    return sorted(f"{'new' if p not in before else 'gone' if p not in after else 'changed'}: {p}"
                  for p in set(before) | set(after) if before.get(p) != after.get(p))
