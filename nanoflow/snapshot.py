"""A TrainState as checkpoint blocks, and back: on any layout, each rank handles only its own pieces.

A sharded parameter (a DTensor under FSDP2 and/or tensor parallelism) is one contiguous box of
the global tensor on each rank; torch's `compute_local_shape_and_global_offset` — the helper
DCP's planner uses — says where, also for the `_StridedShard` FSDP2 puts on top of a column-wise
TP shard. Saving writes each box once (the lowest rank among replicas holding it); restoring
reads just the box each rank of the *new* layout holds, so a checkpoint resumes on any dp × tp.
The bytes themselves go through nanoflow.io.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

from nanoflow.config import Config
from nanoflow.data.fingerprint import DataChangedError, Fingerprints, fingerprint_changes
from nanoflow.io import Block, CheckpointError, CheckpointReader, DamagedCheckpointError
from nanoflow.model import Llama
from nanoflow.parallel import Topology, gather_objects
from nanoflow.schedule import Schedule, TrainingMetadata, resume_point, training_metadata
from nanoflow.state import TrainState, build_optimizer, new_model

log = logging.getLogger(__name__)

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
    coordinate = dict(zip(topology.mesh.mesh_dim_names, topology.mesh.get_coordinate()))
    if not isinstance(tensor, DTensor):
        return all(c == 0 for c in coordinate.values())
    sharded_on = {name for name, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements)
                  if not (placement.is_replicate() or placement.is_partial())}  # Shard or FSDP's _StridedShard
    return all(c == 0 for name, c in coordinate.items() if name not in sharded_on)


def _block(tensor: torch.Tensor) -> Block:
    offset, _ = local_box(tensor)
    data = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return Block(data.detach(), tuple(tensor.shape), offset)


def checkpoint_blocks(state: TrainState, data_fingerprint: dict | None = None) -> tuple[dict[str, dict[str, Block]], dict]:
    """This rank's blocks of the state by group and HF name, and what the metadata records besides them
    (with `data_fingerprint`, {stage name: fingerprint} of the begun stages, when given)."""
    state.check_live()
    topology = state.topology
    params = dict(state.model.named_parameters())  # a tied lm_head is saved once, as model.embed_tokens.weight
    model = {name: _block(p) for name, p in params.items() if owns(p, topology)}
    optimizer = {}
    for name, p in params.items():
        moments = state.optimizer.state.get(p)
        if not moments:
            continue
        if owns(p, topology):
            optimizer.update({f"{key}.{name}": _block(moments[key]) for key in MOMENTS})
        if topology.is_main:
            optimizer[f"{STEP}.{name}"] = Block.whole(moments[STEP])
    info = {
        "training": training_metadata(state.schedule, state.step).to_dict(),
        "lr_origin": state.lr_origin,
        "topology": topology.to_dict(),
        "config": state.config.to_dict(),
    }
    if data_fingerprint is not None:
        info["data_fingerprint"] = data_fingerprint
    rng = {"cpu": Block.whole(state.rng_state)} if topology.is_main else {}
    return {"model": model, "optimizer": optimizer, "rng": rng}, info


def checkpoint_bytes(state: TrainState) -> int:
    """About what a checkpoint of `state` writes, all ranks together: the weights and AdamW's two moments."""
    return 3 * sum(p.numel() * p.element_size() for p in state.model.parameters())


def place(target: torch.Tensor, read_box) -> None:
    """Fill this rank's box of `target` (a parameter or moment, sharded or not) with read_box(offset, shape)."""
    offset, shape = local_box(target)
    local = target.to_local() if isinstance(target, DTensor) else target
    with torch.no_grad():
        local.copy_(read_box(offset, shape))


