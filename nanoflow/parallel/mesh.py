"""The mesh: torch.distributed from torchrun's environment, a ("dp", "tp") DeviceMesh, where this process sits in
it (Topology), and the collectives the run makes across ranks. What is sharded how over that mesh is declared in
nanoflow.parallel.plan.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from datetime import timedelta
from typing import NoReturn

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nanoflow.config import Config, check_world_size
from nanoflow.errors import PeerLostError


@attrs.frozen
class Topology:
    """Where this process sits. A single process has no mesh and rank 0 of 1."""

    dp: int = 1
    tp: int = 1
    rank: int = 0
    mesh: DeviceMesh | None = None

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group() if self.mesh is not None and self.dp > 1 else None

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "world_size": self.world_size}


SINGLE = Topology()


def device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")


# Whether this process joined a process group (see exit_process). A fact of the process, not of a run: torch's default
# process group is the process's, joined once and kept by every run it trains (bin/sweep's too) until it exits.
_joined_a_group = False


def init_topology(config: Config) -> Topology:
    """Join the process group torchrun started (NCCL on CUDA, gloo on CPU) and build the mesh.

    Without torchrun (no WORLD_SIZE) this is a single process, which needs dp = tp = 1.
    """
    dp, tp = config.parallelism.dp, config.parallelism.tp
    check_world_size(config, os.environ.get("WORLD_SIZE"))
    if dp * tp == 1:
        return SINGLE
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device())
        timeout = timedelta(minutes=10)   # a collective waits this long for a late rank (a save, compiling)
        # NCCL bound to this rank's GPU from the start (eager init: a rank that cannot reach its GPU fails here)
        bound = device() if backend == "nccl" else None
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=bound)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, device_id=bound)
    global _joined_a_group
    _joined_a_group = True
    mesh = init_device_mesh(device().type, (dp, tp), mesh_dim_names=("dp", "tp"))
    if dp > 1 and tp > 1:
        _quiet_norm_redistribution()
    return Topology(dp, tp, dist.get_rank(), mesh)


class _NotTheGradNorm(logging.Filter):
    """Drops DTensor's warning that a value partial over both "dp" and "tp" is made whole by two all-reduces, one
    per mesh dimension, instead of one over both. Here that value is the gradient norm (grad_norm: a scalar a
    step), so the second all-reduce costs nothing measurable, and every rank reduces in the same order (dp, then
    tp), so no two ranks can differ, which is the warning's other concern. Left in, it is one line per rank on
    every dp × tp run, telling the user to change what nanoflow decides."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_reduce operations will be performed" not in record.getMessage()


def _quiet_norm_redistribution() -> None:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _NotTheGradNorm) for f in logger.filters):
        logger.addFilter(_NotTheGradNorm())


def _restart_store(timeout: timedelta):
    """The key-value store for this attempt's process group when torchrun shares its own (None: torch's default).

    torchrun's c10d rendezvous (--standalone, --rdzv_backend=c10d) hands every attempt of the worker group the
    same store at the same MASTER_PORT, and torch (2.13) sets the process group up in it under the same keys
    each time: after `--max-restarts` restarts the workers, a new worker can read the address its killed
    predecessor published and wait on it until the 10-minute timeout (seen: both workers hung in
    init_process_group after rank 1 was killed). A prefix per attempt keeps each attempt's keys apart; the
    agent counts the attempts (TORCHELASTIC_RESTART_COUNT), the same for all the workers of one node, and a
    failure on one node fails, and so restarts, the workers of every node."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"nanoflow/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", shared)


def all_reduce_sum(value: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Sum over the data-parallel replicas (tp ranks of one replica already hold the same value)."""
    if topology.dp_group is not None:
        dist.all_reduce(value, group=topology.dp_group)
    return value


def grad_norm(parameters) -> torch.Tensor:
    """The global L2 norm of all gradients, whatever mix of meshes they are sharded over.

    torch's clip_grad_norm_ refuses gradients on different meshes (FSDP-only norms beside
    FSDP×TP matrices), so the norm is taken per mesh and the results combined.
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()


def scale_gradients(parameters, scale: torch.Tensor) -> None:
    """Multiply every gradient in place by `scale`, a device scalar (never read on the host).

    Each rank scales its own blocks of sharded gradients: one foreach over plain tensors, whatever
    mix of meshes the gradients are on (a foreach cannot mix DTensors of several meshes with tensors).
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
        torch._foreach_mul_(local, scale)


def barrier(topology: Topology) -> None:
    if topology.mesh is not None:
        dist.barrier()


def broadcast_object(value, topology: Topology):
    """Rank 0's `value` on every rank."""
    if topology.mesh is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value, topology: Topology) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if topology.mesh is None:
        return [value]
    out = [None] * topology.world_size
    dist.all_gather_object(out, value)
    return out


# What gloo's TCP transport says when the connection to a peer breaks (its process or node gone) or times out
_GLOO_LOST = re.compile(r"gloo/transport/.*?\]\s*(.*?)(?:\. This is typically caused.*)?$", re.DOTALL)


def lost_peer(error: BaseException | None) -> PeerLostError | None:
    """The PeerLostError of `error` (or of an error it was raised from) when it is a collective whose peer went away:
    gloo's broken or timed-out connection, or torch.distributed's own network and backend errors; None otherwise."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        found = _GLOO_LOST.search(text) if isinstance(error, RuntimeError) else None
        if found is not None or isinstance(error, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
            cause = (found.group(1) if found is not None else text).strip().splitlines()[0].rstrip(".")
            return PeerLostError(f"lost the connection to another process of the run ({cause}): a node or worker is "
                                 "gone; nothing was saved after the last committed checkpoint, which stands: run the "
                                 "same command again (on every node) to resume from it")
        error = error.__cause__ or error.__context__
    return None


def shutdown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with exit status `code`, after shutdown() and once everything is written and closed.

    A process that joined a process group skips the interpreter's teardown. torch's DeviceMesh keeps
    the gloo process groups alive past destroy_process_group, so they are freed while the interpreter
    clears its modules, and that can — rarely — abort a worker whose work is all done ("terminate
    called without an active exception", a SIGABRT that torchrun reports as the run's failure).
    """
    if _joined_a_group:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
