"""Sharded tensors as boxes: which box of a global tensor this rank holds, writes and reads.

A sharded parameter (a DTensor under FSDP2 and/or tensor parallelism) is one contiguous box of
the global tensor on each rank; torch's `compute_local_shape_and_global_offset` — the helper
DCP's planner uses — says where, also for the `_StridedShard` FSDP2 puts on top of a column-wise
TP shard. Saving writes each box once (the lowest rank among replicas holding it); restoring
reads just the box each rank of the *new* layout holds, so a checkpoint resumes on any dp × tp.
The bytes themselves go through nanoflow.io; the checkpoint lifecycle is nanoflow.checkpoint.checkpointer's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from nanoflow.io import Block, CheckpointError
from nanoflow.model import Llama
from nanoflow.parallel.mesh import Topology

MOMENTS = ("exp_avg", "exp_avg_sq")   # per-element AdamW state, sharded like the parameter
STEP = "step"                          # AdamW's per-parameter step count, a scalar


def local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's box of `tensor` in the global tensor."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(offset), tuple(shape)
    return (0,) * tensor.dim(), tuple(tensor.shape)


def owns(tensor: torch.Tensor, topology: Topology) -> bool:
    """Whether this rank writes its box of `tensor`: only the first of the ranks holding the same box."""
    if topology.mesh is None:
        return True
    names, coordinates = topology.mesh.mesh_dim_names, topology.mesh.get_coordinate()
    assert names is not None and coordinates is not None   # the run's mesh: named, and this rank is in it
    coordinate = dict(zip(names, coordinates, strict=True))
    if not isinstance(tensor, DTensor):
        return all(c == 0 for c in coordinate.values())
    assert tensor.device_mesh.mesh_dim_names is not None   # the run's mesh, named
    sharded_on = {name for name, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements, strict=True)
                  if not (placement.is_replicate() or placement.is_partial())}  # Shard or FSDP's _StridedShard
    return all(c == 0 for name, c in coordinate.items() if name not in sharded_on)


def _block(tensor: torch.Tensor) -> Block:
    offset, _ = local_box(tensor)
    data = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return Block(data.detach(), tuple(tensor.shape), offset)


def state_blocks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, topology: Topology,
                 ema: dict[str, torch.Tensor] | None = None) -> dict[str, dict[str, Block]]:
    """This rank's blocks of the weights and AdamW state, by group ("model", "optimizer") and HF name; with
    `ema`, the weight EMA too (group "ema", the weights' names), each written by the rank that writes its weight."""
    params = dict(model.named_parameters())  # a tied lm_head is saved once, as model.embed_tokens.weight
    weights = {name: _block(p) for name, p in params.items() if owns(p, topology)}
    moments = {}
    for name, p in params.items():
        state = optimizer.state.get(p)
        if not state:
            continue
        if owns(p, topology):
            moments.update({f"{key}.{name}": _block(state[key]) for key in MOMENTS})
        if topology.is_main:
            moments[f"{STEP}.{name}"] = Block.whole(state[STEP])
    groups = {"model": weights, "optimizer": moments}
    if ema is not None:
        groups["ema"] = {name: _block(ema[name]) for name, p in params.items() if owns(p, topology)}
    return groups


def state_bytes(model: torch.nn.Module, ema: bool = False) -> int:
    """About what a checkpoint of `model` and its AdamW state (and a float32 weight EMA) writes, all ranks together."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * weights + (sum(p.numel() * 4 for p in model.parameters()) if ema else 0)


def local_tensor(target: torch.Tensor) -> torch.Tensor:
    """This rank's own tensor of `target` (its local shard for a DTensor), sharing its memory."""
    return target.to_local() if isinstance(target, DTensor) else target


def fill(reader, group: str, targets: Mapping[str, torch.Tensor]) -> None:
    """Fill each target (by saved name; sharded or not) with this rank's box of it: straight into the
    tensor where the reader can (CheckpointReader.fill), else each box read, then copied in."""
    boxes = [(group, name, *local_box(t), local_tensor(t)) for name, t in targets.items()]
    if hasattr(reader, "fill"):
        reader.fill(boxes)
        return
    reader.fetch(box[:4] for box in boxes)
    with torch.no_grad():
        for group, name, offset, shape, local in boxes:
            local.copy_(reader.read(group, name, offset, shape))


def weight_mismatches(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], *,
                      tied: bool) -> list[str]:
    """One line per way weights `found` ({HF name: shape}) fail a model that has `expected`: names missing,
    names unexpected, shapes that differ. A tied model takes a stored lm_head.weight too (it is the embedding)."""
    def listed(names: list[str]) -> str:
        return ", ".join(names[:6]) + (f" … and {len(names) - 6} more" if len(names) > 6 else "")

    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - ({"lm_head.weight"} if tied else set()))
    lines = ([f"missing {listed(missing)}"] if missing else []) + \
        ([f"unexpected {listed(unexpected)}"] if unexpected else [])
    return lines + [f"{name} has shape {list(found[name])}, the model expects {list(shape)}"
                    for name, shape in expected.items() if name in found and tuple(found[name]) != tuple(shape)]


