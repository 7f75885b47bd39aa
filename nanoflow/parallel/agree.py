"""Agreement across ranks: every question the ranks of a run must answer alike, so that an error or a stop
on one rank stops them all at the same point instead of leaving the others waiting in their next collective.

Beside the plain collectives (nanoflow.parallel.mesh: broadcast_object, gather_objects): each function here
is one collective, made by every rank in the same order; a single process (no mesh) makes none.
"""

from __future__ import annotations

import torch

from nanoflow.errors import NanoflowError
from nanoflow.io import CheckpointError, DamagedCheckpointError
from nanoflow.parallel.mesh import Topology, broadcast_object, device, gather_objects


def on_main(action, topology: Topology):
    """action() on rank 0, its result on every rank; a NanoflowError it raises is raised on every rank
    (never a rank left waiting)."""
    result, failure = None, None
    if topology.is_main:
        try:
            result = action()
        except NanoflowError as e:
            failure = e
    failure, result = broadcast_object((failure, result), topology)
    if failure is not None:
        raise failure
    return result


def on_every_rank(read, topology: Topology):
    """read() — this rank's part of a checkpoint — then agree: each rank reads, and checks, only its
    own shards, so a damaged one may stop a single rank; it then fails every rank alike instead of
    leaving the others waiting in their next collective. Damage stays a DamagedCheckpointError."""
    failure = None
    try:
        result = read()
    except Exception as e:
        result, failure = None, e
    reports = gather_objects(None if failure is None else (isinstance(failure, DamagedCheckpointError), str(failure)),
                             topology)
    failed = [(rank, *report) for rank, report in enumerate(reports) if report is not None]  # (rank, damaged, message)
    if not failed:
        return result
    # One verdict on every rank, from the same reports: damage (an older checkpoint may do) only if every
    # failure was damage; otherwise an error that stops every rank.
    damaged = all(d for _, d, _ in failed)
    if failure is not None and isinstance(failure, DamagedCheckpointError) == damaged:
        raise failure
    rank, _, message = next(f for f in failed if f[1] == damaged)
    raise (DamagedCheckpointError if damaged else CheckpointError)(f"(on rank {rank}) {message}") from failure


def any_failed(result, failure: BaseException | None, topology: Topology) -> tuple[list, tuple[int, str] | None]:
    """Every rank's `result` in rank order, and the first rank whose work failed with (rank, "Type: message"),
    None when none did: the same on every rank, so that all of them fail together or none."""
    gathered = gather_objects(result if failure is None else f"{type(failure).__name__}: {failure}", topology)
    failed = [(rank, report) for rank, report in enumerate(gathered) if isinstance(report, str)]
    return gathered, (failed[0] if failed else None)


def every_rank(flag: bool, topology: Topology) -> bool:
    """Whether `flag` holds on every rank."""
    return all(gather_objects(flag, topology))


def any_rank(flag: bool, topology: Topology) -> bool:
    """Whether `flag` holds on some rank: one tiny all-reduce (a device tensor, cheap enough for every step)."""
    if topology.mesh is None:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())
