"""One optimizer step on one global batch: `train_step(state, batch) -> (state, metrics)`."""

from __future__ import annotations

import contextlib
import math

import torch

from nanoflow.config import stage_rope
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.errors import DivergedError
from nanoflow.lr import scheduled_lr
from nanoflow.parallel import runtime
from nanoflow.parallel.mesh import all_reduce_sum, grad_norm, scale_gradients
from nanoflow.schedule import active_stage
from nanoflow.state import TrainState


def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
    """Forward, backward and AdamW update on `batch`, split into the stage's micro-batches, with the stage's RoPE.

    `batch` maps "input_ids" and "labels" to LongTensors [micro_batch_size × accumulation, seq]
    (this data-parallel replica's part of the global batch), labels already shifted, -100
    ignored; and, for packed documents that attend only to themselves, "position_ids" of the same
    shape, restarting at 0 at each document (absent: 0..seq-1, plain causal attention). The loss is the mean over every target token of the global batch, so how the batch
    is split into replicas and micro-batches does not change the gradient (beyond float
    rounding), masks included. Metrics are global: the same on every rank. A non-finite loss or
    gradient norm raises DivergedError before the update, leaving the parameters and moments as they were.
    """
    state.check_live()
    schedule, config = state.schedule, state.config
    step = state.step + 1
    if step > schedule.train_steps:
        raise ValueError(f"training is complete: all {schedule.train_steps} steps of the schedule are done")
    index = active_stage(schedule, step)
    stage, tokens = schedule.stages[index], config.stage_tokens(index)
    assert tokens.batch_accumulation_per_replica is not None   # stage_tokens resolves it
    rope = stage_rope(config, index)   # the stage's RoPE: a long-context stage's switches with it
    state.model.set_rope(rope.theta, rope.scaling)
    input_ids, labels, position_ids = batch["input_ids"], batch["labels"], batch.get("position_ids")
    rows = tokens.micro_batch_size * tokens.batch_accumulation_per_replica
    if tuple(input_ids.shape) != (rows, stage.sequence_length) or labels.shape != input_ids.shape or \
            (position_ids is not None and position_ids.shape != input_ids.shape):
        shapes = [input_ids, labels] + ([position_ids] if position_ids is not None else [])
        raise ValueError(
            f'step {step} (stage "{stage.name}") expects input_ids and labels'
            + (" and position_ids" if position_ids is not None else "") + f" of shape [{rows}, {stage.sequence_length}] "
            f"(micro_batch_size × batch_accumulation_per_replica, sequence_length), "
            f"got {' and '.join(str(list(t.shape)) for t in shapes)}")

    target_device = next(state.model.parameters()).device
    input_ids, labels = input_ids.to(target_device, non_blocking=True), labels.to(target_device, non_blocking=True)
    lr = scheduled_lr(step, config, schedule, state.lr_origin)
    model, optimizer = state.model, state.optimizer
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)

    topology = state.topology
    # The loss is the mean over every target token of the *global* batch: count them across dp replicas.
    # Kept on the device: the forward is queued without waiting for the count.
    target_tokens = all_reduce_sum((labels != IGNORE_INDEX).sum(), topology)
    denominator = target_tokens.clamp(min=1)  # a fully masked batch contributes no gradient rather than NaN
    # What `loss / denominator`'s backward hands the loss, computed as autograd computes it: the fused
    # loss scales each chunk's gradient by it before rounding, as the unfused order does.
    grad_scale = torch.ones((), dtype=torch.float32, device=input_ids.device) / denominator
    loss_sum = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    # Position ids stay where the loader made them (the CPU): the model reads where documents start on the host.
    positions = [None] * tokens.batch_accumulation_per_replica if position_ids is None \
        else position_ids.split(tokens.micro_batch_size)
    with runtime.attention_kernels():   # once a step (the autocast, once a forward: backward runs outside it)
        for ids, targets, where in zip(input_ids.split(tokens.micro_batch_size), labels.split(tokens.micro_batch_size),
                                       positions, strict=True):
            with precision(config.model.dtype, ids.device):
                loss = model(ids, targets, ignore_index=IGNORE_INDEX, grad_scale=grad_scale,
                             position_ids=where) / denominator
            loss.backward()
            loss_sum += loss.detach()

    total_norm = grad_norm(model.parameters())
    # The step's one read of device values (docs/parallelism.md, "Host synchronisations"): the update
    # must not be applied when the loss or the norm is not finite, and only the host can decide not
    # to call optimizer.step. The metrics come in the same transfer. Both are global (the same on
    # every rank), so every rank stops at the same step, before any update.
    global_loss, norm, target_tokens = torch.stack(
        [all_reduce_sum(loss_sum, topology).double(), total_norm.double(), target_tokens.double()]).tolist()
    if not (math.isfinite(global_loss) and math.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)
        bad = " and ".join(f"the {what} is {value}" for what, value in (("loss", global_loss), ("gradient norm", norm))
                           if not math.isfinite(value))
        raise DivergedError(
            f'step {step} (stage "{stage.name}"): {bad} (loss {global_loss}, gradient norm {norm}); stopped before '
            "applying the update, nothing saved: the last committed checkpoint is the last good state "
            "(lower optimizer.learning_rate_scheduler.learning_rate, or look at the data of this step)")
    clip = config.optimizer.max_grad_norm
    if clip is not None:
        scale = torch.clamp(clip / (total_norm + 1e-6), max=1.0)  # a device scalar: no read
        scale_gradients(model.parameters(), scale)
    optimizer.step()
    if state.ema is not None:
        _update_ema(state.ema, model, config.stage_ema_decay(index))

    metrics = {
        "step": step,
        "stage": stage.name,
        "loss": global_loss,
        "lr": lr,
        "grad_norm": norm,
        "tokens": int(input_ids.numel()) * topology.dp,
        "target_tokens": int(target_tokens),
    }
    return state.advance(step), metrics


@torch.no_grad()
def _update_ema(ema: dict[str, torch.Tensor], model: torch.nn.Module, decay: float) -> None:
    """ema ← decay × ema + (1 − decay) × weights, each rank on its own shards (lerp: one fused op per tensor)."""
    for name, p in model.named_parameters():
        ema[name].lerp_(p.detach().to(torch.float32), 1.0 - decay)


def precision(dtype: str, device: torch.device):
    """`[model] dtype` on `device` ("auto" resolved for it): bfloat16 autocast, or nothing (float32)."""
    if runtime.compute_dtype(dtype, device) == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def forward_context(dtype: str, device: torch.device):
    """How a forward runs on `device`: in `precision`, with the attention kernels tried in
    nanoflow.parallel.runtime's order."""
    with runtime.attention_kernels(), precision(dtype, device):
        yield


_autocast = forward_context   # the name nanoflow.evaluation imports