def load_weights(model: Llama, reader, source: str) -> None:
    """Copy weights by HF name into a (possibly sharded) model, refusing missing, unexpected or misshapen
    ones (CheckpointError). `reader` is a CheckpointReader or an HF folder's nanoflow.io.hf.HFWeights:
    names(), shape(), fetch() and read() of boxes — each rank reads only its own."""
    params = dict(model.named_parameters())
    problems = weight_mismatches({name: tuple(p.shape) for name, p in params.items()},
                                 {name: tuple(reader.shape("model", name)) for name in reader.names("model")},
                                 tied=model.cfg.tie_word_embeddings)
    if problems:
        raise CheckpointError(f"{source}: the weights do not fit the model:\n  " + "\n  ".join(problems))
    fill(reader, "model", params)


def load_ema(model: torch.nn.Module, reader) -> dict[str, torch.Tensor] | None:
    """The weight EMA a checkpoint saved (group "ema"), each rank reading its boxes into tensors sharded like
    `model`'s parameters; None when the checkpoint has none."""
    if "ema" not in reader.metadata["tensors"]:
        return None
    ema = {name: torch.empty_like(p, dtype=torch.float32) for name, p in model.named_parameters()}
    fill(reader, "ema", ema)
    return ema


def load_moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader) -> None:
    """Fill `optimizer` (AdamW, built for `model`) with the moments and step counts a checkpoint saved,
    each rank reading only its boxes; a parameter the optimizer had not stepped yet stays without state.
    Each tensor is made in the form the optimizer's implementation keeps it (step_form)."""
    saved = set(reader.names("optimizer"))
    params = [(name, p) for name, p in model.named_parameters() if f"{STEP}.{name}" in saved]
    # Left unset (empty_like, not zeros_like): the read fills every element, so a zero-fill first is wasted.
    # Like the parameter: its dtype, device and (sharded) layout, as torch's AdamW makes its moments.
    states = {p: {key: torch.empty_like(p) for key in MOMENTS} for _, p in params}
    fill(reader, "optimizer", {f"{key}.{name}": states[p][key] for name, p in params for key in MOMENTS})
    reader.fetch(("optimizer", f"{STEP}.{name}", None, None) for name, _ in params)
    group_of = {id(q): group for group in optimizer.param_groups for q in group["params"]}
    for name, p in params:
        step = step_form(reader.read("optimizer", f"{STEP}.{name}"), p, group_of[id(p)])
        optimizer.state[p] = {STEP: step, **states[p]}


def step_form(saved: torch.Tensor, param: torch.Tensor, group: dict) -> torch.Tensor:
    """A saved AdamW step count as the optimizer keeps it for `param` (of param group `group`), as torch's own
    load_state_dict makes it (Optimizer._process_value_according_to_param_policy): on the parameter's device in
    float32 for the fused and the capturable kernels, which read it there; a CPU scalar otherwise (torch keeps it
    on the host so that a GPU step launches no kernel for it)."""
    if group.get("fused") or group.get("capturable"):
        return saved.to(dtype=torch.float32, device=param.device)
    return saved.clone()