def load_weights(model: Llama, reader, source: str) -> None:
    """Copy weights by HF name into a (possibly sharded) model, refusing missing, unexpected or misshapen
    ones. `reader` is a CheckpointReader or an HF folder's nanoflow.io.hf.HFWeights: names(), shape(),
    fetch() and read() of boxes — each rank reads only its own."""
    params = dict(model.named_parameters())
    names = set(reader.names("model"))
    tied_alias = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    missing, unexpected = sorted(set(params) - names), sorted(names - set(params) - tied_alias)
    if missing or unexpected:
        raise ValueError(f"{source}: the weights do not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, p in params.items():
        saved = reader.shape("model", name)
        if saved != tuple(p.shape):
            raise ValueError(f"{source}: {name} has shape {list(saved)}, the model expects {list(p.shape)}")
    reader.fetch(("model", name, *local_box(p)) for name, p in params.items())
    for name, p in params.items():
        place(p, lambda offset, shape, n=name: reader.read("model", n, offset, shape))


def read_on_every_rank(read, topology: Topology):
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


ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings")


def _check_architecture(config: Config, reader: CheckpointReader) -> None:
    """Refuse, on every rank alike and before any tensor is read, a model that the checkpoint's weights cannot fit."""
    saved = reader.metadata["config"]["model"]
    differences = [f"model.{key} was {saved.get(key)}, the config now says {getattr(config.model, key)}"
                   for key in ARCHITECTURE if saved.get(key) != getattr(config.model, key)]
    if differences:
        raise CheckpointError(f"{reader.path} holds a different model:\n  " + "\n  ".join(differences))


def _check_data(config: Config, reader: CheckpointReader, fingerprints: Fingerprints | None) -> None:
    """Refuse, before any tensor is read, to resume a begun stage on other data, tokenizer or seeds
    (unless checkpoints.ignore_fingerprint_mismatch, then warn). A checkpoint without fingerprints
    (written before nanoflow recorded them) is not checked."""
    saved = reader.metadata.get("data_fingerprint")
    if fingerprints is None or not isinstance(saved, dict):
        return
    changes = fingerprint_changes(saved, fingerprints.of(list(saved)))
    if not changes:
        return
    text = (f"{reader.path}: the data of stages this checkpoint has trained differs from what they trained on:\n  "
            + "\n  ".join(changes[:20]) + (f"\n  … and {len(changes) - 20} more" if len(changes) > 20 else ""))
    if not config.checkpoints.ignore_fingerprint_mismatch:
        raise DataChangedError(text + "\nTo resume on the changed data anyway, set [checkpoints] "
                                      "ignore_fingerprint_mismatch = true (or start a new run)")
    log.warning(f"{text}\n  resuming anyway, as checkpoints.ignore_fingerprint_mismatch = true says; "
                "the next checkpoint records the new fingerprints")


def restore_state(config: Config, reader: CheckpointReader, topology: Topology, *, load_optimizer: bool = True,
                  load_lr_scheduler: bool = True, fingerprints: Fingerprints | None = None) -> TrainState:
    """The TrainState a checkpoint recorded, under `config` and on this `topology`, whatever layout saved it.

    The config's begun stages must match the checkpoint's (ScheduleDriftError otherwise).
    `load_optimizer=False` starts fresh AdamW moments; `load_lr_scheduler=False` restarts the LR
    schedule (warmup included) at the resume step. Step, stage and data position are kept either way.
    """
    schedule = Schedule.from_config(config)
    trained = TrainingMetadata.from_dict(reader.metadata["training"])
    resume_point(schedule, trained)  # raises ScheduleDriftError if the config rewrites trained history
    _check_architecture(config, reader)
    _check_data(config, reader, fingerprints)
    return read_on_every_rank(lambda: _restore(config, reader, topology, schedule, trained, load_optimizer,
                                               load_lr_scheduler), topology)


def _restore(config: Config, reader: CheckpointReader, topology: Topology, schedule: Schedule,
             trained: TrainingMetadata, load_optimizer: bool, load_lr_scheduler: bool) -> TrainState:
    model = new_model(config, topology, init=False)
    load_weights(model, reader, reader.path)
    optimizer = build_optimizer(model, config.optimizer)
    saved = set(reader.names("optimizer"))
    if load_optimizer:
        params = [(name, p) for name, p in model.named_parameters() if f"{STEP}.{name}" in saved]
        reader.fetch([("optimizer", f"{STEP}.{name}", None, None) for name, _ in params]
                     + [("optimizer", f"{key}.{name}", *local_box(p)) for name, p in params for key in MOMENTS])
        for name, p in model.named_parameters():
            if f"{STEP}.{name}" not in saved:
                continue  # a parameter the optimizer had not stepped yet
            state = {STEP: reader.read("optimizer", f"{STEP}.{name}").clone()}
            for key in MOMENTS:
                moment = torch.zeros_like(p)
                place(moment, lambda o, s, k=key: reader.read("optimizer", f"{k}.{name}", o, s))
                state[key] = moment
            optimizer.state[p] = state
    lr_origin = reader.metadata["lr_origin"] if load_lr_scheduler else trained.completed
    return TrainState.create(step=trained.completed, model=model, optimizer=optimizer,
                             rng_state=reader.read("rng", "cpu").clone(), lr_origin=lr_origin, config=config,
                             schedule=schedule, topology=topology)
