"""Factories: the model, the optimizer, a fresh TrainState and the data of the stage a state is at."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoflow.config import Config, OptimizerArgs, stage_rope
from nanoflow.data import open_stage
from nanoflow.data.loader import StageLoader
from nanoflow.io import read_init_weights
from nanoflow.model import Llama
from nanoflow.parallel.agree import on_every_rank
from nanoflow.parallel.mesh import SINGLE, Topology, device
from nanoflow.parallel.plan import parallelize
from nanoflow.parallel.shards import load_weights
from nanoflow.run import Run, as_run
from nanoflow.schedule import active_stage
from nanoflow.state import TrainState, ema_of


def fused_adamw(args: OptimizerArgs, recorded: bool | None = None) -> bool:
    """Whether AdamW runs torch's fused kernel: `torch_adam_is_fused` when the config sets it; unset, what the
    checkpoint a resume reads trained with (`recorded`), else fused. The kernels round differently from torch's
    other AdamW paths, so a resumed run keeps its own."""
    chosen = args.optimizer_factory.torch_adam_is_fused
    if chosen is not None:
        return chosen
    return True if recorded is None else recorded


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` (built by build_optimizer) runs torch's fused kernel."""
    return bool(optimizer.param_groups[0].get("fused"))


def build_optimizer(model: torch.nn.Module, args: OptimizerArgs, *, recorded_fused: bool | None = None
                    ) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only: norms (1-D weights) are not decayed. Fused (one kernel
    for the whole update, on CPUs and GPUs) as `fused_adamw` decides; otherwise torch's own choice.

    A param group holds parameters of one layout only (plain tensors, or DTensors of one mesh): the fused and
    foreach kernels take a group's tensors in one call, and DTensor refuses a call that mixes them (tensor
    parallelism alone leaves the embeddings and norms plain, FSDP2 × TP puts the norms on another mesh)."""
    params = list(model.parameters())  # a tied weight appears once
    factory = args.optimizer_factory
    groups = [{"params": same_layout, "weight_decay": decay}
              for decay, selected in ((args.weight_decay, [p for p in params if p.ndim >= 2]),
                                      (0.0, [p for p in params if p.ndim < 2]))
              for same_layout in _by_layout(selected)]
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate_scheduler.learning_rate,  # overwritten every step by the closed-form LR
        betas=(factory.adam_beta1, factory.adam_beta2),
        eps=factory.adam_eps,
        fused=fused_adamw(args, recorded_fused) or None,
    )


def _by_layout(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` split by layout (the mesh of a DTensor; None for a plain tensor), each list in model order."""
    from torch.distributed.tensor import DTensor

    split: dict = {}
    for p in params:
        split.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(split.values())


def build_model(config: Config, topology: Topology = SINGLE, *, init: bool = True, stage: int = 0) -> Llama:
    """The model of `config`, its weights drawn from general.seed (when `init`), sharded over `topology`, encoding
    positions with the RoPE of stage `stage` (nanoflow.config.stage_rope; train_step sets each step's stage's).

    The modules are made on the meta device (no memory, no draw), their tensors allocated on this process's
    device, and the weights drawn there once, from a generator of that device: the same weights as a model built
    on the CPU and then drawn (Llama.reset_parameters overwrites every weight), without nn.Linear's own init first.
    Every rank draws the same full weights before sharding, so any layout starts from the same model. Without
    `init` the weights are left unset, for the caller to fill (a restore overwrites every one).
    """
    with torch.device("meta"):
        model = Llama(config.model)
    model = model.to_empty(device=device())
    if config.model.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    if init:
        model.reset_parameters(torch.Generator(device=device()).manual_seed(config.general.seed))
    rope = stage_rope(config, stage)
    model.set_rope(rope.theta, rope.scaling)
    if config.model.compile and topology.mesh is None:
        model.compile_whole()   # one graph, loss included; parameter names stay HF's
    elif config.model.compile:   # FSDP2's and tp's hooks run per layer: each layer its own graph, as torchtitan
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names stay HF's
    return parallelize(model, topology, config)


def init_state(run: Run | Config, topology: Topology | None = None) -> TrainState:
    """A fresh run at step 0 with empty optimizer moments: weights drawn from general.seed, or
    read from `[model] init_from` (a checkpoint's run or step folder, or an HF model folder).

    Given a Config, its run is opened here (nanoflow.run.open_run: its checks, the tokenizer, and
    `topology`, by default the one torchrun's environment describes: a single process without it).
    """
    run = as_run(run, topology)
    source = run.config.model.init_from
    model = build_model(run.config, run.topology, init=source is None)   # init_from's weights fill every one
    if source is not None:  # open_run checked an HF folder's config.json against [model]: read its weights
        on_every_rank(lambda: load_weights(model, read_init_weights(source), source), run.topology)
    ema = ema_of(model) if run.config.keeps_ema else None  # starts at the initial weights
    return TrainState.create(step=0, model=model, optimizer=build_optimizer(model, run.config.optimizer), lr_origin=0,
                             run=run, ema=ema)


def stage_data(state: TrainState) -> StageLoader:
    """The loader of the stage that trains step state.step + 1, the next one (close it, or use it in `with`):
    `loader.batch_at(step, state.topology.dp_rank, state.topology.dp)` is the batch of any step of that stage."""
    run = state.run
    return open_stage(run.config, active_stage(run.schedule, state.step + 1), run.tokenizer, run.schedule)
