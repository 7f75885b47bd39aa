"""How many intra-op threads a process computes with: chosen once when a run starts, kept by its resumes.

torch's default is a thread per CPU. On CPUs other work keeps busy, a thread that loses its core holds up the
others at the end of every parallel op, and a step takes several times as long as on one thread
(BENCHMARKS.md, "Intra-op threads"). And the count is part of the numbers: a reduction split over two threads
sums in another order than over one, so a run resumed with another count is not its straight run bit for bit.

So the count is a fact of the run, like its layout: bin/* that train (and bin/eval) choose it when a run
starts — the CPUs the process may use (its affinity, a cgroup's CPU quota) less those the load average says
other work keeps busy, at least one — and a resume takes the count its checkpoint recorded. OMP_NUM_THREADS,
when set (torchrun sets 1 for several processes a node), is the user's choice and never overridden; nor is the
count of a program that uses nanoflow as a library (it sets torch's threads itself, or keeps torch's default):
only `choose_by_default()`, which the front ends call, lets nanoflow choose.
"""

from __future__ import annotations

import math
import os

ENV = "OMP_NUM_THREADS"
# Set by the front ends: nanoflow may set the count (see the module's docstring). A fact of the process, not of a run:
# torch's intra-op thread count is the process's, and who may set it (a command, or a library user) is decided once.
_choosing = False


def choose_by_default() -> None:
    """Let this process choose its intra-op thread count (bin/* call it; a library user's count is theirs)."""
    global _choosing
    _choosing = True


def chosen() -> bool:
    """Whether nanoflow sets this process's count: a front end asked it to, and OMP_NUM_THREADS is not set."""
    return _choosing and not os.environ.get(ENV, "").strip()


def count_for(available: int, cpus: int, load: float) -> int:
    """The threads to use on `available` CPUs of a machine of `cpus`, whose load average is `load` (runnable
    tasks, the machine's): the available CPUs, less the share of them the load keeps busy; at least one."""
    busy = available * min(load / max(cpus, 1), 1.0)
    return max(1, min(available, math.floor(available - busy + 0.5)))


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity, within a cgroup's CPU quota (a container's --cpus)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # no affinity on this OS
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _cgroup_quota() -> float | None:
    """CPUs' worth of time the cgroup allows (cgroup v2 cpu.max, v1 cfs quota / period); None when unlimited."""
    try:
        quota, period = _read("/sys/fs/cgroup/cpu.max").split()
    except (OSError, ValueError):
        try:
            quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        except OSError:
            return None
    try:
        return int(quota) / int(period) if int(quota) > 0 else None
    except (ValueError, ZeroDivisionError):   # "max": no quota
        return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def choose(recorded: int | None) -> tuple[int, str]:
    """The count this process is to use when nanoflow chooses it (see chosen()): `recorded` (a resumed run's), else
    by available_cpus() and the load; and the line that says it."""
    if recorded is not None:
        return recorded, f"intra-op threads: {recorded}, the count the run trained with ({ENV} sets another)"
    available, load = available_cpus(), _load()
    count = count_for(available, os.cpu_count() or available, load)
    return count, (f"intra-op threads: {count} ({available} CPU{'s' * (available != 1)} available, load average "
                   f"{load:.1f}; {ENV} sets another count)")


def apply(count: int) -> None:
    import torch  # here, not at the top: the front ends call choose_by_default() before torch is imported
    torch.set_num_threads(count)


def current() -> int:
    import torch
    return torch.get_num_threads()


def mismatch(recorded: int | None) -> str | None:
    """When nanoflow does not choose the count, and a resumed run's `recorded` count differs from this process's:
    the line that says the continuation is not bit for bit, and how to make it so."""
    now = current()
    if chosen() or recorded is None or recorded == now:
        return None
    how = f"{ENV}={os.environ[ENV]}" if os.environ.get(ENV, "").strip() else "torch.set_num_threads"
    return (f"this run trained with {recorded} intra-op thread{'s' * (recorded != 1)} and resumes with {now} "
            f"({how}): sums split over threads round differently, so it continues close to, not bit for bit as, the "
            f"run trained straight; {ENV}={recorded} resumes it bit for bit")


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
